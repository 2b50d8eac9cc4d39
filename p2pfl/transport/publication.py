"""The publication window: this peer's round, the payloads it serves to Pulls, and who pulled them.

Why: a payload is encoded once and streamed as is to every puller; a Pull for one not yet published
waits on the server's condition until it is, or until the caller's deadline. Memory stays bounded:
payloads of rounds older than ``current - size`` are dropped. The round lives here because it is
what the window slides on; the inbox and the handlers read it (docs/protocol.md, "Bounded
skew"). `GivenPayloads` is the push-mode counterpart: the one payload a restarted receiver may
recover with a Pull.

Every method that touches state takes the server's condition (``cond``, reentrant), the one lock
the whole service shares, so a publish, a round advance and a waiting Pull see one state.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc

from p2pfl.payload import Payload
from p2pfl.transport.rpc import Rejected
from p2pfl.transport.service_config import ServiceConfig
from p2pfl.wire.codec import EncodedPayload, encode_frames

__all__ = ["GivenPayloads", "PublicationWindow"]


class PublicationWindow:
    """This peer's current round and the payloads served for rounds ``>= current - size``.

    ``on_advance(round)`` runs (lock held) each time the round moves forward, after the window
    dropped what fell out of it: the inbox forgets old push decisions there.
    """

    def __init__(self, cond: threading.Condition, config: ServiceConfig,
                 on_advance: Callable[[int], None] = lambda round: None) -> None:
        self._cond = cond
        self._config = config
        self._on_advance = on_advance
        self.current = 0  # the round; read under the lock by the inbox and the handlers
        self.size = 2
        self.stopping = False
        self._published: dict[tuple[int, int], EncodedPayload] = {}
        self._pulled_by: dict[tuple[int, int], set[str]] = {}  # who completed a Pull of each payload
        self._final: int | None = None  # the round count once this peer finished the run (`finish`)
        self._told: dict[str, int] = {}  # per calling neighbour, the highest round its Status answers said
        self._served = 0
        self._pulls_served = 0

    # ---- the round -------------------------------------------------------------------------------

    def advance(self, round: int) -> None:
        """Advance the current round (never backwards) and drop what is older than ``round - size``."""
        with self._cond:
            if round > self.current:
                self.current = int(round)
                self._prune()
            self._cond.notify_all()

    def finish(self, rounds: int) -> None:
        """This peer finished the run: Status reports ``rounds`` from now on."""
        self.advance(rounds)
        with self._cond:
            self._final = int(rounds)

    def told_finished(self, peer: str) -> bool:
        """Whether a Status answer to ``peer`` said this peer had finished."""
        with self._cond:
            return self._final is not None and self._told.get(peer, -1) >= self._final

    def tell(self, caller: str) -> int:
        """The round a Status answer to ``caller`` says; a member's highest is remembered (`told_finished`)."""
        with self._cond:
            round_ = self.current
            if caller in self._config.members and round_ > self._told.get(caller, -1):
                self._told[caller] = round_
        return round_

    def stop(self) -> None:
        """Shutting down: every wait on the condition ends (UNAVAILABLE)."""
        with self._cond:
            self.stopping = True
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake every wait (a call was cancelled or expired: its wait ends at once)."""
        with self._cond:
            self._cond.notify_all()

    def _prune(self) -> None:
        keep = self.current - self.size
        for key in [k for k in self._published if k[0] < keep]:
            del self._published[key]
            self._pulled_by.pop(key, None)
        self._on_advance(self.current)

    def window_error(self, round: int) -> tuple[grpc.StatusCode, str] | None:
        """Why ``round`` cannot be served now, with the status to answer, or None.

        Older than the window: OUT_OF_RANGE (final: it will never be served again). More than
        ``size`` rounds ahead: UNAVAILABLE (transient: the caller retries with backoff within its
        deadline, by which time this peer may have caught up). Anything in between is waited for.
        Takes the (reentrant) lock, so it is one answer whether or not the caller holds it.
        """
        with self._cond:
            cur = self.current
        if round < cur - self.size:
            return (grpc.StatusCode.OUT_OF_RANGE,
                    f"round {round} is no longer served: this peer is at round {cur} and keeps rounds "
                    f">= {cur - self.size}")
        if round > cur + self.size:
            return (grpc.StatusCode.UNAVAILABLE,
                    f"round {round} is more than {self.size} rounds ahead of this peer (round {cur}); retry later")
        return None

    # ---- the payloads ----------------------------------------------------------------------------

    def publish(self, msg: Payload, payload: EncodedPayload | None = None) -> EncodedPayload:
        """Encode ``msg`` once (or take its ``payload``) and serve it for (msg.round, msg.step) (`PeerServer.publish`)."""
        cfg = self._config
        if msg.sender != cfg.peer_id:
            raise ValueError(f"peer {cfg.peer_id!r} cannot publish a message from {msg.sender!r}")
        if msg.topology_hash != cfg.topology_hash:
            raise ValueError(
                f"message topology hash {msg.topology_hash!r} differs from the server's {cfg.topology_hash!r}"
            )
        if payload is None:
            payload = encode_frames(msg, cfg.chunk_bytes)
        if payload.header.total_bytes > cfg.max_bytes:
            raise ValueError(f"payload of {payload.header.total_bytes} bytes exceeds max_message_mb")
        with self._cond:
            if msg.round < self.current - self.size:
                raise ValueError(f"round {msg.round} is older than the retained window (current {self.current})")
            self._published[(msg.round, msg.step)] = payload
            if msg.round > self.current:
                self.current = msg.round
                self._prune()
            self._cond.notify_all()
        return payload

    def published(self) -> list[tuple[int, int]]:
        """(round, step) keys currently served."""
        with self._cond:
            return sorted(self._published)

    @property
    def served_bytes(self) -> int:
        with self._cond:
            return self._served

    @property
    def pulls_served(self) -> int:
        with self._cond:
            return self._pulls_served

    def wait_published(self, key: tuple[int, int], context: grpc.ServicerContext) -> EncodedPayload | None:
        """Block (on the condition, no polling) until ``key`` is published, the caller's deadline or cancel.

        None: the caller went away. A round that will never be served raises `Rejected`.
        """
        cfg = self._config
        remaining = context.time_remaining()
        budget = cfg.max_wait_s if remaining is None else min(remaining, cfg.max_wait_s)
        limit = time.monotonic() + budget
        context.add_callback(self.wake)  # a cancelled or expired call wakes the wait at once
        with self._cond:
            while True:
                if self.stopping:
                    raise Rejected(grpc.StatusCode.UNAVAILABLE, f"peer {cfg.peer_id!r} is shutting down")
                payload = self._published.get(key)
                if payload is not None:
                    return payload
                if not context.is_active():
                    return None
                why = self.window_error(key[0])
                if why:
                    raise Rejected(*why)
                if key[0] < self.current:  # a past round this peer never published (it fast-forwarded)
                    raise Rejected(grpc.StatusCode.OUT_OF_RANGE,
                                   f"round {key[0]} step {key[1]} was skipped: this peer is at round {self.current}")
                left = limit - time.monotonic()
                if left <= 0:
                    raise Rejected(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"round {key[0]} step {key[1]} was not published within {budget:.1f}s",
                    )
                self._cond.wait(left)

    def served(self, key: tuple[int, int], caller: str, sent: int, whole: int) -> None:
        """A Pull of ``key`` by ``caller`` streamed ``sent`` of the payload's ``whole`` wire bytes."""
        with self._cond:
            self._served += sent
            self._pulls_served += sent == whole
            if sent == whole:
                self._pulled_by.setdefault(key, set()).add(caller)
                self._cond.notify_all()

    def wait_pulled(self, key: tuple[int, int], peers: frozenset[str] | set[str], deadline: float) -> set[str]:
        """Wait until every peer in ``peers`` completed a Pull of ``key`` or ``deadline`` (monotonic) passes; those that did not."""
        with self._cond:
            while True:
                left = set(peers) - self._pulled_by.get(key, set())
                remaining = deadline - time.monotonic()
                if not left or remaining <= 0:
                    return left
                self._cond.wait(timeout=min(remaining, 1.0))


