"""The full-model algorithms: D-PSGD, DFedAvgM, DFedSAM(-MGS), DFedADMM(-SAM) (specs 002 and 003).

Unit checks run the algorithms by hand on a tiny MLP; end-to-end checks go through
``simulate`` on the 4-peer synthetic task of ``tests/conftest.py``.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from p2pfl.algorithms import (
    ALGORITHMS,
    HyperparameterError,
    PeerState,
    TrainContext,
    algorithm_class,
    build_algorithm,
    dfedadmm,
    dfedsam,
    full_sharing,
)
from p2pfl.algorithms.local_sgd import loss_step, run_sgd
from p2pfl.algorithms.sam import sam_gradient, sam_step
from p2pfl.config import load_config
from p2pfl.data import PeerData, load_dataset
from p2pfl.models import build_model, split_parameter_names
from p2pfl.models.layout import ParamLayout
from p2pfl.payload import Payload
from p2pfl.simulation import simulate
from p2pfl.topology import generate
from tests.conftest import tiny_config

FULL = ["dpsgd", "dfedavgm", "dfedsam", "dfedsam_mgs", "dfedadmm", "dfedadmm_sam"]


# -- helpers -------------------------------------------------------------------------------------
def _dataset():
    return load_dataset("synthetic", None, num_classes=4, train_size=200, test_size=40, shape=[1, 8, 8], seed=1)


def _model(seed: int = 0) -> tuple[torch.nn.Module, ParamLayout]:
    ds = _dataset()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model("mlp", ds.input_shape, ds.num_classes, hidden=16)
    shared, personal = split_parameter_names(model)
    return model, ParamLayout.from_model(model, shared, personal)


def _ctx(model: torch.nn.Module, layout: ParamLayout, flat: torch.Tensor, seed: int = 7) -> TrainContext:
    layout.bind(model, flat)
    data = PeerData(_dataset(), np.arange(48), np.arange(20), batch_size=16)
    gen = torch.Generator().manual_seed(seed)
    return TrainContext(model, layout, data, gen, torch.device("cpu"))


def _peer_states(layout: ParamLayout, ids: tuple[str, ...], seed: int = 0) -> dict[str, PeerState]:
    """Distinct random models, as after local training (identical ones would hide the mixing)."""
    g = torch.Generator().manual_seed(seed)
    return {pid: PeerState(pid, torch.randn(layout.numel, generator=g)) for pid in ids}


def _gossip(algo: Any, states: dict[str, PeerState], topo: Any, rnd: int, seed: int) -> None:
    """What the Nodes do for one round's gossip: per step, every peer snapshots ``outgoing``,
    then every peer combines the step's snapshots of its in-neighbours (Jacobi)."""
    for step in range(algo.gossip_steps()):
        msgs = {pid: Payload(pid, rnd, step, "h", algo.wire_specs(), algo.outgoing(s, rnd, step)[0].clone())
                for pid, s in states.items()}
        for pid, s in states.items():
            plan = topo.plan(pid, rnd, step, seed=seed, mode=algo.mode)
            algo.combine(s, rnd, step, msgs[pid], {j: msgs[j] for j in plan.in_weights}, plan)


def _run(tmp_path: Path, name: str, algorithm: dict[str, Any], rounds: int, **extra: Any) -> tuple[dict, Path]:
    d = tmp_path / name
    d.mkdir()
    cfg = load_config(tiny_config(d, rounds=rounds, algorithm=algorithm, **extra))
    summary = simulate(cfg, d / "run", progress=False)
    return summary, d / "run"


def _params(run: Path, pid: str) -> np.ndarray:
    with np.load(run / "checkpoints" / f"{pid}.npz") as z:
        return z["params"].copy()


