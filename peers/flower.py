"""The peers under Flower's own server: FedPer (FedAvg over the shared part, heads kept local).

Why this module exists: the centralized baselines must run on the very same data partition,
models, initial weights and local update rule as the decentralized runs, so that a difference
in accuracy is the difference between a server and a gossip graph, nothing else. So:

* ``make_client_app(experiment)`` is a real ``flwr.clientapp.ClientApp``. Its ``train`` handler
  receives the shared part as an ``ArrayRecord`` (named tensors) and a ``ConfigRecord``, binds
  it with this peer's personal head kept in ``Context.state`` into a ``PeerState``, and runs the
  experiment's ``Algorithm.local_update``: the same code a decentralized ``Node`` runs. Its
  ``evaluate`` handler measures global shared + own head on the peer's own test split with
  ``PeerApp.evaluate``.
* ``InProcessGrid`` is a ``flwr.serverapp.Grid`` that delivers each instruction to the
  ``ClientApp`` of its destination node in this process, one persistent ``Context`` per node.
  Flower's simulation engine needs ray, which is not installed (nor wanted on a 2-core box);
  this grid plays the role of Flower's runtime instead, so Flower's unmodified
  ``flwr.serverapp.strategy.FedAvg.start`` drives the rounds.
* ``run_flower`` writes the same run folder as ``p2pfl simulate`` (mode ``flower-fedper``);
  ``flower_command`` is its CLI entry point.

Flower ``Message`` objects stay inside this module (server <-> ClientApp); they never travel on
the peer wire (DESIGN: "convert at the boundary").

Flower refuses to build an instruction ``Message`` unless ``flwr.supercore.task_identity.TaskIdentity``
(run id, node id, task id) is set, as Flower's runtimes do once per process
(``flwr/server/compat/app.py``, ``flwr/supernode/runtime/run_clientapp.py``). Here the server and
every node share one process, so ``task_identity`` sets it for the server while the strategy
builds messages and for each node while its ClientApp runs, and restores the previous identity
afterwards (nested, exception-safe).
"""

from __future__ import annotations

import copy
import itertools
import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

import numpy as np
import torch
import typer
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy
from flwr.serverapp.strategy.result import Result
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from p2pfl.algorithms import Algorithm, PeerState, TrainContext
from p2pfl.config import ExperimentConfig
from p2pfl.experiment import Experiment, peer_seed
from p2pfl.modelpool import ModelPool
from p2pfl.models.layout import ParamLayout
from p2pfl.peerapp import PeerApp
from p2pfl.runfolder import MetricsWriter, plot_accuracy, sort_metrics, summarize, write_inputs, write_summary

MODE = "flower-fedper"

# Peers get node ids from FIRST_NODE_ID on: Flower's server already is node SUPERLINK_NODE_ID (1),
# and a peer sharing its id would make reply routing metadata ambiguous.
FIRST_NODE_ID = SUPERLINK_NODE_ID + 1

# Record keys: what FedAvg sends (its defaults), what a reply carries, what a node keeps.
ARRAYS_KEY = "arrays"
CONFIG_KEY = "config"
METRICS_KEY = "metrics"
STATE_PERSONAL = "p2pfl.personal"  # ArrayRecord: the personal head, named tensors
STATE_EXTRA = "p2pfl.extra"  # ArrayRecord: the algorithm's tensor state (duals, masks)
STATE_SCALARS = "p2pfl.scalars"  # ConfigRecord: the algorithm's scalar state
STATE_RNG = "p2pfl.rng"  # ArrayRecord: this peer's torch.Generator state (uint8)
STATE_ROUND = "p2pfl.round"  # ConfigRecord: {"round": next round to run}


class FlowerPeerError(RuntimeError):
    """A peer's ClientApp failed; the run stops (a silently skipped peer would bias the baseline)."""


# -- TaskIdentity ---------------------------------------------------------------------------------
@contextmanager
def task_identity(run_id: int, node_id: int, task_id: int) -> Iterator[None]:
    """Act as (run, node, task) for flwr's Message constructor, then restore the previous identity.

    Flower's runtimes set ``TaskIdentity`` once per process; server and nodes share this process,
    so the identity is switched around each side's turn. The previous values are read and restored
    raw (``_run_id`` ...) because "unset" is ``None``, which the public getters refuse to return.
    """
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id = int(run_id)
    TaskIdentity.node_id = int(node_id)
    TaskIdentity.task_id = int(task_id)
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


