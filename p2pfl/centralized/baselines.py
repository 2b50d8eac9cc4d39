"""Centralized baselines on Flower's own runtime: FedAvg, FedPer, FedRep, Ditto and FedRoD.

Why: a decentralized run is only judged fairly against a server run on the very same data
partition, models, initial weights and local update rule, so that a difference in accuracy is
the difference between a server and a gossip graph, nothing else. So the peers' ClientApp
(``make_client_app``) runs the experiment's own ``Algorithm.local_update`` (the code a
decentralized ``Node`` runs), and Flower's unmodified ``FedAvg`` aggregates:

==========  ========================================  ==========================================
baseline    what the server averages                  local rule (the config's algorithm)
==========  ========================================  ==========================================
fedavg      the whole model                           one joint pass (local, dfedavg, ...)
fedper      the shared body; heads stay on the nodes  one joint pass (local, dfedavg, ...)
fedrep      the shared body; heads stay on the nodes  head phase then body phase (deprl, ...)
ditto       the whole (global) model; each node also  global update, then the personal model's
            keeps a personal model, the one evaluated proximal update (``p2pfl.algorithms.ditto``)
fedrod      the body and the generic head; each node   balanced-softmax step of body + generic
            also keeps a personal head, evaluated as  head, CE step of the personal head
            generic + personal head                   (``p2pfl.algorithms.fedrod``)
==========  ========================================  ==========================================

Runtime: Flower's Simulation Runtime (Ray backend, ``flwr[simulation]``) the way ``flwr run``
reaches it: this project's Flower App (``p2pfl/centralized/app.py``, whose ServerApp calls
``serve_baseline``) submitted with ``flwr run`` to a SuperLink started for the run
(``p2pfl.centralized.superlink``), not the deprecated ``flwr.simulation.run_simulation``. Where
Ray is not installed, an in-process loop delivers the same messages to the same ClientApp and
aggregates with the same strategy object (its ``aggregate_*`` methods need no runtime); the
run folder's ``summary.json`` says which ran (``runtime``: ``flwr-run`` or ``in-process``). No
Flower private state is written: instruction messages of the in-process loop are built with
Flower's public ``Metadata``.

Per-peer metrics: the strategy (``RecordingFedAvg``) sees every reply before it aggregates; the
ClientApp tags its replies with its peer id (a ``ConfigRecord``, which FedAvg ignores). Replies
are aggregated in peer order, so a run is bitwise repeatable whatever order they arrived in.

Resuming (``run_baseline(resume=True)``, ``p2pfl flower --resume``): every ``checkpoint.every``
rounds each node writes its own state (personal part, algorithm state, generator) as a checkpoint
generation ``checkpoints/gen/<peer>.r<R>.npz`` when it trains round R, and the server writes the
global model it will send next as ``checkpoints/gen/_server.r<R>.npz`` once round R's evaluations
are recorded (the same generations and ``p2pfl.resume.prepare_resume`` as a simulation). A resumed
run picks the last R that the server and every node have, cuts ``metrics.jsonl`` to the rounds
before it and runs the rest with the round numbers shifted by R: the same messages, bitwise, as a
run that was never interrupted. A config's own ClientApp (``app:``) keeps its state in
``Context.state``, which has no checkpoint: such a run starts over.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from p2pfl.algorithms import Algorithm, PeerState, TrainContext
from p2pfl.badinput import BadInput, shorten
from p2pfl.checkpoint import load_checkpoint
from p2pfl.config import ExperimentConfig, parse_config
from p2pfl.experiment import Experiment, peer_seed
from p2pfl.flower.records import (
    ARRAYS_KEY,
    CONFIG_KEY,
    METRICS_KEY,
    array_record,
    instruction,
    load_arrays,
    message_metrics,
    number,
    record_bytes,
    record_of,
    tensor_of,
    train_columns,
    with_acc_loss,
)
from p2pfl.modelpool import ModelPool
from p2pfl.peerapp import PeerApp
from p2pfl.resume import checkpoint_due, drop_generations, prepare_resume, save_generation
from p2pfl.runfolder import RunFolder

log = logging.getLogger(__name__)

PEER_KEY = "peer"  # ConfigRecord in every reply: {"peer-id": ...}
FIRST_NODE_ID = 2  # in-process node ids (Flower's SuperLink is node 1)
STATE_PERSONAL, STATE_RNG, STATE_EXTRA, STATE_SCALARS, STATE_ROUND = (
    "p2pfl.personal", "p2pfl.rng", "p2pfl.extra", "p2pfl.scalars", "p2pfl.round")
JOINT = ("local", "dfedavg", "dfedavgm", "dpsgd", "dfedsam")
ALTERNATING = ("deprl", "dfedmdc", "dfedsmdc")
APP = "clientapp"  # a config's own Flower ClientApp: its train handler is the local rule
SERVER = "_server"  # the server's checkpoint generations (a peer id cannot start with "_")


@dataclass(frozen=True)
class Baseline:
    name: str
    scope: str  # "all": the server averages the whole model; "shared": the body only
    rules: tuple[str, ...]  # algorithms whose local rule this baseline uses
    #: the ``PeerState.extra`` tensor (a whole model, flat) each node is evaluated with; None: the
    #: received model (with the node's own head for scope "shared")
    evaluate_extra: str | None = None
    #: the ``PeerState.extra`` tensor (a head, flat) added to the received model's head to evaluate a
    #: node (FedRoD: generic head + personal head = the sum of their logits; the head is linear)
    evaluate_head_addend: str | None = None


BASELINES: dict[str, Baseline] = {
    "fedavg": Baseline("fedavg", "all", (*JOINT, APP)),
    "fedper": Baseline("fedper", "shared", (*JOINT, APP)),
    "fedrep": Baseline("fedrep", "shared", ALTERNATING),
    "ditto": Baseline("ditto", "all", ("ditto",), evaluate_extra="ditto_personal"),
    "fedrod": Baseline("fedrod", "all", ("fedrod",), evaluate_head_addend="fedrod_head"),
}


class FlowerPeerError(RuntimeError):
    """A peer's ClientApp failed; the run stops (a silently skipped peer would bias the baseline)."""


