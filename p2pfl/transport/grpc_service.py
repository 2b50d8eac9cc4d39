"""The gRPC peer service: what neighbours pull from and push into (``p2pfl/proto/peer.proto``).

`PeerServer` holds this peer's published payloads, encoded once and served as is to every puller
(a Pull for a payload not yet published waits on a condition until it is, or until the caller's
deadline), and an inbox for pushes (directed push-sum). Callers are authenticated: under mutual TLS
the caller's id is the peer id in its client certificate, and it must be a possible neighbour in the
topology (and a neighbour in the plan of the (round, step) it asks about). Every rejection is a gRPC
error with a precise message, logged at WARNING, and changes nothing.

The server is its parts, one job each (docs/architecture.md, "The transport's parts"): the
settings every part reads (`service_config.ServiceConfig`), admission and fairness
(`admission.Admission`), the publication window and the payloads given for recovery
(`publication`), the inbox of pushes and their fates (`inbox.Inbox`), the receiver's push-sum
ledger (`pushsum.ReceiverLedger`), the evidence of the neighbours' rounds (`progress.RoundEvidence`)
and the RPC handlers (`handlers.PeerHandlers`). `PeerServer` starts and stops them and is the one
face the node and the transport call; the wire contract (method names, metadata keys, options) is
in `rpc`, re-exported here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from p2pfl.models.layout import TensorSpec
from p2pfl.payload import Payload
from p2pfl.security.certs import TLSConfig
from p2pfl.topology import Topology
from p2pfl.topology.schedule import check_mode
from p2pfl.transport.admission import Admission
from p2pfl.transport.channels import channel_options
from p2pfl.transport.handlers import PeerHandlers
from p2pfl.transport.inbox import Inbox
from p2pfl.transport.progress import RoundEvidence
from p2pfl.transport.publication import GivenPayloads, PublicationWindow
from p2pfl.transport.pushsum import Key, ReceiverLedger
from p2pfl.transport.rpc import (
    ABSORBED_MD,
    DECISION_ROUNDS,
    EVIDENCE_MD,
    GIVEN_MD,
    HEADER_SLACK,
    KEEP_MD,
    PULL_METHOD,
    PUSH_METHOD,
    SERVICE,
    STATUS_METHOD,
    grpc_message_limit,
    server_options,
    status_for,
)
from p2pfl.transport.service_config import ServiceConfig
from p2pfl.wire.codec import DEFAULT_CHUNK_BYTES, EncodedPayload
from p2pfl.wire.compress import WireFormat

__all__ = [  # the wire contract's names are `rpc`'s, importable from here as before
    "ABSORBED_MD", "DECISION_ROUNDS", "EVIDENCE_MD", "GIVEN_MD", "HEADER_SLACK", "KEEP_MD", "PULL_METHOD",
    "PUSH_METHOD", "SERVICE", "STATUS_METHOD", "PeerServer", "channel_options", "grpc_message_limit",
    "server_options", "status_for",
]

log = logging.getLogger(__name__)


class PeerServer:
    """This peer's gRPC service: published payloads for Pull, an inbox for Push, Status and health.

    Memory stays bounded: payloads of rounds older than ``current - window`` are dropped, each
    sender may have at most ``max_pending`` undelivered pushes, and the push decisions remembered
    for deduplication are those of the last ``DECISION_ROUNDS`` rounds. The round protocol
    (window, waiting, push decisions) is explained in ``docs/protocol.md``.
    """

    def __init__(self) -> None:
        # One lock (reentrant) for the whole service: a publish, a round advance, a push's fate and
        # its ledger entry are one state, and every wait is on this condition.
        self._cond = threading.Condition()
        self.config = ServiceConfig()
        self._server: grpc.Server | None = None
        self._health: health.HealthServicer | None = None
        self._executor: futures.ThreadPoolExecutor | None = None
        # Per in-neighbour, the highest round of a validated payload accepted from it: the only thing
        # the catch-up believes (never the round a request claims; docs/protocol.md, "Catching up").
        self.progress = RoundEvidence()
        # Push-sum ledger, receiver side (p2pfl/transport/pushsum.py), under this server's lock.
        self.ledger = ReceiverLedger(self._cond)
        self.publications = PublicationWindow(self._cond, self.config, on_advance=lambda r: self.pushes.prune(r))
        self.pushes = Inbox(self._cond, self.config, self.publications, self.ledger, self.progress)
        self.given = GivenPayloads(self._cond, self.publications)  # push mode: what a restarted receiver recovers
        self.admission = Admission(self.config)
        self.handlers = PeerHandlers(self.config, self.admission, self.publications, self.pushes, self.given,
                                     self.ledger, lambda key, context: self._wait_published(key, context))
        self.port = 0
        self.address = ""

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
        cfg = self.config
        cfg.peer_id, cfg.mode, cfg.tls, cfg.seed = peer_id, mode, tls, int(seed)
        cfg.topology, cfg.topology_hash = topology, topology.hash()
        cfg.expected_specs = tuple(expected_specs)
        cfg.scalar_keys = frozenset(scalar_keys)
        cfg.chunk_bytes, cfg.max_bytes = int(chunk_bytes), int(max_message_mb) << 20
        cfg.max_wait_s, cfg.max_pending = float(max_wait_s), int(max_pending)
        if window < 1 or start_round < 0:
            raise ValueError("window must be >= 1 and start_round >= 0")
        self.publications.size, self.publications.current = int(window), int(start_round)
        cfg.may_pull = topology.possible_out_neighbours(peer_id)
        cfg.may_push = topology.possible_in_neighbours(peer_id)
        cfg.members = frozenset(topology.ids)
        cfg.max_call_s = float(max_call_s) if max_call_s is not None else cfg.max_wait_s + 60.0
        workers = self.admission.start(max_calls_per_peer, max_calls_others)
        if max_workers is None:
            # Every call in progress holds a worker thread: enough for every quota at once, so a
            # caller meets its own limit, never a pool that another caller filled.
            max_workers = workers
        self._executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"peer-{peer_id}")
        server = grpc.server(self._executor, options=server_options(cfg.chunk_bytes))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, self.handlers.method_handlers()),))
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
        self.publications.stop()
        if self._health is not None:
            self._health.enter_graceful_shutdown()
        stopped = True
        server, self._server = self._server, None
        if server is not None:
            bound = (grace or 0.0) + timeout_s
            stopped = server.stop(grace).wait(bound)
            if not stopped:
                log.error("%s: the peer service did not stop within %.1fs (%d calls still running); giving up on them",
                          self.peer_id, bound, self.admission.live)
        self._release_threads()
        return stopped

    def _release_threads(self) -> None:
        self.admission.stop()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> PeerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(0)

    @property
    def started(self) -> bool:
        return self._server is not None

    # ---- settings the transport reads (`ServiceConfig`) --------------------------------------------

    @property
    def peer_id(self) -> str:
        return self.config.peer_id

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def tls(self) -> TLSConfig | None:
        return self.config.tls

    @property
    def wire_format(self) -> WireFormat:
        """wire.*: what pushes must be encoded as (set by `Transport.configure_wire`)."""
        return self.config.wire_format

    @wire_format.setter
    def wire_format(self, fmt: WireFormat) -> None:
        self.config.wire_format = fmt

    # ---- the round and the payloads served (`PublicationWindow`) -----------------------------------

    @property
    def round(self) -> int:
        """The current round: payloads and pushes older than ``round - 1`` are dropped."""
        with self._cond:
            return self.publications.current

    def set_round(self, round: int) -> None:
        """Advance the current round (never backwards) and drop what is older than ``round - window``."""
        self.publications.advance(round)

    def finish(self, rounds: int) -> None:
        """This peer finished the run (its last round checkpointed): Status reports ``rounds`` from now on."""
        self.publications.finish(rounds)

    def told_finished(self, peer: str) -> bool:
        """Whether a Status answer to ``peer`` said this peer had finished (the round `finish` set;
        a peer restarted after its last round says so from its first answer on)."""
        return self.publications.told_finished(peer)

    def publish(self, msg: Payload, payload: EncodedPayload | None = None) -> EncodedPayload:
        """Encode ``msg`` once (or take its ``payload``, already encoded) and serve it to every puller
        of (msg.round, msg.step).

        Publishing a round advances the current round to it. Republishing the same (round, step)
        replaces the payload for later pullers. In push mode only evidence Pulls read it.
        """
        return self.publications.publish(msg, payload)

    def published(self) -> list[tuple[int, int]]:
        """(round, step) keys currently served."""
        return self.publications.published()

    @property
    def served_bytes(self) -> int:
        """Wire bytes served to pullers since start (a counter, for byte accounting)."""
        return self.publications.served_bytes

    @property
    def pulls_served(self) -> int:
        return self.publications.pulls_served

    def wait_pulled(self, key: tuple[int, int], peers: frozenset[str] | set[str], deadline: float) -> set[str]:
        """Wait until every peer in ``peers`` completed a Pull of ``key`` or ``deadline`` (monotonic) passes.

        Returns those that did not. A peer that finishes its last round lingers on this before it
        stops serving, so slower neighbours can still pull its final payload.
        """
        return self.publications.wait_pulled(key, peers, deadline)

    def _wait_published(self, key: tuple[int, int], context: grpc.ServicerContext) -> EncodedPayload | None:
        """The Pull handler's wait for ``key`` (`PublicationWindow.wait_published`); a seam tests replace."""
        return self.publications.wait_published(key, context)

    def calls_in_progress(self, caller: str | None = None) -> int:
        """Calls holding a slot of ``caller``'s quota (non-neighbours share one), or of all quotas."""
        return self.admission.calls_in_progress(caller)

    # ---- push mode: the inbox and the payloads given (`Inbox`, `GivenPayloads`) ---------------------

    @property
    def inbox(self) -> dict[Key, Payload]:
        """A snapshot of undelivered pushes, keyed by (sender, round, step)."""
        return self.pushes.snapshot()

    def take(self, keys: Sequence[Key], deadline: float,
             wait_for: Iterable[str] | None = None) -> dict[str, tuple[Payload, int]]:
        """Wait until every (sender, round, step) in ``keys`` was pushed or ``deadline`` (monotonic) passes.

        Returns ``{sender: (message, wire_bytes)}`` for those that arrived, removing them from the inbox
        and answering their Push calls "mixed". The keys that did not arrive are *closed*: their
        pushes, now or later, are answered ABORTED, so their senders keep that mass (push-sum loses
        none and counts none twice). ``wait_for`` (sender ids) narrows whom to wait for (e.g. not
        for a neighbour known to be down); the others are taken only if already there.
        """
        return self.pushes.take(keys, deadline, wait_for)

    def deliver(self, key: Key, msg: Payload, nbytes: int) -> None:
        """Put a recovered push in the inbox, to be mixed by `take` like any other."""
        self.pushes.deliver(key, msg, nbytes)

    def recovering(self, key: Key, active: bool) -> None:
        """Mark ``key`` as being recovered after a restart (or no longer): `take` keeps waiting for it."""
        self.pushes.recovering(key, active)

    def close(self, key: Key) -> None:
        """Decide ``key`` "not mixed" ahead of `take` (its sender kept the share)."""
        self.pushes.close(key)

    def withheld(self, keys: Iterable[Key]) -> set[Key]:
        """Those of ``keys`` whose sender withheld its share (it kept all its mass: mu below the floor)."""
        return self.pushes.withheld(keys)

    def gave(self, peer: str, round: int, step: int, payload: EncodedPayload) -> None:
        """Push mode: ``peer`` answered that it mixed ``payload`` for (round, step); keep the latest round's.

        A receiver killed before it checkpointed that round lost the mass with its state; when it
        replays the round it recovers exactly this payload with a Pull (and nothing else).
        """
        self.given.gave(peer, round, step, payload)

    @property
    def given_keys(self) -> set[Key] | frozenset[Key]:
        """Push mode: (receiver, round, step) of every OK this peer heard, durable (its pushes log)."""
        return self.given.keys

    @given_keys.setter
    def given_keys(self, keys: set[Key] | frozenset[Key]) -> None:
        self.given.keys = keys

    @property
    def _given(self) -> dict[str, tuple[int, dict[int, EncodedPayload]]]:
        """The payloads held per receiver (`GivenPayloads.held`)."""
        return self.given.held

    # ---- push-sum ledger (receiver side, `ReceiverLedger`) -----------------------------------------

    def absorbed(self) -> dict[str, float]:
        """Per sender, the running total of push-sum weight this peer absorbed (goes into the checkpoint)."""
        return self.ledger.totals()

    def restore_absorbed(self, totals: dict[str, float], high: Mapping[str, float] | None = None) -> None:
        """Set the running totals from a checkpoint (the state they are consistent with), and its high-water marks."""
        self.ledger.restore(totals, high)

    def raise_absorbed(self, sender: str, total: float) -> float:
        """`ReceiverLedger.raise_to`: a total this peer durably had before a restart."""
        return self.ledger.raise_to(sender, total)

    def note_settled(self, sender: str, amount: float) -> None:
        self.ledger.note(sender, amount)

    def pop_settled(self) -> dict[str, float]:
        """Weight absorbed by settlement since the last call, per sender (the node adds it to its mu)."""
        return self.ledger.pop()
