"""Telling "every neighbour refuses this peer" from "neighbours do not answer".

Why: a peer restarted with certificates of another CA, or with a topology one edge off, used to
see each call fail, mark its neighbours down, run its remaining rounds alone and exit 0, its run
folder looking complete. A neighbour that is down and one that refuses this peer are different
facts: the first heals by itself, the second never does. So the transport notes, per round, how
each neighbour it called answered, and `RefusalTracker.streak` says for how many rounds in a row
*every* neighbour it called refused it; ``p2pfl node`` stops after ``network.refused_rounds`` of
them (docs/protocol.md, "Refused by every neighbour").

A refusal is a call that the neighbour answered with ``UNAUTHENTICATED`` or ``PERMISSION_DENIED``
(who this peer is), ``FAILED_PRECONDITION`` (its topology or config hash, wire format, version),
or a connection that failed in the TLS handshake. A neighbour that answered anything else (a
payload, ``OUT_OF_RANGE``, ...) accepted this peer; one that did not answer (connection refused,
a deadline) is silent. gRPC reports a handshake the *server* rejected (this peer's certificate)
only as the connection closing during connect, and only to a call made without
``wait_for_ready``, such as the transport's liveness probe; both are counted as a refusal.
"""

from __future__ import annotations

import logging
import threading

from p2pfl.transport.limits import RateLimitedLog, bounded

__all__ = ["RefusalTracker", "refusal_cause"]

log = logging.getLogger(__name__)

_REFUSING_CODES = ("UNAUTHENTICATED", "PERMISSION_DENIED", "FAILED_PRECONDITION")
#: Codes of a neighbour that answered the call (so it accepted who this peer is), though not with a payload.
_ANSWERED_CODES = ("OUT_OF_RANGE", "ABORTED", "NOT_FOUND", "ALREADY_EXISTS", "RESOURCE_EXHAUSTED",
                   "INVALID_ARGUMENT", "DATA_LOSS", "CANCELLED")

ANSWERED, REFUSED, SILENT = "answered", "refused", "silent"


def refusal_cause(why: str) -> str | None:
    """The cause, when a failed call's reason (``"CODE: details"``) says the neighbour refuses this peer."""
    code, _, detail = why.partition(": ")
    if code in _REFUSING_CODES:
        return bounded(why, 240)
    if code == "UNAVAILABLE":
        low = detail.lower()
        if "handshake" in low or "certificate" in low:
            at = low.find("certificate_verify_failed")
            tail = detail[at:] if at >= 0 else detail[-160:]
            return "TLS handshake failed: " + bounded(tail, 160)
        if "failed to connect" in low and "socket closed" in low:
            return ("TLS handshake failed: the neighbour closed the connection while connecting "
                    "(it does not accept this peer's certificate: another CA, expired, revoked?)")
    return None


def outcome(why: str | None) -> tuple[str, str | None]:
    """(ANSWERED | REFUSED | SILENT, the refusal's cause) of a call that returned ``why`` (None: success)."""
    if why is None:
        return ANSWERED, None
    cause = refusal_cause(why)
    if cause is not None:
        return REFUSED, cause
    code = why.partition(": ")[0]
    if code in _ANSWERED_CODES or why.startswith("payload rejected"):
        return ANSWERED, None  # it answered (this peer rejected its payload, or the round was over)
    return SILENT, None


class RefusalTracker:
    """Per round, how each neighbour called answered; the streak of rounds in which all refused.

    Thread-safe: the calls of one exchange run on the transport's pool. A round closes when the
    first outcome of a later round arrives; outcomes of an earlier round (a late thread) are dropped.
    A round in which this peer called nobody leaves the streak as it was.
    """

    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id
        self._lock = threading.Lock()
        self._round = -1
        self._now: dict[str, tuple[str, str | None]] = {}  # neighbour -> (outcome, cause) this round
        self._streak = 0
        self._causes: dict[str, str] = {}
        # the log says which neighbour refuses this peer and why, a few lines per neighbour and minute
        self._say = RateLimitedLog(log, burst=2, interval_s=60.0)

    def note(self, round: int, peer: str, why: str | None) -> None:
        """A call to ``peer`` for ``round`` ended with ``why`` (None: it succeeded)."""
        kind, cause = outcome(why)
        with self._lock:
            if round < self._round:
                return
            if round > self._round:
                self._streak, self._causes = self._closed()
                self._round, self._now = round, {}
            prev = self._now.get(peer)
            # one answer in the round outweighs a refusal, which outweighs silence
            rank = {ANSWERED: 2, REFUSED: 1, SILENT: 0}
            if prev is None or rank[kind] > rank[prev[0]]:
                self._now[peer] = (kind, cause)
        if cause is not None:
            self._say(logging.WARNING, peer, "%s: calls to neighbour %s are refused: %s", self.peer_id, bounded(peer, 80),
                      cause)

    def _closed(self) -> tuple[int, dict[str, str]]:
        """The streak with the current round counted (caller holds the lock)."""
        if not self._now:
            return self._streak, self._causes
        if all(kind == REFUSED for kind, _ in self._now.values()):
            return self._streak + 1, {p: c for p, (_, c) in self._now.items() if c is not None}
        return 0, {}

    def streak(self) -> tuple[int, dict[str, str]]:
        """(rounds in a row, up to the last one noted, in which every neighbour called refused this
        peer; each refusing neighbour's cause in the last of them)."""
        with self._lock:
            return self._closed()