def baseline_of(name: str, algorithm: str) -> Baseline:
    """The baseline ``name``, refused unless the config's algorithm has its kind of local rule."""
    if name not in BASELINES:
        raise BadInput(f"unknown baseline {shorten(repr(name))}", source="--baseline", allowed=list(BASELINES))
    b = BASELINES[name]
    if algorithm not in b.rules:
        raise BadInput(f"{algorithm!r} is not a {name} local rule", source=f"--baseline {name}",
                       key="algorithm.name", allowed=b.rules)
    return b


# -- the peers' ClientApp ----------------------------------------------------------------------------
_EXPERIMENTS: dict[str, Experiment] = {}
_EXPERIMENTS_LOCK = threading.Lock()


def portable_config(cfg: ExperimentConfig) -> dict[str, Any]:
    """The resolved config with absolute paths, so a Ray worker (another cwd) reads the same files."""
    raw = json.loads(json.dumps(cfg.raw))
    raw["topology"] = str(Path(raw["topology"]).resolve())
    if isinstance(raw.get("data"), dict) and raw["data"].get("root"):
        raw["data"]["root"] = str(Path(raw["data"]["root"]).resolve())
    return raw


def experiment_for(raw: dict[str, Any], experiment: Experiment | None = None) -> Experiment:
    """One Experiment per config per process (a Ray worker builds it once, on its first message)."""
    key = json.dumps(raw, sort_keys=True)
    with _EXPERIMENTS_LOCK:
        if experiment is not None:
            _EXPERIMENTS.setdefault(key, experiment)
        if key not in _EXPERIMENTS:
            _EXPERIMENTS[key] = Experiment.from_config(parse_config(raw))
        return _EXPERIMENTS[key]


@dataclass
class _Peer:
    """What a peer needs that is a pure function of the config (rebuilt, never persisted)."""

    peer_id: str
    index: int
    app: PeerApp
    algorithm: Algorithm


