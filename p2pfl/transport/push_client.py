"""The push client: push mode's exchange -- push to every out-neighbour, take the in-neighbours' pushes.

Why: in directed push-sum (``mix_mode: push``) a share that leaves this peer must be counted exactly
once. A push's fate is the receiver's answer (OK: mixed; ABORTED: the step closed without it), so
the sender keeps every share not answered OK (``undelivered``). Each OK is appended, fsync'd, to the
pushes log, so a restarted sender neither pushes it again nor counts it twice. The sender side of
the push-sum ledger -- the running total given to each receiver, told to it with every push, and
the settlement of a debt a receiver reports -- is here; its rules (how much may be paid, withholding)
are `p2pfl.transport.pushsum`'s, and the receiver's side is the server's `ReceiverLedger`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from p2pfl.payload import Payload
from p2pfl.storage import append_line, atomic_write
from p2pfl.topology import MixingPlan
from p2pfl.transport.base import ExchangeResult
from p2pfl.transport.channels import Channels, backoff_s
from p2pfl.transport.grpc_service import PeerServer
from p2pfl.transport.limits import bounded
from p2pfl.transport.liveness import Liveness
from p2pfl.transport.push_recovery import PushRecovery
from p2pfl.transport.pushsum import Key, debt_bound, settle_budget
from p2pfl.transport.rpc import ABSORBED_MD, DECISION_ROUNDS, GIVEN_MD, KEEP_MD, TRANSPORT_LOG
from p2pfl.wire.codec import EncodedPayload, encode_frames

__all__ = ["PushClient", "PushFate", "load_pushes_log", "read_absorbed"]

log = TRANSPORT_LOG

#: A call that ended without the receiver's answer: the push may have been mixed there.
_NO_ANSWER = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                        grpc.StatusCode.INTERNAL})

#: How long a sender waits, after its deadline, for the fate of a push whose call ended unanswered.
FATE_QUERY_S = 2.0

#: A push's fate as the sender learns it: mixed or not, and the receiver's running total absorbed
#: from this peer right after it (None when the reply carried none).
PushFate = tuple[bool, float | None]


class PushClient:
    """Pushes of one peer to its out-neighbours, their fates, and the running totals given (sender ledger)."""

    def __init__(self, peer_id: str, server: PeerServer, channels: Channels, liveness: Liveness,
                 recovery: PushRecovery, pool: futures.ThreadPoolExecutor, chunk_bytes: int,
                 pushes_log: Path | None, final_round: Callable[[], int | None]) -> None:
        self.peer_id = peer_id
        self.server = server
        self.chunk_bytes = chunk_bytes
        self._channels = channels
        self._liveness = liveness
        self._recovery = recovery
        self._pool = pool
        self._final_round = final_round  # the transport's `Transport.final_round`, set by the node
        self._lock = threading.Lock()
        self._pushed = 0
        self._pushed_reported = 0
        self.pushes: list[futures.Future[PushFate]] = []  # the last exchange's, waited for by `linger`
        # Push-sum ledger, sender side: per out-neighbour, the running total of mu given to it
        # (checkpointed with the state; docs/protocol.md, "Push-sum mass").
        self._given: dict[str, float] = {}
        # Per out-neighbour, the running total of the shares ever pushed to it, whatever their fate:
        # more than that cannot have been absorbed there (`pushsum.debt_bound`). None: not known (a
        # checkpoint written before it was kept), so a receiver's report is not bounded.
        self._offered: dict[str, float] | None = {}
        self._deferred = 0.0  # settlement the node could not apply yet without breaking the floor (pushsum.debit)
        self._pushes_log = pushes_log
        self._mixed_pushes = load_pushes_log(pushes_log, server.round) if pushes_log is not None else set()
        server.given_keys = self._mixed_pushes  # durable OKs: its recovery answers say "given" from them

    # ---- the sender's ledger ---------------------------------------------------------------------

    def given(self) -> dict[str, float]:
        """Per out-neighbour, the running total given (goes into the checkpoint)."""
        with self._lock:
            return dict(self._given)

    def offered(self) -> dict[str, float] | None:
        """Per out-neighbour, the running total of the shares pushed to it (goes into the checkpoint)."""
        with self._lock:
            return None if self._offered is None else dict(self._offered)

    def restore_given(self, given: Mapping[str, Any], offered: Mapping[str, Any] | None = None) -> None:
        """The totals given (and offered) saved with the checkpoint being resumed."""
        with self._lock:
            self._given = {str(k): float(v) for k, v in dict(given).items()}
            self._offered = None if offered is None else {str(k): float(v) for k, v in dict(offered).items()}

    def defer(self, amount: float) -> None:
        with self._lock:
            self._deferred += amount

    def take_deferred(self) -> float:
        with self._lock:
            out, self._deferred = self._deferred, 0.0
        return out

    def take_pushed(self) -> int:
        """Wire bytes of the pushes mixed since the last call."""
        with self._lock:
            n, self._pushed_reported = self._pushed - self._pushed_reported, self._pushed
        return n

    # ---- the exchange ----------------------------------------------------------------------------

    def exchange(self, message: Payload, plan: MixingPlan, deadline: float, withhold: bool = False) -> ExchangeResult:
        """Push ``message`` to every out-neighbour of ``plan`` and take the in-neighbours' pushes until
        ``deadline``; the fate of every own push is known before the node mixes. ``bytes_sent`` is
        left to the caller (it counts served and pushed bytes together)."""
        self.server.set_round(message.round)
        payload = encode_frames(message, self.chunk_bytes)
        self.server.publish(message, payload)  # served to evidence Pulls only (a lagging receiver's proof)
        tag = f"round {message.round} step {message.step}"
        with self._lock:
            claims = {k: self._given.get(k, 0.0) for k in plan.out_weights}
        mu = float(message.scalars.get("mu", 0.0))
        pushes = {k: self._pool.submit(self._push_checked, k, payload, deadline, tag, claims[k], withhold,
                                       plan.out_weights[k] * mu)
                  for k in plan.out_weights}
        self.pushes = list(pushes.values())
        keys = [(j, message.round, message.step) for j in plan.in_weights]
        self._recovery.start(message.round, keys, deadline, self._pool)
        live = self._liveness
        alive = [j for j in plan.in_weights if live.alive(j)]
        got = self.server.take(keys, deadline, wait_for=alive)
        received = {j: got[j][0] for j in plan.in_weights if j in got}
        held_back = {k[0] for k in self.server.withheld(keys)}
        withheld = [j for j in plan.in_weights if j not in got and j in held_back]
        missing = [j for j in plan.in_weights if j not in got and j not in held_back]
        for j in withheld:
            live.mark_up(j)
        for j in missing:
            log.warning("%s %s: no push from %s by the deadline", self.peer_id, tag, j)
            if j in alive:
                live.mark_down(j, "no push by the deadline")
        for j in received:
            live.mark_up(j)
        # The fate of every own push is known before mixing: an undelivered share stays here.
        undelivered: list[str] = []
        fates: dict[str, PushFate] = {}
        for k, job in pushes.items():
            try:
                fates[k] = job.result(timeout=max(0.0, deadline - time.monotonic()) + 5.0)
            except futures.TimeoutError:  # pragma: no cover - each call is bounded by its deadline
                fates[k] = (False, None)
            if not fates[k][0]:
                undelivered.append(k)
        self._recovery.finish_round(message.round, tag)
        settle = sum(self.server.pop_settled().values())
        if settle:
            log.warning("%s %s: absorbed %.6g of push-sum weight lost in a restart (settled by the ledger)",
                        self.peer_id, tag, settle)
        settle -= self._settle_given(message, plan, fates, undelivered, tag)
        settle += self.take_deferred()
        recv = sum(n for _, n in got.values())
        return ExchangeResult(received=received, missing=missing, bytes_recv=recv, undelivered=undelivered,
                              mu_settle=settle, withheld=withheld)

    def _settle_given(self, message: Payload, plan: MixingPlan, fates: dict[str, PushFate],
                      undelivered: list[str], tag: str) -> float:
        """Add this step's delivered shares to the running totals given; return the weight this peer
        gives now to settle what it owes (a receiver absorbed more than this peer's state gave it: a
        push mixed there whose answer this peer lost, e.g. in its own restart from an older
        checkpoint), as much as `pushsum.settle_budget` allows this step (the rest on its next push)."""
        mu = float(message.scalars.get("mu", 0.0))
        keep = mu * (plan.self_weight + sum(plan.out_weights[k] for k in undelivered))
        final = self._final_round()
        last = final is not None and message.round >= final
        budget = settle_budget(keep, plan.self_weight, mu, last=last)
        owed = 0.0
        with self._lock:
            for k, (ok, told) in fates.items():
                total = self._given.get(k, 0.0) + (plan.out_weights[k] * mu if ok else 0.0)
                offered = None if self._offered is None else self._offered.get(k, 0.0)
                absorbed = debt_bound(told, offered)
                if told is not None and absorbed is not None and told > absorbed:
                    log.warning("%s %s: %s reports it absorbed %.6g from this peer in total, more than was ever "
                                "pushed to it (%.6g); counted only up to that", self.peer_id, tag, k, told, absorbed)
                if absorbed is not None and absorbed > total:
                    pay = min(absorbed - total, max(0.0, budget - owed))
                    owed += pay
                    total = absorbed if pay == absorbed - total else total + pay
                self._given[k] = total
        if owed:
            log.warning("%s %s: gave %.6g of push-sum weight a receiver had already absorbed (settled by the ledger)",
                        self.peer_id, tag, owed)
        return owed

    # ---- one push --------------------------------------------------------------------------------

    def _push_checked(self, peer: str, payload: EncodedPayload, deadline: float, tag: str,
                      claim: float = 0.0, withhold: bool = False, share: float = 0.0) -> PushFate:
        key = (peer, int(payload.header.round), int(payload.header.step))
        if key in self._mixed_pushes:  # mixed before this peer restarted: the same payload, not again
            log.info("%s %s: push to %s was mixed before the restart", self.peer_id, tag, peer)
            self._offer(peer, share)
            self.server.gave(peer, key[1], key[2], payload)
            return True, None
        live = self._liveness
        if not live.alive(peer):
            live.refusals.note(key[1], peer, live.unanswered_probe(peer))
            log.warning("%s %s: push to %s skipped: neighbour is down; its share stays here", self.peer_id, tag, peer)
            return False, None
        if not withhold:
            self._offer(peer, share)
        md: tuple[tuple[str, str], ...] = ((GIVEN_MD, repr(float(claim))),)
        if withhold:
            md += ((KEEP_MD, "1"),)
        return self._push_one(peer, payload, deadline, tag, md)

    def _push_one(self, peer: str, payload: EncodedPayload, deadline: float, tag: str,
                  metadata: tuple[tuple[str, str], ...] = ()) -> PushFate:
        """Push ``payload`` to ``peer``; True once the receiver answered that it mixed it.

        The receiver answers only when it decided (mixed, or closed the step without it), so a
        push's fate is never ambiguous while the receiver is reachable. UNAVAILABLE and
        ALREADY_EXISTS (an earlier attempt is still being withdrawn) are retried with backoff within
        the deadline; any other answer means not mixed: the sender keeps the share. A call that
        ended without an answer (its deadline passed, it was cancelled or broke: this peer may have
        been stalled while the receiver mixed it and said OK) is asked once more, briefly, after the
        deadline (`_ask_fate`): the receiver answers a decided key from its decision.
        """
        nbr = self._channels.get(peer)
        why = "deadline passed before the push started"
        attempt = 0
        sent = False  # some attempt may have reached the receiver: its fate is asked before giving up
        keep = any(k == KEEP_MD for k, _ in metadata)
        told: float | None = None  # the receiver's total absorbed, if an answer said it
        while (left := deadline - time.monotonic()) > 0:
            try:
                _, call = nbr.push.with_call(iter(payload), timeout=left, wait_for_ready=True,
                                             metadata=metadata or None)
            except grpc.RpcError as e:
                code, why = e.code(), _why(e)
                if code in _NO_ANSWER and not keep:  # ended unanswered: asked once more below
                    sent, told = True, read_absorbed(e)
                    break
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ALREADY_EXISTS):
                    return self._refused(peer, payload, tag, why, read_absorbed(e), keep)
                attempt += 1
                time.sleep(min(backoff_s(attempt), max(0.0, deadline - time.monotonic())))
                continue
            return self._mixed(peer, payload, call)
        if sent:
            fate = self._ask_fate(peer, payload, tag, metadata)
            if fate is not None:
                return fate
        return self._refused(peer, payload, tag, why, told, keep)

    def _ask_fate(self, peer: str, payload: EncodedPayload, tag: str,
                  metadata: tuple[tuple[str, str], ...]) -> PushFate | None:
        """The same push once more, for at most ``FATE_QUERY_S``, not waiting for a connection: a key the
        receiver decided is answered from its decision (OK with 0 bytes: it was mixed; ABORTED: not),
        an undecided one is offered as usual. None: no answer (the receiver is down or stalled too);
        the share stays here, and if it was mixed after all the ledger settles it (rule 6).

        Why: a sender stalled (SIGSTOP, swap, a long GC) past its call's deadline while the receiver
        mixed its push and answered OK never hears that OK; keeping the share made both ends count it
        until the ledger paid it back over the next rounds (the 600-round soak: 0.329 for 5 rounds)."""
        try:
            _, call = self._channels.get(peer).push.with_call(iter(payload), timeout=FATE_QUERY_S,
                                                              wait_for_ready=False, metadata=metadata or None)
        except ValueError:  # the channel was closed meanwhile (this peer is shutting down): no answer
            return None
        except grpc.RpcError as e:
            code = e.code()
            if code in _NO_ANSWER or code == grpc.StatusCode.UNAVAILABLE:
                return None
            return self._refused(peer, payload, tag, _why(e), read_absorbed(e), False)
        log.warning("%s %s: push to %s: its call ended unanswered, but the receiver had mixed it (asked again)",
                    self.peer_id, tag, peer)
        return self._mixed(peer, payload, call)

    def _mixed(self, peer: str, payload: EncodedPayload, call: Any) -> PushFate:
        """The receiver answered OK: the share is given (logged first, so a restart does not push it again)."""
        with self._lock:
            self._pushed += payload.wire_bytes
        self.server.gave(peer, int(payload.header.round), int(payload.header.step), payload)
        self._note_mixed(peer, int(payload.header.round), int(payload.header.step))
        live = self._liveness
        live.mark_up(peer)
        live.refusals.note(int(payload.header.round), peer, None)
        return True, read_absorbed(call)

    def _refused(self, peer: str, payload: EncodedPayload, tag: str, why: str, told: float | None,
                 keep: bool) -> PushFate:
        """The receiver answered, and not OK: the share stays here. A refusal still tells this peer's total
        absorbed there (``told``)."""
        live = self._liveness
        live.refusals.note(int(payload.header.round), peer, why)
        if why.startswith("ABORTED") and keep:
            return False, told  # withheld on purpose: the receiver knows; nothing failed
        live.failed(peer, why)
        log.warning("%s %s: push to %s not mixed (%s); its share stays here", self.peer_id, tag, peer, why[:300])
        return False, told

    def _offer(self, peer: str, share: float) -> None:
        """``share`` may reach ``peer`` from now on (a push about to leave, or one mixed before a restart)."""
        with self._lock:
            if self._offered is not None:
                self._offered[peer] = self._offered.get(peer, 0.0) + share

    def _note_mixed(self, peer: str, round: int, step: int) -> None:
        """Append (fsync'd) that ``peer`` mixed this peer's (round, step) push: it survives a kill."""
        if self._pushes_log is None:
            return
        with self._lock:
            self._mixed_pushes.add((peer, round, step))
            append_line(self._pushes_log, f"{peer} {round} {step}")


def _why(e: grpc.RpcError) -> str:
    """A failed call's status and details, bounded, for the log and the refusal counts."""
    return f"{e.code().name}: {bounded(e.details() or '', 300)}"


def read_absorbed(call: Any) -> float | None:
    """The receiver's running total absorbed from this peer, from a Push reply's trailing metadata."""
    try:
        md = call.trailing_metadata() or ()
    except Exception:  # an error raised before any call existed
        return None
    for k, v in md:
        if k == ABSORBED_MD and isinstance(v, str):
            try:
                x = float(v[:40])
            except ValueError:
                return None
            return x if x == x and x >= 0 and x != float("inf") else None
    return None


def load_pushes_log(path: Path, round: int) -> set[Key]:
    """The (receiver, round, step) pushes mixed at rounds >= ``round - DECISION_ROUNDS``; the log is
    rewritten to just those. Older than the checkpoint's round they are never pushed again, but a
    receiver restarted at an earlier round asks whether its push was given (`GivenPayloads.recovery`)."""
    keep: set[Key] = set()
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit() and int(parts[1]) >= round - DECISION_ROUNDS:
                keep.add((parts[0], int(parts[1]), int(parts[2])))
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, "".join(f"{p} {r} {s}\n" for p, r, s in sorted(keep)))
    return keep