# -- conversions at the boundary ----------------------------------------------------------------
_R = TypeVar("_R", ArrayRecord, ConfigRecord, MetricRecord)


def array_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """Named tensors as an ArrayRecord (each one serialized by Flower, no pickle)."""
    rec = ArrayRecord()
    for name, t in tensors.items():
        rec[name] = Array(t.detach().cpu().contiguous().numpy())
    return rec


def shared_arrays(layout: ParamLayout, flat: torch.Tensor) -> ArrayRecord:
    """The shared part of ``flat`` as named tensors (the only thing that leaves a peer)."""
    return array_record(layout.views(flat, "shared"))


def initial_shared_arrays(experiment: Experiment) -> ArrayRecord:
    """The server's starting point: the shared part of the experiment's one initial model."""
    layout, flat = experiment._init
    return shared_arrays(layout, flat)


def record_of(content: RecordDict, key: str, kind: type[_R]) -> _R:
    """``content[key]``, refused unless it is a ``kind`` record (a message is never trusted)."""
    rec = content.get(key)
    if not isinstance(rec, kind):
        raise ValueError(f"message has no {kind.__name__} {key!r}")
    return rec


def number(rec: ConfigRecord | MetricRecord, key: str) -> float:
    """A scalar value of a record, refused unless it is a number."""
    value = rec.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"record value {key!r} is not a number: {value!r}")
    return float(value)


def load_shared(layout: ParamLayout, record: ArrayRecord, flat: torch.Tensor) -> None:
    """Copy received shared tensors into ``flat``; refuse anything but exactly the shared part.

    Never trust what arrives (DESIGN): names, shapes, float dtype and finiteness are checked
    before anything is written, so a refused record leaves no partial update behind.
    """
    specs = layout.shared_specs()
    want = [s.name for s in specs]
    got = list(record.keys())
    if sorted(got) != sorted(want):
        extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
        raise ValueError(f"shared ArrayRecord has wrong names (unexpected {extra}, missing {missing})")
    decoded: list[tuple[int, int, np.ndarray]] = []
    for s in specs:
        arr = record[s.name]
        if tuple(arr.shape) != s.shape:
            raise ValueError(f"tensor {s.name!r}: shape {tuple(arr.shape)} != {s.shape}")
        value = arr.numpy()
        if value.dtype.kind != "f":
            raise ValueError(f"tensor {s.name!r}: dtype {value.dtype} is not floating point")
        if not np.isfinite(value).all():
            raise ValueError(f"tensor {s.name!r}: contains NaN or Inf")
        decoded.append((s.offset, s.numel, value))
    for offset, numel, value in decoded:
        src = torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32).reshape(-1))
        flat[offset : offset + numel].copy_(src)


def snapshot(msg: Message) -> Message:
    """A copy of ``msg`` that shares nothing mutable with it (tensor bytes are immutable: shared).

    Flower's runtimes serialize every message, so neither side sees the other's later changes.
    In one process they would: FedAvg reuses one ConfigRecord for every round and writes
    ``server-round`` into it, so a handler or observer holding last round's message would read this
    round's number. The grid hands each side a snapshot instead, at the cost of new record objects,
    not tensor copies.
    """
    content = RecordDict()
    for key, rec in msg.content.items():
        if isinstance(rec, ArrayRecord):
            content[key] = ArrayRecord.from_array_dict(rec)
        elif isinstance(rec, ConfigRecord):
            content[key] = ConfigRecord({k: copy.copy(v) for k, v in rec.items()})
        elif isinstance(rec, MetricRecord):
            content[key] = MetricRecord({k: copy.copy(v) for k, v in rec.items()})
        else:  # pragma: no cover - RecordDict holds only these three
            raise TypeError(f"unknown record type {type(rec).__name__}")
    return Message(content, metadata=copy.deepcopy(msg.metadata))