class BaselinePeers:
    """The train/evaluate handlers of every peer of one experiment, for one baseline.

    State that persists across rounds (the personal head, algorithm state, the peer's generator
    and round) lives in ``Context.state`` as records, where a Flower SuperNode keeps per-run node
    state; the runtime hands it back with every message. Only the config travels with the app
    (it is pickled to Ray's workers per message), and each process rebuilds the experiment once.
    """

    def __init__(self, raw: dict[str, Any], baseline: str, run_dir: str | None = None, resume_at: int = 0) -> None:
        self.raw = raw
        self.baseline = baseline
        #: where the nodes write their checkpoint generations (None: no checkpoints)
        self.run_dir = run_dir
        #: a resumed run's first round: a node with no state yet starts from its checkpoint of it
        self.resume_at = resume_at
        self._cache: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"raw": self.raw, "baseline": self.baseline, "run_dir": self.run_dir, "resume_at": self.resume_at}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["raw"], state["baseline"], state.get("run_dir"), state.get("resume_at", 0))  # type: ignore[misc]

    @property
    def exp(self) -> Experiment:
        if "exp" not in self._cache:
            self._cache["exp"] = experiment_for(self.raw)
            self._cache["scope"] = BASELINES[self.baseline].scope
            self._cache["models"] = ModelPool(self._cache["exp"].model_factory, 1)
            self._cache["peers"] = {}
        return self._cache["exp"]

    def peer_index(self, context: Context) -> tuple[str, int]:
        """Which peer a node is: ``node_config["peer-id"]``, else its ``partition-id`` (one node per peer)."""
        ids = self.exp.topology.ids
        cfg = context.node_config
        if "peer-id" in cfg:
            pid = str(cfg["peer-id"])
        else:
            n = int(cfg.get("num-partitions", len(ids)))
            if n != len(ids):
                raise ValueError(f"{n} nodes for a topology of {len(ids)} peers: run one node per peer")
            pid = ids[int(cfg["partition-id"])]
        return pid, self.exp.topology.index(pid)

    def peer_of(self, context: Context) -> _Peer:
        exp = self.exp
        pid, _ = self.peer_index(context)
        peers: dict[str, _Peer] = self._cache["peers"]
        if pid not in peers:
            i = exp.topology.index(pid)
            peers[pid] = _Peer(pid, i, PeerApp(pid, exp.model_factory, exp.peer_data(pid), exp.device),
                               exp.new_algorithm())
        return peers[pid]

    # -- Context.state ----------------------------------------------------------------------------
    def _restore(self, peer: _Peer, context: Context, flat: torch.Tensor) -> tuple[PeerState, torch.Generator]:
        """Fill ``flat``'s personal part (scope "shared") and rebuild PeerState + generator from the state.

        On first use, start as ``Experiment.make_node`` does: the initial head, the peer's own
        seeded generator, then ``Algorithm.init_state``; in a resumed run, from the node's checkpoint.
        """
        exp, n = self.exp, self.exp.layout.num_shared
        st = context.state
        if STATE_RNG not in st.array_records and self.resume_at and self.run_dir is not None:
            return self._resumed(peer, flat)
        gen = torch.Generator(device="cpu")
        state = PeerState(peer_id=peer.peer_id, params=flat)
        if STATE_RNG not in st.array_records:
            if self._cache["scope"] == "shared":
                flat[n:].copy_(exp._init[1][n:])
            gen.manual_seed(peer_seed(exp.cfg.seed, peer.index))
            peer.algorithm.init_state(state, gen)
            return state, gen
        if self._cache["scope"] == "shared":
            flat[n:].copy_(self.personal_head(context).to(flat.device))
        gen.set_state(tensor_of(st.array_records[STATE_RNG]["state"]))
        if STATE_EXTRA in st.array_records:
            state.extra = {k: tensor_of(v).to(flat.device) for k, v in st.array_records[STATE_EXTRA].items()}
        if STATE_SCALARS in st.config_records:
            scalars = st.config_records[STATE_SCALARS]
            state.scalars = {k: number(scalars, k) for k in scalars}
        state.round = int(number(st.config_records[STATE_ROUND], "round"))
        return state, gen

    def _resumed(self, peer: _Peer, flat: torch.Tensor) -> tuple[PeerState, torch.Generator]:
        """A node's state at the resumed round, from the checkpoint ``prepare_resume`` put back."""
        path = Path(self.run_dir or ".") / "checkpoints" / f"{peer.peer_id}.npz"
        saved, rng, _ = load_checkpoint(path, flat.device)
        if saved.round != self.resume_at or saved.params.shape != flat.shape:
            raise FlowerPeerError(f"{path}: checkpoint of round {saved.round}, shape {tuple(saved.params.shape)}; "
                                  f"the run resumes at round {self.resume_at}, shape {tuple(flat.shape)}")
        if self._cache["scope"] == "shared":
            n = self.exp.layout.num_shared
            flat[n:].copy_(saved.params[n:])
        gen = torch.Generator(device="cpu")
        gen.set_state(rng)
        return PeerState(peer_id=peer.peer_id, params=flat, extra=saved.extra, scalars=saved.scalars,
                         round=saved.round), gen

    def _save(self, context: Context, state: PeerState, gen: torch.Generator) -> None:
        st, layout = context.state, self.exp.layout
        if self._cache["scope"] == "shared":
            st[STATE_PERSONAL] = array_record(layout.views(state.params, "personal"))
        st[STATE_RNG] = array_record({"state": gen.get_state()})
        if state.extra:
            st[STATE_EXTRA] = array_record(state.extra)
        if state.scalars:
            st[STATE_SCALARS] = ConfigRecord({k: float(v) for k, v in state.scalars.items()})
        st[STATE_ROUND] = ConfigRecord({"round": int(state.round)})

    def personal_head(self, context: Context) -> torch.Tensor:
        """A node's head (flat, layout order): its own after its first train, phi(0)'s before."""
        layout = self.exp.layout
        rec = context.state.array_records.get(STATE_PERSONAL)
        if rec is None:
            return self.exp._init[1][layout.num_shared:].clone()
        return torch.cat([tensor_of(rec[s.name]).reshape(-1) for s in layout.personal_specs()])

    def _received(self, msg: Message) -> torch.Tensor:
        layout = self.exp.layout
        specs = layout.shared_specs() if self._cache["scope"] == "shared" else layout.specs
        flat = torch.empty(layout.numel, dtype=torch.float32, device=self.exp.device)
        load_arrays(specs, record_of(msg.content, ARRAYS_KEY, ArrayRecord), flat, "received ArrayRecord")
        return flat

    # -- handlers ---------------------------------------------------------------------------------
    def train(self, msg: Message, context: Context) -> Message:
        """Bind the received part with what the node keeps, run ``local_update``, reply the averaged part."""
        torch.set_num_threads(1)  # the decentralized runs' numerics (one thread per peer)
        peer = self.peer_of(context)
        t0 = time.perf_counter()
        r = int(number(record_of(msg.content, CONFIG_KEY, ConfigRecord), "server-round")) - 1  # ours count from 0
        flat = self._received(msg)
        state, gen = self._restore(peer, context, flat)
        with self._cache["models"].borrow((r, 0, peer.index)) as model:
            self.exp.layout.bind(model, state.params)
            ctx = TrainContext(model, self.exp.layout, peer.app.data, gen, state.params.device)
            metrics = peer.algorithm.local_update(state, ctx, r)
        state.round = r + 1
        self._save(context, state, gen)
        if self.run_dir is not None:
            save_generation(Path(self.run_dir), state, gen, self.exp.cfg.checkpoint_every, self.exp.cfg.rounds)
        part = "shared" if self._cache["scope"] == "shared" else "all"
        return Message(RecordDict({
            ARRAYS_KEY: array_record(self.exp.layout.views(state.params, part)),
            METRICS_KEY: MetricRecord({"num-examples": int(peer.app.data.num_train),
                                       "train_loss": float(metrics.get("train_loss", float("nan"))),
                                       "train_seconds": time.perf_counter() - t0}),
            PEER_KEY: ConfigRecord({"peer-id": peer.peer_id}),
        }), reply_to=msg)

    def evaluate(self, msg: Message, context: Context) -> Message:
        """The global model (FedAvg), global body + own head (FedPer/FedRep), the node's personal model
        (Ditto) or the global model with its head plus the node's personal head (FedRoD) on the node's
        own test split."""
        torch.set_num_threads(1)
        peer = self.peer_of(context)
        flat = self._received(msg)
        extra = BASELINES[self.baseline].evaluate_extra
        addend = BASELINES[self.baseline].evaluate_head_addend
        if addend is not None:
            rec = context.state.array_records.get(STATE_EXTRA)
            if rec is None or addend not in rec:
                raise FlowerPeerError(f"peer {peer.peer_id}: no {addend} to evaluate (evaluate before any train)")
            flat[self.exp.layout.num_shared:].add_(tensor_of(rec[addend]).reshape(-1).to(flat.device))
        elif extra is not None:
            rec = context.state.array_records.get(STATE_EXTRA)
            if rec is None or extra not in rec:
                raise FlowerPeerError(f"peer {peer.peer_id}: no {extra} to evaluate (evaluate before any train)")
            flat = tensor_of(rec[extra]).reshape(-1).to(flat.device)
        elif self._cache["scope"] == "shared":
            flat[self.exp.layout.num_shared:].copy_(self.personal_head(context).to(flat.device))
        r = int(number(record_of(msg.content, CONFIG_KEY, ConfigRecord), "server-round")) - 1
        with self._cache["models"].borrow((r, 1, peer.index)) as model:
            self.exp.layout.bind(model, flat)
            ev = peer.app.evaluate(model)
        return Message(RecordDict({
            METRICS_KEY: MetricRecord({"num-examples": int(ev["num_examples"]), "accuracy": float(ev["acc"]),
                                       "loss": float(ev["loss"])}),
            PEER_KEY: ConfigRecord({"peer-id": peer.peer_id}),
        }), reply_to=msg)


