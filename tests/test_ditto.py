"""Ditto's local rule (p2pfl.algorithms.ditto) against a hand-written reference, its Flower baseline, and a
sweep case that runs a parameter-server baseline (``flower:``) end to end.

The reference re-derives one round from Ditto's equations with plain autograd on the same minibatches
(the peer's generator, replayed): w <- w - lr (grad F(w) + wd w) over one epoch, then
v <- v - lr (grad F(v) + wd v + lam (v - w^t)) over one epoch, w^t the model received this round.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from p2pfl.algorithms import TrainContext
from p2pfl.algorithms.ditto import PERSONAL
from p2pfl.centralized.baselines import baseline_of, run_baseline
from p2pfl.config import load_config
from p2pfl.experiment import Experiment
from p2pfl.modelpool import ModelPool
from p2pfl.transport.memory import MemoryHub, MemoryTransport
from tests.conftest import tiny_config, train_then_evaluate_one_client

DITTO = {"name": "ditto", "lr": 0.05, "lr_decay": 0.9, "weight_decay": 1e-3, "local_epochs": 1,
         "personal_epochs": 1, "lam": 0.5}


def _reference_epoch(exp: Experiment, flat: torch.Tensor, gen: torch.Generator, data, lr: float, wd: float,
                     anchor: torch.Tensor | None = None, lam: float = 0.0) -> torch.Tensor:
    """One epoch of plain SGD written out: flat <- flat - lr (grad + wd flat [+ lam (flat - anchor)])."""
    model = exp.model_factory()
    names = [s.name for s in exp.layout.specs]
    w = flat.clone()
    for pos in data.epoch_positions(gen):
        x, y = data.train_batch(pos)
        params = {n: t.clone().requires_grad_(True) for n, t in exp.layout.views(w).items()}
        loss = F.cross_entropy(torch.func.functional_call(model, params, (x,)), y)
        grads = torch.autograd.grad(loss, [params[n] for n in names])
        g = torch.cat([gr.reshape(-1) for gr in grads]) + wd * w
        if anchor is not None:
            g = g + lam * (w - anchor)
        w = w - lr * g
    return w


@pytest.mark.timeout(120)
def test_ditto_round_matches_the_hand_written_update(tmp_path: Path) -> None:
    cfg = load_config(tiny_config(tmp_path, rounds=2, algorithm=dict(DITTO)))
    exp = Experiment.from_config(cfg)
    models = ModelPool(exp.model_factory, 1)
    node = exp.make_node("p1", transport=MemoryTransport(MemoryHub(), "p1"), models=models, record=lambda r: None,
                         run_dir=None)
    state, gen = node.state, node.generator
    assert torch.equal(state.extra[PERSONAL], state.params)  # v^0 = w^0
    with torch.no_grad():  # a personal model that has drifted from the global one, as after a few rounds
        state.extra[PERSONAL].add_(0.05 * torch.randn(state.params.shape, generator=torch.Generator().manual_seed(0)))
    w_t, v_prev = state.params.clone(), state.extra[PERSONAL].clone()
    ref_gen = torch.Generator()
    ref_gen.set_state(gen.get_state())
    rnd = 1
    with models.borrow() as model:
        exp.layout.bind(model, state.params)
        metrics = node.algorithm.local_update(state, TrainContext(model, exp.layout, node.app.data, gen, state.params.device),
                                              rnd)
    lr = DITTO["lr"] * DITTO["lr_decay"] ** rnd
    w_ref = _reference_epoch(exp, w_t, ref_gen, node.app.data, lr, DITTO["weight_decay"])
    v_ref = _reference_epoch(exp, v_prev, ref_gen, node.app.data, lr, DITTO["weight_decay"], anchor=w_t,
                             lam=DITTO["lam"])
    torch.testing.assert_close(state.params, w_ref, rtol=1e-5, atol=1e-6)  # what the server gets: w_k
    torch.testing.assert_close(state.extra[PERSONAL], v_ref, rtol=1e-5, atol=1e-6)  # kept at home: v_k
    assert not torch.allclose(v_ref, w_ref, atol=1e-3)  # the two models really differ
    assert metrics["personal_train_loss"] > 0 and metrics["train_loss"] > 0


@pytest.mark.timeout(180)
def test_ditto_baseline_averages_w_and_evaluates_each_clients_personal_model(tmp_path: Path) -> None:
    cfg = load_config(tiny_config(tmp_path, rounds=2, algorithm=dict(DITTO)))
    exp = Experiment.from_config(cfg)
    assert baseline_of("ditto", "ditto").scope == "all"
    with pytest.raises(ValueError, match="'dfedavg' is not a ditto local rule"):
        baseline_of("ditto", "dfedavg")
    summary = run_baseline(cfg, tmp_path / "run", "ditto", runtime="in-process", experiment=exp)
    assert summary["mode"] == "flower-ditto" and summary["runtime"] == "in-process"
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["round"], r["peer"]) for r in recs] == [(r, p) for r in range(2) for p in exp.topology.ids]

    # One client by hand: after a train, evaluate reports v_k on its split, not the received global model.
    peers, ctx, reported = train_then_evaluate_one_client(cfg, exp, "ditto")
    v = torch.cat([torch.as_tensor(a.numpy()).reshape(-1)
                   for a in ctx.state.array_records["p2pfl.extra"].values()])
    data = peers.peer_of(ctx).app
    model = exp.model_factory()
    exp.layout.bind(model, v.clone())
    own = data.evaluate(model)
    exp.layout.bind(model, exp._init[1].clone())
    glob = data.evaluate(model)
    assert reported["loss"] == pytest.approx(own["loss"]) and reported["accuracy"] == pytest.approx(own["acc"])
    assert reported["loss"] != pytest.approx(glob["loss"])


@pytest.mark.timeout(300)
def test_a_sweep_case_runs_a_flower_baseline_and_is_finished_on_rerun(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``flower: fedrep`` in a sweep: validated with the config, run by ``p2pfl flower`` into the cell folder."""
    from p2pfl import sweep

    base = tiny_config(tmp_path, rounds=2)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({
        "name": "ps", "base": str(base),
        "cases": [{"name": "fedrep", "flower": "fedrep", "set": {"algorithm": {"name": "deprl", "tau": 1}}},
                  {"name": "dfedavg", "set": {"algorithm": {"name": "dfedavg", "lr": 0.1}}}],
    }))
    spec = sweep.load_sweep(tmp_path / "s.yaml")
    cells = {c.name: c for c in sweep.plan_cells(spec)}
    assert cells["fedrep"].flower == "fedrep" and cells["dfedavg"].flower is None
    assert sweep.simulate_command(tmp_path, flower="fedrep")[3:5] == ["flower", "--config"]
    bad = yaml.safe_load((tmp_path / "s.yaml").read_text())
    bad["cases"][1]["flower"] = "fedrep"  # dfedavg is not an alternating local rule
    with pytest.raises(sweep.SweepError, match="'dfedavg' is not a fedrep local rule"):
        sweep.plan_cells(sweep.parse_sweep(bad, tmp_path / "s.yaml"))

    # Flower's in-process runtime keeps the test free of Ray's start-up; the Ray path has its own test.
    plain = sweep.simulate_command
    monkeypatch.setattr(sweep, "simulate_command", lambda cell_dir, resume=False, flower=None: plain(
        cell_dir, resume, flower) + (["--runtime", "in-process"] if flower else []))
    spec1 = sweep.parse_sweep({**yaml.safe_load((tmp_path / "s.yaml").read_text()),
                               "cases": [yaml.safe_load((tmp_path / "s.yaml").read_text())["cases"][0]]},
                              tmp_path / "s.yaml")
    res = sweep.run_sweep(spec1, tmp_path / "out", progress=False)
    assert [c.status for c in res.cells] == ["done"], [c.error for c in res.cells]
    cell = tmp_path / "out" / "fedrep"
    summary = json.loads((cell / "summary.json").read_text())
    assert summary["mode"] == "flower-fedrep" and summary["runtime"] == "in-process" and summary["rounds"] == 2
    assert "flower" in (cell / "log.txt").read_text().splitlines()[0]
    assert json.loads((tmp_path / "out" / "sweep.json").read_text())["cells"][0]["flower"] == "fedrep"
    assert sweep.cell_state(cell, res.cells[0].cell.config) == "finished"  # a rerun skips it