def _record_bytes(content: RecordDict) -> int:
    """Bytes of the tensors a message carries, as Flower counts them (``ArrayRecord.count_bytes``)."""
    return sum(rec.count_bytes() for rec in content.array_records.values())


# -- the ClientApp -------------------------------------------------------------------------------
@dataclass
class _PeerRuntime:
    """What a peer needs that is a pure function of the config (rebuilt, never persisted)."""

    peer_id: str
    index: int
    app: PeerApp
    algorithm: Algorithm


class FedPerPeers:
    """The train/evaluate logic of every peer of one experiment, as Flower handlers.

    State that must persist across rounds and would be checkpointed (personal head, algorithm
    state, the peer's generator state, its round counter) lives in ``Context.state`` as records,
    exactly where a Flower SuperNode keeps per-run node state. Objects that are pure functions of
    the config (the peer's data view, its Algorithm object) are cached here by peer id, and one
    model object is shared by all peers with each peer's buffer bound in (DESIGN: one model per
    worker, not N modules).

    Why the generator state lives in ``Context.state`` rather than in an adapter-side dict keyed by
    node id: it is then owned by the node, like the personal head, and the handlers are
    stateless apart from caches; the same ClientApp would keep each peer's randomness its own
    under any Flower runtime. Its cost is about 5 KB of serialize/deserialize per round per peer.
    """

    def __init__(self, experiment: Experiment) -> None:
        self.exp = experiment
        self.layout = experiment.layout
        self._init_flat = experiment._init[1]
        self._models = ModelPool(experiment.model_factory, 1)
        self._peers: dict[str, _PeerRuntime] = {}

    # -- identity ----------------------------------------------------------------------------
    def peer_of(self, context: Context) -> _PeerRuntime:
        """Which peer a node is: ``node_config["peer-id"]``, else ``"partition-id"``, else by node id.

        The fallback maps node id ``FIRST_NODE_ID + i`` to the i-th peer of the topology.
        """
        ids = self.exp.topology.ids
        cfg = context.node_config
        if "peer-id" in cfg:
            pid = str(cfg["peer-id"])
        elif "partition-id" in cfg:
            pid = ids[int(cfg["partition-id"])]
        else:
            i = int(context.node_id) - FIRST_NODE_ID
            if not 0 <= i < len(ids):
                raise ValueError(f"node {context.node_id} maps to no peer (node ids {FIRST_NODE_ID}.."
                                 f"{FIRST_NODE_ID + len(ids) - 1})")
            pid = ids[i]
        rt = self._peers.get(pid)
        if rt is None:
            i = self.exp.topology.index(pid)
            app = PeerApp(pid, self.exp.model_factory, self.exp.peer_data(pid), self.exp.device)
            rt = self._peers[pid] = _PeerRuntime(pid, i, app, self.exp.new_algorithm())
        return rt

    # -- per-node state in Context.state --------------------------------------------------------
    def _restore(self, rt: _PeerRuntime, context: Context, flat: torch.Tensor) -> tuple[PeerState, torch.Generator]:
        """Fill ``flat``'s personal part and rebuild PeerState + generator from ``context.state``.

        On first use, start as ``Experiment.make_node`` does: the initial head, the peer's own
        seeded generator, then ``Algorithm.init_state`` with it.
        """
        n = self.layout.num_shared
        st = context.state
        gen = torch.Generator(device="cpu")
        state = PeerState(peer_id=rt.peer_id, params=flat)
        if STATE_PERSONAL not in st.array_records:
            flat[n:].copy_(self._init_flat[n:])
            gen.manual_seed(peer_seed(self.exp.cfg.seed, rt.index))
            rt.algorithm.init_state(state, gen)
            return state, gen
        head = personal_head(self.layout, context)
        assert head is not None
        flat[n:].copy_(head.to(flat.device))
        gen.set_state(_tensor(st.array_records[STATE_RNG]["state"]))
        if STATE_EXTRA in st.array_records:
            state.extra = {k: _tensor(v).to(flat.device) for k, v in st.array_records[STATE_EXTRA].items()}
        if STATE_SCALARS in st.config_records:
            scalars = st.config_records[STATE_SCALARS]
            state.scalars = {k: number(scalars, k) for k in scalars}
        state.round = int(number(st.config_records[STATE_ROUND], "round"))
        return state, gen

    def _save(self, context: Context, state: PeerState, gen: torch.Generator) -> None:
        st = context.state
        st[STATE_PERSONAL] = array_record(self.layout.views(state.params, "personal"))
        st[STATE_RNG] = array_record({"state": gen.get_state()})
        if state.extra:
            st[STATE_EXTRA] = array_record(state.extra)
        if state.scalars:
            st[STATE_SCALARS] = ConfigRecord({k: float(v) for k, v in state.scalars.items()})
        st[STATE_ROUND] = ConfigRecord({"round": int(state.round)})

    # -- handlers ----------------------------------------------------------------------------
    def train(self, msg: Message, context: Context) -> Message:
        """Bind the received shared part with the own head, run ``local_update``, reply shared + metrics."""
        rt = self.peer_of(context)
        # Flower rounds count from 1; ours (lr decay, records) from 0.
        r = int(number(record_of(msg.content, CONFIG_KEY, ConfigRecord), "server-round")) - 1
        flat = torch.empty(self.layout.numel, dtype=torch.float32, device=self.exp.device)
        load_shared(self.layout, record_of(msg.content, ARRAYS_KEY, ArrayRecord), flat)
        state, gen = self._restore(rt, context, flat)
        with self._models.borrow((r, 0, rt.index)) as model:
            self.layout.bind(model, state.params)
            ctx = TrainContext(model, self.layout, rt.app.data, gen, state.params.device)
            metrics = rt.algorithm.local_update(state, ctx, r)
        state.round = r + 1
        self._save(context, state, gen)
        reply = RecordDict({
            ARRAYS_KEY: shared_arrays(self.layout, state.params),
            METRICS_KEY: MetricRecord({"num-examples": int(rt.app.data.num_train),
                                       "train_loss": float(metrics.get("train_loss", float("nan")))}),
        })
        return Message(reply, reply_to=msg)

    def evaluate(self, msg: Message, context: Context) -> Message:
        """Global shared part + own head on this peer's own test split (personalized accuracy)."""
        rt = self.peer_of(context)
        flat = torch.empty(self.layout.numel, dtype=torch.float32, device=self.exp.device)
        load_shared(self.layout, record_of(msg.content, ARRAYS_KEY, ArrayRecord), flat)
        n = self.layout.num_shared
        head = personal_head(self.layout, context)  # a peer FedAvg never sampled still has phi(0)'s head
        flat[n:].copy_(self._init_flat[n:] if head is None else head.to(flat.device))
        r = int(number(record_of(msg.content, CONFIG_KEY, ConfigRecord), "server-round")) - 1
        with self._models.borrow((r, 1, rt.index)) as model:
            self.layout.bind(model, flat)
            ev = rt.app.evaluate(model)
        return Message(RecordDict({METRICS_KEY: MetricRecord({
            "num-examples": int(ev["num_examples"]), "accuracy": float(ev["acc"]), "loss": float(ev["loss"]),
        })}), reply_to=msg)


