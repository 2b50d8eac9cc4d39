"""The gRPC peer service: what neighbours pull from and push into (``p2pfl/proto/peer.proto``).

`PeerServer` holds this peer's published payloads, encoded once and served as is to every puller
(a Pull for a payload not yet published waits on a condition until it is, or until the caller's
deadline), and an inbox for pushes (directed push-sum). Callers are authenticated: under mutual TLS
the caller's id is the peer id in its client certificate, and it must be a possible neighbour in the
topology (and a neighbour in the plan of the (round, step) it asks about). Every rejection is a gRPC
error with a precise message, logged at WARNING, and changes nothing.

Pull and Push use the codec's frame functions as (de)serializers: the server yields pre-serialized
chunks and reads data chunks as zero-copy views. The bytes on the wire are plain ``peer.proto``
messages, so the generated stubs talk to this server unchanged.
"""

from __future__ import annotations

import importlib.metadata
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from p2pfl.messages import Message
from p2pfl.models.layout import TensorSpec
from p2pfl.proto import peer_pb2
from p2pfl.security.certs import TLSConfig, caller_peer_id
from p2pfl.topology import MixingPlan, Topology
from p2pfl.topology.schedule import check_mode
from p2pfl.transport.limits import (
    Call,
    CallLimits,
    CallWatch,
    RateLimitedLog,
    Undecodable,
    bounded,
    safe_deserializer,
)
from p2pfl.transport.progress import RoundEvidence
from p2pfl.transport.pushsum import ReceiverLedger
from p2pfl.wire.codec import DEFAULT_CHUNK_BYTES, Decoder, EncodedPayload, RawData, encode_frames, parse_frame
from p2pfl.wire.compress import WireFormat
from p2pfl.wire.validate import Expectation, Reason, WireError, excerpt

__all__ = [
    "HEADER_SLACK",
    "PULL_METHOD",
    "PUSH_METHOD",
    "SERVICE",
    "STATUS_METHOD",
    "PeerServer",
    "channel_options",
    "grpc_message_limit",
    "server_options",
    "status_for",
]

log = logging.getLogger(__name__)

SERVICE = "p2pfl.peer.Peer"
PULL_METHOD = f"/{SERVICE}/Pull"
PUSH_METHOD = f"/{SERVICE}/Push"
STATUS_METHOD = f"/{SERVICE}/Status"

#: Room for the header chunk (manifest, scalars) above the data chunk size in one gRPC message.
HEADER_SLACK = 1 << 20

#: Push decisions (mixed / closed) are remembered this many rounds, to answer repeated pushes.
DECISION_ROUNDS = 1024

#: A waiting push is mixed only if its call has at least this long left to hear the answer.
_ANSWER_MARGIN_S = 0.25

#: Push-sum ledger (docs/protocol.md, "Push-sum mass"): invocation metadata of a Push carrying the
#: sender's running total of the weight it gave this receiver before this push, the withhold flag,
#: and the trailing metadata of the reply carrying the receiver's running total absorbed from it.
GIVEN_MD = "p2pfl-given"
KEEP_MD = "p2pfl-keep"
ABSORBED_MD = "p2pfl-absorbed"
#: Invocation metadata of a Pull that asks for evidence of progress (``p2pfl/transport/progress.py``):
#: in push mode it is served this peer's published push payload instead of a recovery (never mixed).
EVIDENCE_MD = "p2pfl-evidence"

_STATUS: dict[Reason, grpc.StatusCode] = {
    Reason.MISSING_HEADER: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.DUPLICATE_HEADER: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.EMPTY_CHUNK: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.MALFORMED: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.MANIFEST: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.DTYPE: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.SCALARS: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.LENGTH: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.NON_FINITE: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.OVERSIZE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.CHECKSUM: grpc.StatusCode.DATA_LOSS,
    Reason.TRUNCATED: grpc.StatusCode.DATA_LOSS,
    Reason.ROUND: grpc.StatusCode.OUT_OF_RANGE,
    Reason.VERSION: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.STEP: grpc.StatusCode.OUT_OF_RANGE,
    Reason.TOPOLOGY: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.SENDER: grpc.StatusCode.PERMISSION_DENIED,
    Reason.COMPRESSION: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.INDICES: grpc.StatusCode.INVALID_ARGUMENT,
}


def status_for(err: WireError) -> grpc.StatusCode:
    """The gRPC status code a rejected payload is answered with."""
    return _STATUS[err.code]


def grpc_message_limit(chunk_bytes: int) -> int:
    """Per-gRPC-message size limit: one data chunk or one header. The whole payload is bounded separately."""
    return chunk_bytes + HEADER_SLACK


def server_options(chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[tuple[str, Any]]:
    """Server channel arguments: explicit message limits, keepalive, no silent port sharing."""
    limit = grpc_message_limit(chunk_bytes)
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        # gRPC sets SO_REUSEPORT by default: a second server on the same port would then start
        # "successfully" and steal half the connections. Refuse instead.
        ("grpc.so_reuseport", 0),
        # Notice dead callers during long Pull waits; accept the clients' keepalive pings.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ]


def channel_options(chunk_bytes: int = DEFAULT_CHUNK_BYTES, target_id: str | None = None) -> list[tuple[str, Any]]:
    """Client channel arguments for one neighbour.

    Keepalive pings detect a neighbour that died while a Pull waits; short reconnect backoff finds
    it again within about a second once it is back (calls use ``wait_for_ready`` with the round's
    deadline). Transparent retries are off: the transport retries a Pull itself, within the deadline.
    ``target_id`` (TLS) makes the client verify the server's certificate by peer id, whatever address
    it dials.
    """
    limit = grpc_message_limit(chunk_bytes)
    opts: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1_000),
        ("grpc.enable_retries", 0),
    ]
    if target_id is not None:
        opts.append(("grpc.ssl_target_name_override", target_id))
    return opts


