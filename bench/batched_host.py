"""How much of a batched training step is fixed per-step cost (Python, dispatch, kernel launches).

The batched engine's vmapped step (``BatchedContext.train``) timed at two sizes on the same device:
``tiny`` (3 peers on a ring, batch 1: almost no arithmetic) and ``full`` (the protocol of
``bench/many_peers.py``: 128 peers, batch 16). The tiny step is what every step costs whatever the
work; ``fixed_share = tiny / full`` bounds how much of a full step that is. On a GPU a share near 1
says the step is launch/host-bound (CUDA graphs or fewer ops would pay; more peers per step are
almost free), a small share that the arithmetic is the limit. Each block is timed as algorithms
train it: ``all`` (D-PSGD), ``shared`` (a body phase: every parameter still in the graph) and
``personal`` (a head phase, on cached body features where the engine caches them).

The vmapped path is the GPU's; on a CPU this script forces it (the engine itself loops over the peers
there), so a CPU figure counts the tiny step's small arithmetic too: it is an upper bound of the
host overhead, for comparing code versions on one machine.

Figures (2026-11-26, twelfth session, this 2-core CPU, sweeps paused; ``--tiny-only --steps 50
--repeats 5``, three interleaved pairs against the code before). A step where every peer is active
now updates its parameters with two multi-tensor calls instead of three ops per tensor (a step of
the ``steps`` unit always; an ``epochs`` step until the first peer's epoch ends): tiny ``all``
5.07/4.93/5.08 -> 4.58/4.51/4.32 ms per step. The 8-peer dry run of ``bench/gpu_checks.sh`` (``DEV=cpu
PEERS=8 STEPS=host``): tiny 5.1 against full 31.8 ms per step, a fixed share of 0.16 on this CPU, where
the arithmetic of 8 x 16 samples dominates. Not yet run on a GPU.

Usage: python bench/batched_host.py [--steps 30] [--set device=cuda]
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from many_peers import DEFAULT_CONFIG, bench_config  # noqa: E402

BLOCKS = ("all", "shared", "personal")


def step_ms(peers: int, batch: int, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    """Median (over ``args.repeats``) milliseconds per vmapped step of each block."""
    import torch

    from p2pfl.algorithms.local_sgd import Phase
    from p2pfl.engine import batched, context
    from p2pfl.experiment import Experiment

    ns = argparse.Namespace(rounds=1, workers=1, peers=peers, config=args.config, set=args.set)
    exp = Experiment.from_config(bench_config(ns, tmp, ["simulation.engine=batched", f"data.batch_size={batch}"]))
    context.VECTORIZE = True  # the GPU's path, on any device
    sim = batched.BatchedSimulation(exp, None, lambda rec: None)
    dev = exp.device

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    out: dict[str, float] = {}
    for block in BLOCKS:
        phase = Phase(lr=0.01, amount=args.steps, unit="steps", weight_decay=1e-5)
        sim.ctx.train(block, phase)  # warm-up: autotuning, allocator growth
        times = []
        for _ in range(args.repeats):
            sync()
            t0 = time.perf_counter()
            sim.ctx.train(block, phase)
            sync()
            times.append((time.perf_counter() - t0) / args.steps * 1e3)
        out[block] = statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--steps", type=int, default=30, help="steps per timed phase")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--full-peers", "--peers", type=int, default=128, help="peers of the full step")
    ap.add_argument("--tiny-only", action="store_true", help="time the tiny step only (comparing code versions)")
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="p2pfl-host-") as tmp:
        tiny = step_ms(3, 1, args, Path(tmp))
        full = None if args.tiny_only else step_ms(args.full_peers, 16, args, Path(tmp))
    device = next((s.split("=", 1)[1] for s in args.set if s.startswith("device=")), "cpu")
    for block in BLOCKS:
        print(f"{block:>8}: tiny {tiny[block]:7.2f} ms/step" + ("" if full is None else
              f", full {full[block]:7.2f} ms/step, fixed share {tiny[block] / full[block]:.2f}"))
    print(json.dumps({"device": device, "steps": args.steps, "full_peers": None if full is None else args.full_peers,
                      **{f"tiny_ms_per_step_{b}": round(tiny[b], 3) for b in BLOCKS},
                      **({} if full is None else {f"full_ms_per_step_{b}": round(full[b], 3) for b in BLOCKS}),
                      **({} if full is None else {f"fixed_share_{b}": round(tiny[b] / full[b], 3)
                                                  for b in BLOCKS})}))


if __name__ == "__main__":
    main()