def make_client_app(experiment: Experiment) -> ClientApp:
    """A Flower ClientApp for every peer of ``experiment`` (which peer: from the node's Context)."""
    peers = FedPerPeers(experiment)
    app = ClientApp()
    app.train()(peers.train)
    app.evaluate()(peers.evaluate)
    return app


def _tensor(arr: Array) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(arr.numpy()))


def personal_head(layout: ParamLayout, context: Context) -> torch.Tensor | None:
    """A node's personal head (flat, layout order) from its ``Context.state``; None before its first train."""
    rec = context.state.array_records.get(STATE_PERSONAL)
    if rec is None:
        return None
    return torch.cat([_tensor(rec[s.name]).reshape(-1) for s in layout.personal_specs()])


# -- the in-process Grid -------------------------------------------------------------------------
Observer = Callable[[Message, Message, float], None]


class InProcessGrid(Grid):
    """Flower's Grid, delivering each instruction to the ClientApp of its node in this process.

    Plays the role of Flower's runtime (SuperLink + SuperNodes): one persistent ``Context`` per
    node (its ``state`` survives rounds), ``TaskIdentity`` set per side, message ids assigned.
    Delivery is synchronous and in node-id order, and replies come back in node-id order, so
    FedAvg sums in a fixed order and a run is bitwise repeatable whatever order the strategy
    sampled in. Each side gets a ``snapshot`` of the other's message, as over Flower's wire.
    ``observers`` see every (instruction, reply, seconds), for metrics and tests.
    A failing ClientApp stops the run (``FlowerPeerError``) instead of becoming an error reply
    that FedAvg would skip: a baseline that silently loses peers is not a baseline.
    """

    def __init__(self, client_app: ClientApp, peer_ids: Sequence[str], *, run_id: int = 1,
                 observers: Iterable[Observer] = ()) -> None:
        self._app = client_app
        self._run = Run.create_empty(run_id)
        n = len(peer_ids)
        self.node_ids: dict[str, int] = {pid: FIRST_NODE_ID + i for i, pid in enumerate(peer_ids)}
        self.peer_ids: dict[int, str] = {nid: pid for pid, nid in self.node_ids.items()}
        self.contexts: dict[int, Context] = {
            nid: Context(run_id=run_id, node_id=nid,
                         node_config={"peer-id": pid, "partition-id": i, "num-partitions": n},
                         state=RecordDict(), run_config={})
            for i, (pid, nid) in enumerate(self.node_ids.items())
        }
        self.observers: list[Observer] = list(observers)
        self._replies: dict[str, Message] = {}
        self._message_ids = itertools.count(1)
        self._task_ids = itertools.count(2)  # task 1 is the server's

    # -- Grid API --------------------------------------------------------------------------------
    def set_run(self, run: Run) -> None:
        if not isinstance(run, Run):
            raise TypeError(f"`run` must be an instance of Run, got {type(run).__name__}")
        self._run = run
        for ctx in self.contexts.values():
            ctx.run_id = run.run_id

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids: list[str] = []
        for msg in sorted(messages, key=lambda m: m.metadata.dst_node_id):
            if msg.metadata.reply_to_message_id:
                raise ValueError("only instruction messages can be pushed")
            if msg.metadata.dst_node_id not in self.contexts:
                raise ValueError(f"no node {msg.metadata.dst_node_id} in this grid")
            mid = f"{next(self._message_ids):016x}"
            msg.metadata.__dict__["_message_id"] = mid  # what Flower's own grids do
            self._replies[mid] = self._deliver(msg)
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        out = [self._replies.pop(m) for m in message_ids if m in self._replies]
        return sorted(out, key=lambda m: m.metadata.src_node_id)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        # Delivery is synchronous, so every reply is there when push returns; ``timeout`` is moot.
        return self.pull_messages(self.push_messages(messages))

    # -- runtime role ----------------------------------------------------------------------------
    def server_identity(self) -> Any:
        """Context manager: act as the server (SuperLink node, task 1) while a strategy runs."""
        return task_identity(self._run.run_id, SUPERLINK_NODE_ID, 1)

    def _deliver(self, msg: Message) -> Message:
        nid = msg.metadata.dst_node_id
        ctx = self.contexts[nid]
        msg = snapshot(msg)
        t0 = time.perf_counter()
        try:
            with task_identity(self._run.run_id, nid, next(self._task_ids)):
                reply = self._app(msg, ctx)
        except Exception as exc:
            raise FlowerPeerError(
                f"peer {self.peer_ids[nid]} (node {nid}) failed on {msg.metadata.message_type!r}: {exc!r}"
            ) from exc
        seconds = time.perf_counter() - t0
        if reply.has_error():
            raise FlowerPeerError(f"peer {self.peer_ids[nid]} (node {nid}) replied with an error: "
                                  f"{reply.error.reason}")
        if reply.metadata.reply_to_message_id != msg.metadata.message_id:
            raise FlowerPeerError(f"peer {self.peer_ids[nid]} replied to another message")
        reply.metadata.__dict__["_message_id"] = f"{next(self._message_ids):016x}"
        reply = snapshot(reply)
        for obs in self.observers:
            obs(msg, reply, seconds)
        return reply


