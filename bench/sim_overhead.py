"""Simulation overhead: wall time per round of `p2pfl simulate` vs the pure compute of the same
local training steps, measured in the same run on the same worker processes.

Pure compute = each worker process runs its peers' local updates (same model, data, batches,
steps) back to back with no transport, no mixing, no evaluation, no metrics, no checkpoints.
Usage: python bench/sim_overhead.py [--config peers/demo.yaml] [--rounds 4]
The last line is a JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pfl.algorithms import PeerState, TrainContext  # noqa: E402
from p2pfl.config import load_config  # noqa: E402
from p2pfl.experiment import Experiment, peer_seed  # noqa: E402
from p2pfl.simulation import simulate  # noqa: E402


def _pure_worker(exp: Experiment, peers: list[str], rounds: int, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    model = exp.model_factory()
    states = []
    for pid in peers:
        gen = torch.Generator().manual_seed(peer_seed(exp.cfg.seed, exp.topology.index(pid)))
        algo = exp.new_algorithm()
        st = PeerState(pid, exp._init[1].clone())
        algo.init_state(st, gen)
        states.append((st, gen, algo, exp.peer_data(pid)))
    t0 = time.perf_counter()
    for r in range(rounds):
        for st, gen, algo, data in states:
            exp.layout.bind(model, st.params)
            algo.local_update(st, TrainContext(model, exp.layout, data, gen, exp.device), r)
    out.put(time.perf_counter() - t0)


def pure_compute(exp: Experiment, rounds: int, workers: int) -> float:
    ids = list(exp.topology.ids)
    groups = [[p for i, p in enumerate(ids) if i % workers == w] for w in range(workers)]
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_pure_worker, args=(exp, g, rounds, q)) for g in groups]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    times = [q.get() for _ in procs]
    for p in procs:
        p.join()
    wall = time.perf_counter() - t0
    print(f"pure compute: per-worker {[round(t, 2) for t in times]} s, wall {wall:.2f} s")
    return max(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="peers/demo.yaml")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(args.config, [f"rounds={args.rounds}", "device=cpu"])
    exp = Experiment.from_config(cfg)
    exp.layout  # noqa: B018 - load data and the initial model before forking
    with tempfile.TemporaryDirectory() as tmp:
        summary = simulate(cfg, Path(tmp) / "run", progress=False, experiment=exp)
    sim_round = summary["wall_seconds"] / args.rounds
    pure_round = pure_compute(exp, args.rounds, summary["workers"]) / args.rounds
    ratio = sim_round / pure_round
    print(f"simulate: {sim_round:.2f} s/round; pure compute: {pure_round:.2f} s/round; "
          f"overhead {100 * (ratio - 1):.1f}%  ({cfg.name}, {len(exp.topology.ids)} peers, {summary['workers']} workers)")
    print(json.dumps({"sim_s_per_round": round(sim_round, 3), "pure_s_per_round": round(pure_round, 3),
                      "ratio": round(ratio, 3), "overhead_pct": round(100 * (ratio - 1), 1),
                      "peers": len(exp.topology.ids), "workers": summary["workers"], "rounds": args.rounds}))


if __name__ == "__main__":
    main()
