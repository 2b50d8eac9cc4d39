"""A user's Flower ClientApp as a peer of the decentralized round loop.

A config names the app instead of a built-in algorithm::

    app: peers.quickstart:app            # a flwr.clientapp.ClientApp
    app_init: peers.quickstart:Net       # the initial model (every peer starts from the same one)
    app_config: {lr: 0.05, local-epochs: 1}   # -> context.run_config
    sharing: {personal: [fc3.]}          # state-dict key prefixes that never leave the peer

or names a Flower App directory (``app: path/to/app``, see ``p2pfl.appdir``): the
ClientApp and ServerApp from its pyproject, the initial model and train config from what its
ServerApp would send in round 1 (``p2pfl.flower.capture``); ``app_init`` and
``app_train_config`` stay explicit overrides.

Each round the Node calls ``ClientAppAlgorithm.local_update``, which sends the app a train
``Message`` holding ``"arrays"`` (the full state: the mixed shared part plus the peer's own
personal and held parts, ``p2pfl.flower.appstate``) and ``"config"`` (``server-round`` and the
run's train config), and copies the returned arrays back. The
Node then gossips the shared keys with the topology's weights (the Algorithm's default pull
mixing) and evaluates through ``ClientAppEvaluator``, which sends an evaluate ``Message``.

A ClientApp built from ``client_fn`` (a ``NumPyClient`` / ``Client``: Flower's legacy API) gets
the layout it expects instead: message types ``train`` / ``evaluate`` holding FitIns /
EvaluateIns records made by Flower's own converters (the state as an unnamed list in state order,
and the config), and its FitRes / EvaluateRes replies are read back the same way
(``records.legacy_content`` / ``legacy_reply``). The peer still keeps its state as named tensors:
the names of ``app_init``'s model when given, else positions ``"0"`` .. ``"n-1"``
(``sharing.personal`` takes indices for those). A legacy ServerApp (``server_fn``) gives the
initial model (its strategy's ``initial_parameters``) and each round's config (its
``configure_fit``, hence ``on_fit_config_fn(round)``; ``capture.LegacyServer``).

Why an ``Algorithm`` and not a second round loop: the Node already does exchange, quorum,
records and checkpoints in every mode (simulate, launch, node, compose); the adapter plugs into
its seam, so a ClientApp peer gets all of that unchanged. The model's state dict becomes a flat
``[shared | personal]`` buffer (``app_layout``), as for the built-in models, so the transport,
wire codec and mixing see nothing new. ``context.state`` travels in ``PeerState.extra`` as
tensors plus one JSON document (``records.state_to_tensors``), so it is checkpointed (no
pickle) and restored with the peer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import MessageTypeLegacy
from flwr.serverapp import ServerApp
from torch import nn

from p2pfl.algorithms.base import Algorithm, PeerState, TrainContext
from p2pfl.appdir import AppError, importable, is_object_ref, load_object, read_app_dir, run_config
from p2pfl.badinput import shorten
from p2pfl.flower.appstate import AppLayout, app_layout, as_state
from p2pfl.flower.records import (
    ARRAYS_KEY,
    CONFIG_KEY,
    SERVER_ROUND,
    LegacyReply,
    get_parameters_content,
    instruction,
    is_state_tensor,
    legacy_content,
    legacy_reply,
    message_metrics,
    round_content,
    state_to_tensors,
    tensors_to_state,
    train_columns,
    with_acc_loss,
)
from p2pfl.models.layout import ParamLayout

if TYPE_CHECKING:
    from p2pfl.flower.capture import LegacyServer

__all__ = ["AppError", "AppLayout", "AppSpec", "ClientAppAlgorithm", "app_layout", "load_client_app"]

NAME = "clientapp"  # the algorithm name a ClientApp run records
PEER_NODE_ID = 0  # src of the messages a peer hands its own app (there is no server)


class AppReplyError(ValueError):
    """A ClientApp's reply is unusable (a failure of the run, not of its input); the message names the peer."""


