"""Flat layouts, mixing, the in-memory transport and checkpoints."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from p2pfl.algorithms.base import PeerState
from p2pfl.algorithms.combine import mix_into, mix_scalar
from p2pfl.checkpoint import load_checkpoint, save_checkpoint
from p2pfl.models import build_model, split_parameter_names
from p2pfl.models.layout import ParamLayout
from p2pfl.payload import Payload
from p2pfl.topology import generate
from p2pfl.transport.base import TransportError
from p2pfl.transport.memory import MemoryHub, MemoryTransport


def _layout():
    torch.manual_seed(0)
    model = build_model("cnn_small", (1, 28, 28), 10)
    shared, personal = split_parameter_names(model)
    return model, ParamLayout.from_model(model, shared, personal)


def test_layout_orders_shared_then_personal_and_binds_views() -> None:
    model, layout = _layout()
    flat = layout.flatten(model)
    assert layout.numel == sum(p.numel() for p in model.parameters())
    assert layout.num_personal == sum(p.numel() for n, p in model.named_parameters() if n.startswith(model.HEAD))
    layout.bind(model, flat)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert torch.equal(flat, layout.flatten(model))  # training updates the flat buffer in place
    assert set(layout.views(flat, "personal")) == set(layout.personal_names)


def _msg(sender: str, r: int, value: float, n: int = 5, mu: float = 1.0) -> Payload:
    return Payload(sender, r, 0, "h", (), torch.full((n,), value), {"mu": mu})


def test_mixing_matches_matrix_and_renormalizes_missing() -> None:
    topo = generate("ring", 4)
    W = topo.mixing_matrix()
    xs = {pid: _msg(pid, 0, float(i + 1)) for i, pid in enumerate(topo.ids)}
    plan = topo.plan("p0", 0)
    out = torch.empty(5)
    mix_into(out, xs["p0"].flat, plan, {j: xs[j] for j in plan.in_weights})
    expect = sum(W[0, j] * (j + 1) for j in range(4))
    assert torch.allclose(out, torch.full((5,), float(expect)))
    # one neighbour missing: weights renormalize over self + the one that arrived
    only = next(iter(plan.in_weights))
    mix_into(out, xs["p0"].flat, plan, {only: xs[only]})
    w_self, w_j = plan.self_weight, plan.in_weights[only]
    expect = (w_self * 1 + w_j * (topo.index(only) + 1)) / (w_self + w_j)
    assert torch.allclose(out, torch.full((5,), float(expect)))
    assert mix_scalar(1.0, plan, {only: xs[only]}, "mu") == pytest.approx(1.0)


def test_mix_into_gives_the_same_bits_into_own_apart_or_overlapping() -> None:
    """mix_into accumulates in `out` directly unless `out` partly overlaps `own`: every case must give
    the reference `w_self * own + sum w_j x_j` (plan order) bit for bit, and leave a partial overlap right."""
    topo = generate("ring", 4)
    plan = topo.plan("p0", 0)
    g = torch.Generator().manual_seed(3)
    received = {j: Payload(j, 0, 0, "h", (), torch.randn(64, generator=g)) for j in plan.in_weights}
    own = torch.randn(64, generator=g)
    total = plan.self_weight + sum(plan.in_weights.values())
    ref = own * (plan.self_weight / total)
    for j, w in plan.in_weights.items():
        ref.add_(received[j].flat, alpha=w / total)
    apart = torch.empty(64)
    mix_into(apart, own, plan, received)
    assert torch.equal(apart, ref)
    same = own.clone()
    mix_into(same, same, plan, received)  # out is own
    assert torch.equal(same, ref)
    buf = torch.zeros(96)
    buf[:64] = own
    mix_into(buf[16:80], buf[:64], plan, received)  # partial overlap: needs the temporary
    assert torch.equal(buf[16:80], ref)


def test_memory_transport_exchanges_and_times_out() -> None:
    topo = generate("ring", 3)
    hub = MemoryHub()
    results = {}

    def run(pid: str, v: float) -> None:
        t = MemoryTransport(hub, pid)
        results[pid] = t.exchange(_msg(pid, 0, v), topo.plan(pid, 0), deadline_s=5)

    threads = [threading.Thread(target=run, args=(pid, i)) for i, pid in enumerate(topo.ids)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(results["p0"].received) == ["p1", "p2"] and not results["p0"].missing
    assert torch.equal(results["p0"].received["p2"].flat, torch.full((5,), 2.0))
    assert len(hub) == 0  # every message dropped once all its readers took it
    t0 = time.monotonic()
    res = MemoryTransport(hub, "p0").exchange(_msg("p0", 1, 0.0), topo.plan("p0", 1), deadline_s=0.3)
    assert res.missing == ["p1", "p2"] and time.monotonic() - t0 < 2
    hub.abort("boom")
    with pytest.raises(TransportError, match="boom"):
        MemoryTransport(hub, "p1").exchange(_msg("p1", 1, 0.0), topo.plan("p1", 1), deadline_s=5)


def test_checkpoint_roundtrip_is_exact(tmp_path) -> None:
    state = PeerState("p3", torch.randn(100), {"dual": torch.randn(10)}, {"mu": 0.75}, round=4)
    gen = torch.Generator().manual_seed(5)
    gen_draw = torch.Generator().manual_seed(5)
    torch.rand(3, generator=gen)
    torch.rand(3, generator=gen_draw)
    save_checkpoint(tmp_path / "c.npz", state, gen)
    st2, rng, meta = load_checkpoint(tmp_path / "c.npz")
    assert torch.equal(st2.params, state.params) and torch.equal(st2.extra["dual"], state.extra["dual"])
    assert st2.scalars == {"mu": 0.75} and st2.round == 4 and meta["peer"] == "p3"
    g2 = torch.Generator()
    g2.set_state(rng)
    assert torch.equal(torch.rand(4, generator=g2), torch.rand(4, generator=gen_draw))
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]  # no temporary file left


def test_memory_transport_refuses_non_finite_payloads_like_the_wire() -> None:
    topo = generate("ring", 3)
    hub = MemoryHub()
    bad = _msg("p1", 0, float("nan"))
    hub.publish(bad, ["p0"])
    hub.publish(_msg("p2", 0, 2.0), ["p0"])
    res = MemoryTransport(hub, "p0").exchange(_msg("p0", 0, 0.0), topo.plan("p0", 0), deadline_s=1)
    assert sorted(res.received) == ["p2"] and res.missing == ["p1"]
