"""Epoch phases on a skewed partition: the batched engine's vmapped step over the live peers only
(``context.COMPACT``) against the padded stack of every peer.

A phase counted in epochs runs until the largest peer's epoch ends; a peer whose epoch has ended
stands still. On the vmapped (GPU) path the padded stack still computes a zero-weight forward and
backward for it; compacted, each step gathers the live peers' parameters into a smaller stack and
computes theirs only. How much that saves is the partition's ``useful_share``: the peer-steps an
epoch needs (each peer its own ``ceil(n_i / batch)``) over what the padded stack computes
(``peers x max_i``). DePRL Table 1's Fashion-MNIST split (128 peers, batch 16): 0.21 at pi 0.1, 0.26
at pi 0.3, 0.50 at pi 0.5. Whether the time follows depends on the device: where the step's
arithmetic is the limit (AlexNet on a GPU; any model on a CPU), nearly so; where launches and
Python are (``cnn_small`` on an idle GPU, bench/batched_host.py), the step count, which compaction
leaves alone, is what costs.

Each block is timed as algorithms train it, one epoch: ``all`` (D-PSGD), ``shared`` (a body phase),
``personal`` (two head epochs, on cached body features: the feature chunks are what compaction
cuts there). Both variants start from the same parameters and generators and must end equal
(``max_rel_diff``); they alternate within each repeat.

Figures (2026-11-26, thirteenth session, this 2-core CPU beside the reproduction sweep at nice 19, the
vmapped path forced; ``--set data.partition.pi=0.1 --blocks all,personal --repeats 2``; 128 peers,
``cnn_small``, useful share 0.21): one epoch of ``all`` 115.7 s padded, 28.1 s compacted (**4.12x**, min
3.74x); two head epochs on cached features (``personal``) 103.5 s against 17.2 s (**6.02x**, min 5.97x);
the two variants' parameters within 4e-9 relative. 16 peers (``--peers 16``, useful share 0.54, 1
repeat): 1.72x, 1.68x and 1.64x for ``all``, ``shared`` and ``personal``. Not yet run on a GPU.

Usage: python bench/batched_idle.py [--set data.partition.pi=0.1] [--set device=cuda] [--blocks all]
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
from many_peers import bench_config  # noqa: E402

#: DePRL Table 1's protocol (128 peers on a ring, Fashion-MNIST Dirichlet per class, batch 16)
DEFAULT_CONFIG = Path(__file__).resolve().parent / "reproduce" / "table1" / "base.yaml"
PHASES = {"all": 1.0, "shared": 1.0, "personal": 2.0}  # epochs per block, as DePRL / D-PSGD train them


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peers", type=int, default=None, help="peers on a ring (default: the config's topology)")
    ap.add_argument("--blocks", default="all,shared,personal")
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args(argv)

    import torch

    from p2pfl.algorithms.local_sgd import Phase
    from p2pfl.engine import batched, context
    from p2pfl.experiment import Experiment

    torch.set_num_threads(1)
    blocks = [b for b in args.blocks.split(",") if b]
    with tempfile.TemporaryDirectory(prefix="p2pfl-idle-") as tmp:
        ns = argparse.Namespace(rounds=1, workers=1, peers=args.peers, config=args.config, set=args.set)
        exp = Experiment.from_config(bench_config(ns, Path(tmp), ["simulation.engine=batched"]))
        context.VECTORIZE = True  # the GPU's path, on any device
        sim = batched.BatchedSimulation(exp, None, lambda rec: None)
    dev = exp.device
    steps = [d.steps_per_epoch() for d in sim.ctx.datas]
    useful = sum(steps) / (len(steps) * max(steps))
    start = sim.ctx.flat.clone()
    gens = [g.get_state() for g in sim.generators]

    def run(block: str, compact: bool) -> tuple[float, torch.Tensor]:
        context.COMPACT = compact
        sim.ctx.flat.copy_(start)
        for g, s in zip(sim.generators, gens, strict=True):
            g.set_state(s)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        sim.ctx.train(block, Phase(lr=0.01, amount=PHASES[block], unit="epochs", weight_decay=1e-5))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0, sim.ctx.flat.clone()

    out: dict[str, float] = {}
    worst = 0.0
    for block in blocks:
        run(block, True)  # warm-up: autotuning, allocator growth
        times: dict[bool, list[float]] = {False: [], True: []}
        for rep in range(args.repeats):
            ends = {}
            for compact in ((False, True) if rep % 2 == 0 else (True, False)):
                t, ends[compact] = run(block, compact)
                times[compact].append(t)
            rel = float(torch.linalg.vector_norm(ends[True] - ends[False]) / torch.linalg.vector_norm(ends[False]))
            worst = max(worst, rel)
        padded, compacted = statistics.median(times[False]), statistics.median(times[True])
        ratios = sorted(p / c for p, c in zip(times[False], times[True], strict=True))
        print(f"{block:>8}: padded {padded:8.2f} s, compacted {compacted:8.2f} s, "
              f"speedup median {statistics.median(ratios):.2f}x (min {ratios[0]:.2f}x)")
        out.update({f"padded_s_{block}": round(padded, 3), f"compacted_s_{block}": round(compacted, 3),
                    f"speedup_{block}": round(statistics.median(ratios), 3),
                    f"speedup_min_{block}": round(ratios[0], 3)})
    print(json.dumps({"device": str(dev), "peers": len(steps), "model": exp.cfg.model["name"],
                      "max_steps_per_epoch": max(steps), "mean_steps_per_epoch": round(sum(steps) / len(steps), 2),
                      "useful_share": round(useful, 3), "repeats": args.repeats, "max_rel_diff": worst, **out}))


if __name__ == "__main__":
    main()