@contextmanager
def _seeded_sampling(seed: int) -> Iterator[None]:
    """FedAvg samples nodes with the global ``random``: seed it for the run, then put it back."""
    saved = random.getstate()
    random.seed(seed)
    try:
        yield
    finally:
        random.setstate(saved)


def make_strategy(num_peers: int, fraction_train: float = 1.0) -> FedAvg:
    """Flower's FedAvg: ``fraction_train`` of the peers train each round, every peer evaluates."""
    if not 0.0 < fraction_train <= 1.0:
        raise ValueError(f"fraction_train must be in (0, 1], got {fraction_train}")
    return FedAvg(fraction_train=fraction_train, fraction_evaluate=1.0, min_train_nodes=1,
                  min_evaluate_nodes=num_peers, min_available_nodes=num_peers,
                  arrayrecord_key=ARRAYS_KEY, configrecord_key=CONFIG_KEY)


def run_strategy(strategy: Strategy, grid: InProcessGrid, initial_arrays: ArrayRecord, num_rounds: int, *,
                 seed: int = 0, train_config: ConfigRecord | None = None) -> Result:
    """``strategy.start`` over ``grid``, as the server (TaskIdentity) and with seeded node sampling."""
    with grid.server_identity(), _seeded_sampling(seed):
        return strategy.start(grid, initial_arrays, num_rounds=num_rounds,
                              train_config=train_config or ConfigRecord({"num-rounds": num_rounds}))


