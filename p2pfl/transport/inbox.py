"""The inbox: pushes waiting to be mixed, and the fate decided for each (directed push-sum).

Why one place: a push's fate must be the same on both ends, or push-sum loses mass or counts it
twice (docs/protocol.md, "Push-sum mass"). A validated push waits here, offered by its Push call;
`Inbox.take` mixes it only while that call can still hear the answer, and closes every planned key
that did not come, so its sender is answered ABORTED and keeps the share. Each decision is
remembered ``DECISION_ROUNDS`` rounds to answer a repeated push the same way. The receiver's
push-sum ledger (`p2pfl.transport.pushsum.ReceiverLedger`) is told of every mix and every answer
that could not be sent, under the same lock, so a push is decided, mixed and accounted at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence

import grpc

from p2pfl.payload import Payload
from p2pfl.transport.progress import RoundEvidence
from p2pfl.transport.publication import PublicationWindow
from p2pfl.transport.pushsum import Key, ReceiverLedger
from p2pfl.transport.rpc import DECISION_ROUNDS, SERVICE_LOG, Rejected
from p2pfl.transport.service_config import ServiceConfig

__all__ = ["Inbox"]

log = SERVICE_LOG

#: A waiting push is mixed only if its call has at least this long left to hear the answer.
_ANSWER_MARGIN_S = 0.25


class Inbox:
    """Undelivered pushes, the Push calls offering them, and every push's decided fate.

    Memory stays bounded: each sender may have at most ``max_pending`` undelivered pushes (the Push
    handler checks with `pending`), and decisions older than ``DECISION_ROUNDS`` rounds are
    forgotten (`prune`, run by the window as the round advances).
    """

    def __init__(self, cond: threading.Condition, config: ServiceConfig, window: PublicationWindow,
                 ledger: ReceiverLedger, progress: RoundEvidence) -> None:
        self._cond = cond
        self._config = config
        self._window = window
        self._ledger = ledger
        self._progress = progress
        self._entries: dict[Key, tuple[Payload, int]] = {}
        # The Push call that offers each inbox entry: it is consumed only while that call can still
        # hear the answer, so sender and receiver always agree on whether the mass moved.
        self._offers: dict[Key, grpc.ServicerContext] = {}
        # (sender, round, step) -> True (mixed) / False (the step closed without it): a push's fate.
        self._decided: dict[Key, bool] = {}
        self._recovering: set[Key] = set()  # keys a restarted peer is asking its senders for
        self._withheld: set[Key] = set()  # keys whose sender kept its whole share

    # ---- what the node / transport drives ---------------------------------------------------------

    def snapshot(self) -> dict[Key, Payload]:
        """Undelivered pushes, keyed by (sender, round, step)."""
        with self._cond:
            return {k: v[0] for k, v in self._entries.items()}

    def take(self, keys: Sequence[Key], deadline: float,
             wait_for: Iterable[str] | None = None) -> dict[str, tuple[Payload, int]]:
        """Wait for ``keys`` until ``deadline`` (monotonic); mix those that came, close the rest (`PeerServer.take`)."""
        waited = {k for k in keys if wait_for is None or k[0] in set(wait_for)}
        out: dict[str, tuple[Payload, int]] = {}
        with self._cond:
            while True:
                for key in keys:
                    if key[0] not in out and key in self._entries and self._offer_alive(key):
                        if not self._absorb(key, self._entries[key][0]):
                            continue  # its log line could not be written: it waits (retried below, lock released)
                        out[key[0]] = self._entries.pop(key)
                        self._offers.pop(key, None)
                        self._decided[key] = True
                # A sender already pushing a later round gave this one up (it keeps that share):
                # do not wait for it, or a receiver one round behind would stay behind for good.
                waited = {k for k in waited if not self._moved_on(k) and self._decided.get(k) is not False}
                left = deadline - time.monotonic()
                if all(k[0] in out for k in waited) or self._window.stopping or left <= 0:
                    break
                self._cond.wait(min(left, 0.5))
            for key in keys:
                if key[0] not in out:
                    self._decided.setdefault(key, False)
            self._cond.notify_all()
            return out

    def deliver(self, key: Key, msg: Payload, nbytes: int) -> None:
        """Put a recovered push in the inbox, to be mixed by `take` like any other."""
        with self._cond:
            if key not in self._decided and key not in self._entries:
                self._entries[key] = (msg, nbytes)
                self._ledger.drop_claim(key)  # the exact lost payload: no settlement with it
                self._cond.notify_all()

    def recovering(self, key: Key, active: bool) -> None:
        """Mark ``key`` as being recovered after a restart (or no longer): `take` keeps waiting for it."""
        with self._cond:
            if active:
                self._recovering.add(key)
            else:
                self._recovering.discard(key)
            self._cond.notify_all()

    def close(self, key: Key) -> None:
        """Decide ``key`` "not mixed" ahead of `take` (its sender kept the share)."""
        with self._cond:
            self._decided.setdefault(key, False)
            self._cond.notify_all()

    def withheld(self, keys: Iterable[Key]) -> set[Key]:
        """Those of ``keys`` whose sender withheld its share (it kept all its mass: mu below the floor)."""
        with self._cond:
            return {k for k in keys if k in self._withheld}

    def prune(self, round: int) -> None:
        """Forget the decisions of rounds before ``round - DECISION_ROUNDS`` (lock held, the window advanced).

        Pending pushes are owned by their (waiting) Push calls, which notice the round moved on.
        """
        forget = round - DECISION_ROUNDS
        for key in [k for k in self._decided if k[1] < forget]:
            del self._decided[key]
            self._ledger.forget(key)
            self._withheld.discard(key)

    # ---- what the Push handler asks ---------------------------------------------------------------

    def admissible(self, key: Key) -> tuple[tuple[grpc.StatusCode, str] | None, bool, int]:
        """Before decoding a push for ``key``: why its round is refused (None: it is not), whether one
        of its sender's is already waiting for it, and how many of its sender's are waiting."""
        caller, r, _ = key
        with self._cond:
            why = None if key in self._decided else self._window.window_error(r)
            dup = key in self._entries
            pending = sum(1 for k in self._entries if k[0] == caller)
        return why, dup, pending

    def offer(self, key: Key, msg: Payload, nbytes: int,
              context: grpc.ServicerContext, claim: float | None = None) -> bool | Rejected:
        """Put a validated push in the inbox and wait for its fate; True: mixed (now or before).

        The answer is the receiver's decision, so the sender knows whether to keep the mass: OK =
        mixed (a repeat of an already mixed push is answered OK again, with 0 bytes: dedupe by
        (sender, round, step)); ABORTED = the step closed without it. A call that ends first (its
        deadline, a cancel, shutdown) withdraws the offer, so an unanswered push is never mixed.
        """
        cfg = self._config
        _, r, s = key
        limit = self._call_limit(context)
        with self._cond:
            if key in self._decided:
                if self._decided[key]:
                    return False
                return Rejected(grpc.StatusCode.ABORTED, f"round {r} step {s} was mixed without this payload")
            if key in self._entries:
                return Rejected(grpc.StatusCode.ALREADY_EXISTS,
                                f"a payload from {key[0]!r} for round {r} step {s} is already waiting")
            why = self._window.window_error(r)
            if why:
                return Rejected(*why)
            self._entries[key] = (msg, nbytes)
            self._offers[key] = context
            self._progress.saw(key[0], r)  # validated and accepted: evidence that the sender reached r
            self._ledger.hold_claim(key, claim)
            self._cond.notify_all()
            try:
                while True:
                    fate = self._decided.get(key)
                    if fate is True:
                        return True
                    if fate is False:
                        return Rejected(grpc.StatusCode.ABORTED, f"round {r} step {s} was mixed without this payload")
                    if self._window.stopping:
                        return Rejected(grpc.StatusCode.UNAVAILABLE, f"peer {cfg.peer_id!r} is shutting down")
                    if r < self._window.current:  # every planned key of a past round was decided; this one never will be
                        return Rejected(grpc.StatusCode.OUT_OF_RANGE, f"round {r} is over on this peer "
                                        f"(round {self._window.current}); the payload was not mixed")
                    left = limit - time.monotonic()
                    if not context.is_active() or left <= 0:
                        return Rejected(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"round {r} step {s} was not mixed before the call's deadline")
                    self._cond.wait(min(left, 1.0))
            finally:
                if self._entries.get(key) is not None and self._decided.get(key) is not True:
                    self._entries.pop(key, None)
                self._offers.pop(key, None)
                self._ledger.drop_claim(key)

    def in_window(self, round: int) -> bool:
        """Whether ``round`` is in this peer's window now (a claim made for it may settle)."""
        return self._window.window_error(round) is None

    def _call_limit(self, context: grpc.ServicerContext) -> float:
        """When a waiting call gives up: its own deadline or ``max_wait_s``, whichever comes first; the
        call's end (deadline, cancel) wakes the waiters so the offer is withdrawn at once."""
        remaining = context.time_remaining()
        max_wait = self._config.max_wait_s
        context.add_callback(self._window.wake)
        return time.monotonic() + (max_wait if remaining is None else min(remaining, max_wait))

    def withhold(self, key: Key, context: grpc.ServicerContext,
                 claim: float | None = None) -> tuple[grpc.StatusCode, str]:
        """A push that withholds its share: close ``key`` once this peer reaches its round.

        It is answered like a push that was not mixed (ABORTED), but only when this peer is in that
        round, so a withholding sender is paced by its receivers exactly like one whose push is
        mixed (answering at once let it run arbitrarily far ahead). Returns the status to answer.
        """
        cfg = self._config
        _, r, s = key
        limit = self._call_limit(context)
        with self._cond:
            why = None if key in self._decided else self._window.window_error(r)
            if why:
                return why
            while key not in self._decided and self._window.current < r:
                left = limit - time.monotonic()
                if self._window.stopping:
                    return grpc.StatusCode.UNAVAILABLE, f"peer {cfg.peer_id!r} is shutting down"
                if not context.is_active() or left <= 0:
                    return grpc.StatusCode.DEADLINE_EXCEEDED, f"round {r} not reached before the call's deadline"
                self._cond.wait(min(left, 1.0))
            if key not in self._decided:
                self._decided[key] = False
                self._withheld.add(key)
                self._cond.notify_all()
        if claim is not None and cfg.mode == "push" and self.in_window(r):  # taken (not refused): it settles
            self._ledger.settle_claim(key[0], claim)  # (a decided key behind the window: answered, not settled)
        return grpc.StatusCode.ABORTED, f"round {r} step {s}: the sender withholds its share (it keeps its mass)"

    def unanswered(self, key: Key) -> None:
        """A push was mixed but its call ended before the OK could be sent (this peer stalled, or the
        call's deadline passed in between): the sender keeps the share (rule 2), so this peer gives
        back what it absorbed (mu only, with the next exchange) and closes the key."""
        with self._cond:
            if not self._ledger.unanswered(key):
                return
            self._decided[key] = False
        log.warning("%s: the OK for round %d step %d of %s could not be sent; its share is given back",
                    self._config.peer_id, key[1], key[2], key[0])

    # ---- internals (lock held) --------------------------------------------------------------------

    def _absorb(self, key: Key, msg: Payload) -> bool:
        """Ledger of a push about to be mixed: its share is the weight ``combine`` is about to apply,
        W[i, j] * mu_j (`ReceiverLedger.absorb` settles the sender's claim first). False: its
        write-ahead log line could not be written now, so it is not mixed yet."""
        cfg = self._config
        if cfg.mode != "push" or cfg.topology is None:
            return True
        j, r, s = key
        return self._ledger.absorb(key, cfg.plan(r, s).in_weights.get(j, 0.0) * float(msg.scalars.get("mu", 0.0)))

    def _moved_on(self, key: Key) -> bool:
        """Whether the sender of ``key`` already offers a later round or step (a push waiting here)."""
        if key in self._recovering:  # it may have moved on because it gave it: the recovery decides
            return False
        j, r, s = key
        return any(k[0] == j and (k[1], k[2]) > (r, s) for k in self._entries)

    def _offer_alive(self, key: Key) -> bool:
        """Whether the Push call offering ``key`` can still be told that it was mixed (with a margin)."""
        ctx = self._offers.get(key)
        if ctx is None:  # put there directly (tests, tools)
            return True
        if not ctx.is_active():
            return False
        left = ctx.time_remaining()
        return left is None or left > _ANSWER_MARGIN_S
