"""Where a round of the batched engine goes: train, gossip (of which wire sizes), evaluate, records, checkpoints.

The protocol of ``bench/many_peers.py`` (128 cnn_small peers on a ring, DePRL's D-PSGD setup) run by
``BatchedSimulation`` directly, each phase timed by wrapping the engine's own calls (a device
synchronize before each clock read, so GPU work is charged to the phase that queued it). The first
round (start-up, cuDNN autotuning, allocator growth) is left out; the figures are seconds per
round, averaged over the rest, and their share of the round.

Usage: python bench/batched_phases.py [--rounds 11] [--set device=cuda] [--set model.name=alexnet]
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from many_peers import DEFAULT_CONFIG, bench_config  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--peers", type=int, default=None)
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args(argv)
    args.workers = 1

    import torch

    from p2pfl.engine import batched
    from p2pfl.experiment import Experiment

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="p2pfl-phases-") as tmp:
        cfg = bench_config(args, Path(tmp), ["simulation.engine=batched"])
        exp = Experiment.from_config(cfg)
        dev = exp.device

        def sync() -> None:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        spent: dict[str, float] = defaultdict(float)

        def timed(name: str, fn: Any) -> Any:
            def wrapper(*a: Any, **k: Any) -> Any:
                sync()
                t0 = time.perf_counter()
                out = fn(*a, **k)
                sync()
                spent[name] += time.perf_counter() - t0
                return out
            return wrapper

        lines: list[str] = []
        record = timed("records", lambda rec: lines.append(json.dumps(rec)))
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        sim = batched.BatchedSimulation(exp, run_dir, record)
        sim.algorithm.local_update = timed("train", sim.algorithm.local_update)  # type: ignore[method-assign]
        sim.gossip = timed("gossip", sim.gossip)  # type: ignore[method-assign]
        sim._wire_sizes = timed("gossip.wire_sizes", sim._wire_sizes)  # type: ignore[method-assign]  # noqa: SLF001
        sim.ctx.evaluate = timed("evaluate", sim.ctx.evaluate)  # type: ignore[method-assign]
        sim._checkpoint = timed("checkpoints", sim._checkpoint)  # type: ignore[method-assign]  # noqa: SLF001
        per_round: list[dict[str, float]] = []
        for r in range(cfg.rounds):
            spent.clear()
            sync()
            t0 = time.perf_counter()
            sim.run_round(r)
            sync()
            per_round.append({"round": time.perf_counter() - t0, **spent})
    steady = per_round[1:]
    keys = ["round", "train", "gossip", "gossip.wire_sizes", "evaluate", "records", "checkpoints"]
    mean = {k: sum(p.get(k, 0.0) for p in steady) / len(steady) for k in keys}
    mean["other"] = mean["round"] - sum(mean[k] for k in ("train", "gossip", "evaluate", "records", "checkpoints"))
    for k, v in mean.items():
        print(f"{k:18s} {v * 1e3:9.2f} ms/round  {100 * v / mean['round']:5.1f} %")
    print(json.dumps({"device": str(dev), "peers": len(exp.topology.ids), "model": cfg.model["name"],
                      "rounds": cfg.rounds, **{f"{k}_ms": round(v * 1e3, 3) for k, v in mean.items()}}))


if __name__ == "__main__":
    main()
