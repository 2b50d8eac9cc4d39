"""The peer service's contract on the wire, shared by its server and its clients.

Why a module of its own: the server (`grpc_service`, `handlers`) and the client side
(`channels`, `pull_client`, `push_client`) must agree on method names, metadata keys, message
limits and what each rejection is answered with; one definition here keeps them from drifting.
Nothing in it holds state.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import grpc

from p2pfl.transport.logs import SERVICE_LOG, TRANSPORT_LOG  # the server's and the client's loggers
from p2pfl.wire.codec import DEFAULT_CHUNK_BYTES
from p2pfl.wire.validate import Reason, WireError

__all__ = [
    "ABSORBED_MD",
    "DECISION_ROUNDS",
    "EVIDENCE_MD",
    "GIVEN_MD",
    "HEADER_SLACK",
    "KEEP_MD",
    "PULL_METHOD",
    "PUSH_METHOD",
    "SERVICE",
    "SERVICE_LOG",
    "STATUS_METHOD",
    "TRANSPORT_LOG",
    "Rejected",
    "grpc_message_limit",
    "identity",
    "server_options",
    "status_for",
    "version",
]


SERVICE = "p2pfl.peer.Peer"
PULL_METHOD = f"/{SERVICE}/Pull"
PUSH_METHOD = f"/{SERVICE}/Push"
STATUS_METHOD = f"/{SERVICE}/Status"

#: Room for the header chunk (manifest, scalars) above the data chunk size in one gRPC message.
HEADER_SLACK = 1 << 20

#: Push decisions (mixed / closed) are remembered this many rounds, to answer repeated pushes.
DECISION_ROUNDS = 1024

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


def identity(b: bytes) -> bytes:
    """The (de)serializer of frames that are already serialized (`p2pfl.wire.codec.encode_frames`)."""
    return b


def version() -> str:
    """This package's version, as Status answers it."""
    try:
        return importlib.metadata.version("p2pfl-personal")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0+unknown"


class Rejected(Exception):
    """A rejection decided under the server's lock, raised (or returned) and answered as a gRPC error outside it."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