class GivenPayloads:
    """Push mode: the last round's payloads each receiver answered "mixed", for its recovery Pull.

    A receiver killed before it checkpointed that round lost the mass with its state; when it
    replays the round it recovers exactly this payload with a Pull (and nothing else). ``keys``:
    every (receiver, round, step) OK this peer heard, durable (the transport's pushes log), so the
    answer says "given" even once the payload is no longer held.
    """

    def __init__(self, cond: threading.Condition, window: PublicationWindow) -> None:
        self._cond = cond
        self._window = window
        self.held: dict[str, tuple[int, dict[int, EncodedPayload]]] = {}  # receiver -> (round, step -> payload)
        self.keys: set[tuple[str, int, int]] | frozenset[tuple[str, int, int]] = frozenset()

    def gave(self, peer: str, round: int, step: int, payload: EncodedPayload) -> None:
        """``peer`` answered that it mixed ``payload`` for (round, step); keep the latest round's."""
        with self._cond:
            held = self.held.get(peer)
            if held is None or held[0] < round:
                self.held[peer] = (round, {step: payload})
            elif held[0] == round:
                held[1][step] = payload

    def recovery(self, caller: str, r: int, s: int) -> EncodedPayload | Rejected:
        """The payload ``caller`` recovers for (r, s), or why not: given but no longer held
        (ALREADY_EXISTS), kept by this peer (ABORTED), not decided yet (NOT_FOUND)."""
        with self._cond:
            held = self.held.get(caller)
            if held is not None and held[0] == r and s in held[1]:
                return held[1][s]
            if (caller, r, s) in self.keys:  # given (its OK is logged), the payload no longer held
                return Rejected(grpc.StatusCode.ALREADY_EXISTS, f"round {r} step {s} was given to {caller!r} "
                                "(its share left this peer); the payload is no longer held")
            if r < self._window.current:
                return Rejected(grpc.StatusCode.ABORTED, f"round {r} step {s} was not given to {caller!r}: "
                                "its share stayed with this peer")
        return Rejected(grpc.StatusCode.NOT_FOUND, f"round {r} step {s} is not decided yet: wait for the push")
