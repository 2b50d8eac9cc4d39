"""Robust mixing (``mixing.robust``) and Byzantine fault injection (``faults.byzantine``).

Each rule's promise (docs/robust.md) is checked against adversarial inputs; refusals come up front
in the config's one-line style; one attacker breaks plain mixing but not median/clipped mixing in a
real simulation; and a robust rule under attack gives bitwise the same parameters over gRPC.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from p2pfl.algorithms.combine import mix_into, mix_rows
from p2pfl.algorithms.robust import MixingRule, robust_mix
from p2pfl.config import load_config
from p2pfl.faults import ByzantineFault, tamper
from p2pfl.payload import Payload
from p2pfl.simulation import simulate
from p2pfl.topology import MixingPlan
from tests.conftest import tiny_config
from tests.swarm import free_base_port
from tests.test_compression import assert_same_as_simulation

ATTACKS = ("huge", "opposite", "inside")


def _bad(kind: str, honest: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A bad input: far away, mirrored, or just outside the honest range on alternating sides."""
    lo, hi = honest.min(0).values, honest.max(0).values
    if kind == "huge":
        return torch.full_like(lo, 1e6) * torch.sign(torch.randn(lo.shape, generator=g))
    if kind == "opposite":
        return -50 * honest.mean(0)
    return torch.where(torch.rand(lo.shape, generator=g) > 0.5, hi + 1e-3, lo - 1e-3)


@pytest.mark.parametrize("robust", ["median", "trimmed_mean"])
@pytest.mark.parametrize("f", [1, 2])
@pytest.mark.parametrize("attack", ATTACKS)
def test_order_statistics_stay_in_the_honest_range(robust: str, f: int, attack: str) -> None:
    """f bad among n >= 2f + 1 inputs (self honest): every coordinate within the honest inputs' range."""
    g = torch.Generator().manual_seed(f * 17 + len(attack))
    rule = MixingRule(robust, trim=f)
    for n in (2 * f + 1, 2 * f + 2, 2 * f + 4):
        honest = torch.randn(n - f, 257, generator=g)
        bad = [_bad(attack, honest, g) for _ in range(f)]
        inputs = [*honest[1:], *bad]
        order = torch.randperm(len(inputs), generator=g).tolist()  # bad ones anywhere in the plan order
        w = [1.0 / n] * (n - 1)
        out = robust_mix(honest[0], [inputs[i] for i in order], 1.0 / n, w, rule)
        assert bool((out >= honest.min(0).values).all()) and bool((out <= honest.max(0).values).all()), (n, attack)


def test_plain_mixing_is_not_tolerant() -> None:
    honest = torch.randn(3, 10)
    out = robust_mix(honest[0], [honest[1], honest[2], torch.full((10,), 1e6)], 0.25, [0.25] * 3,
                     MixingRule("clipped", clip_radius=1e9))  # an unbounded radius: the plain weighted sum
    assert float(out.abs().min()) > 1e5


@pytest.mark.parametrize("attack", ATTACKS)
def test_clipping_bounds_each_neighbours_influence(attack: str) -> None:
    """||out - own|| <= tau * (1 - w_self); a bad neighbour moves the output by at most w_j * tau."""
    g = torch.Generator().manual_seed(5)
    tau = 0.3
    rule = MixingRule("clipped", clip_radius=tau)
    honest = torch.randn(4, 100, generator=g) * 0.05
    bad = _bad(attack, honest, g)
    w_self, w = 0.2, [0.3, 0.25, 0.25]
    out = robust_mix(honest[0], [honest[1], bad, honest[2]], w_self, w, rule)
    assert float(torch.linalg.vector_norm(out - honest[0])) <= tau * (1 - w_self) + 1e-6
    without = robust_mix(honest[0], [honest[1], honest[0], honest[2]], w_self, w, rule)  # the bad one silent
    assert float(torch.linalg.vector_norm(out - without)) <= w[1] * tau + 1e-6
    # close honest neighbours are not clipped: the plain weighted average
    near = robust_mix(honest[0], [honest[1], honest[3], honest[2]], w_self, w, MixingRule("clipped", clip_radius=10))
    plain = honest[0] * w_self + honest[1] * w[0] + honest[3] * w[1] + honest[2] * w[2]
    assert torch.allclose(near, plain, atol=1e-6)


def test_mix_into_and_the_batched_rows_use_the_same_rule() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 33, generator=g)
    ids = ["p0", "p1", "p2", "p3"]
    weights = torch.tensor([[0.4, 0.3, 0.0, 0.3], [0.3, 0.4, 0.3, 0.0], [0.0, 0.3, 0.4, 0.3], [0.3, 0.0, 0.3, 0.4]])
    for robust in ("median", "trimmed_mean", "clipped"):
        rule = MixingRule(robust, trim=1, clip_radius=0.5)
        rows = mix_rows(weights, x, renormalize=True, rule=rule)
        for i, pid in enumerate(ids):
            nbrs = {ids[j]: float(weights[i, j]) for j in range(4) if j != i and weights[i, j] > 0}
            plan = MixingPlan(peer=pid, round=0, step=0, mode="pull", self_weight=float(weights[i, i]),
                              in_weights=nbrs, out_weights=nbrs)
            received = {j: Payload(j, 0, 0, "h", (), x[ids.index(j)]) for j in nbrs}
            out = torch.empty(33)
            mix_into(out, x[i], plan, received, rule=rule)
            assert torch.equal(out, rows[i]), (robust, pid)


