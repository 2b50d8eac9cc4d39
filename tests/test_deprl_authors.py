"""DePRL and D-PSGD at the settings of DePRL's public code (issue 69, spec 004 §9).

The presets carry the authors' values; momentum and gradient clipping act in both DePRL phases,
each phase with its own fresh momentum buffer, and in D-PSGD; the rule is torch's own
(``torch.optim.SGD`` after ``clip_grad_norm_``), checked here step for step by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from p2pfl.algorithms.base import HyperparameterError, TrainContext
from p2pfl.algorithms.deprl import PRESETS as DEPRL_PRESETS
from p2pfl.algorithms.deprl import DePRL
from p2pfl.algorithms.full_sharing import PRESETS as BASELINE_PRESETS
from p2pfl.algorithms.presets import presets_for
from p2pfl.config import load_config
from p2pfl.experiment import Experiment
from p2pfl.modelpool import ModelPool
from p2pfl.transport.memory import MemoryHub, MemoryTransport
from tests.conftest import tiny_config

DATA = {"dataset": "synthetic", "partition": {"kind": "dirichlet", "alpha": 0.3}, "batch_size": 16,
        "params": {"num_classes": 10, "train_size": 200, "test_size": 200, "shape": [1, 16, 16], "seed": 1,
                   "noise": 3.0}}


def _experiment(tmp_path: Path, algorithm: dict[str, Any]) -> Experiment:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tiny_config(tmp_path, algorithm=algorithm, data=DATA, model={"name": "mlp", "hidden": 32},
                       simulation={"workers": 1})
    return Experiment.from_config(load_config(path))


def test_the_authors_presets_carry_the_authors_values(tmp_path: Path) -> None:
    a = DEPRL_PRESETS["deprl-authors"]
    assert (a["lr_head"], a["lr_body"], a["lr_decay"], a["weight_decay"]) == (0.01, 0.01, 0.96, 1e-5)
    assert (a["momentum"], a["grad_clip"]) == (0.9, 10.0)
    assert (a["tau"], a["tau_unit"], a["rep_steps"], a["rep_unit"]) == (3, "epochs", 1, "epochs")
    d = BASELINE_PRESETS["dpsgd-authors"]
    assert (d["lr"], d["lr_decay"], d["weight_decay"], d["momentum"], d["grad_clip"]) == (0.01, 0.96, 1e-5, 0.9, 10.0)
    assert (d["local_epochs"], d["local_steps"]) == (3, 0)
    assert "deprl-authors" in presets_for("deprl") and "dpsgd-authors" in presets_for("dpsgd")
    # a config naming the preset resolves to these values, its own keys winning
    cfg = load_config(tiny_config(tmp_path, algorithm={"name": "deprl", "preset": "deprl-authors", "tau": 2}))
    hp = cfg.hyperparameters()
    assert {k: hp[k] for k in a if k != "tau"} == {k: v for k, v in a.items() if k != "tau"} and hp["tau"] == 2
    # the paper's preset and the class defaults keep clipping and momentum off: earlier runs are unchanged
    assert "grad_clip" not in DEPRL_PRESETS["deprl-paper"] and DEPRL_PRESETS["deprl-paper"]["momentum"] == 0.0
    assert "momentum" not in BASELINE_PRESETS["dpsgd-paper"] and "grad_clip" not in BASELINE_PRESETS["dpsgd-paper"]


def test_a_negative_clip_is_refused(tmp_path: Path) -> None:
    layout = _experiment(tmp_path, {"name": "deprl"}).layout
    with pytest.raises(HyperparameterError, match="grad_clip"):
        DePRL({"grad_clip": -1.0}, layout)


def _node(exp: Experiment) -> Any:
    return exp.make_node("p1", transport=MemoryTransport(MemoryHub(), "p1"), models=ModelPool(exp.model_factory, 1),
                         record=lambda rec: None, run_dir=None)


def _by_hand(ref: torch.nn.Module, phases: list[tuple[list[torch.nn.Parameter], float, int]], gen: torch.Generator,
             data: Any, clip: float, momentum: float, wd: float) -> list[float]:
    """Each phase: a new torch.optim.SGD over its block only, ``clip_grad_norm_`` before every step.
    Returns every step's gradient norm before clipping."""
    norms: list[float] = []
    for params, lr, count in phases:
        opt = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=wd)  # a fresh buffer per phase
        for _ in range(count):
            x, y = data.sample_batch(gen)
            opt.zero_grad()
            grads = torch.autograd.grad(F.cross_entropy(ref(x), y), params)
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
            opt.step()
    return norms


def test_deprl_clips_and_uses_momentum_in_both_phases_with_a_fresh_buffer_each(tmp_path: Path) -> None:
    clip = 0.05  # binds: the gradients of this problem are far larger
    exp = _experiment(tmp_path, {"name": "deprl", "lr_head": 0.3, "lr_body": 0.2, "tau": 3, "rep_steps": 2,
                                 "momentum": 0.9, "grad_clip": clip})
    node = _node(exp)
    layout = exp.layout
    gen = torch.Generator()
    gen.set_state(node.generator.get_state())
    before = node.state.params.clone()
    model = exp.build_model()
    layout.bind(model, node.state.params)
    node.algorithm.local_update(node.state, TrainContext(model, layout, node.app.data, node.generator,
                                                         torch.device("cpu")), 2)
    ref = exp.build_model()
    ref_flat = before.clone()
    layout.bind(ref, ref_flat)
    for p in ref.parameters():
        p.requires_grad_(True)
    norms = _by_hand(ref, [(layout.personal_params(ref), 0.3 * 0.96**2, 3), (layout.shared_params(ref), 0.2 * 0.96**2, 2)],
                     gen, node.app.data, clip, 0.9, 1e-5)
    assert all(n > clip for n in norms)  # every step was clipped
    assert torch.allclose(node.state.params, ref_flat, atol=1e-6)
    # without the clip the round differs: clipping acted
    exp2 = _experiment(tmp_path / "noclip", {"name": "deprl", "lr_head": 0.3, "lr_body": 0.2, "tau": 3,
                                               "rep_steps": 2, "momentum": 0.9})
    node2 = _node(exp2)
    model2 = exp2.build_model()
    exp2.layout.bind(model2, node2.state.params)
    node2.algorithm.local_update(node2.state, TrainContext(model2, exp2.layout, node2.app.data, node2.generator,
                                                           torch.device("cpu")), 2)
    assert not torch.allclose(node2.state.params, ref_flat, atol=1e-4)


def test_dpsgd_takes_the_authors_optimizer(tmp_path: Path) -> None:
    clip = 0.05
    exp = _experiment(tmp_path, {"name": "dpsgd", "lr": 0.2, "local_steps": 4, "momentum": 0.9, "grad_clip": clip,
                                 "weight_decay": 1e-5, "lr_decay": 0.96})
    node = _node(exp)
    gen = torch.Generator()
    gen.set_state(node.generator.get_state())
    ref = exp.build_model()
    ref_flat = node.state.params.clone()
    exp.layout.bind(ref, ref_flat)
    model = exp.build_model()
    exp.layout.bind(model, node.state.params)
    node.algorithm.local_update(node.state, TrainContext(model, exp.layout, node.app.data, node.generator,
                                                         torch.device("cpu")), 1)
    named = dict(ref.named_parameters())
    norms = _by_hand(ref, [([named[s.name] for s in exp.layout.specs], 0.2 * 0.96, 4)], gen, node.app.data,
                     clip, 0.9, 1e-5)
    assert all(n > clip for n in norms)
    assert torch.allclose(node.state.params, ref_flat, atol=1e-6)
