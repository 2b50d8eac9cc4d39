"""The peer service's RPC handlers: Pull, Push and Status (``p2pfl/proto/peer.proto``).

Why a module of its own: a handler is the order of checks a call goes through -- who is calling,
may it (topology, plan, quota), is its request for a round this peer serves, is its payload valid
-- and then one question to the state that answers it (the publication window, the inbox). Every
rejection is a gRPC error with a precise message, logged at WARNING (`Admission.reject`), and
changes nothing. The state and its rules live in `publication`, `inbox` and `pushsum`; the handlers
only read the wire and wire those together.

Pull and Push use the codec's frame functions as (de)serializers: the server yields pre-serialized
chunks and reads data chunks as zero-copy views. The bytes on the wire are plain ``peer.proto``
messages, so the generated stubs talk to this server unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import grpc

from p2pfl.proto import peer_pb2
from p2pfl.transport.admission import Admission
from p2pfl.transport.inbox import Inbox
from p2pfl.transport.limits import Call, Undecodable, safe_deserializer
from p2pfl.transport.publication import GivenPayloads, PublicationWindow
from p2pfl.transport.pushsum import ReceiverLedger
from p2pfl.transport.rpc import (
    ABSORBED_MD,
    EVIDENCE_MD,
    GIVEN_MD,
    KEEP_MD,
    Rejected,
    identity,
    status_for,
    version,
)
from p2pfl.transport.service_config import ServiceConfig
from p2pfl.wire.codec import Decoder, EncodedPayload, RawData, parse_frame
from p2pfl.wire.validate import Expectation, Reason, WireError, excerpt

__all__ = ["PeerHandlers"]

#: How a Pull waits for its payload: (round, step), the call -> the payload, or None if the caller went away.
WaitPublished = Callable[[tuple[int, int], grpc.ServicerContext], "EncodedPayload | None"]


class PeerHandlers:
    """The Pull, Push and Status behaviours of one `PeerServer`, over the parts it owns.

    ``wait_published`` is the server's own wait (`PeerServer._wait_published`), looked up at each
    call, so a test can hold a Pull open by replacing it on the class.
    """

    def __init__(self, config: ServiceConfig, admission: Admission, window: PublicationWindow, inbox: Inbox,
                 given: GivenPayloads, ledger: ReceiverLedger, wait_published: WaitPublished) -> None:
        self._config = config
        self._admission = admission
        self._window = window
        self._inbox = inbox
        self._given = given
        self._ledger = ledger
        self._wait_published = wait_published

    def method_handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """The service's methods, each guarded by admission (quota slot, call limit)."""
        guarded = self._admission.guarded
        return {
            "Pull": grpc.unary_stream_rpc_method_handler(
                guarded("Pull", self.pull, streaming=True),
                request_deserializer=safe_deserializer(peer_pb2.PullRequest.FromString),
                response_serializer=identity,
            ),
            "Push": grpc.stream_unary_rpc_method_handler(
                guarded("Push", self.push),
                request_deserializer=safe_deserializer(parse_frame),
                response_serializer=peer_pb2.PushReply.SerializeToString,
            ),
            "Status": grpc.unary_unary_rpc_method_handler(
                guarded("Status", self.status),
                request_deserializer=safe_deserializer(peer_pb2.StatusRequest.FromString),
                response_serializer=peer_pb2.StatusReply.SerializeToString,
            ),
        }

    def pull(self, request: peer_pb2.PullRequest, context: grpc.ServicerContext, call: Call) -> Iterator[bytes]:
        cfg, adm = self._config, self._admission
        caller = adm.caller(context, request.requester, "Pull")
        adm.admit(call, caller)
        r, s = int(request.round), int(request.step)
        what = f"Pull(round {r}, step {s})"
        if caller not in cfg.may_pull:
            adm.reject(context, what, caller, grpc.StatusCode.PERMISSION_DENIED,
                       f"peer {caller!r} is not an out-neighbour of {cfg.peer_id!r} in the topology; it may not pull")
        if request.topology_hash != cfg.topology_hash:
            adm.reject(context, what, caller, grpc.StatusCode.FAILED_PRECONDITION,
                       f"topology hash {excerpt(request.topology_hash)} differs from this peer's {cfg.topology_hash!r}")
        evidence = any(k == EVIDENCE_MD and v == "1" for k, v in (context.invocation_metadata() or ()))
        payload: EncodedPayload | None
        if cfg.mode != "pull" and not evidence:
            # Push mode serves one kind of Pull besides evidence: a restarted receiver recovering a push
            # it had mixed but lost with its uncheckpointed state (docs/protocol.md, "Push-sum mass").
            got = self._given.recovery(caller, r, s)
            if isinstance(got, Rejected):
                adm.reject(context, what, caller, got.code, got.message)
            payload = got
        else:
            why = self._window.window_error(r)
            if why:
                adm.reject(context, what, caller, *why)
            if caller not in cfg.plan(r, s).out_weights:
                adm.reject(context, what, caller, grpc.StatusCode.PERMISSION_DENIED,
                           f"peer {caller!r} does not pull from {cfg.peer_id!r} at round {r} step {s}")
            try:
                payload = self._wait_published((r, s), context)
            except Rejected as e:
                adm.reject(context, what, caller, e.code, e.message)
        if payload is None:  # the caller went away
            return
        sent = 0
        try:
            for frame in payload:
                yield frame
                sent += len(frame)
        finally:
            self._window.served((r, s), caller, sent, payload.wire_bytes)

    def push(self, request_iterator: Iterator[peer_pb2.Chunk | RawData | Undecodable], context: grpc.ServicerContext,
             call: Call) -> peer_pb2.PushReply:
        cfg, adm = self._config, self._admission
        cert_id = adm.caller(context, "", "Push") if cfg.tls is not None else None
        if cert_id is not None:
            adm.admit(call, cert_id)
        chunks = _decodable(request_iterator)
        if cert_id is not None and cert_id not in cfg.may_push:
            adm.reject(context, "Push", cert_id, grpc.StatusCode.PERMISSION_DENIED,
                       f"peer {cert_id!r} is not an in-neighbour of {cfg.peer_id!r} in the topology; it may not push")
        who = cert_id or context.peer()
        if cfg.mode != "push":
            adm.reject(context, "Push", who, grpc.StatusCode.FAILED_PRECONDITION,
                       f"peer {cfg.peer_id!r} mixes in {cfg.mode} mode; it takes no pushes")
        try:
            first = next(chunks, None)
        except WireError as e:
            adm.reject(context, "Push", who, status_for(e), e.message)
        if first is None:
            adm.reject(context, "Push", who, grpc.StatusCode.INVALID_ARGUMENT, "empty push stream (no header)")
        if isinstance(first, RawData) or first.WhichOneof("body") != "header":
            adm.reject(context, "Push", who, grpc.StatusCode.INVALID_ARGUMENT,
                       "data arrived before the header (the first chunk must be the header)")
        h = first.header
        r, s = int(h.round), int(h.step)
        what = f"Push(round {r}, step {s})"
        if cert_id is None:
            if not h.sender:
                adm.reject(context, what, who, grpc.StatusCode.UNAUTHENTICATED, "the header names no sender")
            caller = h.sender
            adm.admit(call, caller)
            if caller not in cfg.may_push:
                adm.reject(context, what, caller, grpc.StatusCode.PERMISSION_DENIED,
                           f"peer {caller!r} is not an in-neighbour of {cfg.peer_id!r} in the topology; it may not push")
        else:
            caller = cert_id
            if h.sender != cert_id:
                adm.reject(context, what, caller, grpc.StatusCode.PERMISSION_DENIED,
                           f"the header names sender {excerpt(h.sender)} but the caller's certificate is for {cert_id!r}")
        if h.topology_hash != cfg.topology_hash:
            adm.reject(context, what, caller, grpc.StatusCode.FAILED_PRECONDITION,
                       f"topology hash {excerpt(h.topology_hash)} differs from this peer's {cfg.topology_hash!r} "
                       "(the peers run different topology files)")
        key = (caller, r, s)
        md = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        claim: float | None = None
        if GIVEN_MD in md:
            try:
                claim = float(md[GIVEN_MD][:40])
            except ValueError:
                claim = math.nan
            if not (math.isfinite(claim) and claim >= 0):
                adm.reject(context, what, caller, grpc.StatusCode.INVALID_ARGUMENT,
                           f"metadata {GIVEN_MD} must be a finite number >= 0, got {excerpt(md[GIVEN_MD])}")
        # Every answer, a refusal included, tells the sender this peer's total absorbed from it (rule 6);
        # the sender's claim is settled only from a push this peer accepts (a refusal changes nothing).
        context.set_trailing_metadata(((ABSORBED_MD, repr(float(self._ledger.total(caller)))),))
        if md.get(KEEP_MD) == "1":  # the sender keeps its whole share this step: nothing to mix
            kept = self._inbox.withhold(key, context, claim)
            adm.reject(context, what, caller, *kept)
        why, dup, pending = self._inbox.admissible(key)
        if why:
            adm.reject(context, what, caller, *why)
        if dup:
            adm.reject(context, what, caller, grpc.StatusCode.ALREADY_EXISTS,
                       f"a payload from {caller!r} for round {r} step {s} is already waiting")
        if pending >= cfg.max_pending:
            adm.reject(context, what, caller, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"{pending} pushes from {caller!r} are already waiting (limit {cfg.max_pending})")
        plan = cfg.plan(r, s)
        exp = Expectation(
            specs=cfg.expected_specs, round=r, step=s, topology_hash=cfg.topology_hash,
            senders=frozenset(plan.in_weights), scalar_keys=cfg.scalar_keys, max_bytes=cfg.max_bytes,
            wire=cfg.wire_format,
        )
        dec = Decoder(exp)
        try:
            dec.feed(first)
            for item in chunks:
                dec.feed(item)
            if not context.is_active():
                return peer_pb2.PushReply()
            msg = dec.finish()
        except WireError as e:
            adm.reject(context, what, caller, status_for(e), e.message)
        if claim is not None and cfg.mode == "push" and self._inbox.in_window(r):
            # a validated payload in the window: settle on it. A repeat of a decided key is answered
            # (below) whatever its round, but behind the window its claim settles nothing: an honest
            # sender's next push in the window carries its running total anyway (issue 68, the soak)
            self._ledger.settle_claim(caller, claim)
        mixed = self._inbox.offer(key, msg, dec.wire_bytes, context, claim)
        if isinstance(mixed, Rejected):
            adm.reject(context, what, caller, mixed.code, mixed.message)
        if mixed and not context.is_active():
            self._inbox.unanswered(key)
            return peer_pb2.PushReply()  # nobody hears it
        total = self._ledger.answered(key)  # the running total right after this key was mixed
        context.set_trailing_metadata(((ABSORBED_MD, repr(float(total))),))
        return peer_pb2.PushReply(bytes_received=dec.wire_bytes if mixed else 0)

    def status(self, request: peer_pb2.StatusRequest, context: grpc.ServicerContext, call: Call) -> peer_pb2.StatusReply:
        cfg, adm = self._config, self._admission
        caller = request.requester  # plaintext: as claimed (may be empty: an anonymous probe)
        if cfg.tls is not None:
            caller = adm.caller(context, request.requester, "Status")
            adm.admit(call, caller)
            if caller not in cfg.members:
                adm.reject(context, "Status", caller, grpc.StatusCode.PERMISSION_DENIED,
                           f"peer {caller!r} is not in the topology of {cfg.peer_id!r}; it may not ask its status")
        round_ = self._window.tell(caller)
        return peer_pb2.StatusReply(peer_id=cfg.peer_id, round=round_, topology_hash=cfg.topology_hash, version=version())


def _decodable(items: Iterator[peer_pb2.Chunk | RawData | Undecodable]) -> Iterator[peer_pb2.Chunk | RawData]:
    """The pushed chunks; one that did not parse stops the stream with a `WireError` naming it."""
    for i, item in enumerate(items):
        if isinstance(item, Undecodable):
            raise WireError(Reason.MALFORMED, f"chunk {i} ({item.size} bytes) is not a valid Chunk message: {item.error}")
        yield item
