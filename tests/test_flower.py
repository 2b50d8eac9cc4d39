"""The Flower adapter: the peers' ClientApp under Flower's own FedAvg (FedPer), over the in-process grid.

Flower's simulation engine needs ray, which is not installed; these tests run Flower's
unmodified ``FedAvg.start`` directly over ``InProcessGrid``, which delivers each message to the
ClientApp of its node in this process. One module-scoped run (4 peers, 3 rounds, dfedavg's local
update) is shared by most tests; the observers capture every message so the tests can check what
traveled.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp.strategy.result import Result
from flwr.supercore.task_identity import TaskIdentity

from p2pfl.algorithms import TrainContext
from p2pfl.config import load_config
from p2pfl.experiment import Experiment
from p2pfl.modelpool import ModelPool
from p2pfl.transport.memory import MemoryHub, MemoryTransport
from peers.flower import (
    FIRST_NODE_ID,
    STATE_PERSONAL,
    STATE_RNG,
    InProcessGrid,
    initial_shared_arrays,
    make_client_app,
    make_strategy,
    number,
    personal_head,
    record_of,
    run_strategy,
    task_identity,
)
from tests.conftest import tiny_config

ROUNDS = 3


def _arrays(msg: Message) -> ArrayRecord:
    return record_of(msg.content, "arrays", ArrayRecord)


def _metric(msg: Message, key: str) -> float:
    return number(record_of(msg.content, "metrics", MetricRecord), key)


def _raw(record: ArrayRecord) -> dict[str, bytes]:
    """What actually traveled: each tensor's serialized bytes, by name."""
    return {k: v.data for k, v in record.items()}


@dataclass
class Captured:
    """Every (instruction, reply) the grid delivered, in delivery order."""

    pairs: list[tuple[Message, Message]] = field(default_factory=list)
    peer_of: dict[int, str] = field(default_factory=dict)  # node id -> peer id, set once the grid exists

    def __call__(self, ins: Message, reply: Message, seconds: float) -> None:
        self.pairs.append((ins, reply))

    def of(self, kind: str) -> list[tuple[int, str, Message, Message]]:
        """(server round, peer, instruction, reply) for message type ``kind``."""
        out = []
        for ins, rep in self.pairs:
            if ins.metadata.message_type == kind:
                r = int(number(record_of(ins.content, "config", ConfigRecord), "server-round"))
                out.append((r, self.peer_of[ins.metadata.dst_node_id], ins, rep))
        return out


@dataclass
class DirectRun:
    cfg_path: Path
    exp: Experiment
    grid: InProcessGrid
    captured: Captured
    result: Result
    identity_before: tuple[Any, Any, Any]


def _identity() -> tuple[Any, Any, Any]:
    return TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id