# -- the run folder --------------------------------------------------------------------------------
class _Recorder:
    """Turns the grid's (instruction, reply) pairs into one metrics record per peer per round.

    ``bytes_sent`` = the shared part a peer sent to the server; ``bytes_recv`` = everything the
    server sent it that round (the train and the evaluate message both carry the global shared
    part), both as Flower counts ArrayRecord bytes. A peer FedAvg did not sample (fraction_train
    < 1) trains nothing and sends nothing that round.
    """

    def __init__(self, grid_peers: dict[int, str], write: Callable[[dict[str, Any]], None],
                 advance: Callable[[], None] | None = None) -> None:
        self.peers = grid_peers
        self.write = write
        self.advance = advance
        self._train: dict[tuple[int, str], dict[str, Any]] = {}

    def __call__(self, ins: Message, reply: Message, seconds: float) -> None:
        r = int(number(record_of(ins.content, CONFIG_KEY, ConfigRecord), "server-round")) - 1
        pid = self.peers[ins.metadata.dst_node_id]
        metrics = record_of(reply.content, METRICS_KEY, MetricRecord)
        if ins.metadata.message_type == MessageType.TRAIN:
            self._train[(r, pid)] = {"train_loss": number(metrics, "train_loss"),
                                     "bytes_sent": _record_bytes(reply.content),
                                     "bytes_recv": _record_bytes(ins.content), "train_seconds": seconds}
            return
        tr = self._train.pop((r, pid), {"train_loss": None, "bytes_sent": 0, "bytes_recv": 0, "train_seconds": 0.0})
        rec: dict[str, Any] = {
            "round": r, "peer": pid, "acc": number(metrics, "accuracy"), "loss": number(metrics, "loss"),
            "train_loss": tr["train_loss"], "bytes_sent": tr["bytes_sent"],
            "bytes_recv": tr["bytes_recv"] + _record_bytes(ins.content), "consensus_dist": 0.0, "missing": [],
            "train_seconds": tr["train_seconds"], "seconds": tr["train_seconds"] + seconds,
        }
        self.write(rec)
        if self.advance is not None:
            self.advance()


@contextmanager
def _flower_console(verbose: bool) -> Iterator[None]:
    """Flower logs every round at INFO (its own console handler, and the root's); keep that for ``--verbose``."""
    flwr_logger = logging.getLogger("flwr")
    saved = flwr_logger.level
    if not verbose:
        flwr_logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        flwr_logger.setLevel(saved)


def _progress_bar(total: int) -> tuple[Any, Callable[[], None] | None]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("[bold]flower fedper"), BarColumn(), MofNCompleteColumn(), TextColumn("peer-rounds"),
                   TimeElapsedColumn())
    task = bar.add_task("flower", total=total)
    return bar, lambda: bar.advance(task)


