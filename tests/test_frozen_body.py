"""Frozen-body phases computed once: a head phase trains on the body's features of its minibatches,
computed once per phase, instead of running the frozen body at every step.

Checked against the uncached path (``FROZEN_BODY_CACHE = False``, what every mode did before) on a
few peers x 3 rounds through ``simulate``, in both engines: parameters within 1e-5 relative,
per-round accuracies within 0.02. And the saving is real: the body sees each sample once per
head phase, however many head epochs there are.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from p2pfl.algorithms import local_sgd
from p2pfl.algorithms.base import TrainContext
from p2pfl.algorithms.local_sgd import Phase
from p2pfl.config import load_config
from p2pfl.engine import context
from p2pfl.experiment import Experiment
from p2pfl.simulation import simulate
from tests.conftest import tiny_config

DATA = {"dataset": "synthetic", "partition": {"kind": "dirichlet_per_class", "pi": 0.5}, "batch_size": 16,
        "params": {"num_classes": 4, "train_size": 400, "test_size": 200, "shape": [1, 8, 8], "seed": 1}}
CASES = {
    "deprl": {"name": "deprl", "lr_head": 0.05, "lr_body": 0.05, "tau": 8},  # 8 x 16 > a peer's ~100 samples
    "dfedmdc": {"name": "dfedmdc", "head_local": 2, "body_local": 1, "lr_head": 0.05},
    "dfedsmdc-head-sam": {"name": "dfedsmdc", "head_local": 2, "body_local": 1, "lr_head": 0.05, "sam_on": "both"},
    "dfedpgp": {"name": "dfedpgp", "head_local": 1.5, "body_local": 1},
}


def _run(tmp_path: Path, algorithm: dict, engine: str, cache: bool, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(local_sgd, "FROZEN_BODY_CACHE", cache)
    monkeypatch.setattr(context, "VECTORIZE", engine == "batched-vmap")  # vmap: the GPU path, here on a CPU
    folder = tmp_path / f"{engine}-{cache}"
    folder.mkdir()
    cfg = load_config(tiny_config(folder, peers=4, rounds=3, algorithm=algorithm, data=DATA,
                                  simulation={"workers": 1, "engine": engine.split("-")[0]}))
    simulate(cfg, folder / "run", progress=False)
    params = {}
    for f in sorted((folder / "run" / "checkpoints").glob("*.npz")):
        with np.load(f, allow_pickle=False) as z:
            params[f.stem] = z["params"].astype(np.float64)
    recs = {(r["round"], r["peer"]): r for r in map(json.loads, (folder / "run" / "metrics.jsonl").read_text().splitlines())}
    return params, recs


@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine", ["exact", "batched-loop", "batched-vmap"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cached_head_phase_equals_the_uncached_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str,
                                                   engine: str) -> None:
    ref, ref_recs = _run(tmp_path, CASES[case], engine, False, monkeypatch)
    got, got_recs = _run(tmp_path, CASES[case], engine, True, monkeypatch)
    assert sorted(ref) == sorted(got) and len(ref) == 4
    for pid in ref:
        rel = np.linalg.norm(ref[pid] - got[pid]) / np.linalg.norm(ref[pid])
        assert rel <= 1e-5, (pid, rel)
    assert ref_recs.keys() == got_recs.keys()
    for key, r in ref_recs.items():
        assert abs(r["acc"] - got_recs[key]["acc"]) <= 0.02
        assert got_recs[key]["head_loss"] == pytest.approx(r["head_loss"], rel=1e-4)


def test_the_cache_is_used_only_where_samples_repeat(tmp_path: Path) -> None:
    cfg = load_config(tiny_config(tmp_path, peers=4, rounds=1, data=DATA))
    data = Experiment.from_config(cfg).peer_data("p0")
    n, b = data.num_train, data.batch_size
    assert not local_sgd.frozen_cache_pays(Phase(lr=0.1, amount=1), data)  # one pass: nothing to reuse
    assert local_sgd.frozen_cache_pays(Phase(lr=0.1, amount=1.5), data)
    assert not local_sgd.frozen_cache_pays(Phase(lr=0.1, amount=n // b, unit="steps"), data)
    assert local_sgd.frozen_cache_pays(Phase(lr=0.1, amount=n // b + 1, unit="steps"), data)


def test_the_body_sees_each_sample_once_per_head_phase(tmp_path: Path) -> None:
    """Three head epochs: the uncached path runs the body on every sample three times, the cached
    path once; the minibatches (the generator's draws) are the same."""
    cfg = load_config(tiny_config(tmp_path, peers=4, rounds=1, data=DATA))
    exp = Experiment.from_config(cfg)
    seen: dict[bool, int] = {}
    states = {}
    for cache in (False, True):
        node = exp.make_node("p0", transport=None, models=None, record=lambda rec: None,  # type: ignore[arg-type]
                             run_dir=None)
        model = exp.build_model()
        exp.layout.bind(model, node.state.params)
        rows = [0]
        first = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))  # the body's first layer
        first.register_forward_pre_hook(lambda mod, args, rows=rows: rows.__setitem__(0, rows[0] + args[0].shape[0]))
        ctx = TrainContext(model, exp.layout, exp.peer_data("p0"), node.generator, torch.device("cpu"),
                           cache_frozen=cache)
        ctx.train("personal", Phase(lr=0.1, amount=3, momentum=0.9))
        seen[cache] = rows[0]
        states[cache] = (node.state.params.clone(), node.generator.get_state())
    n = exp.peer_data("p0").num_train
    assert seen == {False: 3 * n, True: n}
    assert torch.equal(states[False][1], states[True][1])  # the same minibatch draws
    assert torch.allclose(states[False][0], states[True][0], rtol=1e-5, atol=1e-6)


