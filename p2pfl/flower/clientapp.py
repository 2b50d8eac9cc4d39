"""A user's Flower ClientApp as a peer of the decentralized round loop.

A config names the app instead of a built-in algorithm::

    app: peers.quickstart:app            # a flwr.clientapp.ClientApp
    app_init: peers.quickstart:Net       # the initial model (every peer starts from the same one)
    app_config: {lr: 0.05, local-epochs: 1}   # -> context.run_config
    sharing: {personal: [fc3.]}          # state-dict key prefixes that never leave the peer

Each round the Node calls ``ClientAppAlgorithm.local_update``, which sends the app a train
``Message`` holding ``"arrays"`` (the full state: the mixed shared part plus the peer's own
personal part) and ``"config"`` (``server-round``), and copies the returned arrays back. The
Node then gossips the shared keys with the topology's weights (the Algorithm's default pull
mixing) and evaluates through ``ClientAppEvaluator``, which sends an evaluate ``Message``.

Why an ``Algorithm`` and not a second round loop: the Node already does exchange, quorum,
records and checkpoints in every mode (simulate, launch, node, compose); the adapter plugs into
its seam, so a ClientApp peer gets all of that unchanged. The model's state dict becomes a flat
``[shared | personal]`` buffer (``app_layout``), as for the built-in models, so the transport,
wire codec and mixing see nothing new. ``context.state`` travels in ``PeerState.extra`` as
tensors plus one JSON document (``records.state_to_tensors``), so it is checkpointed (no
pickle) and restored with the peer.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from p2pfl.algorithms.base import Algorithm, PeerState, TrainContext
from p2pfl.flower.records import (
    ARRAYS_KEY,
    CONFIG_KEY,
    array_record,
    instruction,
    is_state_tensor,
    load_arrays,
    message_metrics,
    state_to_tensors,
    tensors_to_state,
    train_columns,
    with_acc_loss,
)
from p2pfl.models.layout import ParamLayout

NAME = "clientapp"  # the algorithm name a ClientApp run records
PEER_NODE_ID = 0  # src of the messages a peer hands its own app (there is no server)


class AppError(ValueError):
    """A ClientApp config or a ClientApp reply is unusable; the message names the key or the tensor."""


@dataclass(frozen=True)
class AppSpec:
    """The ``app``/``app_init``/``app_config``/``sharing`` keys of a config."""

    app: str
    init: str
    config: Mapping[str, Any] = field(default_factory=dict)
    personal: tuple[str, ...] = ()

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any]) -> AppSpec:
        sharing = raw.get("sharing") or {}
        return cls(app=str(raw["app"]), init=str(raw.get("app_init") or ""), config=dict(raw.get("app_config") or {}),
                   personal=tuple(str(p) for p in sharing.get("personal") or ()))


def load_object(ref: str, key: str) -> Any:
    """``"package.module:attr"`` -> the object; a clear error naming the config key otherwise."""
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise AppError(f"{key}: {ref!r} is not 'package.module:attr'")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as exc:
        raise AppError(f"{key}: cannot import module {module!r} ({exc})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AppError(f"{key}: module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def load_client_app(ref: str) -> ClientApp:
    app = load_object(ref, "app")
    if not isinstance(app, ClientApp):
        raise AppError(f"app: {ref!r} is a {type(app).__name__}, not a flwr.clientapp.ClientApp")
    return app


def initial_state(spec: AppSpec, seed: int) -> dict[str, torch.Tensor]:
    """The one initial state every peer starts from: ``app_init`` called under ``torch.manual_seed(seed)``.

    ``app_init`` may be an ``nn.Module`` class or factory (its ``state_dict()`` is used), or a
    callable returning a state dict or an ``ArrayRecord``.
    """
    if not spec.init:
        raise AppError("app_init: missing: name the initial model, e.g. 'mypackage.task:Net'")
    make = load_object(spec.init, "app_init")
    if not callable(make):
        raise AppError(f"app_init: {spec.init!r} is not callable")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        made = make()
    if isinstance(made, nn.Module):
        state = made.state_dict()
    elif isinstance(made, ArrayRecord):
        state = made.to_torch_state_dict()
    elif isinstance(made, Mapping):
        state = dict(made)
    else:
        raise AppError(f"app_init: {spec.init!r} returned a {type(made).__name__}, "
                       "not an nn.Module, a state dict or an ArrayRecord")
    return {k: torch.as_tensor(v).detach().clone() for k, v in state.items()}


def app_layout(state: Mapping[str, torch.Tensor], personal: Sequence[str]) -> tuple[ParamLayout, torch.Tensor,
                                                                                      dict[str, torch.dtype]]:
    """The flat ``[shared | personal]`` layout of a state dict: shared keys first, each part in state order.

    A key is personal when it starts with one of the ``sharing.personal`` prefixes. Returns the
    layout, the flat float32 buffer and each tensor's own dtype (restored when the app gets it).
    """
    for p in personal:
        if not any(k.startswith(p) for k in state):
            raise AppError(f"sharing.personal: prefix {p!r} matches no key of the app's state "
                           f"({', '.join(list(state)[:8])}{', ...' if len(state) > 8 else ''})")
    dtypes: dict[str, torch.dtype] = {}
    for k, v in state.items():
        if not v.is_floating_point():
            raise AppError(f"app_init: state tensor {k!r} has dtype {v.dtype}: only floating-point "
                           "tensors can be gossiped or mixed")
        dtypes[k] = v.dtype
    is_personal = {k: any(k.startswith(p) for p in personal) for k in state}
    shared = [k for k in state if not is_personal[k]]
    own = [k for k in state if is_personal[k]]
    if not shared:
        raise AppError("sharing.personal: every tensor is personal; nothing would be gossiped")
    layout = ParamLayout.from_shapes({k: tuple(v.shape) for k, v in state.items()}, shared, own)
    flat = torch.cat([state[s.name].reshape(-1).to(torch.float32) for s in layout.specs])
    return layout, flat, dtypes


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

    def __init__(self, spec: AppSpec, layout: ParamLayout, dtypes: Mapping[str, torch.dtype], *, run_id: int) -> None:
        super().__init__({}, layout)
        self.spec = spec
        self.dtypes = dict(dtypes)
        self.run_id = run_id
        self.app: ClientApp | None = None
        self.context: Context | None = None
        self.peer_id = ""
        self._state: PeerState | None = None  # the PeerState whose extra mirrors context.state
        self._round = 0

    def bind_peer(self, peer_id: str, index: int, num_peers: int) -> None:
        """Load the app and give the peer its Context (node_config: partition-id, num-partitions, peer-id)."""
        self.app = load_client_app(self.spec.app)
        self.peer_id = peer_id
        self.context = Context(run_id=self.run_id, node_id=index + 1,
                               node_config={"partition-id": index, "num-partitions": num_peers, "peer-id": peer_id},
                               state=RecordDict(), run_config=dict(self.spec.config))

    # -- Context.state <-> PeerState.extra ------------------------------------------------------
    def init_state(self, state: PeerState, generator: torch.Generator) -> None:
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
    def call(self, message_type: str, arrays: ArrayRecord, round: int) -> Message:
        """Hand the app one message (``server-round`` counts from 1, as Flower's strategies do)."""
        assert self.app is not None and self.context is not None, "bind_peer first"
        content = RecordDict({ARRAYS_KEY: arrays, CONFIG_KEY: ConfigRecord({"server-round": round + 1})})
        msg = instruction(content, message_type, run_id=self.run_id, src_node_id=PEER_NODE_ID,
                          dst_node_id=self.context.node_id, message_id=f"{self.peer_id}/{round}/{message_type}",
                          group_id=str(round + 1))
        reply = self.app(msg, self.context)
        if not isinstance(reply, Message):
            raise AppError(f"peer {self.peer_id}: the app's {message_type} handler returned "
                           f"{type(reply).__name__}, not a Message")
        if reply.has_error():
            raise AppError(f"peer {self.peer_id}: the app's {message_type} reply is an error: {reply.error.reason}")
        return reply

    def arrays_of(self, flat: torch.Tensor) -> ArrayRecord:
        return array_record(self.layout.views(flat), self.dtypes)

    def local_update(self, state: PeerState, ctx: TrainContext, round: int) -> dict[str, float]:
        self._sync(state)
        self._round = round
        reply = self.call(MessageType.TRAIN, self.arrays_of(state.params), round)
        recs = list(reply.content.array_records.values())
        if len(recs) != 1:
            raise AppError(f"peer {self.peer_id}: a train reply must hold one ArrayRecord, it holds {len(recs)}")
        load_arrays(self.layout.specs, recs[0], state.params, f"peer {self.peer_id}: train reply")
        self._save(state)
        return train_columns(message_metrics(reply))

    def evaluate(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """Send the app an evaluate Message; its metrics, plus ``acc``/``loss`` for the run folder's columns."""
        reply = self.call(MessageType.EVALUATE, array_record(tensors, self.dtypes), self._round)
        if self._state is not None:
            self._save(self._state)
        return with_acc_loss(message_metrics(reply))  # type: ignore[return-value]


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
