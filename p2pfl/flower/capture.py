"""What a Flower App's own ServerApp would send its ClientApps in round 1, without running a round.

A Flower App's ServerApp decides the model every client starts from and the train config it sends
(the template's ``strategy.start(grid, initial_arrays=..., train_config=ConfigRecord({"lr": lr}))``).
Run peer to peer there is no server, but the peers should start from that same model and get that
same config, so the app runs unmodified. ``capture_server_start`` calls the ServerApp's ``main``
against a Grid that reaches no one, with ``Strategy.start`` replaced for the duration by a
stand-in that asks the strategy itself to configure round 1 (``configure_train`` and
``configure_evaluate``: the strategy's own record keys, ``server-round`` and config), records the
contents, and stops the ServerApp before anything else happens. No round runs, no network is
touched, no ``evaluate_fn`` is called, and a ServerApp that sends messages itself (no strategy) is
caught at its first ``send_and_receive`` / ``push_messages``.

A legacy ServerApp (``ServerApp(server_fn=...)``) has no ``main`` to run: its ``server_fn`` is
called for the strategy, which is asked for its ``initial_parameters`` and, each round, for the
config its ``configure_fit`` / ``configure_evaluate`` would send (``LegacyServer``).

Side effects are contained: the initial model is built under ``torch.manual_seed(seed)`` with the
caller's torch, numpy and ``random`` states restored afterwards (Flower's strategies sample nodes
with ``random``), Flower's process identity (``TaskIdentity``) is put back, and Flower's INFO logs
of the aborted start are held back.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.server.client_manager import ClientManager, SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from p2pfl.flower.records import ARRAYS_KEY, CONFIG_KEY, SERVER_ROUND

SERVER_NODE_ID = 1  # Flower's SUPERLINK_NODE_ID: the node a ServerApp runs as
_lock = threading.Lock()  # Strategy.start and TaskIdentity are process-wide


class _Stop(BaseException):  # noqa: N818 - private control flow, never seen outside this module
    """Raised inside the ServerApp once round 1 is configured: nothing after it may run.

    A BaseException, so an app's own ``except Exception`` does not swallow it.
    """


@dataclass(frozen=True)
class ServerStart:
    """What the ServerApp would send: the initial model and the round-1 train / evaluate contents.

    ``train``/``evaluate`` are whole message contents (the strategy's record keys, its config
    records with ``server-round``); None where the ServerApp did not get that far.
    """

    arrays: ArrayRecord | None
    train: RecordDict | None
    evaluate: RecordDict | None


class CapturingGrid(Grid):
    """A Grid with ``num_nodes`` nodes that delivers nothing: the first messages sent are recorded."""

    def __init__(self, run_id: int, num_nodes: int) -> None:
        self._run = Run.create_empty(run_id)
        self.num_nodes = num_nodes
        self.sent: list[Message] = []

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id,
                       **({} if ttl is None else {"ttl": ttl}))

    def get_node_ids(self) -> Iterable[int]:
        return list(range(SERVER_NODE_ID + 1, SERVER_NODE_ID + 1 + self.num_nodes))

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        self.sent = list(messages)
        raise _Stop

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise _Stop

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.push_messages(messages)


def _content(arrays: ArrayRecord, config: ConfigRecord | None) -> RecordDict:
    """What Flower's FedAvg would send: the arrays and the config with ``server-round``."""
    return RecordDict({ARRAYS_KEY: arrays, CONFIG_KEY: ConfigRecord({**dict(config or {}), SERVER_ROUND: 1})})


def _first_content(messages: Iterable[Message]) -> RecordDict | None:
    first = next(iter(messages), None)
    return None if first is None else first.content


def capture_server_start(app: ServerApp, run_config: dict[str, Any], *, run_id: int, seed: int,
                         num_nodes: int) -> ServerStart:
    """Run ``app``'s ``main`` up to its first round and return what it would send (module docstring).

    Exceptions of the ServerApp itself propagate (the caller names the component); a ServerApp that
    returns without sending anything gives an empty ``ServerStart``.
    """
    grid = CapturingGrid(run_id, num_nodes)
    found: dict[str, Any] = {}

    def start(self: Strategy, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Any = None) -> Any:
        found["arrays"] = initial_arrays
        # Enough nodes for the strategy's minimums, so its sampling never waits for more to connect.
        need = [getattr(self, k, 0) for k in ("min_available_nodes", "min_train_nodes", "min_evaluate_nodes")]
        grid = CapturingGrid(run_id, max([num_nodes, *[n for n in need if isinstance(n, int)]]))
        # A strategy that samples no one (fraction 0) still says what its config would be.
        found["train"] = _first_content(self.configure_train(1, initial_arrays, ConfigRecord(dict(train_config or {})),
                                                             grid)) or _content(initial_arrays, train_config)
        found["evaluate"] = _first_content(self.configure_evaluate(
            1, initial_arrays, ConfigRecord(dict(evaluate_config or {})), grid)) or _content(initial_arrays,
                                                                                                evaluate_config)
        raise _Stop

    context = Context(run_id=run_id, node_id=SERVER_NODE_ID, node_config={}, state=RecordDict(),
                      run_config=dict(run_config))
    with _lock, _contained(seed, run_id), _patched(Strategy, "start", start):
        try:
            app(grid, context)
        except _Stop:
            pass
        except Exception:
            if not found and not grid.sent:  # it failed before saying anything: the caller names it
                raise
    if "arrays" not in found and grid.sent:  # a ServerApp that sends its own messages
        content = grid.sent[0].content
        train = content if grid.sent[0].metadata.message_type == MessageType.TRAIN else None
        recs = list(content.array_records.values())
        return ServerStart(recs[0] if len(recs) == 1 else None, train, None)
    return ServerStart(found.get("arrays"), found.get("train"), found.get("evaluate"))