#: A multi-layer personal head (``model.head_layers``, DePRL's public code's split, issue 69): the head phase
#: trains the whole linear stack on cached features, in every engine, as the uncached exact path does.
DATA16 = {**DATA, "params": {**DATA["params"], "shape": [1, 16, 16]}}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine", ["batched-loop", "batched-vmap"])
def test_a_multi_layer_head_trains_alike_in_every_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         engine: str) -> None:
    algorithm = {"name": "deprl", "lr_head": 0.05, "lr_body": 0.05, "tau": 8, "momentum": 0.9, "grad_clip": 1.0}
    model = {"name": "cnn_small", "head_layers": 3, "hidden": 16}

    def run(name: str, engine: str, cache: bool) -> dict[str, np.ndarray]:
        monkeypatch.setattr(local_sgd, "FROZEN_BODY_CACHE", cache)
        monkeypatch.setattr(context, "VECTORIZE", engine == "batched-vmap")
        folder = tmp_path / name
        folder.mkdir()
        cfg = load_config(tiny_config(folder, peers=4, rounds=2, algorithm=algorithm, data=DATA16, model=model,
                                      simulation={"workers": 1, "engine": engine.split("-")[0]}))
        simulate(cfg, folder / "run", progress=False)
        out = {}
        for f in sorted((folder / "run" / "checkpoints").glob("*.npz")):
            with np.load(f, allow_pickle=False) as z:
                out[f.stem] = z["params"].astype(np.float64)
        return out

    ref = run("exact-uncached", "exact", False)
    exp = Experiment.from_config(load_config(tmp_path / "exact-uncached" / "config.yaml"))
    assert len(exp.layout.personal_names) == 6  # three linear layers, all personal
    for name, eng in (("exact-cached", "exact"), (engine, engine)):
        got = run(name, eng, True)
        assert sorted(got) == sorted(ref) and len(ref) == 4
        for pid in ref:
            assert np.linalg.norm(ref[pid] - got[pid]) / np.linalg.norm(ref[pid]) <= 1e-5, (name, pid)
