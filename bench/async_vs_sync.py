"""Synchronous vs asynchronous gossip with one peer made slower (docs/protocol.md, "Asynchronous gossip").

Runs `p2pfl launch` (one `p2pfl node` process per peer, mutual TLS) twice on the same config, with
``network.slowdown: {SLOW: FACTOR}``: once with ``network.mode: sync`` (every round waits for the
slow peer) and once with ``network.mode: async`` (no round barrier; stale payloads weighted down).
The figure of merit is the mean personalized accuracy over all peers *after the same wall time*:
T = when the asynchronous run's fast peers finished; each peer's accuracy is its last evaluated
record at or before T.

    python bench/async_vs_sync.py                                   # the demo (8 peers, ring, CNN)
    python bench/async_vs_sync.py --set rounds=6 --set topology=topology/ring-4.yaml

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def launch(config: Path, out: Path, sets: list[str], timeout_s: float) -> tuple[float, float]:
    """Run `p2pfl launch`; return (start, end) wall-clock times."""
    cmd = [sys.executable, "-m", "p2pfl.cli", "launch", "--config", str(config), "--out", str(out),
           "--timeout", str(timeout_s)]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s + 120)
    if proc.returncode != 0:
        raise SystemExit(f"launch failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return t0, time.time()


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def acc_at(recs: list[dict[str, Any]], t: float) -> tuple[float | None, float]:
    """(mean over peers of each peer's last accuracy at or before wall time t, mean rounds done by t).

    A peer with no evaluated round by t counts with the accuracy of an untrained model, its first
    record's (the demo evaluates every round, so that is its accuracy after one round: generous).
    """
    last: dict[str, float] = {}
    done: dict[str, int] = {}
    for r in sorted(recs, key=lambda r: r["time"]):
        if r["time"] <= t:
            done[r["peer"]] = r["round"] + 1
            if r.get("acc") is not None:
                last[r["peer"]] = float(r["acc"])
    peers = {r["peer"] for r in recs}
    for p in peers - set(last):
        first = min((r for r in recs if r["peer"] == p and r.get("acc") is not None), key=lambda r: r["round"],
                    default=None)
        if first is not None:
            last[p] = float(first["acc"])
    mean = sum(last.values()) / len(last) if last else None
    return mean, sum(done.values()) / len(peers)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "peers" / "demo.yaml")
    ap.add_argument("--slow", default=None, help="the slow peer (default: the last peer of the topology)")
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config override KEY=VALUE")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--out", type=Path, default=None, help="keep both run folders here")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from p2pfl.config import load_config
    from p2pfl.topology import load_topology

    cfg = load_config(args.config, args.sets)
    slow = args.slow or load_topology(cfg.topology).ids[-1]
    common = [*args.sets, f"network.slowdown={{{slow}: {args.factor}}}"]
    result: dict[str, Any] = {"bench": "async_vs_sync", "config": str(args.config), "sets": args.sets,
                              "slow_peer": slow, "factor": args.factor, "rounds": cfg.rounds}
    with tempfile.TemporaryDirectory(prefix="p2pfl-async-") as td:
        base = args.out or Path(td)
        runs: dict[str, tuple[float, float, list[dict[str, Any]]]] = {}
        for mode in ("async", "sync"):
            out = base / mode
            t0, t1 = launch(args.config, out, [*common, f"network.mode={mode}"], args.timeout)
            runs[mode] = (t0, t1, records(out))
        a0, _, arecs = runs["async"]
        fast_done = max(r["time"] for r in arecs if r["peer"] != slow)
        horizon = fast_done - a0  # seconds from launch until the asynchronous fast peers were done
        result["wall_time_s"] = round(horizon, 1)
        for mode, (t0, t1, recs) in runs.items():
            acc, done = acc_at(recs, t0 + horizon)
            final = [r["acc"] for r in recs if r["round"] == cfg.rounds - 1 and r.get("acc") is not None]
            result[mode] = {
                "acc_at_wall_time": None if acc is None else round(acc, 4),
                "rounds_done_at_wall_time": round(done, 2),
                "total_wall_s": round(t1 - t0, 1),
                "final_acc_mean": round(sum(final) / len(final), 4) if final else None,
            }
    print(json.dumps(result, sort_keys=True))
    return result


if __name__ == "__main__":
    main()
