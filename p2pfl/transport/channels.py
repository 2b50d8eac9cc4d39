"""The client side's channels: one long-lived gRPC channel per neighbour, how it dials, how calls retry.

Why: every call this peer makes (Pull, Push, Status) goes over the same channel to a neighbour,
opened on first use with the same options and credentials, and closed once with the transport.
Keepalive pings detect a neighbour that died while a Pull waits; a short reconnect backoff finds it
again within about a second once it is back. gRPC's transparent retries are off: the pull and
push clients retry themselves, within the round's deadline, with `backoff_s`.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from p2pfl.proto import peer_pb2
from p2pfl.security.certs import TLSConfig
from p2pfl.topology import Topology
from p2pfl.transport.rpc import PULL_METHOD, PUSH_METHOD, STATUS_METHOD, grpc_message_limit, identity
from p2pfl.wire.codec import DEFAULT_CHUNK_BYTES, parse_frame

__all__ = ["RECONNECT_BACKOFF_MAX_S", "Channels", "Neighbour", "backoff_s", "channel_options"]

_BACKOFF_BASE_S = 0.05  # first pause before retrying a transient failure
_BACKOFF_MAX_S = 1.0
#: The longest pause gRPC takes before redialling a neighbour it could not reach (x1.2 at most, its jitter).
RECONNECT_BACKOFF_MAX_S = 1.0


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
        ("grpc.max_reconnect_backoff_ms", int(RECONNECT_BACKOFF_MAX_S * 1000)),
        ("grpc.enable_retries", 0),
    ]
    if target_id is not None:
        opts.append(("grpc.ssl_target_name_override", target_id))
    return opts


def backoff_s(attempt: int) -> float:
    """Jittered exponential backoff before retry ``attempt`` (1, 2, ...): 0.05 s doubling up to 1 s, x[0.5, 1.5)."""
    return min(_BACKOFF_MAX_S, _BACKOFF_BASE_S * 2 ** min(attempt - 1, 10)) * (0.5 + random.random())


@dataclass
class Neighbour:
    """One neighbour's channel and the three calls on it (kept for the transport's lifetime)."""

    channel: grpc.Channel
    pull: Callable[..., Any]
    push: Callable[..., Any]
    status: Callable[..., Any]


class Channels:
    """The channels to this peer's neighbours: opened lazily (mutual TLS, or plaintext when ``tls`` is None), then reused."""

    def __init__(self, topology: Topology, tls: TLSConfig | None, chunk_bytes: int) -> None:
        self._topology = topology
        self._chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._neighbours: dict[str, Neighbour] = {}
        self._credentials = tls.channel_credentials() if tls is not None else None

    def get(self, peer: str) -> Neighbour:
        """The (lazily opened, then reused) channel to ``peer``."""
        with self._lock:
            n = self._neighbours.get(peer)
            if n is not None:
                return n
            target = self._topology.address(peer)
            if self._credentials is not None:
                ch = grpc.secure_channel(target, self._credentials, options=channel_options(self._chunk_bytes, peer))
            else:
                ch = grpc.insecure_channel(target, options=channel_options(self._chunk_bytes))
            n = Neighbour(
                channel=ch,
                pull=ch.unary_stream(
                    PULL_METHOD,
                    request_serializer=peer_pb2.PullRequest.SerializeToString,
                    response_deserializer=parse_frame,
                ),
                push=ch.stream_unary(
                    PUSH_METHOD, request_serializer=identity, response_deserializer=peer_pb2.PushReply.FromString
                ),
                status=ch.unary_unary(
                    STATUS_METHOD,
                    request_serializer=peer_pb2.StatusRequest.SerializeToString,
                    response_deserializer=peer_pb2.StatusReply.FromString,
                ),
            )
            self._neighbours[peer] = n
            return n

    def close(self) -> None:
        """Close every channel opened so far."""
        with self._lock:
            nbrs, self._neighbours = list(self._neighbours.values()), {}
        for n in nbrs:
            n.channel.close()
