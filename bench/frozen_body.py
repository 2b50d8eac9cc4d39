"""Frozen-body phases computed once: what caching the body's features saves, per algorithm.

For each head-then-body algorithm, one peer's local round (``local_update``: head phase with the
body frozen, then the body phase) is timed with the head phase on cached features
(``FROZEN_BODY_CACHE = True``, the default) and without (every step runs the frozen body, the
former path), side by side from the same state and generator, alternating the order every
repeat. Fashion-MNIST, cnn_small, one peer holding ``--samples`` training samples. The cases are
the papers' protocols as this repository configures them:

* ``deprl``: tau = 2 head steps, one body step, batch 16 (the DePRL preset);
* ``deprl-epochs``: tau = 2 head epochs, one body epoch (the FedRep-code reading);
* ``dfedmdc``: head 1 epoch, body 5 epochs, momentum 0.9 (the DFedMDC Dirichlet preset);
* ``dfedmdc-path``: head 5 epochs (the DFedMDC pathological preset);
* ``dfedpgp``: head 1 epoch, body 5 epochs (the DFedPGP preset).

A phase that sees each sample once (one head epoch; a few random minibatches) keeps the plain
path (``frozen_cache_pays``), so its two timings are of the same code (``cache_used: false``).

Figures per case: ``round_s`` (median and min over repeats) cached and uncached, ``head_s`` the
head phase alone, and ``saving`` = 1 - cached / uncached round time (median, min, max over the
repeats' side-by-side ratios). The last line is one JSON object.

Usage: python bench/frozen_body.py [--repeats 5] [--samples 600] [--cases deprl,dfedmdc]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES: dict[str, dict[str, Any]] = {
    "deprl": {"preset": "deprl-paper", "batch": 16},
    "deprl-epochs": {"preset": "deprl-paper", "batch": 16, "tau": 2, "tau_unit": "epochs", "rep_steps": 1,
                     "rep_unit": "epochs"},
    "dfedmdc": {"preset": "dfedmdc-paper", "batch": 32},
    "dfedmdc-path": {"preset": "dfedmdc-paper-path", "batch": 32},
    "dfedpgp": {"preset": "dfedpgp-paper", "batch": 32},
}


def experiment(case: str, samples: int, tmp: Path):
    from p2pfl.config import load_config
    from p2pfl.experiment import Experiment

    spec = dict(CASES[case])
    batch = spec.pop("batch")
    preset = spec.pop("preset")
    name = preset.split("-")[0]
    algo = ", ".join(f"{k}: {v}" for k, v in spec.items())
    cfg_path = tmp / f"{case}.yaml"
    cfg_path.write_text(
        f"name: frozen-{case}\nseed: 0\nrounds: 1\ndevice: cpu\ntopology: {ROOT / 'topology' / 'ring-8.yaml'}\n"
        f"data: {{dataset: fashion_mnist, partition: {{kind: iid, samples_per_client: {samples}}}, "
        f"batch_size: {batch}}}\n"
        f"model: {{name: cnn_small}}\n"
        f"algorithm: {{name: {name}, preset: {preset}{', ' + algo if algo else ''}}}\n")
    return Experiment.from_config(load_config(cfg_path))


def time_round(exp: Any, cache: bool) -> tuple[float, float]:
    """(round seconds, head-phase seconds) of peer p0's first local round."""
    import torch

    from p2pfl.algorithms import local_sgd
    from p2pfl.algorithms.base import TrainContext

    node = exp.make_node("p0", transport=None, models=None, record=lambda rec: None, run_dir=None)
    model = exp.build_model()
    exp.layout.bind(model, node.state.params)
    ctx = TrainContext(model, exp.layout, node.app.data, node.generator, torch.device("cpu"), cache_frozen=cache)
    head_s = [0.0]
    inner = local_sgd.train_exact

    def timed(ctx: Any, block: str, phase: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        out = inner(ctx, block, phase, **kw)
        if block == "personal":
            head_s[0] += time.perf_counter() - t
        return out

    local_sgd.train_exact = timed
    try:
        t0 = time.perf_counter()
        node.algorithm.local_update(node.state, ctx, 0)
        return time.perf_counter() - t0, head_s[0]
    finally:
        local_sgd.train_exact = inner


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--samples", type=int, default=600, help="training samples of the timed peer")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {sorted(CASES)}")
    args = ap.parse_args(argv)
    import torch

    from p2pfl.algorithms.local_sgd import frozen_cache_pays

    torch.set_num_threads(1)
    out: dict[str, Any] = {"device": "cpu", "model": "cnn_small", "samples": args.samples, "repeats": args.repeats}
    with tempfile.TemporaryDirectory() as tmp:
        for case in [c.strip() for c in args.cases.split(",") if c.strip()]:
            exp = experiment(case, args.samples, Path(tmp))
            time_round(exp, True)  # warm up (first-call allocations, dataset pages)
            runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            for rep in range(args.repeats):
                for cache in ((True, False) if rep % 2 == 0 else (False, True)):
                    runs[cache].append(time_round(exp, cache))
            ratios = [c[0] / u[0] for c, u in zip(runs[True], runs[False], strict=True)]
            algo = exp.new_algorithm()
            head = algo.phases(0, 1.0)[0] if algo.name == "dfedpgp" else algo.phases(0)[0]
            res = {
                "cache_used": frozen_cache_pays(head, exp.peer_data("p0")),
                "round_s_cached": {"median": round(statistics.median(r for r, _ in runs[True]), 4),
                                   "min": round(min(r for r, _ in runs[True]), 4)},
                "round_s_uncached": {"median": round(statistics.median(r for r, _ in runs[False]), 4),
                                     "min": round(min(r for r, _ in runs[False]), 4)},
                "head_s_cached": round(statistics.median(h for _, h in runs[True]), 4),
                "head_s_uncached": round(statistics.median(h for _, h in runs[False]), 4),
                "saving": {"median": round(1 - statistics.median(ratios), 3), "min": round(1 - max(ratios), 3),
                           "max": round(1 - min(ratios), 3)},
            }
            print(f"{case:14s} round {res['round_s_uncached']['median']:.3f} s -> {res['round_s_cached']['median']:.3f} s"
                  f" (head {res['head_s_uncached']:.3f} -> {res['head_s_cached']:.3f}), saving {res['saving']}",
                  flush=True)
            out[case] = res
    print(json.dumps(out))


if __name__ == "__main__":
    main()