@dataclass(frozen=True)
class AppSpec:
    """The ``app``/``app_init``/``app_config``/``app_train_config``/``sharing`` keys of a config, resolved.

    ``app``/``server``: the ClientApp and ServerApp (``package.module:attr``; ``server`` is "" when
    there is none); ``config``: the run config the apps see; ``root``: the Flower App directory
    (``""`` when ``app:`` named an object); ``source``: the file that names the components (for errors).
    """

    app: str
    init: str
    config: Mapping[str, Any] = field(default_factory=dict)
    personal: tuple[str | int, ...] = ()  # state-dict key prefixes, or positions in the state's order
    running_stats: str = "shared"
    server: str = ""
    train_config: Mapping[str, Any] = field(default_factory=dict)
    root: str = ""
    source: str | None = None

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any]) -> AppSpec:
        """The spec of a validated config; a Flower App directory is read and made importable here."""
        sharing = raw.get("sharing") or {}
        common = {"init": str(raw.get("app_init") or ""),
                  "personal": tuple(p if isinstance(p, int) and not isinstance(p, bool) else str(p)
                                    for p in sharing.get("personal") or ()),
                  "running_stats": str(sharing.get("running_stats") or "shared"),
                  "train_config": dict(raw.get("app_train_config") or {})}
        ref = str(raw["app"])
        if is_object_ref(ref):
            return cls(app=ref, config=dict(raw.get("app_config") or {}), **common)
        found = read_app_dir(ref)
        importable(found)
        return cls(app=found.clientapp, server=found.serverapp, config=run_config(found, raw.get("app_config") or {}),
                   root=str(found.root), source=found.pyproject, **common)

    def key(self, name: str) -> str:
        """The key that names a component: the pyproject's for a Flower App directory, else the config's."""
        return f"tool.flwr.app.components.{name}" if self.root else {"clientapp": "app", "serverapp": "app"}[name]


def load_client_app(ref: str, *, source: str | None = None, key: str = "app") -> ClientApp:
    app = load_object(ref, key, source=source)
    if not isinstance(app, ClientApp):
        raise AppError(f"{ref!r} is a {type(app).__name__}, not a flwr.clientapp.ClientApp", source=source, key=key)
    return app


def load_server_app(ref: str, *, source: str | None = None, key: str = "serverapp") -> ServerApp:
    app = load_object(ref, key, source=source)
    if not isinstance(app, ServerApp):
        raise AppError(f"{ref!r} is a {type(app).__name__}, not a flwr.serverapp.ServerApp", source=source, key=key)
    return app


@dataclass(frozen=True)
class AppStart:
    """What every peer starts from: the initial state and what its train / evaluate messages hold.

    ``train``/``evaluate`` are content templates (``records.round_content`` puts a round's arrays and
    ``server-round`` in): what the app's ServerApp sends in round 1 when it has one, else an
    ``"arrays"`` record and a ``"config"`` record holding only ``server-round`` (as before).
    ``legacy_server``: a legacy ServerApp's strategy, asked for each round's config instead of the
    templates (``train_overrides``, the config's ``app_train_config``, on top). ``legacy_client``:
    the ClientApp is built from ``client_fn`` and gets Flower's legacy layout (FitIns / EvaluateIns).
    """

    state: dict[str, torch.Tensor]
    train: RecordDict
    evaluate: RecordDict
    legacy_server: LegacyServer | None = None
    legacy_client: bool = False
    train_overrides: Mapping[str, Any] = field(default_factory=dict)

    def config(self, message_type: str, server_round: int) -> dict[str, Any]:
        """The config of a round's message: the legacy strategy's for that round, else the template's."""
        train = message_type == MessageType.TRAIN
        if self.legacy_server is not None:
            values = self.legacy_server.config(message_type, server_round)
            return {**values, **self.train_overrides} if train else values
        content = round_content(self.train if train else self.evaluate, ArrayRecord(), server_round)
        return next((dict(rec) for rec in content.config_records.values()), {})

    def content(self, message_type: str, state: AppLayout, mixed: Mapping[str, torch.Tensor],
                extra: Mapping[str, torch.Tensor], server_round: int) -> RecordDict:
        """A round's message content, in the layout the app's API expects (module docstring)."""
        if self.legacy_client:
            return legacy_content(message_type, state.arrays(mixed, extra), self.config(message_type, server_round))
        record = state.record(mixed, extra)
        if self.legacy_server is not None:  # a Message API client under a legacy strategy: FedAvg's keys
            return RecordDict({ARRAYS_KEY: record, CONFIG_KEY: ConfigRecord(
                {**self.config(message_type, server_round), SERVER_ROUND: server_round})})
        return round_content(self.train if message_type == MessageType.TRAIN else self.evaluate, record, server_round)


def _default_content() -> RecordDict:
    return RecordDict({ARRAYS_KEY: ArrayRecord(), CONFIG_KEY: ConfigRecord({SERVER_ROUND: 1})})