# -- SAM -----------------------------------------------------------------------------------------
def test_sam_with_rho_zero_is_the_sgd_step_bitwise() -> None:
    """rho = 0: every step of the SAM loop equals the plain SGD step, bit for bit."""
    traces = []
    for make_step in (lambda m, ps: loss_step(m), lambda m, ps: sam_step(m, ps, 0.0)):
        model, layout = _model()
        flat = layout.flatten(model)
        ctx = _ctx(model, layout, flat)
        params = list(model.parameters())
        trace: list[torch.Tensor] = []
        run_sgd(ctx, params, lr=0.1, epochs=3, weight_decay=5e-4, step_fn=make_step(model, params),
                after_step=lambda t=trace, f=flat: t.append(f.clone()))
        traces.append(trace)
    plain, sam = traces
    assert len(plain) == len(sam) == 9
    assert not torch.equal(plain[0], plain[-1])
    for a, b in zip(plain, sam, strict=True):
        assert torch.equal(a, b)


def test_dfedsam_rho0_equals_dfedavg_bitwise(tmp_path: Path) -> None:
    hp = {"lr": 0.1, "local_epochs": 1, "weight_decay": 5e-4}
    _, avg = _run(tmp_path, "avg", {"name": "dfedavg", "momentum": 0.0, **hp}, rounds=3)
    _, sam = _run(tmp_path, "sam", {"name": "dfedsam", "rho": 0.0, **hp}, rounds=3)
    _, mgs = _run(tmp_path, "mgs", {"name": "dfedsam_mgs", "rho": 0.0, "gossip_steps": 1, **hp}, rounds=3)
    for pid in ("p0", "p1", "p2", "p3"):
        assert np.array_equal(_params(avg, pid), _params(sam, pid))
        assert np.array_equal(_params(avg, pid), _params(mgs, pid))


# -- DFedSAM-MGS -----------------------------------------------------------------------------------
def test_mgs_combine_over_q_exchanges_is_w_power() -> None:
    """Q Jacobi exchanges through outgoing/combine give W_{Q-1} ... W_0 Z on a per-step random schedule."""
    topo = generate("random_pull", 6, k=2)
    _, layout = _model()
    algo = build_algorithm("dfedsam_mgs", {"gossip_steps": 3}, layout)
    states = _peer_states(layout, topo.ids)
    z = torch.stack([states[p].params for p in topo.ids]).double()
    _gossip(algo, states, topo, rnd=5, seed=11)
    expect = z
    mats = [topo.mixing_matrix(5, q, 11) for q in range(3)]
    assert not np.allclose(mats[0], mats[1])  # the steps really use different matrices
    for w in mats:
        expect = torch.from_numpy(w) @ expect
    got = torch.stack([states[p].params for p in topo.ids]).double()
    assert torch.allclose(got, expect, atol=1e-5)
    assert not torch.allclose(got, torch.from_numpy(mats[0]) @ z, atol=1e-3)  # not a single step


def test_mgs_run_equals_w_power_of_trained_models(tmp_path: Path) -> None:
    """End to end through the Node: one round of MGS (rho 0) = W^Q applied to the round's trained
    models, which a no-gossip run with the same local rule produces (same seeds, same batches)."""
    hp = {"lr": 0.1, "local_epochs": 1, "weight_decay": 5e-4}
    _, loc = _run(tmp_path, "local", {"name": "local", "momentum": 0.0, **hp}, rounds=1)
    _, mgs = _run(tmp_path, "mgs", {"name": "dfedsam_mgs", "rho": 0.0, "gossip_steps": 3, **hp}, rounds=1)
    topo = generate("ring", 4)
    z = np.stack([_params(loc, p) for p in topo.ids]).astype(np.float64)
    w = topo.mixing_matrix()
    got = np.stack([_params(mgs, p) for p in topo.ids])
    np.testing.assert_allclose(got, np.linalg.matrix_power(w, 3) @ z, atol=1e-5)
    assert not np.allclose(got, w @ z, atol=1e-4)
    assert not np.allclose(got, np.linalg.matrix_power(w, 4) @ z, atol=1e-4)  # exactly Q, not Q + 1
    recs = [json.loads(line) for line in (mgs / "metrics.jsonl").read_text().splitlines()]
    one = 2 * 4 * z.shape[1]  # 2 ring neighbours x 4 bytes x the whole model
    assert all(r["bytes_sent"] >= 3 * one for r in recs)  # Q real exchanges of the whole model


