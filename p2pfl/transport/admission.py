"""Admission and fairness for the peer service: who is calling, whether it may, and how a refusal is said.

Why one place: every handler authenticates its caller, takes a slot of that caller's quota, and
answers a refusal with a precise gRPC error logged at WARNING; one object does each of the three
the same way for Pull, Push and Status. `Admission.guarded` wraps a handler so its slot is freed
however the call ends and the server-side call limit cuts it (`p2pfl.transport.limits`:
`CallLimits`, `CallWatch`, `RateLimitedLog`); `caller` says who the caller is (the certificate's
peer id under mutual TLS, the claimed one under --insecure); `reject` answers and logs, at most a
few lines per caller and 10 s, so a caller cannot fill the disk with this peer's logs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import grpc

from p2pfl.security.certs import caller_peer_id
from p2pfl.transport.limits import Call, CallLimits, CallWatch, RateLimitedLog, Undecodable, bounded
from p2pfl.transport.rpc import SERVICE_LOG
from p2pfl.transport.service_config import ServiceConfig
from p2pfl.wire.validate import excerpt

__all__ = ["Admission"]

log = SERVICE_LOG


class Admission:
    """Authentication, per-caller quotas, the server-side call limit and the rejection log of one `PeerServer`."""

    def __init__(self, config: ServiceConfig) -> None:
        self._config = config
        # fair service (p2pfl/transport/limits.py): quotas per caller, server-side call deadlines
        self._limits: CallLimits | None = None
        self._watch: CallWatch | None = None
        self._log_rejection = RateLimitedLog(log, burst=20, interval_s=10.0)

    def start(self, max_calls_per_peer: int, max_calls_others: int) -> int:
        """Set the quotas (every neighbour ``max_calls_per_peer``, all other callers ``max_calls_others``
        together) and start the call watch (``config.max_call_s``); return the worker threads that
        serve every quota at once, so a caller meets its own limit, never a pool another caller filled."""
        cfg = self._config
        self._limits = CallLimits(cfg.may_pull | cfg.may_push, max_calls_per_peer, max_calls_others)
        self._watch = CallWatch(cfg.max_call_s, self._cut, name=f"calls-{cfg.peer_id}")
        return self._limits.workers

    def stop(self) -> None:
        """Stop the call watch's thread."""
        if self._watch is not None:
            self._watch.stop()

    @property
    def live(self) -> int:
        """Calls still running (-1 before start)."""
        return self._watch.live if self._watch else -1

    def calls_in_progress(self, caller: str | None = None) -> int:
        """Calls holding a slot of ``caller``'s quota (non-neighbours share one), or of all quotas."""
        return self._limits.active(caller) if self._limits is not None else 0

    def reject(self, context: grpc.ServicerContext, rpc: str, who: str, code: grpc.StatusCode, msg: str) -> NoReturn:
        """Answer ``code``/``msg`` and log it (one bounded line; at most a few per caller and 10 s)."""
        who, msg = bounded(who, 80), bounded(msg)
        self._log_rejection(logging.WARNING, self._log_key(who), "%s: rejected %s from %s: %s: %s",
                            self._config.peer_id, rpc, who, code.name, msg)
        context.abort(code, msg)
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover

    def guarded(self, rpc: str, handler: Callable[..., Any], streaming: bool = False) -> Callable[..., Any]:
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

    def admit(self, call: Call, caller: str) -> None:
        """Take a slot of ``caller``'s quota for ``call``, or refuse RESOURCE_EXHAUSTED at once."""
        assert self._limits is not None
        got = self._limits.enter(caller)
        if got is None:
            bucket = self._limits.bucket(caller)
            whose = f"peer {excerpt(caller)}" if bucket == caller else "callers that are not neighbours"
            limit = self._limits.per_peer if bucket == caller else self._limits.unknown
            self.reject(call.context, call.rpc, caller, grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{whose} {'has' if bucket == caller else 'have'} {limit} calls in progress on "
                        f"{self._config.peer_id!r} already (the limit); retry later")
        call.slot, call.caller = got[0], caller

    def caller(self, context: grpc.ServicerContext, claimed: str, rpc: str) -> str:
        """The authenticated caller id: the certificate's under TLS, the claimed one under --insecure."""
        who = claimed or context.peer()
        if self._config.tls is None:
            if not claimed:
                self.reject(context, rpc, who, grpc.StatusCode.UNAUTHENTICATED,
                            "the request names no peer id (insecure mode identifies callers by the id they claim)")
            return claimed
        cert_id = caller_peer_id(context)
        if cert_id is None:
            self.reject(context, rpc, who, grpc.StatusCode.UNAUTHENTICATED,
                        "the caller presented no usable peer certificate")
        if claimed and claimed != cert_id:
            self.reject(context, rpc, cert_id, grpc.StatusCode.PERMISSION_DENIED,
                        f"the caller claims to be {excerpt(claimed)} but its certificate is for {cert_id!r}")
        return cert_id

    def _open(self, rpc: str, request: Any, context: grpc.ServicerContext) -> Call:
        assert self._watch is not None
        call = self._watch.open(rpc, context)
        if isinstance(request, Undecodable):
            self._close(call)
            self.reject(context, rpc, context.peer(), grpc.StatusCode.INVALID_ARGUMENT,
                        f"the request ({request.size} bytes) is not a valid {rpc} request message: {request.error}")
        return call

    def _close(self, call: Call) -> None:
        assert self._watch is not None and self._limits is not None
        self._watch.close(call)
        if call.slot is not None:
            self._limits.leave(call.slot)
            call.slot = None

    def _log_key(self, who: str) -> str:
        """Whose log quota a line uses: each peer of the topology its own, everyone else one shared."""
        return who if who in self._config.members else "(others)"

    def _cut(self, call: Call) -> None:
        """The call watch is cancelling ``call``: say so (the caller sees CANCELLED)."""
        self._log_rejection(logging.WARNING, self._log_key(call.caller),
                            "%s: cut %s from %s after %.1fs: the server-side call limit is %.0fs",
                            self._config.peer_id, call.rpc, bounded(call.caller, 80),
                            time.monotonic() - call.started, self._config.max_call_s)