def is_legacy_client(app: ClientApp) -> bool:
    """``ClientApp(client_fn=...)``: Flower routes every message to a NumPyClient / Client (legacy layout)."""
    return getattr(app, "_call", None) is not None


def peer_context(spec: AppSpec, run_id: int, peer_id: str, index: int, num_peers: int) -> Context:
    """The Context a peer's app runs in: node_config ``partition-id``, ``num-partitions``, ``peer-id``."""
    return Context(run_id=run_id, node_id=index + 1,
                   node_config={"partition-id": index, "num-partitions": num_peers, "peer-id": peer_id},
                   state=RecordDict(), run_config=dict(spec.config))


def positional_state(arrays: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """A legacy model (an unnamed list) as a state: each array named by its position, ``"0"`` .. ``"n-1"``.

    The names Flower itself gives such a list (``parameters_to_arrayrecord``); ``sharing.personal``
    names these entries by index.
    """
    return {str(i): torch.from_numpy(np.array(a, copy=True)) for i, a in enumerate(arrays)}


def app_start(spec: AppSpec, seed: int, num_peers: int, first_peer: str = "0") -> AppStart:
    """The initial state and message contents of a run (every peer gets the same; see ``AppStart``).

    Where each comes from, first found wins. The initial model: ``app_init`` (called under
    ``torch.manual_seed(seed)``; for a legacy app also the way to give its list state_dict names),
    else the ServerApp's ``initial_arrays`` (Message API) or its strategy's ``initial_parameters``
    (legacy), else, for a legacy ClientApp, its own ``get_parameters`` on the first peer under
    ``torch.manual_seed(seed)`` (what Flower's legacy server asks one client). The train config: the
    ServerApp's round-1 train message, or the legacy strategy's ``configure_fit`` (its
    ``on_fit_config_fn``) of each round, with ``app_train_config`` on top.
    """
    client = load_client_app(spec.app, source=spec.source, key=spec.key("clientapp"))  # refused before anything
    legacy_client = is_legacy_client(client)
    captured = legacy = None
    server = load_server_app(spec.server, source=spec.source, key=spec.key("serverapp")) if spec.server else None
    if server is not None:
        from p2pfl.flower.capture import capture_legacy_server, capture_server_start, is_legacy_server

        old = is_legacy_server(server)
        try:
            if old:
                legacy = capture_legacy_server(server, dict(spec.config), run_id=seed, seed=seed, num_nodes=num_peers)
            else:
                captured = capture_server_start(server, dict(spec.config), run_id=seed, seed=seed, num_nodes=num_peers)
        except Exception as exc:  # noqa: BLE001 - the app's own code failed: one line naming it
            what = "the ServerApp's server_fn failed" if old else "the ServerApp failed before its first round"
            raise AppError(f"{what}: {type(exc).__name__}: {shorten(str(exc), 300)}",
                           source=spec.source, key=spec.key("serverapp")) from None
    if spec.init:
        state = initial_state(spec, seed)
    elif captured is not None and captured.arrays is not None:
        state = as_state(captured.arrays, "the ServerApp's initial arrays")
    elif captured is not None:
        raise AppError("the ServerApp sent no initial model before its first round; name one with app_init",
                       source=spec.source, key=spec.key("serverapp"))
    elif legacy is not None and legacy.initial is not None:
        state = positional_state(legacy.initial)
    elif legacy_client:
        state = positional_state(_client_parameters(client, spec, seed, num_peers, first_peer))
    else:
        raise AppError("missing: name the initial model, e.g. 'mypackage.task:Net'", key="app_init")
    train = captured.train if captured is not None and captured.train is not None else _default_content()
    evaluate = captured.evaluate if captured is not None and captured.evaluate is not None else _default_content()
    if spec.train_config:
        train = _with_config(train, spec.train_config)
    return AppStart(state, train, evaluate, legacy_server=legacy, legacy_client=legacy_client,
                    train_overrides=dict(spec.train_config))


def _client_parameters(client: ClientApp, spec: AppSpec, seed: int, num_peers: int, peer_id: str) -> list[np.ndarray]:
    """A legacy ClientApp's ``get_parameters`` on the first peer, under ``torch.manual_seed(seed)``."""
    msg = instruction(get_parameters_content(), MessageTypeLegacy.GET_PARAMETERS, run_id=seed,
                      src_node_id=PEER_NODE_ID, dst_node_id=1, message_id=f"{peer_id}/init/get_parameters")
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            reply = client(msg, peer_context(spec, seed, peer_id, 0, num_peers))
        if reply.has_error():
            raise ValueError(reply.error.reason)
        arrays = legacy_reply(MessageTypeLegacy.GET_PARAMETERS, reply.content).arrays
    except Exception as exc:  # noqa: BLE001 - the app's own code failed: one line naming it
        raise AppError(f"missing: no ServerApp strategy gives initial_parameters and the ClientApp's "
                       f"get_parameters failed ({type(exc).__name__}: {shorten(str(exc), 200)}); name the "
                       "initial model, e.g. 'mypackage.task:Net'", key="app_init") from None
    if not arrays:
        raise AppError("missing: no ServerApp strategy gives initial_parameters and the ClientApp's get_parameters "
                       "returned none; name the initial model, e.g. 'mypackage.task:Net'", key="app_init")
    return arrays


def _with_config(content: RecordDict, values: Mapping[str, Any]) -> RecordDict:
    """``content`` with ``values`` set in its config record (``app_train_config``: explicit overrides)."""
    out = RecordDict()
    configs = [k for k, v in content.items() if isinstance(v, ConfigRecord)]
    target = CONFIG_KEY if CONFIG_KEY in configs or not configs else configs[0]
    for k, v in content.items():
        out[k] = ConfigRecord({**dict(v), **values}) if k == target else v
    if target not in out:
        out[target] = ConfigRecord({**dict(values), SERVER_ROUND: 1})
    return out


def initial_state(spec: AppSpec, seed: int) -> dict[str, torch.Tensor]:
    """The one initial state every peer starts from: ``app_init`` called under ``torch.manual_seed(seed)``.

    ``app_init`` may be an ``nn.Module`` class or factory (its ``state_dict()`` is used), or a
    callable returning a state dict or an ``ArrayRecord``.
    """
    if not spec.init:
        raise AppError("missing: name the initial model, e.g. 'mypackage.task:Net'", key="app_init")
    make = load_object(spec.init, "app_init")
    if not callable(make):
        raise AppError(f"{spec.init!r} is not callable", key="app_init")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        made = make()
    return as_state(made, repr(spec.init))


def carrier_module(layout: ParamLayout) -> nn.Module:
    """A module whose ``named_parameters()`` are exactly the layout's names (nested as the dots say).

    The Node binds a peer's flat buffer into a borrowed model before training and evaluating; for
    a ClientApp peer that model only carries the tensors (the app brings its own network).
    """
    root = nn.Module()
    for s in layout.specs:
        *path, leaf = s.name.split(".")
        mod = root
        for part in path:
            child = mod._modules.get(part)
            if child is None:
                child = nn.Module()
                mod.add_module(part, child)
            mod = child
        mod.register_parameter(leaf, nn.Parameter(torch.zeros(s.shape), requires_grad=False))
    return root


class ClientAppAlgorithm(Algorithm):
    """The Algorithm seam over a ClientApp: train = one train Message; mixing = the default pull rule.

    One instance per peer (``bind_peer``); it owns the peer's ``Context``. An unbound instance
    only answers what goes on the wire (what ``p2pfl node`` asks before the peer exists).
    """

    name = NAME
    shares = "shared"
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, spec: AppSpec, state: AppLayout, start: AppStart, *, run_id: int) -> None:
        super().__init__({}, state.layout)
        self.spec = spec
        self.state_layout = state
        self.start = start
        self.run_id = run_id
        self.app: ClientApp | None = None
        self.context: Context | None = None
        self.peer_id = ""
        self._state: PeerState | None = None  # the PeerState whose extra mirrors context.state
        self._round = 0

    @property
    def dtypes(self) -> dict[str, torch.dtype]:
        return self.state_layout.dtypes

    def bind_peer(self, peer_id: str, index: int, num_peers: int) -> None:
        """Load the app and give the peer its Context (node_config: partition-id, num-partitions, peer-id)."""
        self.app = load_client_app(self.spec.app, source=self.spec.source, key=self.spec.key("clientapp"))
        self.peer_id = peer_id
        self.context = peer_context(self.spec, self.run_id, peer_id, index, num_peers)

    # -- Context.state <-> PeerState.extra ------------------------------------------------------
    def init_state(self, state: PeerState, generator: torch.Generator) -> None:
        self.state_layout.init_extra(state.extra)
        self._save(state)

    def _sync(self, state: PeerState) -> None:
        """Adopt ``state`` (a resumed checkpoint brings a new PeerState): its extra is the Context's state."""
        if state is self._state:
            return
        assert self.context is not None
        self.context.state = tensors_to_state({k: v for k, v in state.extra.items() if is_state_tensor(k)})
        self._state = state

    def _save(self, state: PeerState) -> None:
        assert self.context is not None
        for k in [k for k in state.extra if is_state_tensor(k)]:
            del state.extra[k]
        state.extra.update(state_to_tensors(self.context.state))
        self._state = state

    # -- messages ----------------------------------------------------------------------------
    def call(self, message_type: str, mixed: Mapping[str, torch.Tensor], extra: Mapping[str, torch.Tensor],
             round: int) -> Message:
        """Hand the app one message: this round's state (``mixed`` and the held ``extra``) and config,
        in the layout its API expects (``AppStart.content``).

        ``server-round`` counts from 1, as Flower's strategies do.
        """
        assert self.app is not None and self.context is not None, "bind_peer first"
        self._seed_rngs(message_type, round)
        content = self.start.content(message_type, self.state_layout, mixed, extra, round + 1)
        msg = instruction(content, message_type, run_id=self.run_id, src_node_id=PEER_NODE_ID,
                          dst_node_id=self.context.node_id, message_id=f"{self.peer_id}/{round}/{message_type}",
                          group_id=str(round + 1))
        reply = self.app(msg, self.context)
        if not isinstance(reply, Message):
            raise AppReplyError(f"peer {self.peer_id}: the app's {message_type} handler returned "
                                f"{type(reply).__name__}, not a Message")
        if reply.has_error():
            raise AppReplyError(f"peer {self.peer_id}: the app's {message_type} reply is an error: "
                                f"{reply.error.reason}")
        return reply

    def _seed_rngs(self, message_type: str, round: int) -> None:
        """Seed torch's and numpy's process-wide RNGs from (run seed, peer, round, message type).

        An app draws from them (``DataLoader(shuffle=True)``, dropout, ``np.random``); the peers of
        one simulate worker share them, a launched peer has its own. Seeded before every message,
        an app's draws are a function of the peer and the round: two runs with one seed agree, in
        any mode, and a resumed peer draws what it would have drawn.
        """
        index = int(self.context.node_id) if self.context is not None else 0
        seed = (self.run_id * 1_000_003 + index * 7919 + round * 104_729
                + (0 if message_type == MessageType.TRAIN else 1)) % (2**63 - 1)
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)

    def _legacy(self, message_type: str, reply: Message) -> LegacyReply:
        try:
            return legacy_reply(message_type, reply.content)
        except ValueError as exc:
            raise AppReplyError(f"peer {self.peer_id}: the app's {message_type} reply: {exc}") from None

    def local_update(self, state: PeerState, ctx: TrainContext, round: int) -> dict[str, float]:
        self._sync(state)
        self._round = round
        reply = self.call(MessageType.TRAIN, self.layout.views(state.params), state.extra, round)
        what = f"peer {self.peer_id}: train reply"
        try:
            if self.start.legacy_client:
                res = self._legacy(MessageType.TRAIN, reply)
                self.state_layout.load_arrays(res.arrays, state.params, state.extra, what)
                metrics = res.metrics
            else:
                recs = list(reply.content.array_records.values())
                if len(recs) != 1:
                    raise AppReplyError(f"{what} must hold one ArrayRecord, it holds {len(recs)}")
                self.state_layout.load(recs[0], state.params, state.extra, what)
                metrics = message_metrics(reply)
        except ValueError as exc:
            raise AppReplyError(str(exc)) from None
        self._save(state)
        return train_columns(metrics)

    def evaluate(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """Send the app an evaluate Message; its metrics, plus ``acc``/``loss`` for the run folder's columns."""
        extra = self._state.extra if self._state is not None else {}
        reply = self.call(MessageType.EVALUATE, tensors, extra, self._round)
        if self._state is not None:
            self._save(self._state)
        metrics = self._legacy(MessageType.EVALUATE, reply).metrics if self.start.legacy_client else message_metrics(reply)
        return with_acc_loss(metrics)  # type: ignore[return-value]


@dataclass
class ClientAppEvaluator:
    """What the Node calls to evaluate a ClientApp peer (the PeerApp role): an evaluate Message.

    ``data`` is None: the app owns its data (it reads ``partition-id`` from its Context).
    """

    algorithm: ClientAppAlgorithm
    data: Any = None

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Evaluate the tensors the Node bound into ``model`` (the peer's post-mixing state)."""
        params = dict(model.named_parameters())
        return self.algorithm.evaluate({s.name: params[s.name].data for s in self.algorithm.layout.specs})
