"""In-memory transport for the single-host simulation.

A board keyed by (sender, round, step) plays the role of every peer's gRPC service: publishing
is storing, pulling is waiting on a condition until the key is present. A message is dropped
once every peer that will read it has done so, so memory stays bounded.

When the simulation runs peers in several worker processes, each process has its own board and
a ``forward`` callback carries a message to the other processes whose peers read it (the
simulation's bridge); the board then only counts its local readers.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from p2pfl.messages import Message
from p2pfl.topology import MixingPlan
from p2pfl.transport.base import ExchangeResult, Transport, TransportError
from p2pfl.wire.codec import wire_size

log = logging.getLogger(__name__)

HEADER_BYTES = 64  # the batched engine's fixed per-message header estimate (this transport counts exactly)



class MemoryHub:
    """The board all in-memory transports of one simulation share.

    A reader waiting for keys registers an event under each missing key; storing a message wakes
    the readers of that key only. (One condition notified on every store woke all of a worker's
    peer threads for each message, and each went back to sleep: a herd of futile wake-ups.)
    """

    def __init__(self, local_peers: set[str] | None = None,
                 forward: Callable[[Message, list[str]], None] | None = None) -> None:
        self.local_peers = local_peers  # None: every peer is local (one process)
        self.forward = forward
        self._lock = threading.Lock()
        self._board: dict[tuple[str, int, int], tuple[Message, int]] = {}
        self._waiters: dict[tuple[str, int, int], list[threading.Event]] = {}
        self._aborted: str | None = None

    def publish(self, message: Message, readers: list[str]) -> None:
        """Offer ``message`` to ``readers`` (peer ids); remote readers get it through ``forward``."""
        if self.local_peers is not None:
            remote = [p for p in readers if p not in self.local_peers]
            if remote and self.forward is not None:
                self.forward(message, remote)
            readers = [p for p in readers if p in self.local_peers]
        self.put(message, len(readers))

    def put(self, message: Message, count: int) -> None:
        """Store ``message`` for ``count`` local reads."""
        if count <= 0:
            return
        key = (message.sender, message.round, message.step)
        with self._lock:
            self._board[key] = (message, count)
            waiters = self._waiters.pop(key, ())
        for ev in waiters:
            ev.set()

    def take(self, keys: list[tuple[str, int, int]], deadline: float) -> dict[str, Message]:
        """Wait for ``keys`` until ``deadline`` (monotonic); return those present."""
        out: dict[str, Message] = {}
        ev: threading.Event | None = None
        while True:
            with self._lock:
                if self._aborted:
                    raise TransportError(f"simulation aborted: {self._aborted}")
                missing = []
                for key in keys:
                    if key[0] in out:
                        continue
                    if key in self._board:
                        msg, left = self._board[key]
                        out[key[0]] = msg
                        if left <= 1:
                            del self._board[key]
                        else:
                            self._board[key] = (msg, left - 1)
                    else:
                        missing.append(key)
                if not missing:
                    return out
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._forget(ev, missing)
                    return out
                if ev is None:
                    ev = threading.Event()
                else:
                    ev.clear()
                for key in missing:
                    lst = self._waiters.setdefault(key, [])
                    if ev not in lst:
                        lst.append(ev)
            ev.wait(timeout=min(remaining, 1.0))

    def _forget(self, ev: threading.Event | None, keys: list[tuple[str, int, int]]) -> None:
        """Unregister ``ev`` from ``keys`` (a reader that gave up); call with the lock held."""
        if ev is None:
            return
        for key in keys:
            lst = self._waiters.get(key)
            if lst and ev in lst:
                lst.remove(ev)
                if not lst:
                    del self._waiters[key]

    def abort(self, reason: str) -> None:
        """Wake every waiter with an error (a peer thread failed)."""
        with self._lock:
            self._aborted = reason
            waiters = [ev for lst in self._waiters.values() for ev in lst]
            self._waiters.clear()
        for ev in waiters:
            ev.set()

    def __len__(self) -> int:
        with self._lock:
            return len(self._board)


class MemoryTransport(Transport):
    def __init__(self, hub: MemoryHub, peer_id: str) -> None:
        self.hub = hub
        self.peer_id = peer_id

    def exchange(self, message: Message, plan: MixingPlan, deadline_s: float) -> ExchangeResult:
        # Exactly the bytes gRPC would carry: the codec's own size of this message (headers included).
        size = wire_size(message, self.chunk_bytes)
        readers = list(plan.out_weights)
        self.hub.publish(message, readers)
        keys = [(j, message.round, message.step) for j in plan.in_weights]
        got = self.hub.take(keys, time.monotonic() + deadline_s)
        for j in [j for j, m in got.items() if not _finite(m)]:
            # The gRPC receiver refuses NaN/Inf payloads; so does the simulation (same results).
            log.warning("%s round %d step %d: payload from %s rejected: NaN or Inf values",
                        self.peer_id, message.round, message.step, j)
            del got[j]
        missing = [j for j in plan.in_weights if j not in got]
        recv = sum(wire_size(m, self.chunk_bytes) for m in got.values())
        return ExchangeResult(received=got, missing=missing, bytes_sent=size * len(readers), bytes_recv=recv)


def _finite(msg: Message) -> bool:
    from p2pfl.wire.validate import all_finite

    return all(math.isfinite(v) for v in msg.scalars.values()) and all_finite(msg.flat.detach().cpu().numpy())
