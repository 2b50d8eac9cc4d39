"""In-memory transport for the single-host simulation.

A board keyed by (sender, round, step) plays the role of every peer's gRPC service: publishing
is storing, pulling is waiting on a condition until the key is present. A message is dropped
once every peer that will read it has done so, so memory stays bounded.

When the simulation shards peers over several ranks (processes), each rank has its own board and
a ``forward`` callback hands a message for peers of other ranks to the simulation, which sends its
wire frames at the next exchange step (``p2pfl/engine/exact.py``); the board then only counts its
local readers.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from p2pfl.payload import Payload
from p2pfl.topology import MixingPlan
from p2pfl.transport.base import ExchangeResult, Transport, TransportError
from p2pfl.wire.codec import wire_size

if TYPE_CHECKING:
    from p2pfl.turns import Turns

log = logging.getLogger(__name__)

HEADER_BYTES = 64  # the batched engine's fixed per-message header estimate (this transport counts exactly)



class _Reader:
    """A reader waiting for several keys: woken once (``wake``), when the last of them is stored.

    ``armed`` (changed under the hub's lock) says a wake-up may still come; whoever disarms it
    (the store that completes it, an abort, or the reader giving up) decides whether it does.
    """

    __slots__ = ("missing", "armed", "wake")

    def __init__(self, wake: Callable[[], None]) -> None:
        self.missing = 0
        self.armed = False
        self.wake = wake


class MemoryHub:
    """The board all in-memory transports of one simulation share.

    A reader waiting for keys registers under each missing key and counts them; storing a
    message counts down its readers and wakes those that now have everything. (One condition
    notified on every store woke all of a worker's peers for each message, a herd of futile
    wake-ups; waking a reader per message still woke a ring peer twice per exchange, once to find
    its other neighbour missing: each wake-up is a thread switch the GIL makes costly.)
    """

    def __init__(self, local_peers: set[str] | None = None,
                 forward: Callable[[Payload, list[str], int], None] | None = None) -> None:
        self.local_peers = local_peers  # None: every peer is local (one process)
        self.forward = forward
        self._lock = threading.Lock()
        # key -> (message, local reads left, its wire size, whether its values are all finite):
        # both computed once per board, when stored (the payload is then still in the cache)
        self._board: dict[tuple[str, int, int], tuple[Payload | None, int, int, bool]] = {}
        self._waiters: dict[tuple[str, int, int], list[_Reader]] = {}
        self._aborted: str | None = None

    def publish(self, message: Payload, readers: list[str], size: int | None = None) -> None:
        """Offer ``message`` to ``readers`` (peer ids); remote readers get it through ``forward``.

        ``size``: the message's wire size if the caller has it (`take` hands it to the readers).
        """
        if size is None:
            size = wire_size(message)
        if self.local_peers is not None:
            remote = [p for p in readers if p not in self.local_peers]
            if remote and self.forward is not None:
                self.forward(message, remote, size)
            readers = [p for p in readers if p in self.local_peers]
        self.put(message, len(readers), size)

    def put(self, message: Payload, count: int, size: int | None = None) -> None:
        """Store ``message`` for ``count`` local reads (``size``: its wire size, computed here if not given)."""
        if count <= 0:
            return
        if size is None:
            size = wire_size(message)
        self._store((message.sender, message.round, message.step), message, count, size, _finite(message))

    def refuse(self, sender: str, round: int, step: int, count: int, size: int) -> None:
        """Record that ``sender``'s payload for (round, step) arrived and was refused (the decoder
        of the simulation's exchange step said why): its ``count`` local readers get it as rejected, as from a NaN payload."""
        if count > 0:
            self._store((sender, round, step), None, count, size, False)

    def _store(self, key: tuple[str, int, int], message: Payload | None, count: int, size: int, ok: bool) -> None:
        ready = []
        with self._lock:
            self._board[key] = (message, count, size, ok)
            for reader in self._waiters.pop(key, ()):
                if not reader.armed:
                    continue
                reader.missing -= 1
                if reader.missing <= 0:
                    reader.armed = False
                    ready.append(reader)
        for reader in ready:
            reader.wake()

    def take(self, keys: list[tuple[str, int, int]], deadline: float,
             sizes: dict[str, int] | None = None, rejected: set[str] | None = None) -> dict[str, Payload]:
        """Wait for ``keys`` until ``deadline`` (monotonic); return those present.

        ``sizes``, if given, receives each returned message's wire size (by sender), so readers do
        not size every message again (building its header was ~2% of a worker's CPU). A message
        with NaN or Inf values is not returned: its sender goes into ``rejected`` (if given), as
        the gRPC receiver refuses such a payload.
        """
        out: dict[str, Payload] = {}
        rejected = set() if rejected is None else rejected
        event = threading.Event()
        reader = _Reader(event.set)
        registered: list[tuple[str, int, int]] = []
        while True:
            event.clear()
            with self._lock:
                remaining = self._collect(keys, deadline, out, sizes, reader, registered, rejected)
            if remaining is None:
                return out
            event.wait(timeout=min(remaining, 1.0))

    def take_gated(self, keys: list[tuple[str, int, int]], deadline: float, sizes: dict[str, int] | None,
                   gate: Turns, priority: tuple, rejected: set[str] | None = None) -> dict[str, Payload]:
        """`take` for a peer whose turn it is in its worker (``gate``): the others run while it
        waits, and it returns (or raises) in its turn again.

        The reader is woken once: when its last message is stored, the storer (a peer of this
        worker, or the exchange step with other ranks) admits it to the line with ``priority``, and it runs on its
        turn. (Woken by its messages, it would only have gone back to waiting for its turn.)
        """
        out: dict[str, Payload] = {}
        rejected = set() if rejected is None else rejected
        ticket = gate.ticket()
        reader = _Reader(wake=lambda: gate.admit(priority, ticket))
        registered: list[tuple[str, int, int]] = []
        while True:  # every `wait` returns in this peer's turn, timed out or not
            with self._lock:
                remaining = self._collect(keys, deadline, out, sizes, reader, registered, rejected)
            if remaining is None:
                return out
            # Woken by its last message, an abort, or its deadline: no periodic wake-up (each was a
            # futile switch of a parked peer, once a second, tens per round at 10,000 peers).
            if gate.wait(ticket, remaining):
                continue  # admitted: its messages are stored (or the run aborted)
            with self._lock:  # timed out: stop any wake-up, unless one is already on its way
                coming = not reader.armed  # disarmed by the store that completed it, or an abort
                reader.armed = False
            if coming:
                gate.wait(ticket)  # take that admission now: a later one would wake a later wait

    def _collect(self, keys: list[tuple[str, int, int]], deadline: float, out: dict[str, Payload],
                 sizes: dict[str, int] | None, reader: _Reader, registered: list[tuple[str, int, int]],
                 rejected: set[str]) -> float | None:
        """Move the stored ``keys`` into ``out``; register ``reader`` for the missing ones.

        Call with the lock held. Returns None when the reader is done (all keys, or its deadline),
        else the seconds left. Raises if the simulation was aborted.
        """
        if self._aborted:
            raise TransportError(f"simulation aborted: {self._aborted}")
        reader.armed = False
        self._forget(reader, registered)
        registered.clear()
        missing = []
        for key in keys:
            if key[0] in out or key[0] in rejected:
                continue
            if key in self._board:
                msg, left, size, ok = self._board[key]
                if ok:
                    out[key[0]] = msg
                    if sizes is not None:
                        sizes[key[0]] = size
                else:
                    rejected.add(key[0])
                if left <= 1:
                    del self._board[key]
                else:
                    self._board[key] = (msg, left - 1, size, ok)
            else:
                missing.append(key)
        if not missing:
            return None
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        reader.missing = len(missing)
        reader.armed = True
        for key in missing:
            self._waiters.setdefault(key, []).append(reader)
        registered.extend(missing)
        return remaining

    def _forget(self, reader: _Reader, keys: list[tuple[str, int, int]]) -> None:
        """Unregister ``reader`` from those of ``keys`` not stored yet; call with the lock held."""
        for key in keys:
            lst = self._waiters.get(key)
            if lst and reader in lst:
                lst.remove(reader)
                if not lst:
                    del self._waiters[key]

    @property
    def aborted(self) -> str | None:
        """Why the simulation was aborted (`abort`), or None."""
        return self._aborted

    def abort(self, reason: str) -> None:
        """Wake every waiter with an error (a peer failed)."""
        with self._lock:
            self._aborted = reason
            waiters = {id(r): r for lst in self._waiters.values() for r in lst if r.armed}
            self._waiters.clear()
            for reader in waiters.values():
                reader.armed = False
        for reader in waiters.values():
            reader.wake()

    def __len__(self) -> int:
        with self._lock:
            return len(self._board)


class MemoryTransport(Transport):
    """``gate``: the worker's `Turns`, if its peers take turns (the simulation): the others run while
    this peer waits for its neighbours, and it queues again with priority (round, ``rank``)."""

    def __init__(self, hub: MemoryHub, peer_id: str, gate: Turns | None = None, rank: int = 0) -> None:
        self.hub = hub
        self.peer_id = peer_id
        self.gate = gate
        self.rank = rank

    def sleep(self, seconds: float) -> None:
        if self.gate is None:
            time.sleep(seconds)
        else:
            self.gate.pause(seconds, (-1, self.rank))

    def exchange(self, message: Payload, plan: MixingPlan, deadline_s: float) -> ExchangeResult:
        # Exactly the bytes gRPC would carry: the codec's own size of this message (headers included).
        size = wire_size(message, self.chunk_bytes)
        readers = list(plan.out_weights)
        self.hub.publish(message, readers, size)
        keys = [(j, message.round, message.step) for j in plan.in_weights]
        sizes: dict[str, int] = {}
        rejected: set[str] = set()
        deadline = time.monotonic() + deadline_s
        if self.gate is None:
            got = self.hub.take(keys, deadline, sizes, rejected)
        else:
            got = self.hub.take_gated(keys, deadline, sizes, self.gate, (message.round, self.rank), rejected)
        for j in sorted(rejected):
            # The gRPC receiver refuses NaN/Inf payloads; so does the simulation (same results).
            log.warning("%s round %d step %d: payload from %s rejected: NaN or Inf values",
                        self.peer_id, message.round, message.step, j)
        missing = [j for j in plan.in_weights if j not in got]
        recv = sum(sizes[j] for j in got)
        return ExchangeResult(received=got, missing=missing, bytes_sent=size * len(readers), bytes_recv=recv)


def _finite(msg: Payload) -> bool:
    from p2pfl.wire.validate import all_finite

    return all(math.isfinite(v) for v in msg.scalars.values()) and all_finite(msg.flat.detach().cpu().numpy())
