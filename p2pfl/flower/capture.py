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
