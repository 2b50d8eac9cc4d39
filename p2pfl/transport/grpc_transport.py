"""The gRPC transport: `Transport.exchange` over real sockets, with the semantics of MemoryTransport.

Pull mode: publish this peer's payload on its own `PeerServer`, then pull from every in-neighbour
of the plan in parallel (one long-lived channel per neighbour, each call bounded by the round's
deadline and ``wait_for_ready`` so a neighbour that starts late is waited for). Push mode: push the
payload to every out-neighbour in parallel and wait on the own inbox. A neighbour that fails —
unreachable, too late, rejected by validation — lands in ``missing`` with its reason logged; one bad
neighbour never raises. What arrives is the same `Message` the sender built, bitwise.

Byte accounting (docs/protocol.md, "Bytes"), the simulation's: ``bytes_recv`` is the wire bytes
this exchange read (including payloads that were then rejected); ``bytes_sent`` in pull mode is
the encoded payload's wire bytes once per out-neighbour of the plan, attributed to the round that
published it (the simulation's ``MemoryTransport`` counts the same), in push mode the pushes that
completed in this exchange. Counting what the server streamed instead put a neighbour's late pull
into the serving peer's next round, and a pull after its last round in no record at all. The
asynchronous mode (no round barrier: a neighbour pulls whichever round is newest, or none) still
reports the bytes served since the previous exchange.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from p2pfl.config import NetworkConfig
from p2pfl.messages import Message
from p2pfl.models.layout import TensorSpec
from p2pfl.proto import peer_pb2
from p2pfl.security.certs import TLSConfig
from p2pfl.topology import MixingPlan, Topology
from p2pfl.transport.base import ExchangeResult, Transport, TransportError
from p2pfl.transport.grpc_service import (
    ABSORBED_MD,
    DECISION_ROUNDS,
    EVIDENCE_MD,
    GIVEN_MD,
    KEEP_MD,
    PULL_METHOD,
    PUSH_METHOD,
    STATUS_METHOD,
    PeerServer,
    channel_options,
)
from p2pfl.transport.limits import bounded
from p2pfl.transport.pushsum import logged_totals, settle_budget
from p2pfl.transport.refusals import RefusalTracker
from p2pfl.wire.codec import Decoder, EncodedPayload, encode_frames, parse_frame
from p2pfl.wire.compress import WireFormat
from p2pfl.wire.validate import Expectation, WireError

__all__ = ["GrpcTransport", "bind_address", "start_grpc_peer"]

log = logging.getLogger(__name__)

_BACKOFF_BASE_S = 0.05  # first pause before retrying a transient failure
_BACKOFF_MAX_S = 1.0

#: A push's fate as the sender learns it: mixed or not, and the receiver's running total absorbed
#: from this peer right after it (None when the reply carried none).
PushFate = tuple[bool, float | None]

#: Push-sum: how long a finished peer keeps serving for a neighbour that is down (its ledger).
_LINGER_DOWN_S = 60.0



def backoff_s(attempt: int) -> float:
    """Jittered exponential backoff before retry ``attempt`` (1, 2, ...): 0.05 s doubling up to 1 s, x[0.5, 1.5)."""
    return min(_BACKOFF_MAX_S, _BACKOFF_BASE_S * 2 ** min(attempt - 1, 10)) * (0.5 + random.random())


def _identity(b: bytes) -> bytes:
    return b


@dataclass
class _Neighbour:
    """One neighbour's channel and the three calls on it (kept for the transport's lifetime)."""

    channel: grpc.Channel
    pull: Callable[..., Any]
    push: Callable[..., Any]
    status: Callable[..., Any]


class GrpcTransport(Transport):
    """`Transport` over the gRPC peer service; pairs with this peer's started `PeerServer`."""

    def __init__(
        self,
        peer_id: str,
        topology: Topology,
        server: PeerServer,
        *,
        tls: TLSConfig | None,
        network_cfg: NetworkConfig,
        expected_specs: Sequence[TensorSpec],
        scalar_keys: Iterable[str] = (),
        owns_server: bool = False,
        pushes_log: Path | None = None,
    ) -> None:
        """``tls=None`` requires ``network_cfg.insecure`` (plaintext is never a silent fallback).

        ``expected_specs`` / ``scalar_keys``: what every neighbour's payload must carry.
        ``owns_server``: `close` also stops ``server``. ``pushes_log`` (push mode, next to the
        checkpoint): the pushes receivers answered "mixed", kept across a restart so a replayed
        round does not count a share twice (docs/protocol.md).
        """
        if tls is None and not network_cfg.insecure:
            raise ValueError(
                "no TLS configuration given: pass tls=TLSConfig.load(certs_dir, peer_id), "
                "or set network.insecure (--insecure) for plaintext"
            )
        if tls is not None and network_cfg.insecure:
            raise ValueError("both a TLS configuration and network.insecure given; choose one")
        if tls is not None and tls.peer_id != peer_id:
            raise ValueError(f"TLS material is for peer {tls.peer_id!r}, not {peer_id!r}")
        if not server.started or server.peer_id != peer_id:
            raise ValueError(f"server must be the started PeerServer of {peer_id!r}")
        if (tls is None) != (server.tls is None):
            raise ValueError("the transport and its server must both use TLS or both be insecure")
        self.peer_id = peer_id
        self.topology = topology
        self.server = server
        self.tls = tls
        self.network_cfg = network_cfg
        self.expected_specs = tuple(expected_specs)
        self.scalar_keys = frozenset(scalar_keys)
        self.owns_server = owns_server
        self.chunk_bytes = int(network_cfg.chunk_kb) * 1024
        self.wire_format = WireFormat()  # wire.*: what neighbours' payloads must be encoded as (configure_wire)
        self.max_bytes = int(network_cfg.max_message_mb) << 20
        if self.chunk_bytes < 1 or self.max_bytes < 1:
            raise ValueError("network.chunk_kb and network.max_message_mb must be positive")
        self.topology_hash = topology.hash()
        nbrs = topology.possible_in_neighbours(peer_id) | topology.possible_out_neighbours(peer_id)
        # Pulls of this step, plus pushes of an earlier step that may still be running.
        self._pool = futures.ThreadPoolExecutor(
            max_workers=max(4, 2 * len(nbrs) + 2), thread_name_prefix=f"xchg-{peer_id}"
        )
        self._lock = threading.Lock()
        self._neighbours: dict[str, _Neighbour] = {}
        self._credentials = tls.channel_credentials() if tls is not None else None
        self._served_reported = server.served_bytes
        self._pushed = 0
        self._pushed_reported = 0
        self._closed = False
        self._last_published: tuple[tuple[int, int], frozenset[str]] | None = None
        self._pushes: list[futures.Future[PushFate]] = []
        # Push-sum ledger, sender side: per out-neighbour, the running total of mu given to it
        # (checkpointed with the state; docs/protocol.md, "Push-sum mass").
        self._given: dict[str, float] = {}
        self._deferred = 0.0  # settlement the node could not apply yet without breaking the floor (pushsum.debit)
        self._down: set[str] = set()  # neighbours noticed down: probed briefly, not waited for
        self._probe_why: dict[str, str] = {}  # neighbour -> why its last liveness probe failed
        self._refusals = RefusalTracker(peer_id)  # "refuses this peer" apart from "does not answer"
        # neighbours whose Status said they finished the run: every such answer, whichever call got
        # it, since the neighbour counts each as having told this peer (`PeerServer.told_finished`)
        self._finished: set[str] = set()
        self.probe_s = float(network_cfg.probe_s)
        self._latest: dict[tuple[str, int], Message] = {}  # async: freshest payload held per (peer, step)
        # A restarted peer (it has a checkpoint, or a pushes log from an earlier start) recovers the
        # pushes of its first round that it had mixed and lost with its state.
        restarted = server.round > 0 or (pushes_log is not None and pushes_log.exists())
        self._resumed_round = server.round if restarted else -1
        self._pushes_log = pushes_log
        self._mixed_pushes = _load_pushes_log(pushes_log, server.round) if pushes_log is not None else set()
        server.given_keys = self._mixed_pushes  # durable OKs: its recovery answers say "given" from them
        # The write-ahead log's lines for rounds >= the checkpoint's: what this peer mixed after its
        # checkpoint and lost with its state (restored after its first exchange, `pushsum.logged_totals`),
        # less the pushes their senders answer they kept (`_kept`: the OK never reached them).
        self._logged: list[tuple[str, int, int, float]] = []
        self._ckpt_absorbed: dict[str, float] = {}
        self._kept: set[tuple[str, int, int]] = set()
        if pushes_log is not None and server.mode == "push":
            server.ledger.log_path = pushes_log.with_suffix(".absorbed")
            self._logged = _load_absorb_log(server.ledger.log_path, server.round)
            if restarted:
                server.ledger.held = frozenset(topology.possible_in_neighbours(peer_id))

    # ---- channels ------------------------------------------------------------------------------

    def _neighbour(self, peer: str) -> _Neighbour:
        """The (lazily opened, then reused) channel to ``peer``."""
        with self._lock:
            n = self._neighbours.get(peer)
            if n is not None:
                return n
            target = self.topology.address(peer)
            if self._credentials is not None:
                ch = grpc.secure_channel(target, self._credentials, options=channel_options(self.chunk_bytes, peer))
            else:
                ch = grpc.insecure_channel(target, options=channel_options(self.chunk_bytes))
            n = _Neighbour(
                channel=ch,
                pull=ch.unary_stream(
                    PULL_METHOD,
                    request_serializer=peer_pb2.PullRequest.SerializeToString,
                    response_deserializer=parse_frame,
                ),
                push=ch.stream_unary(
                    PUSH_METHOD, request_serializer=_identity, response_deserializer=peer_pb2.PushReply.FromString
                ),
                status=ch.unary_unary(
                    STATUS_METHOD,
                    request_serializer=peer_pb2.StatusRequest.SerializeToString,
                    response_deserializer=peer_pb2.StatusReply.FromString,
                ),
            )
            self._neighbours[peer] = n
            return n

    def status(self, peer: str, timeout_s: float = 5.0, wait_for_ready: bool = True) -> peer_pb2.StatusReply:
        """Ask ``peer`` for its Status, naming this peer (raises grpc.RpcError when unreachable); an
        answer that says it finished the run is remembered (`_linger_for_ledger`)."""
        reply = self._neighbour(peer).status(peer_pb2.StatusRequest(requester=self.peer_id), timeout=timeout_s,
                                             wait_for_ready=wait_for_ready)
        if self.final_round is not None and reply.round > self.final_round:
            with self._lock:
                self._finished.add(peer)
        return reply

    def pull(self, peer: str, round: int, step: int, deadline_s: float) -> tuple[Message, int]:
        """Pull ``peer``'s payload for (round, step) alone: (message, wire bytes); `TransportError` with the reason.

        The same path `exchange` takes for each in-neighbour (validation included), for tools,
        tests and benchmarks that want one transfer.
        """
        msg, nbytes, why = self._pull_one(peer, round, step, time.monotonic() + deadline_s)
        if msg is None:
            raise TransportError(f"pull from {peer} (round {round} step {step}) failed: {why}")
        return msg, nbytes

    # ---- failure detection -------------------------------------------------------------------------

    def _mark_down(self, peer: str, why: str) -> None:
        with self._lock:
            if peer in self._down:
                return
            self._down.add(peer)
        log.warning("%s: neighbour %s is down (%s); later rounds probe it for %.1fs instead of waiting",
                    self.peer_id, peer, why[:200], self.probe_s)

    def _mark_up(self, peer: str) -> None:
        with self._lock:
            if peer not in self._down:
                return
            self._down.discard(peer)
        log.warning("%s: neighbour %s answers again", self.peer_id, peer)

    def is_down(self, peer: str) -> bool:
        with self._lock:
            return peer in self._down

    def _alive(self, peer: str) -> bool:
        """True unless ``peer`` is marked down and a short Status probe still gets no answer."""
        if not self.is_down(peer):
            return True
        try:
            self.status(peer, self.probe_s, wait_for_ready=False)
        except grpc.RpcError as e:  # without wait_for_ready it says why (a TLS handshake, a refused connection)
            self._probe_why[peer] = f"{e.code().name}: {bounded(e.details() or '', 300)}"
            return False
        self._mark_up(peer)
        return True

    def refused_streak(self) -> tuple[int, dict[str, str]]:
        """Rounds in a row in which every neighbour called refused this peer, and why (`RefusalTracker`)."""
        return self._refusals.streak()

    def _unanswered_probe(self, peer: str) -> str:
        return self._probe_why.get(peer, "UNAVAILABLE: no answer to a probe")

    def _failed(self, peer: str, why: str) -> None:
        """A call to ``peer`` failed; a dead or silent neighbour (not a refusal) is marked down."""
        if why.startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED")) or why.startswith("deadline"):
            self._mark_down(peer, why)

    # ---- exchange ------------------------------------------------------------------------------

    can_withhold = True

    def exchange(self, message: Message, plan: MixingPlan, deadline_s: float,
                 withhold: bool = False) -> ExchangeResult:
        """Publish/push ``message`` per ``plan``; collect the in-neighbours' payloads until ``deadline_s``.

        ``withhold`` (push mode): tell every out-neighbour that this peer keeps its whole share this
        step (they mix without it at once, without waiting).
        """
        self._check(message, plan)
        deadline = time.monotonic() + deadline_s
        if plan.mode == "push":
            return self._exchange_push(message, plan, deadline, withhold)
        return self._exchange_pull(message, plan, deadline)

    # ---- push-sum ledger -----------------------------------------------------------------------

    def ledger_state(self) -> dict[str, dict[str, float]] | None:
        """The running totals given (this peer as sender) and absorbed (as receiver), for the checkpoint."""
        if self.server.mode != "push":
            return None
        with self._lock:
            given = dict(self._given)
        return {"given": given, "absorbed": self.server.absorbed()}

    def late_settlement(self) -> float:
        return sum(self.server.pop_settled().values()) + self._take_deferred()

    def defer_settlement(self, amount: float) -> None:
        with self._lock:
            self._deferred += amount

    def _take_deferred(self) -> float:
        with self._lock:
            out, self._deferred = self._deferred, 0.0
        return out

    def restore_ledger(self, ledger: dict[str, Any] | None) -> None:
        """Restore the running totals saved with the checkpoint being resumed (the state they match)."""
        if not isinstance(ledger, dict):
            return
        with self._lock:
            self._given = {str(k): float(v) for k, v in dict(ledger.get("given") or {}).items()}
        self._ckpt_absorbed = {str(k): float(v) for k, v in dict(ledger.get("absorbed") or {}).items()}
        self.server.restore_absorbed(self._ckpt_absorbed)

    def _check(self, message: Message, plan: MixingPlan) -> None:
        if self._closed:
            raise RuntimeError(f"transport of {self.peer_id!r} is closed")
        if message.sender != self.peer_id or plan.peer != self.peer_id:
            raise ValueError(f"exchange of {self.peer_id!r} got a message from {message.sender!r} / plan of {plan.peer!r}")
        if (plan.round, plan.step) != (message.round, message.step):
            raise ValueError(
                f"plan is for round {plan.round} step {plan.step}, message for round {message.round} step {message.step}"
            )
        if plan.mode != self.server.mode:
            raise ValueError(f"plan mode {plan.mode!r} differs from the server's mode {self.server.mode!r}")

    def _exchange_pull(self, message: Message, plan: MixingPlan, deadline: float) -> ExchangeResult:
        payload = self.server.publish(message)
        self._last_published = ((message.round, message.step), frozenset(plan.out_weights))
        senders = list(plan.in_weights)
        jobs = {j: self._pool.submit(self._pull_checked, j, message.round, message.step, deadline) for j in senders}
        received: dict[str, Message] = {}
        missing: list[str] = []
        recv = 0
        for j in senders:
            msg, nbytes, why = self._result(jobs[j], deadline)
            recv += nbytes
            if msg is None:
                missing.append(j)
                log.warning("%s round %d step %d: no payload from %s: %s",
                            self.peer_id, message.round, message.step, j, why)
            else:
                received[j] = msg
        # This round's payload, once per reader it is published for (module doc: "Byte accounting")
        sent = payload.wire_bytes * len(plan.out_weights)
        return ExchangeResult(received=received, missing=missing, bytes_sent=sent, bytes_recv=recv)

    def _take_sent(self) -> int:
        served = self.server.served_bytes
        sent, self._served_reported = served - self._served_reported, served
        return sent + self._take_pushed()

    def _pull_checked(self, peer: str, round: int, step: int, deadline: float) -> tuple[Message | None, int, str]:
        """`_pull_one`, skipped for a neighbour that is down and does not answer a probe."""
        if not self._alive(peer):
            self._refusals.note(round, peer, self._unanswered_probe(peer))
            return None, 0, "neighbour is down (no answer to a probe)"
        msg, nbytes, why = self._pull_one(peer, round, step, deadline)
        self._refusals.note(round, peer, None if msg is not None else why)
        if msg is None:
            self._failed(peer, why)
        else:
            self._mark_up(peer)
        return msg, nbytes, why

    @staticmethod
    def _result(job: futures.Future[tuple[Message | None, int, str]], deadline: float) -> tuple[Message | None, int, str]:
        # Each call is bounded by its gRPC deadline; the margin only guards against a wedged thread.
        try:
            return job.result(timeout=max(0.0, deadline - time.monotonic()) + 5.0)
        except futures.TimeoutError:
            job.cancel()
            return None, 0, "the pull did not finish by the deadline"

    def _pull_one(self, peer: str, round: int, step: int, deadline: float,
                  evidence: bool = False) -> tuple[Message | None, int, str]:
        """Pull (round, step) from ``peer``: (message or None, wire bytes read, reason when None).

        UNAVAILABLE (connection lost, neighbour restarting, or the round too far ahead of it) is
        retried with jittered exponential backoff until the deadline; every other status is final.
        A payload that passed validation is evidence that ``peer`` reached ``round`` (`RoundEvidence`).
        ``evidence``: ask a push-mode peer for its published payload (not a recovery; never mixed).
        """
        nbr = self._neighbour(peer)
        md = ((EVIDENCE_MD, "1"),) if evidence else None
        req = peer_pb2.PullRequest(requester=self.peer_id, round=round, step=step, topology_hash=self.topology_hash)
        exp = Expectation(
            specs=self.expected_specs, round=round, step=step, topology_hash=self.topology_hash,
            senders=frozenset((peer,)), scalar_keys=self.scalar_keys, max_bytes=self.max_bytes,
            wire=self.wire_format,
        )
        nbytes = 0
        why = "deadline passed before the pull started"
        attempt = 0
        while (left := deadline - time.monotonic()) > 0:
            dec = Decoder(exp)
            call = nbr.pull(req, timeout=left, wait_for_ready=True, metadata=md)
            try:
                for item in call:
                    dec.feed(item)
                msg = dec.finish()
                self.server.progress.saw(peer, msg.round)
                return msg, nbytes + dec.wire_bytes, ""
            except WireError as e:
                call.cancel()
                return None, nbytes + dec.wire_bytes, f"payload rejected ({e.code}): {e.message}"
            except grpc.RpcError as e:
                nbytes += dec.wire_bytes
                code = e.code()
                why = f"{code.name}: {bounded(e.details() or '', 300)}"
                if code != grpc.StatusCode.UNAVAILABLE:
                    break
                attempt += 1
                time.sleep(min(backoff_s(attempt), max(0.0, deadline - time.monotonic())))
        return None, nbytes, why

    def _exchange_push(self, message: Message, plan: MixingPlan, deadline: float,
                       withhold: bool = False) -> ExchangeResult:
        self.server.set_round(message.round)
        payload = encode_frames(message, self.chunk_bytes)
        self.server.publish(message, payload)  # served to evidence Pulls only (a lagging receiver's proof)
        tag = f"round {message.round} step {message.step}"
        with self._lock:
            claims = {k: self._given.get(k, 0.0) for k in plan.out_weights}
        pushes = {k: self._pool.submit(self._push_checked, k, payload, deadline, tag, claims[k], withhold)
                  for k in plan.out_weights}
        self._pushes = list(pushes.values())
        keys = [(j, message.round, message.step) for j in plan.in_weights]
        if message.round == self._resumed_round:
            for key in keys:  # answers land in the inbox (or close the key) while take waits
                self.server.recovering(key, True)
                self._pool.submit(self._recover_one, key, deadline)
        alive = [j for j in plan.in_weights if self._alive(j)]
        got = self.server.take(keys, deadline, wait_for=alive)
        received = {j: got[j][0] for j in plan.in_weights if j in got}
        held_back = {k[0] for k in self.server.withheld(keys)}
        withheld = [j for j in plan.in_weights if j not in got and j in held_back]
        missing = [j for j in plan.in_weights if j not in got and j not in held_back]
        for j in withheld:
            self._mark_up(j)
        for j in missing:
            log.warning("%s %s: no push from %s by the deadline", self.peer_id, tag, j)
            if j in alive:
                self._mark_down(j, "no push by the deadline")
        for j in received:
            self._mark_up(j)
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
        if message.round >= self._resumed_round:
            self.server.ledger.held = frozenset()  # recovery is over: claims settle again
        if self._logged:  # the resumed round: what recovery (rule 4) did not bring back
            with self._lock:
                kept = set(self._kept)
            for j, total in logged_totals(self._ckpt_absorbed, self._logged, kept).items():
                got_back = self.server.raise_absorbed(j, total)
                if got_back:
                    log.warning("%s %s: %.6g of push-sum weight from %s, mixed before the restart, restored "
                                "from the write-ahead log", self.peer_id, tag, got_back, j)
                self.server.note_settled(j, got_back)
            self._logged = []
        settle = sum(self.server.pop_settled().values())
        if settle:
            log.warning("%s %s: absorbed %.6g of push-sum weight lost in a restart (settled by the ledger)",
                        self.peer_id, tag, settle)
        settle -= self._settle_given(message, plan, fates, undelivered, tag)
        settle += self._take_deferred()
        recv = sum(n for _, n in got.values())
        return ExchangeResult(received=received, missing=missing, bytes_sent=self._take_sent(),
                              bytes_recv=recv, undelivered=undelivered, mu_settle=settle, withheld=withheld)

    def _settle_given(self, message: Message, plan: MixingPlan, fates: dict[str, PushFate],
                      undelivered: list[str], tag: str) -> float:
        """Add this step's delivered shares to the running totals given; return the weight this peer
        gives now to settle what it owes (a receiver absorbed more than this peer's state gave it: a
        push mixed there whose answer this peer lost, e.g. in its own restart from an older
        checkpoint), as much as `pushsum.settle_budget` allows this step (the rest on its next push)."""
        mu = float(message.scalars.get("mu", 0.0))
        keep = mu * (plan.self_weight + sum(plan.out_weights[k] for k in undelivered))
        last = self.final_round is not None and message.round >= self.final_round
        budget = settle_budget(keep, plan.self_weight, mu, last=last)
        owed = 0.0
        with self._lock:
            for k, (ok, absorbed) in fates.items():
                total = self._given.get(k, 0.0) + (plan.out_weights[k] * mu if ok else 0.0)
                if absorbed is not None and absorbed > total:
                    pay = min(absorbed - total, max(0.0, budget - owed))
                    owed += pay
                    total = absorbed if pay == absorbed - total else total + pay
                self._given[k] = total
        if owed:
            log.warning("%s %s: gave %.6g of push-sum weight a receiver had already absorbed (settled by the ledger)",
                        self.peer_id, tag, owed)
        return owed

    def _recover_one(self, key: tuple[str, int, int], deadline: float) -> None:
        """After a restart, while waiting for the pushes of the resumed round: ask the sender (Pull,
        in push mode) whether it had given this peer that round's push, then lost with the
        uncheckpointed state. Given: recovered into the inbox. Given, but the payload no longer held
        (ALREADY_EXISTS: in the sender's durable log of OKs): closed; the write-ahead log restores its
        share. Kept by the sender (ABORTED: it moved past the round without an OK): closed, and a
        share this peer's write-ahead log holds for it is *not* restored -- its OK never reached the
        sender, which kept the share (issue 68: both counted it, sum mu = 4.5). Not decided yet
        (NOT_FOUND): the push itself will come.
        """
        try:
            msg, nbytes, why = self._pull_one(key[0], key[1], key[2], deadline)
            if msg is not None:
                log.warning("%s: recovered the round %d step %d push of %s lost in the restart",
                            self.peer_id, key[1], key[2], key[0])
                self.server.deliver(key, msg, nbytes)
            elif why.startswith("ABORTED"):
                with self._lock:
                    self._kept.add(key)
                self.server.close(key)
            elif why.startswith("ALREADY_EXISTS"):
                self.server.close(key)
        finally:
            self.server.recovering(key, False)

    def _push_checked(self, peer: str, payload: EncodedPayload, deadline: float, tag: str,
                      claim: float = 0.0, withhold: bool = False) -> PushFate:
        key = (peer, int(payload.header.round), int(payload.header.step))
        if key in self._mixed_pushes:  # mixed before this peer restarted: the same payload, not again
            log.info("%s %s: push to %s was mixed before the restart", self.peer_id, tag, peer)
            self.server.gave(peer, key[1], key[2], payload)
            return True, None
        if not self._alive(peer):
            self._refusals.note(key[1], peer, self._unanswered_probe(peer))
            log.warning("%s %s: push to %s skipped: neighbour is down; its share stays here", self.peer_id, tag, peer)
            return False, None
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
        the deadline; anything else, or the deadline, means not mixed: the sender keeps the share.
        """
        nbr = self._neighbour(peer)
        why = "deadline passed before the push started"
        attempt = 0
        while (left := deadline - time.monotonic()) > 0:
            try:
                _, call = nbr.push.with_call(iter(payload), timeout=left, wait_for_ready=True,
                                             metadata=metadata or None)
            except grpc.RpcError as e:
                code = e.code()
                why = f"{code.name}: {bounded(e.details() or '', 300)}"
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ALREADY_EXISTS):
                    self._refusals.note(int(payload.header.round), peer, why)
                    told = _absorbed(e)  # a refusal still tells this peer's total absorbed there
                    if why.startswith("ABORTED") and any(k == KEEP_MD for k, _ in metadata):
                        return False, told  # withheld on purpose: the receiver knows; nothing failed
                    self._failed(peer, why)
                    log.warning("%s %s: push to %s not mixed (%s); its share stays here", self.peer_id, tag,
                                peer, why[:300])
                    return False, told
                attempt += 1
                time.sleep(min(backoff_s(attempt), max(0.0, deadline - time.monotonic())))
                continue
            with self._lock:
                self._pushed += payload.wire_bytes
            self.server.gave(peer, int(payload.header.round), int(payload.header.step), payload)
            self._note_mixed(peer, int(payload.header.round), int(payload.header.step))
            self._mark_up(peer)
            self._refusals.note(int(payload.header.round), peer, None)
            return True, _absorbed(call)
        self._refusals.note(int(payload.header.round), peer, why)
        self._failed(peer, why)
        log.warning("%s %s: push to %s not mixed (%s); its share stays here", self.peer_id, tag, peer, why[:300])
        return False, None

    # ---- asynchronous gossip -----------------------------------------------------------------

    def exchange_latest(self, message: Message, plan: MixingPlan, max_staleness: int,
                        wait_s: float) -> ExchangeResult:
        """Publish ``message``; return the freshest payload of each in-neighbour, no round barrier.

        For each in-neighbour: ask its Status (its latest published round r_j), pull (r_j, step)
        unless it is what this peer already holds, and keep the newest copy. Payloads with
        r_j < round - max_staleness are dropped (missing). Nobody waits longer than ``wait_s`` for
        a neighbour (a slow one is mixed at its last known state, a down one not at all).
        """
        self._check(message, plan)
        if plan.mode != "pull":
            raise ValueError("asynchronous gossip needs pull mode (push-sum needs the round barrier)")
        self.server.publish(message)
        self._last_published = ((message.round, message.step), frozenset(plan.out_weights))
        deadline = time.monotonic() + wait_s
        senders = list(plan.in_weights)
        jobs = {j: self._pool.submit(self._latest_one, j, message.step, deadline) for j in senders}
        received: dict[str, Message] = {}
        missing: list[str] = []
        recv = 0
        for j in senders:
            msg, nbytes, why = self._result(jobs[j], deadline)
            recv += nbytes
            if msg is not None:
                self._latest[(j, message.step)] = msg
            held = self._latest.get((j, message.step))
            if held is not None and message.round - held.round <= max_staleness:
                received[j] = held
            else:
                missing.append(j)
                log.info("%s round %d: nothing fresh from %s: %s", self.peer_id, message.round, j,
                         why or f"newest held is round {held.round if held else None}")
        return ExchangeResult(received=received, missing=missing, bytes_sent=self._take_sent(), bytes_recv=recv)

    def _latest_one(self, peer: str, step: int, deadline: float) -> tuple[Message | None, int, str]:
        """The payload ``peer`` published last, if newer than the one held; (None, 0, why) otherwise."""
        if not self._alive(peer):
            return None, 0, "neighbour is down"
        try:
            st = self.status(peer, max(0.05, deadline - time.monotonic()), wait_for_ready=False)
        except grpc.RpcError as e:
            self._failed(peer, f"{e.code().name}: {bounded(e.details() or '', 300)}")
            return None, 0, f"status: {e.code().name}"
        held = self._latest.get((peer, step))
        r = int(st.round)
        if held is not None and held.round >= r:
            return None, 0, "nothing newer"
        msg, nbytes, why = self._pull_one(peer, r, step, deadline)
        if msg is None:
            self._failed(peer, why)
        return msg, nbytes, why

    # ---- rejoin ------------------------------------------------------------------------------

    def resumed_round(self) -> int:
        return self._resumed_round

    def proven_rounds(self, peers: Iterable[str], probe: Iterable[str], timeout_s: float) -> dict[str, int]:
        """Per peer of ``peers``, the highest round of a validated payload from it; those in ``probe``
        are asked first (in parallel, each bounded by ``timeout_s``): `_prove`."""
        asked = sorted(set(probe))
        if asked:
            list(self._pool.map(lambda p: self._prove(p, timeout_s), asked))
        return self.server.progress.rounds(peers)

    def _prove(self, peer: str, timeout_s: float) -> None:
        """Ask ``peer`` where it is (Status: a claim, used only as where to look), then pull that
        round's payload (its step 0): once it passes validation it is evidence (`RoundEvidence`). A peer
        that claims a round it never published proves nothing; one that does not answer, neither."""
        deadline = time.monotonic() + timeout_s
        try:
            claimed = int(self.status(peer, timeout_s, wait_for_ready=False).round)
        except grpc.RpcError:
            return
        if claimed <= self.server.round or (self.final_round is not None and claimed > self.final_round):
            return  # not ahead (nothing to prove), or finished (no round of the run to move to)
        self._pull_one(peer, claimed, 0, deadline, evidence=True)

    def _note_mixed(self, peer: str, round: int, step: int) -> None:
        """Append (fsync'd) that ``peer`` mixed this peer's (round, step) push: it survives a kill."""
        if self._pushes_log is None:
            return
        with self._lock:
            self._mixed_pushes.add((peer, round, step))
            with open(self._pushes_log, "a") as f:
                f.write(f"{peer} {round} {step}\n")
                f.flush()
                os.fsync(f.fileno())

    def _take_pushed(self) -> int:
        with self._lock:
            n, self._pushed_reported = self._pushed - self._pushed_reported, self._pushed
        return n

    def linger(self, deadline_s: float) -> None:
        """Before stopping: let the neighbours get this peer's last payload (up to ``deadline_s``).

        A peer that finishes first would otherwise take its final payload away from neighbours that
        are still one exchange behind: pull mode waits until every planned puller completed its Pull;
        push mode waits for its own pushes in flight.
        """
        deadline = time.monotonic() + deadline_s
        if self._last_published is not None:
            key, pullers = self._last_published
            pullers = frozenset(p for p in pullers if not self.is_down(p))
            left = self.server.wait_pulled(key, pullers, deadline)
            if left:
                log.warning("%s: stopping before %s pulled round %d step %d", self.peer_id,
                            ",".join(sorted(left)), key[0], key[1])
        if self._pushes:
            futures.wait(self._pushes, timeout=max(0.0, deadline - time.monotonic()))
        if self.server.mode == "push" and self.final_round is not None:
            self._linger_for_ledger(deadline_s)

    def _linger_for_ledger(self, deadline_s: float) -> None:
        """Push-sum: a finished peer serves on (at most ``_LINGER_DOWN_S``) until

        * every in-neighbour reports (Status) that it finished too: before that, one killed after this
          peer mixed its last push and before it heard the OK replays that push after its restart,
          and only this peer's answer (the push is refused "round over" with its total absorbed)
          tells it the share is given, not kept (CI of 7382d4c: a receiver that had finished and
          restarted left at once, the sender kept the share it had also given: sum mu = 4.5);
        * every out-neighbour has asked this peer's Status since it finished (it then knows, and may
          leave: without this, two finished neighbours could each wait for the other to be seen
          finished after it had already gone; a fault-free out-neighbour never leaves before it
          asked, and one that is down asks when it is back);
        * no neighbour this peer found down stays down, and one deadline has passed since the last
          came back, so a neighbour restarted after this peer finished can still recover its lost
          push here (rule 4) or settle with it (docs/protocol.md, "Push-sum mass", rule 6).
        """
        assert self.final_round is not None
        rounds = self.final_round + 1
        self.server.finish(rounds)
        ins = sorted(self.topology.possible_in_neighbours(self.peer_id) - {self.peer_id})
        outs = sorted(self.topology.possible_out_neighbours(self.peer_id) - {self.peer_id})
        nbrs = sorted(set(ins) | set(outs))
        start = time.monotonic()
        bound = start + max(deadline_s, _LINGER_DOWN_S)
        last_down: float | None = None
        said = False
        while (now := time.monotonic()) < bound:
            for p in nbrs:  # one Status call each: it also tells a finished one this peer knows
                try:
                    self.status(p, self.probe_s, wait_for_ready=False)
                except grpc.RpcError:
                    continue
                if self.is_down(p):
                    self._mark_up(p)
            with self._lock:
                finished = set(self._finished)
            if any(self.is_down(p) for p in nbrs):
                last_down = now
            waiting = [p for p in ins if p not in finished]
            # an out-neighbour down now comes back asking (a fault-free one never leaves without)
            waiting += [p for p in outs if not self.server.told_finished(p)]
            if not waiting and (last_down is None or now - last_down >= deadline_s):
                return
            if not said and now - start >= 2 * self.probe_s:
                log.warning("%s: finished; serving on for its ledger while %s %s", self.peer_id,
                            ",".join(sorted(set(waiting)) or [p for p in nbrs if self.is_down(p)]),
                            "not finished" if waiting else "down")
                said = True
            time.sleep(max(0.02, min(0.1, bound - time.monotonic())))
        log.warning("%s: stopping with %s not finished or down", self.peer_id,
                    ",".join(p for p in nbrs if (p in ins and p not in self._finished) or self.is_down(p)))

    def configure_wire(self, fmt: WireFormat, chunk_bytes: int | None = None) -> None:
        """The wire format for the neighbours' payloads this peer pulls and for the pushes its server takes."""
        self.wire_format = fmt
        self.server.wire_format = fmt

    def close(self) -> None:
        """Close channels and worker threads; stop the server too when this transport owns it."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            nbrs, self._neighbours = list(self._neighbours.values()), {}
        for n in nbrs:
            n.channel.close()
        if self.owns_server:
            self.server.stop(1.0)


def _absorbed(call: Any) -> float | None:
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


def _load_absorb_log(path: Path, round: int) -> list[tuple[str, int, int, float]]:
    """The write-ahead log's lines (sender, round, step, total absorbed after it) at rounds >= ``round``,
    in order; the log keeps just those lines. A line torn by a kill is dropped (its OK was never sent)."""
    lines: list[tuple[str, int, int, float]] = []
    keep: list[str] = []
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) != 4 or not (parts[1].isdigit() and parts[2].isdigit()):
                continue
            try:
                total = float(parts[3])
            except ValueError:
                continue
            if int(parts[1]) >= round and total == total and total >= 0:
                lines.append((parts[0], int(parts[1]), int(parts[2]), total))
                keep.append(line)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(x + "\n" for x in keep))
    os.replace(tmp, path)
    return lines


def _load_pushes_log(path: Path, round: int) -> set[tuple[str, int, int]]:
    """The (receiver, round, step) pushes mixed at rounds >= ``round - DECISION_ROUNDS``; the log is
    rewritten to just those. Older than the checkpoint's round they are never pushed again, but a
    receiver restarted at an earlier round asks whether its push was given (`PeerServer._recovery`)."""
    keep: set[tuple[str, int, int]] = set()
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit() and int(parts[1]) >= round - DECISION_ROUNDS:
                keep.add((parts[0], int(parts[1]), int(parts[2])))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{p} {r} {s}\n" for p, r, s in sorted(keep)))
    os.replace(tmp, path)
    return keep


def bind_address(address: str) -> str:
    """Where to listen for a topology address: exactly the host given when it is an IP address or
    ``localhost`` (any case: ``LOCALHOST:PORT`` must not listen on all interfaces); every interface
    only for a DNS name, e.g. a container's ``peer-3:50051``, which names this host as the others see it.
    """
    from p2pfl.topology.address import listen_address

    return listen_address(address)


def start_grpc_peer(
    topology: Topology,
    peer_id: str,
    network_cfg: NetworkConfig,
    *,
    expected_specs: Sequence[TensorSpec],
    scalar_keys: Iterable[str] = (),
    seed: int = 0,
    mode: str = "pull",
    bind: str | None = None,
    start_round: int = 0,
    pushes_log: Path | None = None,
) -> GrpcTransport:
    """Start ``peer_id``'s server (mutual TLS from ``network_cfg.certs`` unless insecure) and its transport.

    The returned transport owns the server: ``close()`` stops both. ``start_round``: the round a
    resumed peer is at (its checkpoint's), so it serves where it stands from the first request on.
    """
    if network_cfg.insecure:
        tls = None
        log.warning("%s: running INSECURE (plaintext, callers identified by the id they claim)", peer_id)
    else:
        if not network_cfg.certs:
            raise ValueError(
                "network.certs is not set: point it at the folder made by `p2pfl certs`, or run with --insecure"
            )
        tls = TLSConfig.load(network_cfg.certs, peer_id)
    server = PeerServer()
    server.start(
        bind or bind_address(topology.address(peer_id)), topology, peer_id,
        expected_specs=expected_specs, scalar_keys=scalar_keys, seed=seed, mode=mode, tls=tls,
        insecure=network_cfg.insecure, max_message_mb=network_cfg.max_message_mb,
        chunk_bytes=int(network_cfg.chunk_kb) * 1024, window=network_cfg.window, start_round=start_round,
    )
    try:
        return GrpcTransport(
            peer_id, topology, server, tls=tls, network_cfg=network_cfg, expected_specs=expected_specs,
            scalar_keys=scalar_keys, owns_server=True, pushes_log=pushes_log if mode == "push" else None,
        )
    except BaseException:
        server.stop(0)
        raise
