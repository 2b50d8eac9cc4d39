"""The pull client: fetch a neighbour's payload for (round, step), validated, retried within the deadline.

Why: pull mode's exchange, the asynchronous mode's "newest of each neighbour", a restarted
receiver's recovery of a lost push and the catch-up's evidence all read a neighbour's payload the
same way -- one Pull, every chunk through the codec's validation, UNAVAILABLE retried with
jittered backoff until the deadline, any other status final. A payload that passed validation is
evidence that its sender reached its round (`p2pfl.transport.progress.RoundEvidence`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent import futures

import grpc

from p2pfl.models.layout import TensorSpec
from p2pfl.payload import Payload
from p2pfl.proto import peer_pb2
from p2pfl.topology import MixingPlan
from p2pfl.transport.base import ExchangeResult
from p2pfl.transport.channels import Channels, backoff_s
from p2pfl.transport.grpc_service import PeerServer
from p2pfl.transport.limits import bounded
from p2pfl.transport.liveness import Liveness
from p2pfl.transport.rpc import EVIDENCE_MD, TRANSPORT_LOG
from p2pfl.wire.codec import Decoder
from p2pfl.wire.compress import WireFormat
from p2pfl.wire.validate import Expectation, WireError

__all__ = ["PullClient", "PullResult"]

log = TRANSPORT_LOG

#: One pull's outcome: the message (None on failure), the wire bytes read, and why it failed ("" if not).
PullResult = tuple[Payload | None, int, str]


class PullClient:
    """Pulls of one peer from its neighbours, over `Channels`, noting each outcome in `Liveness`."""

    def __init__(self, peer_id: str, topology_hash: str, server: PeerServer, channels: Channels, liveness: Liveness,
                 pool: futures.ThreadPoolExecutor, expected_specs: tuple[TensorSpec, ...],
                 scalar_keys: frozenset[str], max_bytes: int) -> None:
        self.peer_id = peer_id
        self.topology_hash = topology_hash
        self.server = server
        self.expected_specs = expected_specs
        self.scalar_keys = scalar_keys
        self.max_bytes = max_bytes
        self.wire_format = WireFormat()  # wire.*: what neighbours' payloads must be encoded as (configure_wire)
        self._channels = channels
        self._liveness = liveness
        self._pool = pool
        self._latest: dict[tuple[str, int], Payload] = {}  # async: freshest payload held per (peer, step)

    def pull_one(self, peer: str, round: int, step: int, deadline: float, evidence: bool = False) -> PullResult:
        """Pull (round, step) from ``peer``: (message or None, wire bytes read, reason when None).

        UNAVAILABLE (connection lost, neighbour restarting, or the round too far ahead of it) is
        retried with jittered exponential backoff until the deadline; every other status is final.
        A payload that passed validation is evidence that ``peer`` reached ``round`` (`RoundEvidence`).
        ``evidence``: ask a push-mode peer for its published payload (not a recovery; never mixed).
        """
        nbr = self._channels.get(peer)
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

    def pull_checked(self, peer: str, round: int, step: int, deadline: float) -> PullResult:
        """`pull_one`, skipped for a neighbour that is down and does not answer a probe."""
        live = self._liveness
        if not live.alive(peer):
            live.refusals.note(round, peer, live.unanswered_probe(peer))
            return None, 0, "neighbour is down (no answer to a probe)"
        msg, nbytes, why = self.pull_one(peer, round, step, deadline)
        live.refusals.note(round, peer, None if msg is not None else why)
        if msg is None:
            live.failed(peer, why)
        else:
            live.mark_up(peer)
        return msg, nbytes, why

    @staticmethod
    def result(job: futures.Future[PullResult], deadline: float) -> PullResult:
        # Each call is bounded by its gRPC deadline; the margin only guards against a wedged thread.
        try:
            return job.result(timeout=max(0.0, deadline - time.monotonic()) + 5.0)
        except futures.TimeoutError:
            job.cancel()
            return None, 0, "the pull did not finish by the deadline"

    def exchange(self, message: Payload, plan: MixingPlan, deadline: float, wire_bytes: int) -> ExchangeResult:
        """Pull mode, after ``message`` was published (``wire_bytes`` encoded): pull every in-neighbour of the plan in parallel."""
        senders = list(plan.in_weights)
        jobs = {j: self._pool.submit(self.pull_checked, j, message.round, message.step, deadline) for j in senders}
        received: dict[str, Payload] = {}
        missing: list[str] = []
        recv = 0
        for j in senders:
            msg, nbytes, why = self.result(jobs[j], deadline)
            recv += nbytes
            if msg is None:
                missing.append(j)
                log.warning("%s round %d step %d: no payload from %s: %s",
                            self.peer_id, message.round, message.step, j, why)
            else:
                received[j] = msg
        # This round's payload, once per reader it is published for (grpc_transport's doc: "Byte accounting")
        sent = wire_bytes * len(plan.out_weights)
        return ExchangeResult(received=received, missing=missing, bytes_sent=sent, bytes_recv=recv)

    def latest(self, message: Payload, plan: MixingPlan, max_staleness: int, wait_s: float) -> ExchangeResult:
        """Asynchronous gossip, after ``message`` was published: the freshest payload of each in-neighbour
        (`GrpcTransport.exchange_latest`); ``bytes_sent`` is left to the caller."""
        deadline = time.monotonic() + wait_s
        senders = list(plan.in_weights)
        jobs = {j: self._pool.submit(self._latest_one, j, message.round, message.step, deadline) for j in senders}
        received: dict[str, Payload] = {}
        missing: list[str] = []
        recv = 0
        for j in senders:
            msg, nbytes, why = self.result(jobs[j], deadline)
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
        return ExchangeResult(received=received, missing=missing, bytes_recv=recv)

    def _latest_one(self, peer: str, round: int, step: int, deadline: float) -> PullResult:
        """The payload ``peer`` published last, if newer than the one held; (None, 0, why) otherwise.
        How ``peer`` answered is noted for this peer's ``round`` (`RefusalTracker`), as in pull mode: an
        asynchronous peer that every neighbour refuses stops too, instead of mixing stale payloads alone."""
        live = self._liveness
        if not live.alive(peer):
            live.refusals.note(round, peer, live.unanswered_probe(peer))
            return None, 0, "neighbour is down"
        try:
            st = live.status(peer, max(0.05, deadline - time.monotonic()), wait_for_ready=False)
        except grpc.RpcError as e:
            why = f"{e.code().name}: {bounded(e.details() or '', 300)}"
            live.refusals.note(round, peer, why)
            live.failed(peer, why)
            return None, 0, f"status: {e.code().name}"
        held = self._latest.get((peer, step))
        r = int(st.round)
        if held is not None and held.round >= r:
            live.refusals.note(round, peer, None)  # it answered: nothing newer to fetch
            return None, 0, "nothing newer"
        msg, nbytes, why = self.pull_one(peer, r, step, deadline)
        live.refusals.note(round, peer, None if msg is not None else why)
        if msg is None:
            live.failed(peer, why)
        return msg, nbytes, why

    def proven_rounds(self, peers: Iterable[str], probe: Iterable[str], timeout_s: float,
                      final_round: int | None) -> dict[str, int]:
        """Per peer of ``peers``, the highest round of a validated payload from it; those in ``probe``
        are asked first (in parallel, each bounded by ``timeout_s``): `_prove`."""
        asked = sorted(set(probe))
        if asked:
            list(self._pool.map(lambda p: self._prove(p, timeout_s, final_round), asked))
        return self.server.progress.rounds(peers)

    def _prove(self, peer: str, timeout_s: float, final_round: int | None) -> None:
        """Ask ``peer`` where it is (Status: a claim, used only as where to look), then pull that
        round's payload (its step 0): once it passes validation it is evidence (`RoundEvidence`). A peer
        that claims a round it never published proves nothing; one that does not answer, neither."""
        deadline = time.monotonic() + timeout_s
        try:
            claimed = int(self._liveness.status(peer, timeout_s, wait_for_ready=False).round)
        except grpc.RpcError:
            return
        if claimed <= self.server.round or (final_round is not None and claimed > final_round):
            return  # not ahead (nothing to prove), or finished (no round of the run to move to)
        self.pull_one(peer, claimed, 0, deadline, evidence=True)