def _version() -> str:
    try:
        return importlib.metadata.version("p2pfl-personal")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0+unknown"


class _Rejected(Exception):
    """Internal: a rejection decided under the lock, raised as a gRPC error outside it."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class PeerServer:
    """This peer's gRPC service: published payloads for Pull, an inbox for Push, Status and health.

    Memory stays bounded: payloads of rounds older than ``current - window`` are dropped, each
    sender may have at most ``max_pending`` undelivered pushes, and the push decisions remembered
    for deduplication are those of the last ``DECISION_ROUNDS`` rounds. The round protocol
    (window, waiting, push decisions) is explained in ``docs/protocol.md``.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None
        self._health: health.HealthServicer | None = None
        self._published: dict[tuple[int, int], EncodedPayload] = {}
        self._pulled_by: dict[tuple[int, int], set[str]] = {}  # who completed a Pull of each payload
        self._inbox: dict[tuple[str, int, int], tuple[Message, int]] = {}
        # The Push call that offers each inbox entry: it is consumed only while that call can still
        # hear the answer, so sender and receiver always agree on whether the mass moved.
        self._offers: dict[tuple[str, int, int], grpc.ServicerContext] = {}
        # (sender, round, step) -> True (mixed) / False (the step closed without it): a push's fate.
        self._decided: dict[tuple[str, int, int], bool] = {}
        self.window = 2
        # Per in-neighbour, the highest round of a validated payload accepted from it: the only thing
        # the catch-up believes (never the round a request claims; docs/protocol.md, "Catching up").
        self.progress = RoundEvidence()
        self._given: dict[str, tuple[int, dict[int, EncodedPayload]]] = {}  # push mode: last round mixed by each
        # push mode: (receiver, round, step) of every OK this peer heard, durable (its pushes log)
        self.given_keys: set[tuple[str, int, int]] | frozenset[tuple[str, int, int]] = frozenset()
        self._recovering: set[tuple[str, int, int]] = set()  # keys a restarted peer is asking its senders for
        # Push-sum ledger, receiver side (p2pfl/transport/pushsum.py), under this server's lock.
        self.ledger = ReceiverLedger(self._cond)
        self._withheld: set[tuple[str, int, int]] = set()  # keys whose sender kept its whole share
        self._round = 0
        self._final: int | None = None  # the round count once this peer finished the run (`finish`)
        self._told: dict[str, int] = {}  # per calling neighbour, the highest round its Status answers said
        self._served = 0
        self._pulls_served = 0
        self._stopping = False
        self.port = 0
        self.address = ""
        self.peer_id = ""
        self.mode = "pull"
        self.tls: TLSConfig | None = None
        self.chunk_bytes = DEFAULT_CHUNK_BYTES
        self.wire_format = WireFormat()  # wire.*: what pushes must be encoded as (Transport.configure_wire)
        self.max_bytes = 256 << 20
        self.max_wait_s = 300.0
        self.max_pending = 16
        self.seed = 0
        self.expected_specs: tuple[TensorSpec, ...] = ()
        self.scalar_keys: frozenset[str] = frozenset()
        self.topology: Topology | None = None
        self.topology_hash = ""
        self._may_pull: frozenset[str] = frozenset()
        self._may_push: frozenset[str] = frozenset()
        self._members: frozenset[str] = frozenset()
        # fair service (p2pfl/transport/limits.py): quotas per caller, server-side call deadlines
        self._limits: CallLimits | None = None
        self._watch: CallWatch | None = None
        self._executor: futures.ThreadPoolExecutor | None = None
        self._log_rejection = RateLimitedLog(log, burst=20, interval_s=10.0)
        self.max_call_s = 0.0

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(
        self,
        address: str,
        topology: Topology,
        peer_id: str,
        *,
        expected_specs: Sequence[TensorSpec],
        scalar_keys: Iterable[str] = (),
        seed: int = 0,
        mode: str = "pull",
        tls: TLSConfig | None = None,
        insecure: bool = False,
        max_message_mb: int = 256,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_workers: int | None = None,
        max_wait_s: float = 300.0,
        max_pending: int = 16,
        window: int = 2,
        start_round: int = 0,
        max_calls_per_peer: int = 8,
        max_calls_others: int = 4,
        max_call_s: float | None = None,
    ) -> int:
        """Bind ``address`` (``host:port``; port 0 picks one) and serve; return the bound port.

        ``tls`` enables mutual TLS; plaintext needs ``insecure=True`` explicitly (no silent fallback).
        ``expected_specs`` / ``scalar_keys`` describe what pushes must carry; ``seed`` and ``mode``
        let the server compute each (round, step)'s plan to authorize callers. ``max_message_mb``
        bounds one payload, ``chunk_bytes`` sizes chunks (and the per-gRPC-message limit).
        ``max_wait_s`` caps how long a Pull without a deadline waits for a publish. ``window``: how
        many past rounds stay served (and how far ahead a request is waited for rather than
        refused); ``start_round``: the round a resumed peer is at, served from the first request on.

        Fair service: each neighbour may hold ``max_calls_per_peer`` calls at once (Pull, Push and
        Status together; a push-mode neighbour ahead by ``window`` rounds holds ``window + 1``), all
        other callers share ``max_calls_others``; more are refused RESOURCE_EXHAUSTED at once. The
        thread pool serves every quota at once (``max_workers`` defaults to that). Every call is cut
        (cancelled) ``max_call_s`` after it started, whatever the client's deadline (default:
        ``max_wait_s + 60``): a Pull waits at most ``max_wait_s`` for its payload, then has a minute
        to stream it, and so does a Push to send its chunks and hear its answer.
        """
        if self._server is not None:
            raise RuntimeError(f"peer server {self.peer_id!r} is already started")
        if tls is None and not insecure:
            raise ValueError(
                "no TLS configuration given: pass tls=TLSConfig.load(certs_dir, peer_id), "
                "or insecure=True to serve plaintext (--insecure)"
            )
        if tls is not None and insecure:
            raise ValueError("both tls and insecure=True given; choose one")
        if tls is not None and tls.peer_id != peer_id:
            raise ValueError(f"TLS material is for peer {tls.peer_id!r}, not {peer_id!r}")
        check_mode(mode)
        topology.index(peer_id)  # KeyError for a peer that is not in the topology
        if max_message_mb < 1 or chunk_bytes < 1:
            raise ValueError("max_message_mb and chunk_bytes must be positive")
        self.peer_id, self.mode, self.tls, self.seed = peer_id, mode, tls, int(seed)
        self.topology, self.topology_hash = topology, topology.hash()
        self.expected_specs = tuple(expected_specs)
        self.scalar_keys = frozenset(scalar_keys)
        self.chunk_bytes, self.max_bytes = int(chunk_bytes), int(max_message_mb) << 20
        self.max_wait_s, self.max_pending = float(max_wait_s), int(max_pending)
        if window < 1 or start_round < 0:
            raise ValueError("window must be >= 1 and start_round >= 0")
        self.window, self._round = int(window), int(start_round)
        self._may_pull = topology.possible_out_neighbours(peer_id)
        self._may_push = topology.possible_in_neighbours(peer_id)
        self._members = frozenset(topology.ids)
        self._limits = CallLimits(self._may_pull | self._may_push, max_calls_per_peer, max_calls_others)
        if max_workers is None:
            # Every call in progress holds a worker thread: enough for every quota at once, so a
            # caller meets its own limit, never a pool that another caller filled.
            max_workers = self._limits.workers
        self.max_call_s = float(max_call_s) if max_call_s is not None else self.max_wait_s + 60.0
        self._watch = CallWatch(self.max_call_s, self._cut, name=f"calls-{peer_id}")
        self._executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"peer-{peer_id}")
        server = grpc.server(self._executor, options=server_options(self.chunk_bytes))
        handlers = {
            "Pull": grpc.unary_stream_rpc_method_handler(
                self._guarded("Pull", self._pull, streaming=True),
                request_deserializer=safe_deserializer(peer_pb2.PullRequest.FromString),
                response_serializer=_identity,
            ),
            "Push": grpc.stream_unary_rpc_method_handler(
                self._guarded("Push", self._push),
                request_deserializer=safe_deserializer(parse_frame),
                response_serializer=peer_pb2.PushReply.SerializeToString,
            ),
            "Status": grpc.unary_unary_rpc_method_handler(
                self._guarded("Status", self._status),
                request_deserializer=safe_deserializer(peer_pb2.StatusRequest.FromString),
                response_serializer=peer_pb2.StatusReply.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        try:
            if tls is not None:
                port = server.add_secure_port(address, tls.server_credentials())
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as e:
            self._release_threads()
            raise RuntimeError(f"peer {peer_id!r} cannot listen on {address}: {e}") from None
        if not port:
            self._release_threads()
            raise RuntimeError(f"peer {peer_id!r} cannot listen on {address}")
        server.start()
        self._server, self.port, self.address = server, port, address
        for name in ("", SERVICE):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "%s: peer service on %s (port %d, %s, %s mode)",
            peer_id, address, port, "mutual TLS" if tls else "INSECURE plaintext", mode,
        )
        return port

    def stop(self, grace: float | None = 1.0, timeout_s: float = 10.0) -> bool:
        """Stop serving: waiting Pulls end (UNAVAILABLE), in-flight calls get ``grace`` seconds.

        Returns within ``grace + timeout_s``: True once every call ended; False, logged at ERROR, if
        some were still running then (they are abandoned: gRPC has cancelled them, and their
        threads end when they notice).
        """
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._health is not None:
            self._health.enter_graceful_shutdown()
        stopped = True
        server, self._server = self._server, None
        if server is not None:
            bound = (grace or 0.0) + timeout_s
            stopped = server.stop(grace).wait(bound)
            if not stopped:
                log.error("%s: the peer service did not stop within %.1fs (%d calls still running); giving up on them",
                          self.peer_id, bound, self._watch.live if self._watch else -1)
        self._release_threads()
        return stopped

    def _release_threads(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> PeerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(0)

    @property
    def started(self) -> bool:
        return self._server is not None

    # ---- state the node / transport drives ----------------------------------------------------

    @property
    def round(self) -> int:
        """The current round: payloads and pushes older than ``round - 1`` are dropped."""
        with self._cond:
            return self._round

    def set_round(self, round: int) -> None:
        """Advance the current round (never backwards) and drop what is older than ``round - window``."""
        with self._cond:
            if round > self._round:
                self._round = int(round)
                self._prune()
            self._cond.notify_all()

    def finish(self, rounds: int) -> None:
        """This peer finished the run (its last round checkpointed): Status reports ``rounds`` from now on."""
        self.set_round(rounds)
        with self._cond:
            self._final = int(rounds)

    def told_finished(self, peer: str) -> bool:
        """Whether a Status answer to ``peer`` said this peer had finished (the round `finish` set;
        a peer restarted after its last round says so from its first answer on)."""
        with self._cond:
            return self._final is not None and self._told.get(peer, -1) >= self._final

    def _prune(self) -> None:
        keep = self._round - self.window
        for key in [k for k in self._published if k[0] < keep]:
            del self._published[key]
            self._pulled_by.pop(key, None)
        # Pending pushes are owned by their (waiting) Push calls, which notice the round moved on.
        forget = self._round - DECISION_ROUNDS
        for key in [k for k in self._decided if k[1] < forget]:
            del self._decided[key]
            self.ledger.forget(key)
            self._withheld.discard(key)

    def gave(self, peer: str, round: int, step: int, payload: EncodedPayload) -> None:
        """Push mode: ``peer`` answered that it mixed ``payload`` for (round, step); keep the latest round's.

        A receiver killed before it checkpointed that round lost the mass with its state; when it
        replays the round it recovers exactly this payload with a Pull (and nothing else).
        """
        with self._cond:
            held = self._given.get(peer)
            if held is None or held[0] < round:
                self._given[peer] = (round, {step: payload})
            elif held[0] == round:
                held[1][step] = payload

    def _recovery(self, caller: str, r: int, s: int) -> EncodedPayload | _Rejected:
        with self._cond:
            held = self._given.get(caller)
            if held is not None and held[0] == r and s in held[1]:
                return held[1][s]
            if (caller, r, s) in self.given_keys:  # given (its OK is logged), the payload no longer held
                return _Rejected(grpc.StatusCode.ALREADY_EXISTS, f"round {r} step {s} was given to {caller!r} "
                                 "(its share left this peer); the payload is no longer held")
            if r < self._round:
                return _Rejected(grpc.StatusCode.ABORTED, f"round {r} step {s} was not given to {caller!r}: "
                                 "its share stayed with this peer")
        return _Rejected(grpc.StatusCode.NOT_FOUND, f"round {r} step {s} is not decided yet: wait for the push")

    def deliver(self, key: tuple[str, int, int], msg: Message, nbytes: int) -> None:
        """Put a recovered push in the inbox, to be mixed by `take` like any other."""
        with self._cond:
            if key not in self._decided and key not in self._inbox:
                self._inbox[key] = (msg, nbytes)
                self.ledger.drop_claim(key)  # the exact lost payload: no settlement with it
                self._cond.notify_all()

    def recovering(self, key: tuple[str, int, int], active: bool) -> None:
        """Mark ``key`` as being recovered after a restart (or no longer): `take` keeps waiting for it."""
        with self._cond:
            if active:
                self._recovering.add(key)
            else:
                self._recovering.discard(key)
            self._cond.notify_all()

    def close(self, key: tuple[str, int, int]) -> None:
        """Decide ``key`` "not mixed" ahead of `take` (its sender kept the share)."""
        with self._cond:
            self._decided.setdefault(key, False)
            self._cond.notify_all()

    # ---- push-sum ledger (receiver side) ----------------------------------------------------------

    def absorbed(self) -> dict[str, float]:
        """Per sender, the running total of push-sum weight this peer absorbed (goes into the checkpoint)."""
        return self.ledger.totals()

    def restore_absorbed(self, totals: dict[str, float]) -> None:
        """Set the running totals from a checkpoint (the state they are consistent with)."""
        self.ledger.restore(totals)

    def raise_absorbed(self, sender: str, total: float) -> float:
        """`ReceiverLedger.raise_to`: a total this peer durably had before a restart."""
        return self.ledger.raise_to(sender, total)

    def note_settled(self, sender: str, amount: float) -> None:
        self.ledger.note(sender, amount)

    def pop_settled(self) -> dict[str, float]:
        """Weight absorbed by settlement since the last call, per sender (the node adds it to its mu)."""
        return self.ledger.pop()

    def withheld(self, keys: Iterable[tuple[str, int, int]]) -> set[tuple[str, int, int]]:
        """Those of ``keys`` whose sender withheld its share (it kept all its mass: mu below the floor)."""
        with self._cond:
            return {k for k in keys if k in self._withheld}

    def _absorb(self, key: tuple[str, int, int], msg: Message) -> None:
        """Ledger of a push being mixed (lock held): its share is the weight ``combine`` is about to
        apply, W[i, j] * mu_j (`ReceiverLedger.absorb` settles the sender's claim first)."""
        if self.mode != "push" or self.topology is None:
            return
        j, r, s = key
        self.ledger.absorb(key, self._plan(r, s).in_weights.get(j, 0.0) * float(msg.scalars.get("mu", 0.0)))

    def _unanswered(self, key: tuple[str, int, int]) -> None:
        """A push was mixed but its call ended before the OK could be sent (this peer stalled, or the
        call's deadline passed in between): the sender keeps the share (rule 2), so this peer gives
        back what it absorbed (mu only, with the next exchange) and closes the key."""
        with self._cond:
            if not self.ledger.unanswered(key):
                return
            self._decided[key] = False
        log.warning("%s: the OK for round %d step %d of %s could not be sent; its share is given back",
                    self.peer_id, key[1], key[2], key[0])

    def publish(self, msg: Message, payload: EncodedPayload | None = None) -> EncodedPayload:
        """Encode ``msg`` once (or take its ``payload``, already encoded) and serve it to every puller
        of (msg.round, msg.step).

        Publishing a round advances the current round to it. Republishing the same (round, step)
        replaces the payload for later pullers. In push mode only evidence Pulls read it.
        """
        if msg.sender != self.peer_id:
            raise ValueError(f"peer {self.peer_id!r} cannot publish a message from {msg.sender!r}")
        if msg.topology_hash != self.topology_hash:
            raise ValueError(
                f"message topology hash {msg.topology_hash!r} differs from the server's {self.topology_hash!r}"
            )
        if payload is None:
            payload = encode_frames(msg, self.chunk_bytes)
        if payload.header.total_bytes > self.max_bytes:
            raise ValueError(f"payload of {payload.header.total_bytes} bytes exceeds max_message_mb")
        with self._cond:
            if msg.round < self._round - self.window:
                raise ValueError(f"round {msg.round} is older than the retained window (current {self._round})")
            self._published[(msg.round, msg.step)] = payload
            if msg.round > self._round:
                self._round = msg.round
                self._prune()
            self._cond.notify_all()
        return payload

    def published(self) -> list[tuple[int, int]]:
        """(round, step) keys currently served."""
        with self._cond:
            return sorted(self._published)

    @property
    def served_bytes(self) -> int:
        """Wire bytes served to pullers since start (a counter, for byte accounting)."""
        with self._cond:
            return self._served

    @property
    def pulls_served(self) -> int:
        with self._cond:
            return self._pulls_served

    def calls_in_progress(self, caller: str | None = None) -> int:
        """Calls holding a slot of ``caller``'s quota (non-neighbours share one), or of all quotas."""
        return self._limits.active(caller) if self._limits is not None else 0

    @property
    def inbox(self) -> dict[tuple[str, int, int], Message]:
        """A snapshot of undelivered pushes, keyed by (sender, round, step)."""
        with self._cond:
            return {k: v[0] for k, v in self._inbox.items()}

    def take(self, keys: Sequence[tuple[str, int, int]], deadline: float,
             wait_for: Iterable[str] | None = None) -> dict[str, tuple[Message, int]]:
        """Wait until every (sender, round, step) in ``keys`` was pushed or ``deadline`` (monotonic) passes.

        Returns ``{sender: (message, wire_bytes)}`` for those that arrived, removing them from the inbox
        and answering their Push calls "mixed". The keys that did not arrive are *closed*: their
        pushes, now or later, are answered ABORTED, so their senders keep that mass (push-sum loses
        none and counts none twice). ``wait_for`` (sender ids) narrows whom to wait for (e.g. not
        for a neighbour known to be down); the others are taken only if already there.
        """
        waited = {k for k in keys if wait_for is None or k[0] in set(wait_for)}
        out: dict[str, tuple[Message, int]] = {}
        with self._cond:
            while True:
                for key in keys:
                    if key[0] not in out and key in self._inbox and self._offer_alive(key):
                        out[key[0]] = self._inbox.pop(key)
                        self._offers.pop(key, None)
                        self._decided[key] = True
                        self._absorb(key, out[key[0]][0])
                # A sender already pushing a later round gave this one up (it keeps that share):
                # do not wait for it, or a receiver one round behind would stay behind for good.
                waited = {k for k in waited if not self._moved_on(k) and self._decided.get(k) is not False}
                left = deadline - time.monotonic()
                if all(k[0] in out for k in waited) or self._stopping or left <= 0:
                    break
                self._cond.wait(min(left, 0.5))
            for key in keys:
                if key[0] not in out:
                    self._decided.setdefault(key, False)
            self._cond.notify_all()
            return out

    def _moved_on(self, key: tuple[str, int, int]) -> bool:
        """Whether the sender of ``key`` already offers a later round or step (a push waiting here)."""
        if key in self._recovering:  # it may have moved on because it gave it: the recovery decides
            return False
        j, r, s = key
        return any(k[0] == j and (k[1], k[2]) > (r, s) for k in self._inbox)

    def _offer_alive(self, key: tuple[str, int, int]) -> bool:
        """Whether the Push call offering ``key`` can still be told that it was mixed (with a margin)."""
        ctx = self._offers.get(key)
        if ctx is None:  # put there directly (tests, tools)
            return True
        if not ctx.is_active():
            return False
        left = ctx.time_remaining()
        return left is None or left > _ANSWER_MARGIN_S

    # ---- RPC handlers ------------------------------------------------------------------------

    def _reject(self, context: grpc.ServicerContext, rpc: str, who: str, code: grpc.StatusCode, msg: str) -> NoReturn:
        """Answer ``code``/``msg`` and log it (one bounded line; at most a few per caller and 10 s)."""
        who, msg = bounded(who, 80), bounded(msg)
        self._log_rejection(logging.WARNING, self._log_key(who), "%s: rejected %s from %s: %s: %s", self.peer_id,
                            rpc, who, code.name, msg)
        context.abort(code, msg)
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover

    def _guarded(self, rpc: str, handler: Callable[..., Any], streaming: bool = False) -> Callable[..., Any]:
        """``handler`` as a gRPC behaviour under the server-side call limit; its quota slot is freed however it ends."""
        if streaming:
            def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                call = self._open(rpc, request, context)
                try:
                    yield from handler(request, context, call)
                finally:
                    self._close(call)

            return stream

        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            call = self._open(rpc, request, context)
            try:
                return handler(request, context, call)
            finally:
                self._close(call)

        return unary

    def _open(self, rpc: str, request: Any, context: grpc.ServicerContext) -> Call:
        assert self._watch is not None
        call = self._watch.open(rpc, context)
        if isinstance(request, Undecodable):
            self._close(call)
            self._reject(context, rpc, context.peer(), grpc.StatusCode.INVALID_ARGUMENT,
                         f"the request ({request.size} bytes) is not a valid {rpc} request message: {request.error}")
        return call

    def _close(self, call: Call) -> None:
        assert self._watch is not None and self._limits is not None
        self._watch.close(call)
        if call.slot is not None:
            self._limits.leave(call.slot)
            call.slot = None

    def _admit(self, call: Call, caller: str) -> None:
        """Take a slot of ``caller``'s quota for ``call``, or refuse RESOURCE_EXHAUSTED at once."""
        assert self._limits is not None
        got = self._limits.enter(caller)
        if got is None:
            bucket = self._limits.bucket(caller)
            whose = f"peer {excerpt(caller)}" if bucket == caller else "callers that are not neighbours"
            limit = self._limits.per_peer if bucket == caller else self._limits.unknown
            self._reject(call.context, call.rpc, caller, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"{whose} {'has' if bucket == caller else 'have'} {limit} calls in progress on "
                         f"{self.peer_id!r} already (the limit); retry later")
        call.slot, call.caller = got[0], caller

    def _log_key(self, who: str) -> str:
        """Whose log quota a line uses: each peer of the topology its own, everyone else one shared."""
        return who if who in self._members else "(others)"

    def _cut(self, call: Call) -> None:
        """The call watch is cancelling ``call``: say so (the caller sees CANCELLED)."""
        self._log_rejection(logging.WARNING, self._log_key(call.caller),
                            "%s: cut %s from %s after %.1fs: the server-side call limit is %.0fs",
                            self.peer_id, call.rpc, bounded(call.caller, 80), time.monotonic() - call.started,
                            self.max_call_s)

    def _caller(self, context: grpc.ServicerContext, claimed: str, rpc: str) -> str:
        """The authenticated caller id: the certificate's under TLS, the claimed one under --insecure."""
        who = claimed or context.peer()
        if self.tls is None:
            if not claimed:
                self._reject(context, rpc, who, grpc.StatusCode.UNAUTHENTICATED,
                             "the request names no peer id (insecure mode identifies callers by the id they claim)")
            return claimed
        cert_id = caller_peer_id(context)
        if cert_id is None:
            self._reject(context, rpc, who, grpc.StatusCode.UNAUTHENTICATED,
                         "the caller presented no usable peer certificate")
        if claimed and claimed != cert_id:
            self._reject(context, rpc, cert_id, grpc.StatusCode.PERMISSION_DENIED,
                         f"the caller claims to be {excerpt(claimed)} but its certificate is for {cert_id!r}")
        return cert_id

    def _plan(self, round: int, step: int) -> MixingPlan:
        assert self.topology is not None
        return self.topology.plan(self.peer_id, round, step, seed=self.seed, mode=self.mode)

    def _window_error(self, round: int) -> tuple[grpc.StatusCode, str] | None:
        """Why ``round`` cannot be served now, with the status to answer, or None.

        Older than the window: OUT_OF_RANGE (final: it will never be served again). More than
        ``window`` rounds ahead: UNAVAILABLE (transient: the caller retries with backoff within its
        deadline, by which time this peer may have caught up). Anything in between is waited for.
        """
        cur = self._round
        if round < cur - self.window:
            return (grpc.StatusCode.OUT_OF_RANGE,
                    f"round {round} is no longer served: this peer is at round {cur} and keeps rounds "
                    f">= {cur - self.window}")
        if round > cur + self.window:
            return (grpc.StatusCode.UNAVAILABLE,
                    f"round {round} is more than {self.window} rounds ahead of this peer (round {cur}); retry later")
        return None

    def _pull(self, request: peer_pb2.PullRequest, context: grpc.ServicerContext, call: Call) -> Iterator[bytes]:
        caller = self._caller(context, request.requester, "Pull")
        self._admit(call, caller)
        r, s = int(request.round), int(request.step)
        what = f"Pull(round {r}, step {s})"
        if caller not in self._may_pull:
            self._reject(context, what, caller, grpc.StatusCode.PERMISSION_DENIED,
                         f"peer {caller!r} is not an out-neighbour of {self.peer_id!r} in the topology; it may not pull")
        if request.topology_hash != self.topology_hash:
            self._reject(context, what, caller, grpc.StatusCode.FAILED_PRECONDITION,
                         f"topology hash {excerpt(request.topology_hash)} differs from this peer's {self.topology_hash!r}")
        evidence = any(k == EVIDENCE_MD and v == "1" for k, v in (context.invocation_metadata() or ()))
        if self.mode != "pull" and not evidence:
            # Push mode serves one kind of Pull besides evidence: a restarted receiver recovering a push
            # it had mixed but lost with its uncheckpointed state (docs/protocol.md, "Push-sum mass").
            got = self._recovery(caller, r, s)
            if isinstance(got, _Rejected):
                self._reject(context, what, caller, got.code, got.message)
            payload = got
        else:
            with self._cond:
                why = self._window_error(r)
            if why:
                self._reject(context, what, caller, *why)
            if caller not in self._plan(r, s).out_weights:
                self._reject(context, what, caller, grpc.StatusCode.PERMISSION_DENIED,
                             f"peer {caller!r} does not pull from {self.peer_id!r} at round {r} step {s}")
            try:
                payload = self._wait_published((r, s), context)
            except _Rejected as e:
                self._reject(context, what, caller, e.code, e.message)
        if payload is None:  # the caller went away
            return
        sent = 0
        try:
            for frame in payload:
                yield frame
                sent += len(frame)
        finally:
            with self._cond:
                self._served += sent
                self._pulls_served += sent == payload.wire_bytes
                if sent == payload.wire_bytes:
                    self._pulled_by.setdefault((r, s), set()).add(caller)
                    self._cond.notify_all()

    def wait_pulled(self, key: tuple[int, int], peers: frozenset[str] | set[str], deadline: float) -> set[str]:
        """Wait until every peer in ``peers`` completed a Pull of ``key`` or ``deadline`` (monotonic) passes.

        Returns those that did not. A peer that finishes its last round lingers on this before it
        stops serving, so slower neighbours can still pull its final payload.
        """
        with self._cond:
            while True:
                left = set(peers) - self._pulled_by.get(key, set())
                remaining = deadline - time.monotonic()
                if not left or remaining <= 0:
                    return left
                self._cond.wait(timeout=min(remaining, 1.0))

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _wait_published(self, key: tuple[int, int], context: grpc.ServicerContext) -> EncodedPayload | None:
        """Block (on the condition, no polling) until ``key`` is published, the caller's deadline or cancel."""
        remaining = context.time_remaining()
        budget = self.max_wait_s if remaining is None else min(remaining, self.max_wait_s)
        limit = time.monotonic() + budget
        context.add_callback(self._wake)  # a cancelled or expired call wakes the wait at once
        with self._cond:
            while True:
                if self._stopping:
                    raise _Rejected(grpc.StatusCode.UNAVAILABLE, f"peer {self.peer_id!r} is shutting down")
                payload = self._published.get(key)
                if payload is not None:
                    return payload
                if not context.is_active():
                    return None
                why = self._window_error(key[0])
                if why:
                    raise _Rejected(*why)
                if key[0] < self._round:  # a past round this peer never published (it fast-forwarded)
                    raise _Rejected(grpc.StatusCode.OUT_OF_RANGE,
                                    f"round {key[0]} step {key[1]} was skipped: this peer is at round {self._round}")
                left = limit - time.monotonic()
                if left <= 0:
                    raise _Rejected(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"round {key[0]} step {key[1]} was not published within {budget:.1f}s",
                    )
                self._cond.wait(left)

    def _push(self, request_iterator: Iterator[peer_pb2.Chunk | RawData | Undecodable], context: grpc.ServicerContext,
              call: Call) -> peer_pb2.PushReply:
        cert_id = self._caller(context, "", "Push") if self.tls is not None else None
        if cert_id is not None:
            self._admit(call, cert_id)
        request_iterator = _decodable(request_iterator)
        if cert_id is not None and cert_id not in self._may_push:
            self._reject(context, "Push", cert_id, grpc.StatusCode.PERMISSION_DENIED,
                         f"peer {cert_id!r} is not an in-neighbour of {self.peer_id!r} in the topology; it may not push")
        who = cert_id or context.peer()
        if self.mode != "push":
            self._reject(context, "Push", who, grpc.StatusCode.FAILED_PRECONDITION,
                         f"peer {self.peer_id!r} mixes in {self.mode} mode; it takes no pushes")
        try:
            first = next(request_iterator, None)
        except WireError as e:
            self._reject(context, "Push", who, status_for(e), e.message)
        if first is None:
            self._reject(context, "Push", who, grpc.StatusCode.INVALID_ARGUMENT, "empty push stream (no header)")
        if isinstance(first, RawData) or first.WhichOneof("body") != "header":
            self._reject(context, "Push", who, grpc.StatusCode.INVALID_ARGUMENT,
                         "data arrived before the header (the first chunk must be the header)")
        h = first.header
        r, s = int(h.round), int(h.step)
        what = f"Push(round {r}, step {s})"
        if cert_id is None:
            if not h.sender:
                self._reject(context, what, who, grpc.StatusCode.UNAUTHENTICATED, "the header names no sender")
            caller = h.sender
            self._admit(call, caller)
            if caller not in self._may_push:
                self._reject(context, what, caller, grpc.StatusCode.PERMISSION_DENIED,
                             f"peer {caller!r} is not an in-neighbour of {self.peer_id!r} in the topology; it may not push")
        else:
            caller = cert_id
            if h.sender != cert_id:
                self._reject(context, what, caller, grpc.StatusCode.PERMISSION_DENIED,
                             f"the header names sender {excerpt(h.sender)} but the caller's certificate is for {cert_id!r}")
        if h.topology_hash != self.topology_hash:
            self._reject(context, what, caller, grpc.StatusCode.FAILED_PRECONDITION,
                         f"topology hash {excerpt(h.topology_hash)} differs from this peer's {self.topology_hash!r} "
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
                self._reject(context, what, caller, grpc.StatusCode.INVALID_ARGUMENT,
                             f"metadata {GIVEN_MD} must be a finite number >= 0, got {excerpt(md[GIVEN_MD])}")
        # Every answer, a refusal included, tells the sender this peer's total absorbed from it (rule 6);
        # the sender's claim is settled only from a push this peer accepts (a refusal changes nothing).
        context.set_trailing_metadata(((ABSORBED_MD, repr(float(self.ledger.total(caller)))),))
        if md.get(KEEP_MD) == "1":  # the sender keeps its whole share this step: nothing to mix
            kept = self._withhold(key, context, claim)
            self._reject(context, what, caller, *kept)
        with self._cond:
            why = None if key in self._decided else self._window_error(r)
            dup = key in self._inbox
            pending = sum(1 for k in self._inbox if k[0] == caller)
        if why:
            self._reject(context, what, caller, *why)
        if dup:
            self._reject(context, what, caller, grpc.StatusCode.ALREADY_EXISTS,
                         f"a payload from {caller!r} for round {r} step {s} is already waiting")
        if pending >= self.max_pending:
            self._reject(context, what, caller, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"{pending} pushes from {caller!r} are already waiting (limit {self.max_pending})")
        plan = self._plan(r, s)
        exp = Expectation(
            specs=self.expected_specs, round=r, step=s, topology_hash=self.topology_hash,
            senders=frozenset(plan.in_weights), scalar_keys=self.scalar_keys, max_bytes=self.max_bytes,
            wire=self.wire_format,
        )
        dec = Decoder(exp)
        try:
            dec.feed(first)
            for item in request_iterator:
                dec.feed(item)
            if not context.is_active():
                return peer_pb2.PushReply()
            msg = dec.finish()
        except WireError as e:
            self._reject(context, what, caller, status_for(e), e.message)
        if claim is not None and self.mode == "push":  # a validated payload in the window: settle on it
            self.ledger.settle_claim(caller, claim)
        mixed = self._offer(key, msg, dec.wire_bytes, context, claim)
        if isinstance(mixed, _Rejected):
            self._reject(context, what, caller, mixed.code, mixed.message)
        if mixed and not context.is_active():
            self._unanswered(key)
            return peer_pb2.PushReply()  # nobody hears it
        total = self.ledger.answered(key)  # the running total right after this key was mixed
        context.set_trailing_metadata(((ABSORBED_MD, repr(float(total))),))
        return peer_pb2.PushReply(bytes_received=dec.wire_bytes if mixed else 0)

    def _withhold(self, key: tuple[str, int, int], context: grpc.ServicerContext,
                  claim: float | None = None) -> tuple[grpc.StatusCode, str]:
        """A push that withholds its share: close ``key`` once this peer reaches its round.

        It is answered like a push that was not mixed (ABORTED), but only when this peer is in that
        round, so a withholding sender is paced by its receivers exactly like one whose push is
        mixed (answering at once let it run arbitrarily far ahead). Returns the status to answer.
        """
        _, r, s = key
        remaining = context.time_remaining()
        limit = time.monotonic() + (self.max_wait_s if remaining is None else min(remaining, self.max_wait_s))
        context.add_callback(self._wake)
        with self._cond:
            why = None if key in self._decided else self._window_error(r)
            if why:
                return why
            while key not in self._decided and self._round < r:
                left = limit - time.monotonic()
                if self._stopping:
                    return grpc.StatusCode.UNAVAILABLE, f"peer {self.peer_id!r} is shutting down"
                if not context.is_active() or left <= 0:
                    return grpc.StatusCode.DEADLINE_EXCEEDED, f"round {r} not reached before the call's deadline"
                self._cond.wait(min(left, 1.0))
            if key not in self._decided:
                self._decided[key] = False
                self._withheld.add(key)
                self._cond.notify_all()
        if claim is not None and self.mode == "push":  # the withhold was taken (not refused): it settles
            self.ledger.settle_claim(key[0], claim)
        return grpc.StatusCode.ABORTED, f"round {r} step {s}: the sender withholds its share (it keeps its mass)"

    def _offer(self, key: tuple[str, int, int], msg: Message, nbytes: int,
               context: grpc.ServicerContext, claim: float | None = None) -> bool | _Rejected:
        """Put a validated push in the inbox and wait for its fate; True: mixed (now or before).

        The answer is the receiver's decision, so the sender knows whether to keep the mass: OK =
        mixed (a repeat of an already mixed push is answered OK again, with 0 bytes: dedupe by
        (sender, round, step)); ABORTED = the step closed without it. A call that ends first (its
        deadline, a cancel, shutdown) withdraws the offer, so an unanswered push is never mixed.
        """
        _, r, s = key
        remaining = context.time_remaining()
        limit = time.monotonic() + (self.max_wait_s if remaining is None else min(remaining, self.max_wait_s))
        context.add_callback(self._wake)
        with self._cond:
            if key in self._decided:
                if self._decided[key]:
                    return False
                return _Rejected(grpc.StatusCode.ABORTED, f"round {r} step {s} was mixed without this payload")
            if key in self._inbox:
                return _Rejected(grpc.StatusCode.ALREADY_EXISTS,
                                 f"a payload from {key[0]!r} for round {r} step {s} is already waiting")
            why = self._window_error(r)
            if why:
                return _Rejected(*why)
            self._inbox[key] = (msg, nbytes)
            self._offers[key] = context
            self.progress.saw(key[0], r)  # validated and accepted: evidence that the sender reached r
            self.ledger.hold_claim(key, claim)
            self._cond.notify_all()
            try:
                while True:
                    fate = self._decided.get(key)
                    if fate is True:
                        return True
                    if fate is False:
                        return _Rejected(grpc.StatusCode.ABORTED, f"round {r} step {s} was mixed without this payload")
                    if self._stopping:
                        return _Rejected(grpc.StatusCode.UNAVAILABLE, f"peer {self.peer_id!r} is shutting down")
                    if r < self._round:  # every planned key of a past round was decided; this one never will be
                        return _Rejected(grpc.StatusCode.OUT_OF_RANGE, f"round {r} is over on this peer "
                                         f"(round {self._round}); the payload was not mixed")
                    left = limit - time.monotonic()
                    if not context.is_active() or left <= 0:
                        return _Rejected(grpc.StatusCode.DEADLINE_EXCEEDED,
                                         f"round {r} step {s} was not mixed before the call's deadline")
                    self._cond.wait(min(left, 1.0))
            finally:
                if self._inbox.get(key) is not None and self._decided.get(key) is not True:
                    self._inbox.pop(key, None)
                self._offers.pop(key, None)
                self.ledger.drop_claim(key)

    def _status(self, request: peer_pb2.StatusRequest, context: grpc.ServicerContext, call: Call) -> peer_pb2.StatusReply:
        caller = request.requester  # plaintext: as claimed (may be empty: an anonymous probe)
        if self.tls is not None:
            caller = self._caller(context, request.requester, "Status")
            self._admit(call, caller)
            if caller not in self._members:
                self._reject(context, "Status", caller, grpc.StatusCode.PERMISSION_DENIED,
                             f"peer {caller!r} is not in the topology of {self.peer_id!r}; it may not ask its status")
        with self._cond:
            round_ = self._round
            if caller in self._members and round_ > self._told.get(caller, -1):
                self._told[caller] = round_
        return peer_pb2.StatusReply(
            peer_id=self.peer_id, round=round_, topology_hash=self.topology_hash, version=_version()
        )


def _identity(b: bytes) -> bytes:
    return b


def _decodable(items: Iterator[peer_pb2.Chunk | RawData | Undecodable]) -> Iterator[peer_pb2.Chunk | RawData]:
    """The pushed chunks; one that did not parse stops the stream with a `WireError` naming it."""
    for i, item in enumerate(items):
        if isinstance(item, Undecodable):
            raise WireError(Reason.MALFORMED, f"chunk {i} ({item.size} bytes) is not a valid Chunk message: {item.error}")
        yield item