# -- a legacy ServerApp (server_fn / ServerAppComponents, flwr.server.strategy) ------------------------
class _Proxy(ClientProxy):
    """A client the legacy strategy can sample; it is never asked anything (configure_* only picks it)."""

    def get_properties(self, ins: Any, timeout: float | None, group_id: int | None) -> Any:
        raise _Stop

    get_parameters = fit = evaluate = reconnect = get_properties


class _Clients(SimpleClientManager):
    """``num`` registered clients; ``wait_for`` never blocks (a strategy wanting more gets an empty sample)."""

    def __init__(self, num: int) -> None:
        super().__init__()
        for i in range(num):
            self.register(_Proxy(str(i)))

    def wait_for(self, num_clients: int, timeout: int = 0) -> bool:
        return len(self.clients) >= num_clients


@dataclass
class LegacyServer:
    """A legacy ServerApp's strategy, asked what it would send in any round without running one.

    ``initial``: the strategy's ``initialize_parameters`` (its ``initial_parameters``), decoded, or
    None (Flower's server would then ask one client's ``get_parameters``). ``config(type, round)``:
    the config of the FitIns / EvaluateIns the strategy's ``configure_fit`` / ``configure_evaluate``
    builds for that round (so ``on_fit_config_fn(round)`` and a strategy's own keys, e.g. FedProx's
    ``proximal_mu``), asked per round because ``on_fit_config_fn`` may depend on it.
    """

    strategy: Any
    initial: list[np.ndarray] | None
    clients: ClientManager
    seed: int

    def config(self, message_type: str, server_round: int) -> dict[str, Any]:
        from flwr.common import Parameters

        train = message_type == MessageType.TRAIN
        configure = self.strategy.configure_fit if train else self.strategy.configure_evaluate
        with _lock, _rng_kept(self.seed + server_round):
            pairs = configure(server_round, Parameters(tensors=[], tensor_type=""), self.clients)
            if pairs:
                return dict(pairs[0][1].config)
            # Sampling no one (fraction_evaluate=0): its config function still says what it would send.
            fn = getattr(self.strategy, "on_fit_config_fn" if train else "on_evaluate_config_fn", None)
            return dict(fn(server_round)) if callable(fn) else {}


def capture_legacy_server(app: ServerApp, run_config: dict[str, Any], *, run_id: int, seed: int,
                          num_nodes: int) -> LegacyServer:
    """Build a legacy ServerApp's strategy (``server_fn(context)``, or the deprecated constructor arguments).

    No server loop runs: the strategy is only asked for its initial parameters here and for each
    round's config later (``LegacyServer``). Without a strategy Flower's server uses ``FedAvg()``; so
    does this. Exceptions of ``server_fn`` propagate (the caller names the component).
    """
    from flwr.common import parameters_to_ndarrays
    from flwr.server.strategy import FedAvg

    context = Context(run_id=run_id, node_id=SERVER_NODE_ID, node_config={}, state=RecordDict(),
                      run_config=dict(run_config))
    with _lock, _contained(seed, run_id):
        server_fn = getattr(app, "_server_fn", None)
        if server_fn is not None:
            components = server_fn(context)
            strategy, server = getattr(components, "strategy", None), getattr(components, "server", None)
        else:
            strategy, server = getattr(app, "_strategy", None), getattr(app, "_server", None)
        if strategy is None and server is not None:
            strategy = getattr(server, "strategy", None)
        strategy = strategy if strategy is not None else FedAvg()
        need = [getattr(strategy, k, 0) for k in ("min_available_clients", "min_fit_clients", "min_evaluate_clients")]
        clients = _Clients(max([num_nodes, *[n for n in need if isinstance(n, int)]]))
        params = strategy.initialize_parameters(client_manager=clients)
        initial = parameters_to_ndarrays(params) if params is not None and params.tensors else None
    return LegacyServer(strategy, initial, clients, seed)


def is_legacy_server(app: ServerApp) -> bool:
    """A ServerApp without ``@app.main()``: Flower runs its legacy server loop with a strategy."""
    return getattr(app, "_main", None) is None


@contextmanager
def _rng_kept(seed: int) -> Iterator[None]:
    """``random`` seeded for a strategy's sampling and the caller's state put back (peers' own RNG use is theirs)."""
    state = random.getstate()
    log = logging.getLogger("flwr")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        random.seed(seed)
        yield
    finally:
        random.setstate(state)
        log.setLevel(level)


@contextmanager
def _patched(owner: type, name: str, value: Any) -> Iterator[None]:
    old = owner.__dict__[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


@contextmanager
def _contained(seed: int, run_id: int) -> Iterator[None]:
    """Seeded RNGs, Flower's process identity and quiet Flower logs for the duration; all restored after."""
    py_state, np_state = random.getstate(), np.random.get_state()
    identity = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    log = logging.getLogger("flwr")
    level = log.level
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run_id, SERVER_NODE_ID
    log.setLevel(logging.WARNING)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed % 2**32)
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = identity
        log.setLevel(level)