def _result_dict(result: Result) -> dict[str, Any]:
    """Flower's own aggregated (num-examples weighted) metrics per round, as plain data."""
    return {
        "train": {str(k): dict(v) for k, v in result.train_metrics_clientapp.items()},
        "evaluate": {str(k): dict(v) for k, v in result.evaluate_metrics_clientapp.items()},
    }


def run_flower(cfg: ExperimentConfig, out_dir: str | Path, progress: bool = False, *,
               experiment: Experiment | None = None, fraction_train: float = 1.0,
               verbose: bool = False, observers: Iterable[Observer] = (),
               torch_threads: int | None = 1) -> dict[str, Any]:
    """FedPer under Flower's FedAvg on the experiment's data and models; write the run folder.

    Same folder format as ``p2pfl simulate`` (config.yaml, topology.yaml, partition.json,
    metrics.jsonl, summary.json with mode ``flower-fedper``, accuracy.png). Checkpoints are not
    written: a Flower run has no per-peer resume here.

    ``torch_threads`` (default 1, restored afterwards; None leaves torch alone): the simulation's
    workers train with one torch thread, so one thread here gives the same local-update numerics,
    and small models lose more to intra-op thread synchronization than they gain.
    """
    run_dir = Path(out_dir)
    exp = experiment or Experiment.from_config(cfg)
    write_inputs(run_dir, cfg.raw, exp.topology.to_dict(), exp.partition)
    ids = list(exp.topology.ids)
    app = make_client_app(exp)
    strategy = make_strategy(len(ids), fraction_train)
    writer = MetricsWriter(run_dir / "metrics.jsonl")
    bar, advance = _progress_bar(len(ids) * cfg.rounds) if progress else (None, None)
    grid = InProcessGrid(app, ids)
    grid.observers = [_Recorder(grid.peer_ids, writer, advance), *observers]
    saved_threads = torch.get_num_threads()
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    t0 = time.perf_counter()
    try:
        with _flower_console(verbose), (bar if bar is not None else nullcontext()):
            result = run_strategy(strategy, grid, initial_shared_arrays(exp), cfg.rounds, seed=cfg.seed)
    finally:
        writer.close()
        torch.set_num_threads(saved_threads)
    wall = time.perf_counter() - t0
    recs = sort_metrics(run_dir / "metrics.jsonl", ids)
    summary = summarize(recs, {
        "name": cfg.name, "algorithm": cfg.algorithm_name, "seed": cfg.seed, "mode": MODE,
        "strategy": type(strategy).__name__, "fraction_train": fraction_train,
        "wall_seconds": wall, "wall_seconds_per_round": wall / cfg.rounds, "flower": _result_dict(result),
    })
    write_summary(run_dir, summary)
    plot_accuracy(recs, run_dir / "accuracy.png", f"{cfg.name}: {MODE} ({cfg.algorithm_name} local update)")
    return summary


# -- CLI -------------------------------------------------------------------------------------------
ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="experiment config YAML")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="override a config value: dotted.key=VALUE (repeatable)")]


def flower_command(config: ConfigOpt, rounds: Annotated[int | None, typer.Option(help="override rounds")] = None,
                   out: Annotated[Path | None, typer.Option(help="run folder")] = None, set: SetOpt = None,
                   fraction_train: Annotated[float, typer.Option(help="fraction of peers FedAvg trains per round")] = 1.0,
                   quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar")] = False,
                   verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    """Centralized baseline: CONFIG's peers under Flower's FedAvg server (FedPer: heads stay local)."""
    from p2pfl.cli import _load, _setup_logging, default_run_dir, print_summary

    _setup_logging(verbose)
    cfg = _load(config, set, rounds)
    run_dir = out or default_run_dir(cfg.name, f"{MODE}-{cfg.algorithm_name}")
    try:
        summary = run_flower(cfg, run_dir, progress=not quiet, fraction_train=fraction_train, verbose=verbose)
    except (ValueError, RuntimeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    print_summary(summary, run_dir)
