"""FedRoD's local rule (p2pfl.algorithms.fedrod) against a hand-written reference, and its Flower baseline.

The reference re-derives one round from FedRoD's equations with plain autograd on the same minibatches
(the peer's generator, replayed): per minibatch, body and generic head take an SGD step on the balanced
softmax CE(g(z) + log n_k, y); the personal head takes one on CE(g(z) + p(z), y) with z and g(z) fixed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from p2pfl.algorithms import TrainContext
from p2pfl.algorithms.fedrod import PERSONAL_HEAD
from p2pfl.centralized.baselines import baseline_of, run_baseline
from p2pfl.config import load_config
from p2pfl.experiment import Experiment
from p2pfl.modelpool import ModelPool
from p2pfl.transport.memory import MemoryHub, MemoryTransport
from tests.conftest import tiny_config, train_then_evaluate_one_client

FEDROD = {"name": "fedrod", "lr": 0.05, "lr_decay": 0.9, "weight_decay": 1e-3, "local_epochs": 1}


def _reference_round(exp: Experiment, w: torch.Tensor, p: torch.Tensor, gen: torch.Generator, data, lr: float,
                     wd: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One epoch of FedRoD written out with autograd on a fresh model (w and p flat, layout order)."""
    model = exp.model_factory()
    named = dict(model.named_parameters())
    params = [named[s.name] for s in exp.layout.specs]
    n0 = exp.layout.num_shared
    _, y_all = data.train_batch(torch.arange(data.num_train))
    log_prior = torch.log(torch.bincount(y_all, minlength=data.num_classes).float())
    hw, hb = exp.layout.personal_specs()  # the head: weight, then bias
    w, p = w.clone(), p.clone()
    for pos in data.epoch_positions(gen):
        x, y = data.train_batch(pos)
        with torch.no_grad():
            for t, s in zip(params, exp.layout.specs, strict=True):
                t.copy_(w[s.offset : s.offset + s.numel].view(s.shape))
        feats = model.represent(x)
        g = model.head()(feats)
        grads = torch.autograd.grad(F.cross_entropy(g + log_prior, y), params)
        pw = p[hw.offset - n0 : hw.offset - n0 + hw.numel].view(hw.shape).clone().requires_grad_(True)
        pb = p[hb.offset - n0 : hb.offset - n0 + hb.numel].view(hb.shape).clone().requires_grad_(True)
        gpw, gpb = torch.autograd.grad(F.cross_entropy(g.detach() + feats.detach() @ pw.T + pb, y), (pw, pb))
        w = w - lr * (torch.cat([gr.reshape(-1) for gr in grads]) + wd * w)
        p = p - lr * (torch.cat([gpw.reshape(-1), gpb.reshape(-1)]) + wd * p)
    return w, p


@pytest.mark.timeout(120)
def test_fedrod_round_matches_the_hand_written_update(tmp_path: Path) -> None:
    cfg = load_config(tiny_config(tmp_path, rounds=2, algorithm=dict(FEDROD)))
    exp = Experiment.from_config(cfg)
    models = ModelPool(exp.model_factory, 1)
    node = exp.make_node("p1", transport=MemoryTransport(MemoryHub(), "p1"), models=models, record=lambda r: None,
                         run_dir=None)
    state, gen = node.state, node.generator
    head_numel = exp.layout.numel - exp.layout.num_shared
    assert torch.equal(state.extra[PERSONAL_HEAD], torch.zeros(head_numel))  # p starts at zero
    with torch.no_grad():  # a personal head that has learnt something, as after a few rounds
        state.extra[PERSONAL_HEAD].add_(0.1 * torch.randn(head_numel, generator=torch.Generator().manual_seed(0)))
    counts = node.app.data.train_label_counts()
    assert int(counts.sum()) == node.app.data.num_train
    w_t, p_prev = state.params.clone(), state.extra[PERSONAL_HEAD].clone()
    ref_gen = torch.Generator()
    ref_gen.set_state(gen.get_state())
    rnd = 1
    with models.borrow() as model:
        exp.layout.bind(model, state.params)
        metrics = node.algorithm.local_update(state, TrainContext(model, exp.layout, node.app.data, gen,
                                                                  state.params.device), rnd)
    lr = FEDROD["lr"] * FEDROD["lr_decay"] ** rnd
    w_ref, p_ref = _reference_round(exp, w_t, p_prev, ref_gen, node.app.data, lr, FEDROD["weight_decay"])
    torch.testing.assert_close(state.params, w_ref, rtol=1e-5, atol=1e-6)  # what the server gets
    torch.testing.assert_close(state.extra[PERSONAL_HEAD], p_ref, rtol=1e-5, atol=1e-6)  # kept at home
    assert not torch.allclose(p_ref, p_prev, atol=1e-4)  # the personal head really moved
    assert math.isfinite(metrics["train_loss"]) and math.isfinite(metrics["personal_train_loss"])