# -- DFedADMM --------------------------------------------------------------------------------------
def _admm_reference(model: torch.nn.Module, layout: ParamLayout, x0: torch.Tensor, dual: torch.Tensor,
                    lam: float, lr: float, rho: float, seed: int, clip: float = 0.0) -> torch.Tensor:
    """eq. 6 by hand (plain SGD; prox and dual terms at the unperturbed x), then the old-dual message.

    ``clip > 0``: the loss gradient alone is scaled to norm ``clip`` when longer (the eps of
    ``torch.nn.utils.clip_grad_norm_``) before the dual and prox terms are added.
    """
    flat = x0.clone()
    ctx = _ctx(model, layout, flat, seed=seed)
    params = list(model.parameters())
    assert [s.name for s in layout.specs] == [n for n, _ in model.named_parameters()]  # flat order = params order
    for x, y in ctx.data.epoch(ctx.generator):
        if rho > 0:
            sam_gradient(model, params, x, y, rho)
            grad = torch.cat([p.grad.reshape(-1) for p in params])
        else:
            grad = torch.cat([g.reshape(-1) for g in torch.autograd.grad(F.cross_entropy(model(x), y), params)])
        if clip > 0:
            grad = grad * min(1.0, clip / (float(grad.norm()) + 1e-6))
        with torch.no_grad():
            flat -= lr * (grad - dual + (flat - x0) / lam)
    return flat - lam * dual


@pytest.mark.parametrize(("name", "semantics", "lam_eq", "clip"), [("dfedadmm", "prox_coef", 10.0, 0.0),
                                                                  ("dfedadmm", "equation", 0.5, 0.0),
                                                                  ("dfedadmm_sam", "prox_coef", 10.0, 0.0),
                                                                  ("dfedadmm", "prox_coef", 10.0, 0.05),
                                                                  ("dfedadmm_sam", "prox_coef", 10.0, 0.05)])
def test_dfedadmm_local_step_dual_and_message(name: str, semantics: str, lam_eq: float, clip: float) -> None:
    model, layout = _model()
    lam_hp = 1.0 / lam_eq if semantics == "prox_coef" else lam_eq
    algo = build_algorithm(name, {"lam": lam_hp, "lambda_semantics": semantics, "lr": 0.1, "grad_clip": clip},
                           layout)
    assert algo.lam == pytest.approx(lam_eq)
    state = PeerState("p0", layout.flatten(model))
    algo.init_state(state, torch.Generator())
    assert torch.equal(state.extra["dual"], torch.zeros_like(state.params))  # g_hat^{-1} = 0
    duals = [state.extra["dual"].clone()]
    for rnd in range(3):
        anchor, old = state.params.clone(), state.extra["dual"].clone()
        ref = _admm_reference(copy.deepcopy(model), layout, anchor, old, lam_eq, 0.1,
                              rho=0.1 if name == "dfedadmm_sam" else 0.0, seed=rnd, clip=clip)
        if clip > 0:  # the clip binds: without it the same round lands elsewhere
            unclipped = _admm_reference(copy.deepcopy(model), layout, anchor, old, lam_eq, 0.1,
                                        rho=0.1 if name == "dfedadmm_sam" else 0.0, seed=rnd)
            assert float((unclipped - ref).abs().max()) > 1e-3
        ctx = _ctx(model, layout, state.params, seed=rnd)
        algo.local_update(state, ctx, rnd)
        z, scalars = algo.outgoing(state, rnd, 0)
        new = state.extra["dual"]
        # the sent message is x^t - lambda * g_hat^t (new dual), and is eq. 6 + old-dual message
        torch.testing.assert_close(z, anchor - lam_eq * new, atol=1e-5, rtol=0)
        torch.testing.assert_close(z, ref, atol=1e-5, rtol=0)
        assert scalars == {} and z.numel() == layout.numel  # nothing but the model-shaped z
        assert not torch.equal(new, old)  # the dual evolves
        duals.append(new.clone())
        state.params.copy_(anchor + 0.5 * (z - anchor))  # stand-in for the mix, so the anchor moves
    assert all(float(d.abs().max()) > 0 for d in duals[1:])