@pytest.fixture(scope="module")
def direct(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DirectRun]:
    """Flower's FedAvg driving 4 tiny peers for 3 rounds through the in-process grid."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as run_flower does: the simulation's numerics, no thread contention
    path = tiny_config(tmp_path_factory.mktemp("flower"), rounds=ROUNDS)
    exp = Experiment.from_config(load_config(path))
    captured = Captured()
    grid = InProcessGrid(make_client_app(exp), exp.topology.ids, observers=[captured])
    captured.peer_of = grid.peer_ids
    before = _identity()
    result = run_strategy(make_strategy(len(exp.topology.ids)), grid, initial_shared_arrays(exp), ROUNDS,
                          seed=exp.cfg.seed)
    yield DirectRun(path, exp, grid, captured, result, before)
    torch.set_num_threads(threads)


@pytest.mark.timeout(60)
def test_every_peer_has_metrics_every_round_and_accuracy_improves(direct: DirectRun) -> None:
    ids = list(direct.exp.topology.ids)
    evals = direct.captured.of(MessageType.EVALUATE)
    assert sorted((r, p) for r, p, _, _ in evals) == sorted((r, p) for r in range(1, ROUNDS + 1) for p in ids)
    trains = direct.captured.of(MessageType.TRAIN)
    assert sorted((r, p) for r, p, _, _ in trains) == sorted((r, p) for r in range(1, ROUNDS + 1) for p in ids)
    acc = {r: [] for r in range(1, ROUNDS + 1)}  # type: dict[int, list[float]]
    for r, _, _, rep in evals:
        assert set(record_of(rep.content, "metrics", MetricRecord)) == {"num-examples", "accuracy", "loss"}
        acc[r].append(_metric(rep, "accuracy"))
    assert np.mean(acc[ROUNDS]) > np.mean(acc[1])
    # Flower's own aggregate exists for every round (FedAvg saw valid replies each time).
    assert sorted(direct.result.evaluate_metrics_clientapp) == list(range(1, ROUNDS + 1))
    assert sorted(direct.result.train_metrics_clientapp) == list(range(1, ROUNDS + 1))


@pytest.mark.timeout(60)
def test_heads_stay_personal_while_every_peer_gets_the_same_shared_part(direct: DirectRun) -> None:
    maybe = [personal_head(direct.exp.layout, direct.grid.contexts[nid]) for nid in sorted(direct.grid.contexts)]
    heads = [h for h in maybe if h is not None]
    assert len(heads) == len(direct.exp.topology.ids)
    for i in range(len(heads)):
        for j in range(i + 1, len(heads)):
            assert not torch.equal(heads[i], heads[j]), f"heads {i} and {j} are equal"
    # Every peer's generator state is its own and persisted in its Context.state.
    rngs = {direct.grid.contexts[nid].state.array_records[STATE_RNG]["state"].data for nid in direct.grid.contexts}
    assert len(rngs) == len(heads)
    for kind in (MessageType.TRAIN, MessageType.EVALUATE):
        by_round: dict[int, list[dict[str, bytes]]] = {}
        for r, _, ins, _ in direct.captured.of(kind):
            by_round.setdefault(r, []).append(_raw(_arrays(ins)))
        for r, sent in by_round.items():
            assert all(s == sent[0] for s in sent), f"{kind} round {r}: peers received different shared parts"
    # ... and what they received in round r+1 is FedAvg's num-examples-weighted mean of round r's replies.
    trains = direct.captured.of(MessageType.TRAIN)
    r1 = [(_arrays(rep), _metric(rep, "num-examples")) for r, _, _, rep in trains if r == 1]
    r2_in = next(_arrays(ins) for r, _, ins, _ in trains if r == 2)
    total = sum(w for _, w in r1)
    for name in direct.exp.layout.shared_names:
        mean = sum(rec[name].numpy().astype(np.float64) * (w / total) for rec, w in r1)
        np.testing.assert_allclose(r2_in[name].numpy(), mean, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
def test_only_shared_tensor_names_travel(direct: DirectRun) -> None:
    layout = direct.exp.layout
    shared, personal = set(layout.shared_names), set(layout.personal_names)
    assert personal and shared
    for ins, rep in direct.captured.pairs:
        for content in (ins.content, rep.content):
            for rec in content.array_records.values():
                assert set(rec.keys()) == shared
                assert not set(rec.keys()) & personal
    # Evaluate replies carry metrics only; every train reply carries exactly one ArrayRecord.
    for _, _, _, rep in direct.captured.of(MessageType.EVALUATE):
        assert not rep.content.array_records
    for _, _, _, rep in direct.captured.of(MessageType.TRAIN):
        assert list(rep.content.array_records) == ["arrays"]


@pytest.mark.timeout(60)
def test_task_identity_is_restored_after_the_run(direct: DirectRun) -> None:
    assert _identity() == direct.identity_before
    trains = direct.captured.of(MessageType.TRAIN)
    ins, rep = trains[0][2], trains[0][3]
    assert ins.metadata.src_node_id == SUPERLINK_NODE_ID
    assert rep.metadata.src_node_id == ins.metadata.dst_node_id >= FIRST_NODE_ID
    assert rep.metadata.reply_to_message_id == ins.metadata.message_id != ""


@pytest.mark.timeout(60)
def test_first_round_is_the_decentralized_nodes_local_update(direct: DirectRun) -> None:
    """Round 1 starts where a decentralized Node starts: same weights, generator, update, so the same loss."""
    exp = direct.exp
    models = ModelPool(exp.model_factory, 1)
    hub = MemoryHub()
    flower_loss = {p: _metric(rep, "train_loss") for r, p, _, rep in direct.captured.of(MessageType.TRAIN) if r == 1}
    for pid in exp.topology.ids:
        node = exp.make_node(pid, transport=MemoryTransport(hub, pid), models=models, record=lambda rec: None,
                             run_dir=None)
        with models.borrow() as model:
            exp.layout.bind(model, node.state.params)
            ctx = TrainContext(model, exp.layout, node.app.data, node.generator, node.state.params.device)
            loss = node.algorithm.local_update(node.state, ctx, 0)["train_loss"]
        assert loss == flower_loss[pid], pid


def _train_message(arrays: ArrayRecord, server_round: int, dst: int) -> Message:
    with task_identity(7, SUPERLINK_NODE_ID, 1):
        msg = Message(RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": server_round})}),
                      dst, MessageType.TRAIN)
    msg.metadata.__dict__["_message_id"] = f"crafted-{server_round}"
    return msg


@pytest.mark.timeout(60)
def test_train_handler_called_directly_returns_shared_part_and_metrics(direct: DirectRun) -> None:
    exp = direct.exp
    app = make_client_app(exp)
    node_id = FIRST_NODE_ID + 1  # no node_config: the node id maps to the 2nd peer, p1
    context = Context(run_id=7, node_id=node_id, node_config={}, state=RecordDict(), run_config={})
    sent = initial_shared_arrays(exp)
    reply = app(_train_message(sent, 1, node_id), context)
    assert not reply.has_error()
    assert reply.metadata.reply_to_message_id == "crafted-1"
    arrays = _arrays(reply)
    assert list(arrays) == list(exp.layout.shared_names)
    specs = {s.name: s.shape for s in exp.layout.shared_specs()}
    assert all(tuple(arrays[k].shape) == specs[k] for k in arrays)
    assert _raw(arrays) != _raw(sent)  # it trained
    assert _metric(reply, "num-examples") == exp.peer_data("p1").num_train
    assert math.isfinite(_metric(reply, "train_loss"))
    # The head stayed home, in Context.state; it is the one the round-1 Flower run trained for p1.
    assert set(context.state.array_records[STATE_PERSONAL]) == set(exp.layout.personal_names)
    r1_p1 = next(rep for r, p, _, rep in direct.captured.of(MessageType.TRAIN) if r == 1 and p == "p1")
    assert _raw(arrays) == _raw(_arrays(r1_p1))


@pytest.mark.timeout(60)
def test_train_handler_refuses_a_personal_tensor_and_keeps_state(direct: DirectRun) -> None:
    exp = direct.exp
    app = make_client_app(exp)
    context = Context(run_id=7, node_id=FIRST_NODE_ID, node_config={"peer-id": "p0"}, state=RecordDict(),
                      run_config={})
    arrays = initial_shared_arrays(exp)
    name = exp.layout.personal_names[0]
    arrays[name] = Array(np.zeros(exp.layout.personal_specs()[0].shape, np.float32))
    with pytest.raises(ValueError, match="unexpected"):
        app(_train_message(arrays, 1, FIRST_NODE_ID), context)
    assert not context.state.array_records  # nothing half-written


@pytest.mark.timeout(60)
def test_flower_command_writes_the_run_folder(direct: DirectRun, tmp_path: Path) -> None:
    """``p2pfl flower`` end to end (typer), on the same config: same folder format, same accuracies."""
    import typer
    from typer.testing import CliRunner

    from peers.flower import flower_command

    cli = typer.Typer()
    cli.command("flower")(flower_command)
    cli.command("noop")(lambda: None)  # two commands, so "flower" is addressed by name as in p2pfl
    out = tmp_path / "run"
    res = CliRunner().invoke(cli, ["flower", "--config", str(direct.cfg_path), "--out", str(out), "-q"])
    assert res.exit_code == 0, res.output
    for name in ("config.yaml", "topology.yaml", "partition.json", "metrics.jsonl", "summary.json", "accuracy.png"):
        assert (out / name).exists(), name
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    ids = list(direct.exp.topology.ids)
    assert [(r["round"], r["peer"]) for r in recs] == [(r, p) for r in range(ROUNDS) for p in ids]
    shared_bytes = direct.exp.layout.num_shared * 4
    for r in recs:
        assert {"round", "peer", "acc", "loss", "bytes_sent", "bytes_recv", "consensus_dist", "seconds"} <= set(r)
        assert r["consensus_dist"] == 0.0
        assert shared_bytes <= r["bytes_sent"] < 1.1 * shared_bytes  # the shared part (+ npy headers)
        assert r["bytes_recv"] == 2 * r["bytes_sent"]  # train + evaluate messages carry the global part
    direct_acc = {(r - 1, p): _metric(rep, "accuracy") for r, p, _, rep in direct.captured.of(MessageType.EVALUATE)}
    assert {(r["round"], r["peer"]): r["acc"] for r in recs} == direct_acc  # deterministic, bitwise
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "flower-fedper"
    assert summary["rounds"] == ROUNDS and summary["peers"] == len(ids)
    assert summary["final_acc_mean"] > summary["acc_mean_per_round"]["0"]


@pytest.mark.timeout(60)
def test_fraction_train_samples_some_peers_every_peer_still_evaluated(direct: DirectRun, tmp_path: Path) -> None:
    """FedAvg's fraction_train: half the peers train (seeded sampling), all are measured; ``random`` is left as found."""
    from peers.flower import run_flower

    cfg = load_config(direct.cfg_path, ["rounds=2"])
    state = random.getstate()
    summary = run_flower(cfg, tmp_path / "half", experiment=direct.exp, fraction_train=0.5)
    assert random.getstate() == state
    recs = [json.loads(line) for line in (tmp_path / "half" / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2 * len(direct.exp.topology.ids)
    for r in range(2):
        trained = [x for x in recs if x["round"] == r and x["bytes_sent"] > 0]
        assert len(trained) == 2 and all(x["train_loss"] is not None for x in trained)
        assert all(x["acc"] is not None for x in recs if x["round"] == r)
    assert summary["fraction_train"] == 0.5
    with pytest.raises(ValueError, match="fraction_train"):
        make_strategy(4, 0.0)