def test_faults_are_deterministic_and_leave_scalars_alone() -> None:
    msg = Payload("p1", 3, 0, "h", (), torch.ones(8), {"mu": 1.0})
    assert torch.equal(tamper(msg, ByzantineFault("p1", "sign_flip", 2.0), 0).flat, torch.full((8,), -2.0))
    assert torch.equal(tamper(msg, ByzantineFault("p1", "scaled", 10.0), 0).flat, torch.full((8,), 10.0))
    a = tamper(msg, ByzantineFault("p1", "noise", 1.0), 7)
    assert torch.equal(a.flat, tamper(msg, ByzantineFault("p1", "noise", 1.0), 7).flat)
    assert not torch.equal(a.flat, msg.flat) and a.scalars == {"mu": 1.0}


# ---- refusals, up front -----------------------------------------------------------------------------

REFUSED = [
    ({"mixing": {"robust": "median"}, "kind": "directed_ring"}, "mixing.robust", "at least 2 in-neighbours"),
    ({"mixing": {"robust": "trimmed_mean", "trim": 2}}, "mixing.robust", "at least 4 in-neighbours"),
    ({"mixing": {"robust": "median"}, "kind": "directed_ring",
      "algorithm": {"name": "dfedpgp", "mix_mode": "push"}}, "mixing.robust", "push-sum"),
    ({"mixing": {"robust": "clipped"}, "algorithm": {"name": "dispfl"}}, "mixing.robust", "single holder"),
    ({"mixing": {"robust": "clipped", "clip_radius": 0}}, "mixing.clip_radius", "> 0"),
    ({"mixing": {"robust": "krum"}}, "mixing.robust", "not an allowed value"),
    ({"faults": {"byzantine": [{"peer": "p9", "kind": "noise"}]}}, "faults.byzantine[0].peer", "not in topology"),
    ({"faults": {"byzantine": [{"peer": "p1", "kind": "flip"}]}}, "faults.byzantine.0.kind", "not an allowed"),
    ({"faults": {"byzantine": [{"peer": "p1", "kind": "noise"}]}, "simulation": {"engine": "batched"}},
     "faults.byzantine", "batched"),
]


@pytest.mark.parametrize("extra, key, words", REFUSED, ids=[r[1] + "-" + r[2][:12] for r in REFUSED])
def test_unsupported_settings_are_refused_in_one_line(tmp_path: Path, extra: dict, key: str, words: str) -> None:
    from p2pfl.badinput import BadInput

    path = tiny_config(tmp_path, **extra)
    with pytest.raises(BadInput) as info:
        load_config(path)
    text = str(info.value)
    assert "\n" not in text and words in text and str(path) in text, text
    assert key.replace(".0.", "[0].") in text or key in text, text


# ---- end to end ----------------------------------------------------------------------------------------


def _final_acc(run: Path, peers: set[str], rounds: int) -> float:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r["acc"] for r in recs if r["round"] == rounds - 1 and r["peer"] in peers]
    return sum(last) / len(last)


@pytest.mark.timeout(400)
def test_one_attacker_breaks_plain_mixing_not_median(tmp_path: Path) -> None:
    """4-peer ring, p1 sends its model scaled by -20: the honest peers' accuracy collapses with the
    plain weighted sum and stays near the no-attack run with median mixing (and median alone costs
    little). Short runs, so the margins are wide."""
    attack = {"faults": {"byzantine": [{"peer": "p1", "kind": "scaled", "scale": -20.0}]}}
    honest = {"p0", "p2", "p3"}
    acc = {}
    for name, extra in (("plain", {}), ("median", {"mixing": {"robust": "median"}}),
                        ("plain-attacked", attack), ("median-attacked", {"mixing": {"robust": "median"}, **attack})):
        d = tmp_path / name
        d.mkdir()
        cfg = load_config(tiny_config(d, rounds=4, **extra))
        simulate(cfg, d / "run", progress=False)
        acc[name] = _final_acc(d / "run", honest, cfg.rounds)
    assert acc["median"] >= acc["plain"] - 0.15, acc
    assert acc["median-attacked"] >= acc["median"] - 0.1, acc
    assert acc["plain-attacked"] <= acc["plain"] - 0.3, acc


@pytest.mark.timeout(180)
def test_robust_rule_under_attack_simulate_equals_grpc_bitwise(tmp_path: Path) -> None:
    cfg = load_config(tiny_config(tmp_path, base_port=free_base_port(), rounds=2, mixing={"robust": "trimmed_mean"},
                                  faults={"byzantine": [{"peer": "p2", "kind": "noise", "scale": 3.0}]}))
    assert_same_as_simulation(cfg, tmp_path)
