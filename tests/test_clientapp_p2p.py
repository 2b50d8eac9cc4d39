"""A Flower ClientApp written in the quickstart style (peers/quickstart.py) runs peer-to-peer.

Three peers on a ring (each the other two's neighbour), two rounds, the app's tiny synthetic
data: the simulation and a launch of real gRPC processes with mutual TLS give identical
metrics and weights; the personal keys (``fc2.``) never appear in what a peer encodes for the
wire; ``context.state`` persists across rounds and is in the checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from p2pfl.badinput import BadInput
from p2pfl.checkpoint import load_checkpoint
from p2pfl.config import ConfigError, load_config
from p2pfl.experiment import Experiment
from p2pfl.flower.appstate import app_layout
from p2pfl.flower.clientapp import AppError, AppSpec, initial_state, load_client_app
from p2pfl.flower.records import state_to_tensors, tensors_to_state
from p2pfl.modelpool import ModelPool
from p2pfl.payload import Payload
from p2pfl.simulation import simulate
from p2pfl.topology import MixingPlan, generate
from p2pfl.transport.base import ExchangeResult, Transport
from p2pfl.transport.memory import MemoryHub, MemoryTransport
from p2pfl.wire.codec import encode_frames, parse_frame
from tests.swarm import free_base_port, records

PEERS = ["p0", "p1", "p2"]
ROUNDS = 2
# Metrics the app computes (plus what the node derives from them): equal in every mode.
COMPARED = ("acc", "loss", "eval_acc", "eval_loss", "train_loss", "num-examples", "train-num-examples",
            "consensus_dist", "round", "peer")


@pytest.fixture(autouse=True)
def one_torch_thread() -> Any:
    """In-process peers train with one torch thread, as simulate's workers and `p2pfl node` do."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def app_config(tmp_path: Path, *, base_port: int = 50050, **extra: Any) -> Path:
    topo = generate("ring", len(PEERS), base_port=base_port)
    topo.dump(tmp_path / "topology.yaml")
    cfg = {
        "name": "quickstart-p2p", "seed": 5, "rounds": ROUNDS, "topology": str(tmp_path / "topology.yaml"),
        "app": "peers.quickstart:app", "app_init": "peers.quickstart:Net",
        "app_config": {"dataset": "synthetic", "lr": 0.05, "local-epochs": 1, "batch-size": 32, "seed": 5},
        "sharing": {"personal": ["fc2."]},
        "simulation": {"workers": 2}, "network": {"round_timeout_s": 60},
    }
    cfg.update(extra)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _view(recs: list[dict]) -> list[dict]:
    return [{k: r.get(k) for k in COMPARED} for r in recs]


@pytest.mark.timeout(300)
def test_quickstart_clientapp_simulate_and_launch_give_identical_metrics(tmp_path: Path) -> None:
    cfg_path = app_config(tmp_path, base_port=free_base_port(len(PEERS)))
    sim = tmp_path / "sim"
    summary = simulate(load_config(cfg_path), sim, progress=False)
    assert summary["algorithm"] == "clientapp" and summary["rounds"] == ROUNDS
    sim_recs = records(sim / "metrics.jsonl")
    assert [(r["round"], r["peer"]) for r in sim_recs] == [(r, p) for r in range(ROUNDS) for p in PEERS]
    for r in sim_recs:  # every metric the app returned, under its own name (+ acc/loss filled from them)
        assert {"eval_acc", "eval_loss", "train_loss", "num-examples", "train-num-examples"} <= set(r)
        assert r["acc"] == r["eval_acc"] and r["loss"] == r["eval_loss"]
        assert r["bytes_sent"] > 0 and not r["missing"]

    out = tmp_path / "launch"
    proc = subprocess.run([sys.executable, "-m", "p2pfl.cli", "launch", "--config", str(cfg_path), "--out", str(out),
                           "--timeout", "200"], capture_output=True, text=True, timeout=260)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["tls"] is True
    assert _view(records(out / "metrics.jsonl")) == _view(sim_recs)
    for pid in PEERS:
        s_state, _, _ = load_checkpoint(sim / "checkpoints" / f"{pid}.npz")
        l_state, _, _ = load_checkpoint(out / "checkpoints" / f"{pid}.npz")
        assert torch.equal(s_state.params, l_state.params), pid
        # context.state persisted across rounds and into the checkpoint (tensors + JSON, no pickle)
        ctx_state = tensors_to_state(l_state.extra)
        assert ctx_state["progress"]["rounds-trained"] == ROUNDS, pid


class CapturingTransport(Transport):
    """The in-memory transport, plus the exact frames the gRPC transport would send for each message.

    It also notes the peer's personal tensors (their bytes) at that moment: its head after training.
    """

    def __init__(self, inner: Transport, layout: Any) -> None:
        self.inner = inner
        self.layout = layout
        self.node: Any = None
        self.seen: list[tuple[list[str], bytes, dict[str, bytes]]] = []

    def exchange(self, message: Payload, plan: MixingPlan, deadline_s: float) -> ExchangeResult:
        personal = {k: v.detach().cpu().numpy().tobytes()
                    for k, v in self.layout.views(self.node.state.params, "personal").items()}
        frames = encode_frames(message).frames
        header = parse_frame(frames[0]).header  # type: ignore[union-attr]
        self.seen.append(([t.name for t in header.manifest], b"".join(frames), personal))
        return self.inner.exchange(message, plan, deadline_s)