def test_dfedadmm_dual_is_private_and_checkpointed(tmp_path: Path) -> None:
    """The wire carries exactly the model's tensors (the bytes equal DFedAvg's); the dual is state."""
    model, layout = _model()
    algo = build_algorithm("dfedadmm", {}, layout)
    assert [s.name for s in algo.wire_specs()] == [n for n, _ in model.named_parameters()]
    _, avg = _run(tmp_path, "avg", {"name": "dfedavg"}, rounds=2)
    _, admm = _run(tmp_path, "admm", {"name": "dfedadmm"}, rounds=2)
    sent = [[r["bytes_sent"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]
            for run in (avg, admm)]
    assert sent[0] == sent[1]
    with np.load(admm / "checkpoints" / "p0.npz") as ck:
        assert ck["extra/dual"].shape == ck["params"].shape and np.abs(ck["extra/dual"]).max() > 0


def test_dfedadmm_refuses_what_eq6_excludes() -> None:
    _, layout = _model()
    for bad in ({"momentum": 0.9}, {"weight_decay": 5e-4}, {"lambda_semantics": "1/lambda"},
                {"lam": 0.01, "lambda_semantics": "equation"}):  # lr / lambda = 10 > 2: unstable
        with pytest.raises(HyperparameterError):
            build_algorithm("dfedadmm", bad, layout)


# -- mixing ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["dpsgd", "dfedavgm", "dfedsam", "dfedsam_mgs", "dfedadmm"])
def test_doubly_stochastic_gossip_preserves_the_average(name: str) -> None:
    topo = generate("ring", 5)  # metropolis weights: symmetric, doubly stochastic
    _, layout = _model()
    algo = build_algorithm(name, {}, layout)
    states = _peer_states(layout, topo.ids, seed=1)
    before = torch.stack([s.params for s in states.values()]).double()
    _gossip(algo, states, topo, rnd=0, seed=0)
    after = torch.stack([s.params for s in states.values()]).double()
    assert algo.shares == "all"
    assert torch.allclose(after.mean(0), before.mean(0), atol=1e-6)
    assert (after - after.mean(0)).norm() < 0.9 * (before - before.mean(0)).norm()  # it did mix


# -- presets ---------------------------------------------------------------------------------------
def test_presets_build_their_algorithms() -> None:
    _, layout = _model()
    owner = {"dfedavg-paper": "dfedavg", "dfedavgm-paper": "dfedavgm", "dpsgd-paper": "dpsgd",
             "dfedsam-paper": "dfedsam", "dfedsam-mgs-paper": "dfedsam_mgs", "dfedsam-dfedadmm-paper": "dfedsam",
             "dfedadmm-paper": "dfedadmm", "dfedadmm-sam-paper": "dfedadmm_sam"}
    presets = {**full_sharing.PRESETS, **dfedsam.PRESETS, **dfedadmm.PRESETS}
    # dpsgd-authors is DePRL's authors' optimizer, not these papers' protocol (tests/test_deprl_authors.py)
    assert set(presets) == set(owner) | {"dpsgd-authors"}
    assert build_algorithm("dpsgd", presets["dpsgd-authors"], layout).hp["grad_clip"] == 10.0
    for preset, name in owner.items():
        algo = build_algorithm(name, presets[preset], layout)
        assert algo.hp["lr"] == 0.1 and algo.hp["lr_decay"] == 0.998
    assert presets["dfedsam-mgs-paper"]["gossip_steps"] == 4 and presets["dfedsam-paper"]["rho"] == 0.01
    assert "weight_decay" not in presets["dfedadmm-paper"]  # DFedADMM has none (spec 002 section 4.5)


# -- beats local -----------------------------------------------------------------------------------
# IID data on 4 peers of 60 noisy samples each (synthetic noise 3): a single peer overfits its few
# samples, so sharing the whole model should help every full-model method, as their papers say
# for IID data (spec 002 section 5, spec 003 section 4). 3 local epochs (12 steps), 6 rounds, ring.
# Each method is compared with `local` running the same local optimizer where `local` can (same
# momentum, same weight decay), and with itself cut off from its neighbours (no gossip step; DFedADMM
# alone is a different optimizer from `local`), so the margin is the gossip's, not the optimizer's.
BEAT_DATA = {"dataset": "synthetic", "partition": {"kind": "iid"}, "batch_size": 16,
             "params": {"num_classes": 4, "train_size": 240, "test_size": 800, "shape": [1, 8, 8], "seed": 1,
                        "noise": 3.0}}
BEAT: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # name -> (its hyperparameters, local's)
    "dpsgd": ({"local_steps": 12}, {"local_epochs": 3}),  # the same number of SGD steps (4 batches x 3)
    "dfedavgm": ({"local_epochs": 3}, {"local_epochs": 3, "momentum": 0.9}),
    "dfedsam": ({"local_epochs": 3}, {"local_epochs": 3}),
    "dfedsam_mgs": ({"local_epochs": 3}, {"local_epochs": 3}),
    "dfedadmm": ({"local_epochs": 3}, {"local_epochs": 3, "weight_decay": 0.0}),
    "dfedadmm_sam": ({"local_epochs": 3}, {"local_epochs": 3, "weight_decay": 0.0}),
}


