"""The gRPC transport: `Transport.exchange` over real sockets, with the semantics of MemoryTransport.

Pull mode: publish this peer's payload on its own `PeerServer`, then pull from every in-neighbour
of the plan in parallel (one long-lived channel per neighbour, each call bounded by the round's
deadline and ``wait_for_ready`` so a neighbour that starts late is waited for). Push mode: push the
payload to every out-neighbour in parallel and wait on the own inbox. A neighbour that fails —
unreachable, too late, rejected by validation — lands in ``missing`` with its reason logged; one bad
neighbour never raises. What arrives is the same `Payload` the sender built, bitwise.

Byte accounting (docs/protocol.md, "Bytes"), the simulation's: ``bytes_recv`` is the wire bytes
this exchange read (including payloads that were then rejected); ``bytes_sent`` in pull mode is
the encoded payload's wire bytes once per out-neighbour of the plan, attributed to the round that
published it (the simulation's ``MemoryTransport`` counts the same), in push mode the pushes that
completed in this exchange. Counting what the server streamed instead put a neighbour's late pull
into the serving peer's next round, and a pull after its last round in no record at all. The
asynchronous mode (no round barrier: a neighbour pulls whichever round is newest, or none) still
reports the bytes served since the previous exchange.

`GrpcTransport` is its parts, one job each (docs/architecture.md, "The transport's parts"): the
channels to the neighbours (`channels`), who answers and who refuses (`liveness`), pulls
(`pull_client`), pushes and the sender's push-sum ledger (`push_client`), and a restarted
receiver's repair (`push_recovery`). It checks each call, keeps the byte accounting and the
checkpointed ledger's shape, and lingers before it closes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

from p2pfl.config import NetworkConfig
from p2pfl.models.layout import TensorSpec
from p2pfl.payload import Payload
from p2pfl.proto import peer_pb2
from p2pfl.security.certs import TLSConfig
from p2pfl.topology import MixingPlan, Topology
from p2pfl.transport.base import ExchangeResult, Transport, TransportError
from p2pfl.transport.channels import Channels
from p2pfl.transport.grpc_service import PeerServer
from p2pfl.transport.liveness import Liveness
from p2pfl.transport.pull_client import PullClient
from p2pfl.transport.push_client import PushClient
from p2pfl.transport.push_recovery import PushRecovery
from p2pfl.wire.compress import WireFormat

__all__ = ["GrpcTransport", "bind_address", "start_grpc_peer"]

log = logging.getLogger(__name__)


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
        self.owns_server = owns_server
        self.chunk_bytes = int(network_cfg.chunk_kb) * 1024
        self.wire_format = WireFormat()  # wire.*: what neighbours' payloads must be encoded as (configure_wire)
        max_bytes = int(network_cfg.max_message_mb) << 20
        if self.chunk_bytes < 1 or max_bytes < 1:
            raise ValueError("network.chunk_kb and network.max_message_mb must be positive")
        nbrs = topology.possible_in_neighbours(peer_id) | topology.possible_out_neighbours(peer_id)
        # Pulls of this step, plus pushes of an earlier step that may still be running.
        self._pool = futures.ThreadPoolExecutor(
            max_workers=max(4, 2 * len(nbrs) + 2), thread_name_prefix=f"xchg-{peer_id}"
        )
        self.channels = Channels(topology, tls, self.chunk_bytes)
        self.liveness = Liveness(peer_id, self.channels, float(network_cfg.probe_s), lambda: self.final_round)
        self.puller = PullClient(peer_id, topology.hash(), server, self.channels, self.liveness, self._pool,
                                 tuple(expected_specs), frozenset(scalar_keys), max_bytes)
        # A restarted peer (it has a checkpoint, or a pushes log from an earlier start) recovers the
        # pushes of its first round that it had mixed and lost with its state.
        restarted = server.round > 0 or (pushes_log is not None and pushes_log.exists())
        self.recovery = PushRecovery(peer_id, topology, server, self.puller, pushes_log, restarted)
        self.pusher = PushClient(peer_id, server, self.channels, self.liveness, self.recovery, self._pool,
                                 self.chunk_bytes, pushes_log, lambda: self.final_round)
        self._served_reported = server.served_bytes
        self._closed = False
        self._last_published: tuple[tuple[int, int], frozenset[str]] | None = None

    # ---- calls for tools, the node process and the checks ----------------------------------------

    def status(self, peer: str, timeout_s: float = 5.0, wait_for_ready: bool = True) -> peer_pb2.StatusReply:
        """Ask ``peer`` for its Status, naming this peer (raises grpc.RpcError when unreachable)."""
        return self.liveness.status(peer, timeout_s, wait_for_ready)

    def pull(self, peer: str, round: int, step: int, deadline_s: float) -> tuple[Payload, int]:
        """Pull ``peer``'s payload for (round, step) alone: (message, wire bytes); `TransportError` with the reason.

        The same path `exchange` takes for each in-neighbour (validation included), for tools,
        tests and benchmarks that want one transfer.
        """
        msg, nbytes, why = self.puller.pull_one(peer, round, step, time.monotonic() + deadline_s)
        if msg is None:
            raise TransportError(f"pull from {peer} (round {round} step {step}) failed: {why}")
        return msg, nbytes

    def is_down(self, peer: str) -> bool:
        return self.liveness.is_down(peer)

    def refused_streak(self) -> tuple[int, dict[str, str]]:
        """Rounds in a row in which every neighbour called refused this peer, and why (`RefusalTracker`)."""
        return self.liveness.refusals.streak()

    # ---- exchange ------------------------------------------------------------------------------

    can_withhold = True

    def exchange(self, message: Payload, plan: MixingPlan, deadline_s: float,
                 withhold: bool = False) -> ExchangeResult:
        """Publish/push ``message`` per ``plan``; collect the in-neighbours' payloads until ``deadline_s``.

        ``withhold`` (push mode): tell every out-neighbour that this peer keeps its whole share this
        step (they mix without it at once, without waiting).
        """
        self._check(message, plan)
        deadline = time.monotonic() + deadline_s
        if plan.mode == "push":
            res = self.pusher.exchange(message, plan, deadline, withhold)
            res.bytes_sent = self._take_sent()
            return res
        payload = self.server.publish(message)
        self._last_published = ((message.round, message.step), frozenset(plan.out_weights))
        return self.puller.exchange(message, plan, deadline, payload.wire_bytes)

    def exchange_latest(self, message: Payload, plan: MixingPlan, max_staleness: int,
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
        res = self.puller.latest(message, plan, max_staleness, wait_s)
        res.bytes_sent = self._take_sent()
        return res

    def _check(self, message: Payload, plan: MixingPlan) -> None:
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

    def _take_sent(self) -> int:
        """Bytes served to pullers since the last call, plus the pushes mixed (module doc: "Byte accounting")."""
        served = self.server.served_bytes
        sent, self._served_reported = served - self._served_reported, served
        return sent + self.pusher.take_pushed()

    # ---- push-sum ledger -----------------------------------------------------------------------

    def ledger_state(self) -> dict[str, dict[str, float]] | None:
        """The running totals given (this peer as sender) and absorbed (as receiver), for the checkpoint."""
        if self.server.mode != "push":
            return None
        return {"given": self.pusher.given(), "offered": self.pusher.offered(), "absorbed": self.server.absorbed(),
                "absorbed_high": self.server.ledger.highs()}

    def late_settlement(self) -> float:
        return sum(self.server.pop_settled().values()) + self.pusher.take_deferred()

    def defer_settlement(self, amount: float) -> None:
        self.pusher.defer(amount)

    def restore_ledger(self, ledger: dict[str, Any] | None) -> None:
        """Restore the running totals saved with the checkpoint being resumed (the state they match)."""
        if not isinstance(ledger, dict):
            return
        self.pusher.restore_given(ledger.get("given") or {}, ledger.get("offered"))
        self.recovery.restore_checkpoint(ledger.get("absorbed") or {}, ledger.get("absorbed_high"))

    # ---- rejoin ------------------------------------------------------------------------------

    def resumed_round(self) -> int:
        return self.recovery.resumed_round

    def proven_rounds(self, peers: Iterable[str], probe: Iterable[str], timeout_s: float) -> dict[str, int]:
        """Per peer of ``peers``, the highest round of a validated payload from it; those in ``probe``
        are asked first (in parallel, each bounded by ``timeout_s``): `PullClient.proven_rounds`."""
        return self.puller.proven_rounds(peers, probe, timeout_s, self.final_round)

    # ---- the end -------------------------------------------------------------------------------

    def linger(self, deadline_s: float) -> None:
        """Before stopping: let the neighbours get this peer's last payload (up to ``deadline_s``).

        A peer that finishes first would otherwise take its final payload away from neighbours that
        are still one exchange behind: pull mode waits until every planned puller completed its Pull;
        push mode waits for its own pushes in flight, then serves on for its ledger
        (`Liveness.serve_on_for_ledger`).
        """
        deadline = time.monotonic() + deadline_s
        if self._last_published is not None:
            key, pullers = self._last_published
            pullers = frozenset(p for p in pullers if not self.is_down(p))
            left = self.server.wait_pulled(key, pullers, deadline)
            if left:
                log.warning("%s: stopping before %s pulled round %d step %d", self.peer_id,
                            ",".join(sorted(left)), key[0], key[1])
        if self.pusher.pushes:
            futures.wait(self.pusher.pushes, timeout=max(0.0, deadline - time.monotonic()))
        if self.server.mode == "push" and self.final_round is not None:
            self.liveness.serve_on_for_ledger(self.server, self.topology, self.final_round, deadline_s)

    def configure_wire(self, fmt: WireFormat, chunk_bytes: int | None = None) -> None:
        """The wire format for the neighbours' payloads this peer pulls and for the pushes its server takes."""
        self.wire_format = fmt
        self.puller.wire_format = fmt
        self.server.wire_format = fmt

    def close(self) -> None:
        """Close channels and worker threads; stop the server too when this transport owns it."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.channels.close()
        if self.owns_server:
            self.server.stop(1.0)


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
