"""Soak test of the round protocol (docs/protocol.md): N real `p2pfl node` processes over mutual TLS,
R rounds, random faults drawn from a seed (kill -9 then restart, SIGSTOP then SIGCONT, one slow peer),
compared with the same run without faults.

    python bench/soak.py --peers 4 --rounds 40 --faults 4 --seed 1            # push-sum, directed ring
    python bench/soak.py --mode pull --topology ring --rounds 60 --faults 6

Ends with one JSON line: rounds completed per peer, peer-rounds that mixed without a neighbour two
or more rounds after it rejoined, the push-sum mass error (max over rounds of |sum_i mu_i - n|,
the rounds where it exceeds 1e-9, and at the end), the smallest mu, the steps a peer withheld its
share (weight floor) and the ledger settlements, the NaN/Inf count, seconds per round with and without faults, and the faults injected.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from p2pfl.security.certs import make_certs  # noqa: E402
from p2pfl.topology import generate  # noqa: E402


@dataclass
class Fault:
    kind: str  # kill9 | stall | slow
    peer: str
    at_round: int  # injected once the other peers recorded this many rounds (kill9, stall)
    down_s: float = 0.0  # how long it stays killed / stopped
    fault_round: int | None = None  # the round the others had reached when it was hit
    rejoin_round: int | None = None  # ... and when it came back
    factor: float = 1.0  # slow


@dataclass
class Run:
    wall_s: float
    recs: dict[str, list[dict[str, Any]]]
    failed: dict[str, int] = field(default_factory=dict)


def write_config(tmp: Path, args: argparse.Namespace, slowdown: dict[str, float]) -> Path:
    kind = "directed_ring" if args.mode == "push" and args.topology == "ring" else args.topology
    topo = generate(kind, args.peers, base_port=args.base_port)
    topo.dump(tmp / "topology.yaml")
    algorithm = ({"name": "dfedpgp", "mix_mode": "push", "body_local": 1} if args.mode == "push"
                 else {"name": "dfedavg", "lr": 0.1, "local_epochs": 1})
    cfg = {
        "name": "soak", "seed": args.seed, "rounds": args.rounds, "device": "cpu",
        "topology": str(tmp / "topology.yaml"),
        "data": {"dataset": "synthetic", "partition": {"kind": "dirichlet", "alpha": 0.5}, "batch_size": 16,
                 "params": {"num_classes": 4, "train_size": 200 * args.peers, "test_size": 100 * args.peers,
                            "shape": [1, 8, 8], "seed": 1}},
        "model": {"name": "mlp", "hidden": 32},
        "algorithm": algorithm,
        "network": {"round_timeout_s": args.timeout, "probe_s": args.probe, "slowdown": slowdown},
    }
    path = tmp / f"config-{len(slowdown)}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start(cfg: Path, pid: str, out: Path, certs: Path, logs: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "p2pfl.cli", "node", "--config", str(cfg), "--peer", pid, "--out", str(out),
           "--certs", str(certs)]
    return subprocess.Popen(cmd, stdout=open(logs / f"{pid}.log", "a"), stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=ROOT)


def read(out: Path, pid: str) -> list[dict[str, Any]]:
    path = out / f"metrics-{pid}.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def progress(out: Path, ids: list[str]) -> int:
    return max((len(read(out, p)) for p in ids), default=0)


def run(cfg: Path, ids: list[str], out: Path, certs: Path, faults: list[Fault], limit_s: float) -> Run:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs = {pid: start(cfg, pid, out, certs, logs) for pid in ids}
    t0 = time.monotonic()
    pending = sorted((f for f in faults if f.kind != "slow"), key=lambda f: f.at_round)
    restore: list[tuple[float, Fault]] = []
    try:
        while time.monotonic() - t0 < limit_s:
            now = time.monotonic() - t0
            while pending and progress(out, [q for q in ids if q != pending[0].peer]) >= pending[0].at_round:
                if any(g.peer == pending[0].peer for _, g in restore):
                    break  # one fault at a time per peer: wait until it is back
                f = pending.pop(0)
                p = procs[f.peer]
                if p.poll() is not None:
                    continue
                f.fault_round = progress(out, [q for q in ids if q != f.peer])
                if f.kind == "kill9":
                    _signal(p, signal.SIGKILL)
                    p.wait(10)
                else:
                    _signal(p, signal.SIGSTOP)
                restore.append((now + f.down_s, f))
            for item in [x for x in restore if x[0] <= now]:
                restore.remove(item)
                f = item[1]
                f.rejoin_round = progress(out, [p for p in ids if p != f.peer])
                if f.kind == "kill9":
                    procs[f.peer] = start(cfg, f.peer, out, certs, logs)
                else:
                    _signal(procs[f.peer], signal.SIGCONT)
            if not pending and not restore and all(p.poll() is not None for p in procs.values()):
                break
            time.sleep(0.05)
    finally:
        for p in procs.values():
            if p.poll() is None:
                _signal(p, signal.SIGCONT)
                _signal(p, signal.SIGKILL)
                p.wait(10)
    wall = time.monotonic() - t0
    failed = {pid: p.returncode for pid, p in procs.items() if p.returncode != 0}
    return Run(wall, {pid: read(out, pid) for pid in ids}, failed)


def _signal(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def draw_faults(rng: random.Random, ids: list[str], n: int, rounds: int, timeout: float,
                down: tuple[float, float] = (0.2, 1.5)) -> list[Fault]:
    """``n`` faults at random rounds (in the first half of the run), one slow peer among them.

    A kill or stall lasts ``down`` round deadlines (default 0.2 to 1.5: sometimes the neighbours
    wait for the peer, sometimes they give up on it and it has to catch up; a restart also takes
    the process's start-up time).
    """
    faults = [Fault("slow", rng.choice(ids), 0, factor=2.0)]
    for _ in range(max(0, n - 1)):
        kind = rng.choice(["kill9", "kill9", "stall"])
        faults.append(Fault(kind, rng.choice(ids), rng.randint(1, max(1, rounds // 2)),
                            down_s=rng.uniform(*down) * timeout))
    return faults


def mass_errors(recs: dict[str, list[dict[str, Any]]], n: int) -> dict[int, float]:
    """|sum_i mu_i - n| per round boundary, over the rounds every peer recorded (push mode only).

    A peer that skipped rounds (fast-forward) still holds its mass: its last recorded mu counts.
    """
    by_peer = {pid: {int(r["round"]): float(r["mu"]) for r in rs if "mu" in r} for pid, rs in recs.items()}
    if not any(by_peer.values()):
        return {}
    out: dict[int, float] = {}
    last = max(max(v) for v in by_peer.values() if v)
    for k in range(last + 1):
        if not any(k in v for v in by_peer.values()):
            continue
        held = [v[max(x for x in v if x <= k)] for v in by_peer.values() if any(x <= k for x in v)]
        if len(held) == n:
            out[k] = abs(sum(held) - n)
    return out


def mass_error(recs: dict[str, list[dict[str, Any]]], n: int) -> float | None:
    errs = mass_errors(recs, n)
    return max(errs.values()) if errs else None


def final_mass_error(recs: dict[str, list[dict[str, Any]]], n: int) -> float | None:
    """|sum_i mu_i - n| over each peer's last recorded mu (the run's end: every edge settled)."""
    last = [float(r["mu"]) for rs in recs.values() for r in rs[-1:] if "mu" in r]
    return abs(sum(last) - n) if len(last) == n else None


def mixed_without_after_rejoin(recs: dict[str, list[dict[str, Any]]], faults: list[Fault]) -> int:
    """Peer-rounds that mixed without a peer two or more rounds after it rejoined (until its next fault).

    Counted: a record of any peer at round >= rejoin + 2 naming the rejoined peer as missing.
    """
    count = 0
    events = sorted((f for f in faults if f.rejoin_round is not None), key=lambda f: f.at_round)
    for i, f in enumerate(events):
        assert f.rejoin_round is not None
        later = [g.fault_round for g in events[i + 1:] if g.peer == f.peer and g.fault_round is not None]
        lo, hi = f.rejoin_round + 2, (min(later) if later else math.inf)
        for rs in recs.values():
            for r in rs:
                if lo <= r["round"] < hi:
                    count += f.peer in r.get("missing", [])
    return count


def summarize(runs: Run, clean: Run, faults: list[Fault], n: int, rounds: int) -> dict[str, Any]:
    def spr(r: Run) -> float:
        return r.wall_s / rounds

    nan = sum(1 for rs in runs.recs.values() for r in rs
              for k in ("loss", "acc", "mu") if k in r and not math.isfinite(float(r[k])))
    dup = {pid: len(rs) - len({r["round"] for r in rs}) for pid, rs in runs.recs.items()}
    skipped = {pid: 0 for pid in runs.recs}
    lost = {pid: 0 for pid in runs.recs}  # gaps not explained by a fast-forward (should be 0)
    for pid, rs in runs.recs.items():
        for prev, rec in zip(rs, rs[1:], strict=False):
            gap = rec["round"] - prev["round"] - 1
            if gap > 0:
                key = skipped if rec.get("fast_forward_from") == prev["round"] + 1 else lost
                key[pid] += gap
    return {
        "bench": "soak", "peers": n, "rounds": rounds,
        "rounds_completed": {pid: len({r["round"] for r in rs}) for pid, rs in runs.recs.items()},
        "duplicated_rounds": dup,
        "rounds_skipped_by_fast_forward": skipped,
        "lost_rounds": lost,
        "failed_peers": runs.failed,
        "mixed_without_after_rejoin": mixed_without_after_rejoin(runs.recs, faults),
        "push_sum_mass_error": mass_error(runs.recs, n),
        "push_sum_mass_error_rounds": sorted(k for k, e in mass_errors(runs.recs, n).items() if e > 1e-9),
        "push_sum_mass_error_final": final_mass_error(runs.recs, n),
        "push_sum_mass_error_clean": mass_error(clean.recs, n),
        "mu_min": min((float(r["mu"]) for rs in runs.recs.values() for r in rs if "mu" in r), default=None),
        "withheld_steps": sum(1 for rs in runs.recs.values() for r in rs if r.get("withheld")),
        "ledger_settlements": sum(1 for rs in runs.recs.values() for r in rs if r.get("mu_settled")),
        "nan_count": nan,
        "s_per_round": round(spr(runs), 3),
        "s_per_round_clean": None if math.isnan(clean.wall_s) else round(spr(clean), 3),
        "slowdown_vs_clean": None if math.isnan(clean.wall_s) else round(spr(runs) / spr(clean), 2),
        "faults": [{"kind": f.kind, "peer": f.peer, "at_round": f.at_round, "down_s": round(f.down_s, 1),
                    "factor": f.factor, "fault_round": f.fault_round, "rejoin_round": f.rejoin_round}
                   for f in faults],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--faults", type=int, default=3, help="number of faults, the slow peer included")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=["push", "pull"], default="push")
    ap.add_argument("--topology", default="ring")
    ap.add_argument("--timeout", type=float, default=8.0, help="network.round_timeout_s")
    ap.add_argument("--probe", type=float, default=0.5, help="network.probe_s")
    ap.add_argument("--base-port", type=int, default=None)
    ap.add_argument("--limit", type=float, default=900.0, help="give up after this many seconds per run")
    ap.add_argument("--out", type=Path, default=None, help="keep the run folders here")
    ap.add_argument("--down", type=float, nargs=2, default=(0.2, 1.5), metavar=("MIN", "MAX"),
                    help="how long a killed/stalled peer stays down, in round deadlines")
    ap.add_argument("--no-clean", action="store_true", help="skip the fault-free run (no s/round ratio)")
    args = ap.parse_args(argv)
    if args.base_port is None:
        args.base_port = random.Random(os.getpid()).randint(21000, 59000)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="p2pfl-soak-") as td:
        tmp = args.out or Path(td)
        tmp.mkdir(parents=True, exist_ok=True)
        ids = [f"p{i}" for i in range(args.peers)]
        certs = tmp / "certs"
        make_certs(ids, certs)
        clean = (Run(math.nan, {}) if args.no_clean
                 else run(write_config(tmp, args, {}), ids, tmp / "clean", certs, [], args.limit))
        faults = draw_faults(rng, ids, args.faults, args.rounds, args.timeout, tuple(args.down))
        slow = {f.peer: f.factor for f in faults if f.kind == "slow"}
        faulty = run(write_config(tmp, args, slow), ids, tmp / "faulty", certs, faults, args.limit)
        out = summarize(faulty, clean, faults, args.peers, args.rounds)
    print(json.dumps(out, sort_keys=True))
    return out


if __name__ == "__main__":
    main()