@pytest.mark.timeout(180)
def test_fedrod_baseline_averages_body_and_generic_head_and_evaluates_generic_plus_personal(tmp_path: Path) -> None:
    cfg = load_config(tiny_config(tmp_path, rounds=2, algorithm=dict(FEDROD)))
    exp = Experiment.from_config(cfg)
    assert baseline_of("fedrod", "fedrod").scope == "all"
    with pytest.raises(ValueError, match="'dfedavg' is not a fedrod local rule"):
        baseline_of("fedrod", "dfedavg")
    summary = run_baseline(cfg, tmp_path / "run", "fedrod", runtime="in-process", experiment=exp)
    assert summary["mode"] == "flower-fedrod" and summary["runtime"] == "in-process"
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["round"], r["peer"]) for r in recs] == [(r, p) for r in range(2) for p in exp.topology.ids]
    assert all(math.isfinite(r["acc"]) for r in recs)

    # One client by hand: after a train, evaluate reports the received model with head g + p on its split.
    peers, ctx, reported = train_then_evaluate_one_client(cfg, exp, "fedrod")
    p = torch.as_tensor(ctx.state.array_records["p2pfl.extra"][PERSONAL_HEAD].numpy()).reshape(-1)
    data = peers.peer_of(ctx).app
    model = exp.model_factory()
    combined = exp._init[1].clone()
    combined[exp.layout.num_shared:] += p
    exp.layout.bind(model, combined)
    own = data.evaluate(model)
    exp.layout.bind(model, exp._init[1].clone())
    glob = data.evaluate(model)
    assert reported["loss"] == pytest.approx(own["loss"]) and reported["accuracy"] == pytest.approx(own["acc"])
    assert reported["loss"] != pytest.approx(glob["loss"])


@pytest.mark.timeout(120)
def test_a_client_without_some_class_trains_with_finite_losses(tmp_path: Path) -> None:
    """The balanced softmax gives an absent class log 0 = -inf: it leaves the normalizer, and nothing is NaN."""
    from p2pfl.data.loader import PeerData

    cfg = load_config(tiny_config(tmp_path, rounds=1, algorithm=dict(FEDROD)))
    exp = Experiment.from_config(cfg)
    labels = exp.dataset.train_y.numpy()
    data = PeerData(exp.dataset, (labels != 3).nonzero()[0][:120], exp.peer_data("p0").test_indices, batch_size=16)
    assert data.train_label_counts().tolist()[3] == 0
    node = exp.make_node("p0", transport=MemoryTransport(MemoryHub(), "p0"), models=ModelPool(exp.model_factory, 1),
                         record=lambda r: None, run_dir=None)
    model = exp.model_factory()
    exp.layout.bind(model, node.state.params)
    metrics = node.algorithm.local_update(node.state, TrainContext(model, exp.layout, data, node.generator,
                                                                   node.state.params.device), 0)
    assert math.isfinite(metrics["train_loss"]) and math.isfinite(metrics["personal_train_loss"])
    assert torch.isfinite(node.state.params).all() and torch.isfinite(node.state.extra[PERSONAL_HEAD]).all()