@pytest.mark.timeout(120)
def test_personal_keys_never_reach_the_wire(tmp_path: Path) -> None:
    exp = Experiment.from_config(load_config(app_config(tmp_path)))
    layout = exp.layout
    assert layout.personal_names == ("fc2.weight", "fc2.bias")
    assert all(not n.startswith("fc2.") for n in layout.shared_names)
    hub, models = MemoryHub(), ModelPool(exp.model_factory, 1)
    nodes, transports = {}, {}
    for pid in PEERS:
        transports[pid] = CapturingTransport(MemoryTransport(hub, pid), layout)
        nodes[pid] = exp.make_node(pid, transport=transports[pid], models=models, record=lambda rec: None,
                                   run_dir=None)
        transports[pid].node = nodes[pid]
    threads = [threading.Thread(target=nodes[p].run) for p in PEERS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert all(n.state.round == ROUNDS for n in nodes.values())
    shared_bytes = layout.num_shared * 4
    for pid, tr in transports.items():
        assert len(tr.seen) == ROUNDS
        for names, wire, personal in tr.seen:
            assert names == list(layout.shared_names)  # the manifest names the shared keys only
            assert shared_bytes <= len(wire) < shared_bytes + 4096  # ... and the bytes are theirs alone
            assert set(personal) == {"fc2.weight", "fc2.bias"}
            for name, raw in personal.items():
                assert raw[:32] not in wire, f"{pid}: bytes of personal {name} are on the wire"
    # The heads stayed personal: they differ between peers after training.
    heads = [layout.views(nodes[p].state.params, "personal")["fc2.weight"] for p in PEERS]
    assert not torch.equal(heads[0], heads[1]) and not torch.equal(heads[1], heads[2])


def test_context_state_round_trips_through_tensors() -> None:
    state = RecordDict({
        "w": ArrayRecord({"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1, 2], dtype=torch.int64)}),
        "c": ConfigRecord({"s": "x", "i": 3, "f": 0.5, "b": b"\x00\xff", "l": [1, 2], "bl": [b"a", b"b"]}),
        "m": MetricRecord({"x": 1.5, "y": [1.0, 2.0]}),
    })
    back = tensors_to_state(state_to_tensors(state))
    assert list(back) == ["w", "c", "m"]
    assert dict(back["c"]) == dict(state["c"]) and dict(back["m"]) == dict(state["m"])
    for k in ("a", "b"):
        np.testing.assert_array_equal(back["w"][k].numpy(), state["w"][k].numpy())
        assert back["w"][k].numpy().dtype == state["w"][k].numpy().dtype
    assert tensors_to_state({}) == RecordDict() or len(tensors_to_state({})) == 0


def test_bad_app_configs_are_refused_with_the_key(tmp_path: Path) -> None:
    with pytest.raises(AppError, match="app: 'peers.quickstart:Net' is a .*not a flwr.clientapp.ClientApp"):
        load_client_app("peers.quickstart:Net")
    with pytest.raises(AppError, match="cannot import module"):
        load_client_app("peers.no_such_module:app")
    state = initial_state(AppSpec(app="peers.quickstart:app", init="peers.quickstart:Net"), seed=0)
    with pytest.raises(BadInput, match="sharing.personal: prefix 'head.' matches no key"):
        app_layout(state, ["head."])
    with pytest.raises(BadInput, match="every floating-point tensor is personal"):
        app_layout(state, ["conv", "fc"])
    with pytest.raises(BadInput, match="complex tensors are not supported"):
        app_layout({"w": torch.zeros(2), "c": torch.zeros(2, dtype=torch.complex64)}, [])
    with pytest.raises(ConfigError, match="app_init"):
        load_config(app_config(tmp_path, app_init="peers.quickstart"))
    with pytest.raises(ConfigError, match="model"):
        load_config(app_config(tmp_path, model={"name": "mlp"}))
    with pytest.raises(AppError, match="not a flwr.clientapp.ClientApp"):
        Experiment.from_config(load_config(app_config(tmp_path, app="peers.quickstart:Net"))).layout  # noqa: B018


@pytest.mark.timeout(120)
def test_a_restarted_peer_gets_its_context_state_back_from_the_checkpoint(tmp_path: Path) -> None:
    """Checkpoint after round 1, a fresh process-like start (new Experiment, new Node) resumes with its Context."""
    cfg = load_config(app_config(tmp_path, topology=str(_single_peer(tmp_path))))
    run = tmp_path / "run"

    def node_of(exp: Experiment, rounds: int) -> Any:
        node = exp.make_node("p0", transport=MemoryTransport(MemoryHub(), "p0"),
                             models=ModelPool(exp.model_factory, 1), record=lambda rec: None, run_dir=run,
                             rounds=rounds)
        node.deadline_s = 0.05  # p1 never runs: p0 mixes alone
        return node

    first = node_of(Experiment.from_config(cfg), 1)
    first.run()
    assert first.algorithm.context.state["progress"]["rounds-trained"] == 1
    again = node_of(Experiment.from_config(cfg), 2)
    assert again.algorithm.context.state.get("progress") is None  # a new peer object knows nothing yet
    assert again.resume() and again.state.round == 1
    again.run()
    assert again.algorithm.context.state["progress"]["rounds-trained"] == 2  # counted on from the checkpoint
    state, _, _ = load_checkpoint(run / "checkpoints" / "p0.npz")
    assert tensors_to_state(state.extra)["progress"]["rounds-trained"] == 2


def _single_peer(tmp_path: Path) -> Path:
    path = tmp_path / "two.yaml"
    generate("full", 2).dump(path)
    return path
