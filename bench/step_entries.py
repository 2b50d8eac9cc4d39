"""A gossip step's plans as index arrays, at 1,024 to 100,000 peers (issue 71).

Before the mixing product, the batched engine turns the step's plans into the entries of its sparse
weight matrices (`p2pfl.engine.mixing.StepEntries`). It did so with one `Topology.plan` object per
peer and a Python loop over them, every gossip step; it now reads them off the step's sparse matrix
with numpy (`entries_from_matrix`), once per matrix (a static graph: once per run). Timed here,
per step, on a random 4-regular graph (pull mode), each variant ``--repeats`` times, the median:

* ``plans``: `Topology.plan` for every peer, then `entries_from_plans` (what the engine did);
* ``matrix``: `entries_from_matrix` on all rows, uncached (what a scheduled topology costs per step);
* ``step``: `step_mixing` on those entries (the sparse matrices, received bytes, refusals), which
  both paths then paid; it is unchanged.

    PYTHONPATH=. python bench/step_entries.py                  # 1,024, 10,000 and 100,000 peers
    PYTHONPATH=. python bench/step_entries.py --peers 10000 --repeats 5

Ends with one JSON line: per size the three medians and ``plans_over_matrix``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from p2pfl.engine.mixing import entries_from_matrix, entries_from_plans, step_mixing
from p2pfl.topology import generate


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(peers: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    topo = generate("random_regular", peers, k=4, seed=0, address_template="peer-{i}:50051")
    ids = list(topo.ids)
    index = {p: i for i, p in enumerate(ids)}
    rows = np.arange(peers)
    w = topo.sparse_matrix(0, 0)  # built and cached before timing, as in a run
    entries = entries_from_matrix(w, rows)
    assert entries == entries_from_plans([topo.plan(p, 0, 0) for p in ids], index)
    ok, size = torch.ones(peers, dtype=torch.bool), torch.full((peers,), 1000, dtype=torch.int64)
    out = {"peers": peers,
           "plans_s": _median(lambda: entries_from_plans([topo.plan(p, 1, 0) for p in ids], index), repeats),
           "matrix_s": _median(lambda: entries_from_matrix(w, rows), repeats),
           "step_s": _median(lambda: step_mixing(entries, rows, ok, size, peers, torch.device("cpu")), repeats)}
    out["plans_over_matrix"] = round(out["plans_s"] / out["matrix_s"], 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="1024,10000,100000")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    results = []
    for n in (int(x) for x in args.peers.split(",")):
        results.append(measure(n, args.repeats))
        print(f"# {results[-1]}", flush=True)
    print(json.dumps({"bench": "step_entries", "results": results}))


if __name__ == "__main__":
    main()