def _isolated(name: str) -> type:
    """``name``'s algorithm with no gossip step: the same local rule, alone."""
    cls = algorithm_class(name)
    return type(f"Isolated_{name}", (cls,), {"name": f"{name}_isolated", "gossip_steps": lambda self: 0})


ISOLATED = {f"Isolated_{name}": _isolated(name) for name in FULL}
globals().update(ISOLATED)


@cache
def _beat_acc(algorithm: str, tmp: str) -> float:
    algo = json.loads(algorithm)
    name = f"{algo['name']}-{abs(hash(algorithm))}"
    summary, _ = _run(Path(tmp), name, algo, rounds=6, data=BEAT_DATA, simulation={"workers": 1})
    return float(summary["final_acc_mean"])


@pytest.fixture(scope="module")
def beat_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("beat"))


@pytest.mark.parametrize("name", FULL)
def test_full_model_methods_beat_local_on_iid(name: str, beat_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ALGORITHMS, f"{name}_isolated", f"{__name__}:Isolated_{name}")
    mine, local = BEAT[name]
    acc = _beat_acc(json.dumps({"name": name, **mine}, sort_keys=True), beat_dir)
    base = _beat_acc(json.dumps({"name": "local", **local}, sort_keys=True), beat_dir)
    alone = _beat_acc(json.dumps({"name": f"{name}_isolated", **mine}, sort_keys=True), beat_dir)
    print(f"{name}: {acc:.4f} vs local {base:.4f}, alone {alone:.4f}")
    assert acc > base + 0.02
    assert acc > alone + 0.02


def test_sgd_step_is_torch_optim_sgd_bit_for_bit_with_and_without_momentum() -> None:
    """The shared rule (multi-tensor path without momentum, per tensor with it) against torch.optim.SGD."""
    from p2pfl.algorithms.rules import sgd_step_

    gen = torch.Generator().manual_seed(4)
    shapes = [(16, 1, 5, 5), (16,), (128, 512), (10,)]
    for momentum, wd in ((0.0, 0.0), (0.0, 5e-4), (0.9, 5e-4)):
        ref = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        ours = [p.detach().clone() for p in ref]
        opt = torch.optim.SGD(ref, lr=0.07, momentum=momentum, weight_decay=wd, foreach=False)
        bufs: list = [None] * len(ours)
        for _ in range(4):
            grads = [torch.randn(s, generator=gen) * 10.0 ** float(torch.randint(-4, 3, (), generator=gen))
                     for s in shapes]
            for p, g in zip(ref, grads, strict=True):
                p.grad = g.clone()
            opt.step()
            sgd_step_(ours, grads, bufs, lr=0.07, momentum=momentum, weight_decay=wd)
            for a, b in zip(ref, ours, strict=True):
                assert torch.equal(a.detach(), b), (momentum, wd)
