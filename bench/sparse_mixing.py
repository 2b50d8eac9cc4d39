"""One gossip step of the batched engine, dense against sparse mixing (issue 71).

The step as the engine takes it after ``outgoing``: every peer's mixing plan for (round, step),
the weight matrix built from them, and the product that mixes the stacked rows (pull mode: rows
renormalized), plus the consensus distance from the ``arrived`` matrix (step 0 of every round).

* ``dense``: what the engine did before: ``[P, P]`` float64 ``weights`` and ``arrived`` filled by a
  Python loop over the plans, moved to the device, ``row_normalized`` and one dense product each;
* ``sparse``: the engine now: `p2pfl.engine.mixing.step_mixing` (the step's entries, index arrays
  read off the sparse mixing matrix once, made into sparse COO matrices at once), `combine.mix_rows`
  and `consensus_distances`. The entries themselves: ``bench/step_entries.py``.

Each variant runs in a fresh child process (so its peak RSS is its own): the plans are made once
(topology cached, as in a run), then ``--repeats`` steps are timed; reported: the median seconds
per step and the process's peak RSS above what it held before the first step (CPU) or CUDA's peak
allocated memory (``--device cuda``). The topology is ``random_regular`` with k=4.

    PYTHONPATH=. python bench/sparse_mixing.py --peers 1024 --width 80000
    PYTHONPATH=. python bench/sparse_mixing.py --peers 10000 --width 8192
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import torch


def _dense_step(plans: list, index: dict[str, int], rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    P = len(plans)  # noqa: N806
    weights = torch.zeros(P, P, dtype=torch.float64)
    arrived = torch.zeros(P, P, dtype=torch.float64)
    for i, plan in enumerate(plans):
        weights[i, i] = plan.self_weight
        for j, w in plan.in_weights.items():
            weights[i, index[j]] = w
            arrived[i, index[j]] = 1.0
    weights, arrived = weights.to(device), arrived.to(device)
    count = arrived.sum(1, keepdim=True)
    mean = (arrived.to(rows.dtype) @ rows) / count.clamp(min=1.0).to(rows.dtype)
    torch.linalg.vector_norm(rows - mean, dim=1).tolist()
    w = weights / weights.sum(dim=1, keepdim=True)
    return w.to(rows.dtype) @ rows


def _sparse_step(entries: Any, index: dict[str, int], rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    import numpy as np

    from p2pfl.algorithms.combine import mix_rows
    from p2pfl.engine.mixing import consensus_distances, step_mixing

    P = len(index)  # noqa: N806
    m = step_mixing(entries, np.arange(P), torch.ones(P, dtype=torch.bool), torch.ones(P, dtype=torch.int64), P,
                    device)
    consensus_distances(m.arrived, rows)
    return mix_rows(m.weights, rows, renormalize=True)


def child(args: argparse.Namespace) -> dict:
    from p2pfl.topology import generate

    torch.set_num_threads(1)
    device = torch.device(args.device)
    topo = generate("random_regular", args.peers, k=4, seed=0)
    ids = list(topo.ids)
    index = {p: i for i, p in enumerate(ids)}
    if args.variant == "dense":
        plans: Any = [topo.plan(p, 0, 0) for p in ids]
    else:
        from p2pfl.engine.mixing import entries_from_matrix

        plans = entries_from_matrix(topo.sparse_matrix(), range(len(ids)))
    rows = torch.randn(args.peers, args.width, generator=torch.Generator().manual_seed(0)).to(device)
    step = _dense_step if args.variant == "dense" else _sparse_step
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        out = step(plans, index, rows, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        del out
    peak = ((torch.cuda.max_memory_allocated() - base) if device.type == "cuda"
            else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024)
    return {"variant": args.variant, "peers": args.peers, "width": args.width, "device": args.device,
            "s_per_step": statistics.median(times), "peak_extra_mb": round(peak / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=1024)
    ap.add_argument("--width", type=int, default=80_000, help="floats per row (cnn_small: ~80k)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default="dense,sparse")
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(child(args)))
        return
    for v in args.variants.split(","):
        cmd = [sys.executable, __file__, "--variant", v, "--peers", str(args.peers), "--width", str(args.width),
               "--device", args.device, "--repeats", str(args.repeats)]
        print(subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=3600).stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
