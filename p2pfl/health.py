"""The health probe of a peer: is its standard gRPC health service (grpc.health.v1) SERVING?

Why its own module: a container HEALTHCHECK runs this every few seconds in a fresh process, next to
a peer that is busy training. Going through the ``p2pfl`` CLI would import typer, the config loader,
and (through the lazily mounted commands) torch and Flower: seconds of CPU per probe. This module
needs only grpc and the certificate loader (cryptography), so a probe costs a fraction of a second.

    python -m p2pfl.health 127.0.0.1:50051 --certs /p2pfl/certs --peer p0     (exit 0: SERVING)
    p2pfl health ...                                                           (same, through the CLI)
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

__all__ = ["check_health", "main"]

log = logging.getLogger(__name__)


def check_health(address: str, *, certs: Path | None, peer: str | None, target: str | None, insecure: bool,
                 timeout_s: float = 5.0) -> bool:
    """True if the peer at ``address`` reports SERVING on the standard gRPC health service.

    Mutual TLS unless ``insecure``: ``peer`` is our own id (client certificate from ``certs``),
    ``target`` the checked peer's id (its certificate's name; default ``peer``, a self-check).
    Raises ValueError / FileNotFoundError for missing TLS material; a peer that does not answer is False.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if insecure:
        channel = grpc.insecure_channel(address)
    else:
        from p2pfl.security.certs import TLSConfig

        if certs is None or peer is None:
            raise ValueError("TLS health check needs --certs DIR and --peer ID (or --insecure)")
        tls = TLSConfig.load(certs, peer)
        channel = grpc.secure_channel(address, tls.channel_credentials(),
                                      options=[("grpc.ssl_target_name_override", target or peer)])
    with channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                             timeout=timeout_s, wait_for_ready=False)
        except grpc.RpcError as exc:
            log.info("health check of %s failed: %s", address, exc.code())
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    """Exit 0 if SERVING, 1 if not (or unreachable), 2 for bad arguments or missing TLS material."""
    parser = argparse.ArgumentParser(prog="python -m p2pfl.health",
                                     description="Exit 0 if the peer at ADDRESS reports SERVING.")
    parser.add_argument("address", help="host:port of a peer")
    parser.add_argument("--certs", type=Path, help="certificate folder made by `p2pfl certs`")
    parser.add_argument("--peer", help="our own peer id (client certificate)")
    parser.add_argument("--target", help="the checked peer's id (default: --peer)")
    parser.add_argument("--insecure", action="store_true", help="plaintext gRPC")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    try:
        ok = check_health(args.address, certs=args.certs, peer=args.peer, target=args.target,
                          insecure=args.insecure, timeout_s=args.timeout)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("SERVING" if ok else "NOT SERVING")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