class AppBaselinePeers(BaselinePeers):
    """A config's own ClientApp (``app:``) under a server: the app sees exactly what it sees as a P2P peer.

    The server sends the averaged part (the shared keys for FedPer, everything for FedAvg); this
    wrapper adds the node's personal keys from ``Context.state`` (phi(0)'s before its first train),
    hands the app the full state with ``app_config`` as its ``run_config``, keeps the personal keys
    of its reply at home and sends the rest back. The app's metrics pass through unchanged.
    """

    def __init__(self, raw: dict[str, Any], baseline: str, run_dir: str | None = None, resume_at: int = 0) -> None:
        super().__init__(raw, baseline, None, 0)  # the app's Context.state has no checkpoint: no resume

    def _app_context(self, context: Context, peer_id: str, index: int) -> Context:
        exp = self.exp
        assert exp.app_spec is not None
        cfg = {"partition-id": index, "num-partitions": len(exp.topology.ids), "peer-id": peer_id}
        return Context(run_id=context.run_id, node_id=context.node_id, node_config=cfg, state=context.state,
                       run_config=dict(exp.app_spec.config))

    def _forward(self, msg: Message, context: Context) -> tuple[Message, str]:
        from p2pfl.flower.clientapp import load_client_app

        exp = self.exp
        layout, dtypes = exp.layout, exp._app_init[2]
        pid, index = self.peer_index(context)
        flat = self._received(msg)
        if self._cache["scope"] == "shared":
            flat[layout.num_shared:].copy_(self.personal_head(context).to(flat.device))
        content = RecordDict({ARRAYS_KEY: array_record(layout.views(flat), dtypes),
                              CONFIG_KEY: record_of(msg.content, CONFIG_KEY, ConfigRecord)})
        md = msg.metadata
        inner = instruction(content, md.message_type, run_id=md.run_id, src_node_id=md.src_node_id,
                            dst_node_id=md.dst_node_id, message_id=md.message_id, group_id=md.group_id)
        if "app" not in self._cache:
            self._cache["app"] = load_client_app(exp.app_spec.app)  # type: ignore[union-attr]
        reply = self._cache["app"](inner, self._app_context(context, pid, index))
        if reply.has_error():
            raise FlowerPeerError(f"peer {pid}: the app's {md.message_type} reply is an error: {reply.error.reason}")
        return reply, pid

    def train(self, msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        reply, pid = self._forward(msg, context)
        layout = self.exp.layout
        recs = list(reply.content.array_records.values())
        if len(recs) != 1:
            raise FlowerPeerError(f"peer {pid}: a train reply must hold one ArrayRecord, it holds {len(recs)}")
        flat = torch.empty(layout.numel, dtype=torch.float32)
        load_arrays(layout.specs, recs[0], flat, f"peer {pid}: train reply")
        if self._cache["scope"] == "shared":
            context.state[STATE_PERSONAL] = array_record(layout.views(flat, "personal"))
        part = "shared" if self._cache["scope"] == "shared" else "all"
        out = RecordDict({ARRAYS_KEY: array_record(layout.views(flat, part), self.exp._app_init[2]),
                          PEER_KEY: ConfigRecord({"peer-id": pid})})
        for key, rec in reply.content.metric_records.items():
            out[key] = rec
        return Message(out, reply_to=msg)

    def evaluate(self, msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        reply, pid = self._forward(msg, context)
        out = RecordDict({PEER_KEY: ConfigRecord({"peer-id": pid})})
        for key, rec in reply.content.metric_records.items():
            out[key] = rec
        return Message(out, reply_to=msg)


def baseline_peers(raw: dict[str, Any], baseline: str, run_dir: str | None = None, resume_at: int = 0) -> BaselinePeers:
    """The handlers for config ``raw``: its own ClientApp's (``app:``) or the built-in algorithm's."""
    return (AppBaselinePeers if raw.get("app") else BaselinePeers)(raw, baseline, run_dir, resume_at)


def make_client_app(raw: dict[str, Any], baseline: str, run_dir: str | None = None, resume_at: int = 0) -> ClientApp:
    """A Flower ClientApp for every peer of the config ``raw`` (which peer: from the node's Context);
    with ``run_dir`` the nodes write checkpoint generations there, and a run resumed at round
    ``resume_at`` starts each node from its checkpoint of that round."""
    peers = baseline_peers(raw, baseline, run_dir, resume_at)
    app = ClientApp()
    app.train()(peers.train)
    app.evaluate()(peers.evaluate)
    return app


def initial_arrays(exp: Experiment, scope: str) -> ArrayRecord:
    """The server's starting point: the experiment's one initial model (its shared part for FedPer/FedRep)."""
    layout, flat = exp._init
    dtypes = exp._app_init[2] if exp.app_spec is not None else None
    return array_record(layout.views(flat, "shared" if scope == "shared" else "all"), dtypes)


# -- the server side --------------------------------------------------------------------------------
Observer = Callable[[dict[str, Any]], None]


def _peer_id(msg: Message) -> str:
    return str(record_of(msg.content, PEER_KEY, ConfigRecord)["peer-id"])


class RecordingFedAvg(FedAvg):
    """Flower's FedAvg (all nodes train and evaluate every round), recording each peer's reply.

    A reply with an error stops the run (``FlowerPeerError``) instead of being skipped. Replies
    are aggregated in peer order (``order``), whatever order the runtime delivered them in.
    """

    def __init__(self, peer_ids: list[str], record: Observer, *, offset: int = 0,
                 checkpoint: Callable[[int, ArrayRecord], None] | None = None) -> None:
        n = len(peer_ids)
        super().__init__(fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=n, min_evaluate_nodes=n,
                         min_available_nodes=n, arrayrecord_key=ARRAYS_KEY, configrecord_key=CONFIG_KEY)
        self.order = {p: i for i, p in enumerate(peer_ids)}
        self.record = record
        #: rounds already run before this start (a resumed run): Flower's round k is the run's round k + offset
        self.offset = offset
        #: called with (rounds done, the global model sent next) once a round's evaluations are recorded
        self.checkpoint = checkpoint
        self.sent_bytes = 0  # what one instruction carries this round (the global arrays)
        self._train: dict[str, dict[str, Any]] = {}
        self._arrays: ArrayRecord | None = None  # the last aggregate, for ``checkpoint``

    def note_sent(self, arrays: ArrayRecord) -> None:
        self.sent_bytes = int(arrays.count_bytes())

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self.note_sent(arrays)
        return super().configure_train(server_round + self.offset, arrays, config, grid)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        self.note_sent(arrays)
        return super().configure_evaluate(server_round + self.offset, arrays, config, grid)

    def _sorted(self, replies: Iterable[Message], kind: str) -> list[Message]:
        replies = list(replies)
        for m in replies:
            if m.has_error():
                raise FlowerPeerError(f"node {m.metadata.src_node_id} failed on {kind}: {m.error.reason}")
        return sorted(replies, key=lambda m: self.order[_peer_id(m)])

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None,
                                                                                         MetricRecord | None]:
        replies = self._sorted(replies, "train")
        for m in replies:
            rec: dict[str, Any] = train_columns(message_metrics(m))
            rec.update(bytes_sent=record_bytes(m.content), bytes_recv=self.sent_bytes)
            self._train[_peer_id(m)] = rec
        arrays, metrics = super().aggregate_train(server_round + self.offset, replies)
        self._arrays = arrays
        return arrays, metrics

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        replies = self._sorted(replies, "evaluate")
        for m in replies:
            pid = _peer_id(m)
            rec: dict[str, Any] = {"round": server_round + self.offset - 1, "peer": pid,
                                   **with_acc_loss(message_metrics(m)),
                                   "consensus_dist": 0.0, "missing": []}
            tr = self._train.pop(pid, {"bytes_sent": 0, "bytes_recv": 0})
            rec.update(tr)
            rec["bytes_recv"] = tr["bytes_recv"] + self.sent_bytes
            rec["seconds"] = float(tr.get("train_seconds", 0.0))
            self.record(rec)
        if self.checkpoint is not None and self._arrays is not None:
            self.checkpoint(server_round + self.offset, self._arrays)
        return super().aggregate_evaluate(server_round + self.offset, replies)


def run_in_process(client_app: ClientApp, strategy: RecordingFedAvg, peer_ids: list[str],
                   initial: ArrayRecord, rounds: int, *, run_id: int = 1) -> None:
    """The same rounds without a Flower runtime (Ray missing): deliver, then aggregate with ``strategy``.

    One persistent Context per node, as a SuperNode keeps; every node trains and evaluates every
    round (what ``RecordingFedAvg`` samples with fraction 1). Messages carry public ``Metadata``;
    their round is the run's (``strategy.offset`` added, as ``configure_train`` adds it).
    """
    n = len(peer_ids)
    contexts = [Context(run_id=run_id, node_id=FIRST_NODE_ID + i,
                        node_config={"partition-id": i, "num-partitions": n, "peer-id": pid},
                        state=RecordDict(), run_config={}) for i, pid in enumerate(peer_ids)]
    arrays = initial
    seq = 0
    for server_round in range(1, rounds + 1):
        for kind in (MessageType.TRAIN, MessageType.EVALUATE):
            strategy.note_sent(arrays)
            replies = []
            for ctx in contexts:
                seq += 1
                content = RecordDict({ARRAYS_KEY: arrays,
                                      CONFIG_KEY: ConfigRecord({"server-round": server_round + strategy.offset})})
                msg = instruction(content, kind, run_id=run_id, src_node_id=1, dst_node_id=ctx.node_id,
                                  message_id=f"{seq:016x}", group_id=str(server_round))
                replies.append(client_app(msg, ctx))
            if kind == MessageType.TRAIN:
                new, _ = strategy.aggregate_train(server_round, replies)
                if new is None:
                    raise FlowerPeerError(f"round {server_round}: no train reply to aggregate")
                arrays = new
            else:
                strategy.aggregate_evaluate(server_round, replies)


def ray_available() -> bool:
    return importlib.util.find_spec("ray") is not None


RUNTIMES = ("auto", "ray", "in-process")


def run_baseline(cfg: ExperimentConfig, out_dir: str | Path, baseline: str = "fedper", *,
                 runtime: str = "auto", experiment: Experiment | None = None, verbose: bool = False,
                 ray_cpus: int | None = None, resume: bool = False) -> dict[str, Any]:
    """Run ``baseline`` on ``cfg``'s peers; write the run folder (same format as ``p2pfl simulate``).

    ``runtime``: ``ray`` (Flower's Simulation Runtime behind ``flwr run``, module doc), ``in-process``,
    or ``auto`` (Ray when it is installed). ``summary.json`` records the one that ran. ``resume``:
    continue an interrupted run in ``out_dir`` from the last round the server and every node
    checkpointed (module doc); from round 0 when there is none.
    """
    if runtime not in RUNTIMES:
        raise BadInput(f"unknown runtime {shorten(repr(runtime))}", source="--runtime", allowed=RUNTIMES)
    baseline_of(baseline, cfg.algorithm_name)
    if runtime == "auto":
        runtime = "ray" if ray_available() else "in-process"
    if runtime == "ray" and not ray_available():
        raise RuntimeError("runtime ray: Ray is not installed (pip install 'flwr[simulation]')")
    run_dir = Path(out_dir)
    exp = experiment or Experiment.from_config(cfg)
    ids = list(exp.topology.ids)
    start = prepare_resume(run_dir, [*ids, SERVER], before=cfg.rounds) if resume else 0
    if runtime == "ray":
        return run_with_flwr(cfg, run_dir, baseline, start=start, num_supernodes=len(ids),
                             num_cpus=ray_cpus or max(1, min(len(ids), _cpus())), verbose=verbose)
    flwr_logger = logging.getLogger("flwr")
    saved_level, saved_threads = flwr_logger.level, torch.get_num_threads()
    if not verbose:
        flwr_logger.setLevel(logging.WARNING)
    raw = portable_config(cfg)
    experiment_for(raw, exp)  # this process's peers reuse the experiment already built
    client_app = make_client_app(raw, baseline, str(run_dir.resolve()), start)
    try:
        return serve_baseline(
            lambda strategy, initial, rounds: run_in_process(client_app, strategy, ids, initial, rounds),
            cfg, run_dir, baseline, runtime="in-process", start=start, experiment=exp)
    finally:
        torch.set_num_threads(saved_threads)
        flwr_logger.setLevel(saved_level)


#: drives the rounds: (the strategy, the global model it starts from, the number of rounds to run)
Rounds = Callable[[RecordingFedAvg, ArrayRecord, int], None]


def on_grid(grid: Grid) -> Rounds:
    """Rounds driven by ``strategy.start`` on a Flower ``Grid`` (a ServerApp's main under ``flwr run``)."""
    def drive(strategy: RecordingFedAvg, initial: ArrayRecord, rounds: int) -> None:
        strategy.start(grid, initial, num_rounds=rounds, train_config=ConfigRecord({"num-rounds": rounds}))

    return drive


def serve_baseline(rounds: Rounds, cfg: ExperimentConfig, run_dir: Path, baseline: str, *, runtime: str,
                   start: int = 0, experiment: Experiment | None = None) -> dict[str, Any]:
    """The server's side of a baseline, whatever runtime carries its messages: open the run folder
    (appended to from round ``start`` on a resume), run the rounds with ``RecordingFedAvg``
    (checkpointing the global model), then write the summary and drop the resume state.

    One definition for both runtimes: ``run_baseline``'s in-process loop and the Flower App's
    ServerApp (``p2pfl/centralized/app.py``, which ``flwr run`` runs) both call it.
    """
    b = baseline_of(baseline, cfg.algorithm_name)
    exp = experiment or Experiment.from_config(cfg)
    ids = list(exp.topology.ids)
    run = RunFolder.start(run_dir, cfg, exp.topology, exp.partition, f"flower-{baseline}", append=start > 0)
    # a config's own ClientApp keeps its state where no checkpoint reaches (module doc): no server part either
    checkpoint = server_checkpoint(exp, b.scope, run_dir) if exp.app_spec is None else None
    strategy = RecordingFedAvg(ids, run.record, offset=start, checkpoint=checkpoint)
    initial = initial_arrays(exp, b.scope) if start == 0 else resumed_arrays(exp, b.scope, run_dir, start)
    try:
        rounds(strategy, initial, cfg.rounds - start)
    finally:
        run.close()
    summary = finish_run_folder(run, ids, baseline, runtime, start)
    # A node's checkpoint is resume state, not a final model (a resumed run's put-back files are
    # of an earlier round): a finished baseline keeps none, so nothing reads them as final models.
    drop_generations(run_dir)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return summary


def run_with_flwr(cfg: ExperimentConfig, run_dir: Path, baseline: str, *, start: int, num_supernodes: int,
                  num_cpus: int, verbose: bool = False) -> dict[str, Any]:
    """The baseline as this project's Flower App under ``flwr run`` (module doc), on a SuperLink of its own.

    The resolved config (``--set`` and ``--rounds`` applied, paths absolute) goes to the app as a
    file; the ServerApp writes the run folder and its ``summary.json``, read back here.
    """
    from p2pfl.centralized.superlink import APP_ROOT, FlowerRunError, LocalSuperLink

    if not (APP_ROOT / "pyproject.toml").exists():
        raise FlowerRunError(f"runtime ray runs the Flower App of {APP_ROOT}, which has no pyproject.toml "
                             "(an installed copy of p2pfl): use --runtime in-process")
    run_dir = run_dir.resolve()
    with LocalSuperLink(verbose=verbose) as link:
        config_path = link.home / "config.yaml"
        config_path.write_text(json.dumps(portable_config(cfg)))  # JSON is YAML
        (run_dir / "summary.json").unlink(missing_ok=True)  # the run's own summary is the proof it finished
        link.flwr_run(APP_ROOT, {"config": str(config_path), "baseline": baseline, "out": str(run_dir),
                                 "resume-at": start},
                      {"num-supernodes": num_supernodes, "client-resources-num-cpus": 1,
                       "init-args-num-cpus": num_cpus})
    return json.loads((run_dir / "summary.json").read_text())


def server_checkpoint(exp: Experiment, scope: str, run_dir: Path) -> Callable[[int, ArrayRecord], None] | None:
    """The server's part of a checkpoint: every ``checkpoint.every`` rounds (and the last), the global
    model it sends next, as generation ``_server.r<R>`` (a flat buffer; the personal part is zeros
    where only the body is averaged). None when the config disables checkpoints."""
    every, rounds, layout = exp.cfg.checkpoint_every, exp.cfg.rounds, exp.layout
    if not every:
        return None
    specs = layout.shared_specs() if scope == "shared" else layout.specs

    def save(done: int, arrays: ArrayRecord) -> None:
        if not checkpoint_due(done, every, rounds):
            return  # decided before the ArrayRecord is copied out
        flat = torch.zeros(layout.numel, dtype=torch.float32)
        load_arrays(specs, arrays, flat, "the aggregated ArrayRecord")
        save_generation(run_dir, PeerState(peer_id=SERVER, params=flat, round=done),
                        torch.Generator(), every, rounds)  # the server draws nothing: its generator is not used

    return save


def resumed_arrays(exp: Experiment, scope: str, run_dir: Path, start: int) -> ArrayRecord:
    """The global model a run resumed at round ``start`` sends first (its server checkpoint)."""
    path = run_dir / "checkpoints" / f"{SERVER}.npz"
    saved, _, _ = load_checkpoint(path)
    if saved.round != start or saved.params.numel() != exp.layout.numel:
        raise FlowerPeerError(f"{path}: a server checkpoint of round {saved.round} with {saved.params.numel()} "
                              f"values; the run resumes at round {start} with {exp.layout.numel}")
    dtypes = exp._app_init[2] if exp.app_spec is not None else None
    return array_record(exp.layout.views(saved.params, "shared" if scope == "shared" else "all"), dtypes)


def finish_run_folder(run: RunFolder, ids: list[str], baseline: str, runtime: str, start: int = 0) -> dict[str, Any]:
    """The run folder's summary (with the runtime that ran) and plot; every peer-round must be there."""
    recs = len(run.metrics.path.read_text().splitlines())
    if recs != len(ids) * run.cfg.rounds:
        raise FlowerPeerError(f"{recs} peer-rounds recorded, {len(ids) * run.cfg.rounds} expected")
    return run.finish(ids, {"baseline": baseline, "runtime": runtime, "strategy": "FedAvg",
                            "resumed_from_round": start},
                      title=f"{run.cfg.name}: {run.mode} ({run.cfg.algorithm_name} local rule)",
                      rounds_run=run.cfg.rounds - start)


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
