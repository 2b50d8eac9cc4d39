"""Fair, bounded service for the peer server: who may hold how many calls, for how long, and how
loudly a caller's rejections are logged.

Why: every gRPC call of the synchronous server holds a worker thread while it waits (a Pull for
an unpublished step, a Push for its fate) or streams (a Pull whose caller does not read, a Push
whose caller trickles chunks). Without limits one neighbour with a valid certificate can hold
every worker and the others lose their rounds (issue 10, item 3). So:

* `CallLimits`: at most ``per_peer`` concurrent calls per authenticated neighbour, and a small
  shared quota for every other caller (a certificate the topology does not name as a neighbour);
  the excess is answered RESOURCE_EXHAUSTED at once. The server sizes its thread pool from these
  quotas (`CallLimits.workers`), so the quota binds, never the pool.
* `CallWatch`: a server-side deadline on every call, whatever deadline the client set (or none):
  one thread cancels calls that outlive it, which frees a worker blocked in a send to a caller that
  does not read, or in a receive from a caller that stalls.
* `RateLimitedLog`: rejections are logged one line each, at most ``burst`` per caller and
  ``interval_s``, then counted and summarized, so a caller cannot fill the disk with our logs.
* `safe_deserializer`: a request that is not a valid protobuf message becomes an `Undecodable`
  value for the handler to refuse with one line, not an exception gRPC logs with a traceback.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "UNKNOWN",
    "CallLimits",
    "CallWatch",
    "RateLimitedLog",
    "Undecodable",
    "bounded",
    "safe_deserializer",
]

#: The shared quota's key: callers the topology does not name as a neighbour of this peer.
UNKNOWN = "(non-neighbours)"

#: Longest status detail / log message built from a rejection (the rest is cut).
MAX_DETAIL_CHARS = 1024


def bounded(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """``text`` fit for a log line or a status detail: control characters escaped, at most ``limit`` chars."""
    n = len(text)
    out = text[:limit]
    if not out.isprintable():
        out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in out)
    if n > limit or len(out) > limit:
        out = f"{out[: limit - 24]}... ({n} chars)"
    return out


class CallLimits:
    """Per-caller concurrency quotas: ``per_peer`` calls for each neighbour, ``unknown`` shared by the rest."""

    def __init__(self, neighbours: Iterable[str], per_peer: int, unknown: int) -> None:
        if per_peer < 1 or unknown < 1:
            raise ValueError(f"call limits must be >= 1 (per peer {per_peer}, non-neighbours {unknown})")
        self.neighbours = frozenset(neighbours)
        self.per_peer = int(per_peer)
        self.unknown = int(unknown)
        self._lock = threading.Lock()
        self._active: dict[str, int] = {}

    @property
    def workers(self) -> int:
        """Threads that serve every quota at once, plus a margin for health checks and quick refusals."""
        return len(self.neighbours) * self.per_peer + self.unknown + 4

    def bucket(self, caller: str | None) -> str:
        return caller if caller is not None and caller in self.neighbours else UNKNOWN

    def enter(self, caller: str | None) -> tuple[str, int] | None:
        """Take one slot of ``caller``'s quota: (bucket, limit), or None when it is full."""
        key = self.bucket(caller)
        limit = self.unknown if key == UNKNOWN else self.per_peer
        with self._lock:
            n = self._active.get(key, 0)
            if n >= limit:
                return None
            self._active[key] = n + 1
        return key, limit

    def leave(self, key: str) -> None:
        with self._lock:
            n = self._active.get(key, 0) - 1
            if n > 0:
                self._active[key] = n
            else:
                self._active.pop(key, None)

    def active(self, caller: str | None = None) -> int:
        """Calls in progress for ``caller``'s bucket (all buckets when None)."""
        with self._lock:
            if caller is None:
                return sum(self._active.values())
            return self._active.get(self.bucket(caller), 0)


@dataclass(eq=False)
class Call:
    """One call in progress: its server-side deadline, its quota slot, whether the watch cut it."""

    rpc: str
    context: Any  # grpc.ServicerContext
    deadline: float  # time.monotonic()
    slot: str | None = None
    cut: bool = False
    caller: str = "?"
    started: float = field(default_factory=time.monotonic)


class CallWatch:
    """Server-side deadlines: a call still running ``limit_s`` after it started is cancelled.

    One daemon thread sleeps until the earliest deadline (a heap; calls that ended are skipped
    lazily). Cancelling wakes a handler blocked in gRPC (a send to a caller that does not read, a
    receive from one that stalls) and runs the call's callbacks (which wake condition waits).
    """

    def __init__(self, limit_s: float, on_cut: Callable[[Call], None], name: str = "call-watch") -> None:
        if limit_s <= 0:
            raise ValueError(f"the server-side call limit must be positive, got {limit_s}")
        self.limit_s = float(limit_s)
        self._on_cut = on_cut
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Call]] = []
        self._live: set[Call] = set()
        self._seq = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def open(self, rpc: str, context: Any) -> Call:
        call = Call(rpc, context, time.monotonic() + self.limit_s)
        with self._cond:
            self._live.add(call)
            heapq.heappush(self._heap, (call.deadline, next(self._seq), call))
            if self._heap[0][2] is call:
                self._cond.notify()
        return call

    def close(self, call: Call) -> None:
        with self._cond:
            self._live.discard(call)
            if len(self._heap) > 2 * len(self._live) + 1024:  # many short calls: drop the ended ones
                self._heap = [e for e in self._heap if e[2] in self._live]
                heapq.heapify(self._heap)

    @property
    def live(self) -> int:
        with self._cond:
            return len(self._live)

    def stop(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    while self._heap and self._heap[0][2] not in self._live:
                        heapq.heappop(self._heap)
                    if self._heap and self._heap[0][0] <= time.monotonic():
                        call = heapq.heappop(self._heap)[2]
                        self._live.discard(call)
                        call.cut = True
                        break
                    self._cond.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
            try:
                self._on_cut(call)
                call.context.cancel()
            except Exception:  # pragma: no cover - never let one call stop the watch
                logging.getLogger(__name__).exception("cutting a %s call failed", call.rpc)


class RateLimitedLog:
    """At most ``burst`` lines per key per ``interval_s``; the rest are counted, then summarized."""

    def __init__(self, logger: logging.Logger, burst: int = 5, interval_s: float = 10.0,
                 max_keys: int = 1024) -> None:
        self._log = logger
        self.burst, self.interval_s, self.max_keys = int(burst), float(interval_s), int(max_keys)
        self._lock = threading.Lock()
        self._state: dict[str, list[float]] = {}  # key -> [window start, lines in window, suppressed]

    def __call__(self, level: int, key: str, fmt: str, *args: object) -> bool:
        """Log ``fmt % args`` unless ``key`` used up its lines; True if it was logged."""
        now = time.monotonic()
        with self._lock:
            st = self._state.get(key)
            if st is None:
                if len(self._state) >= self.max_keys:  # many distinct callers: drop expired windows
                    self._state = {k: v for k, v in self._state.items() if now - v[0] < self.interval_s}
                    if len(self._state) >= self.max_keys:
                        key = "*"
                st = self._state.setdefault(key, [now, 0, 0])
            if now - st[0] >= self.interval_s:
                suppressed = int(st[2])
                st[:] = [now, 0, 0]
            else:
                suppressed = 0
            if st[1] >= self.burst:
                st[2] += 1
                return False
            st[1] += 1
        if suppressed:
            fmt += " (%d similar messages about this caller suppressed in the last %.0fs)"
            args = (*args, suppressed, self.interval_s)
        self._log.log(level, fmt, *args)
        return True


@dataclass(frozen=True)
class Undecodable:
    """A request message that did not parse: what the handler gets instead of an exception."""

    size: int
    error: str


def safe_deserializer(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``parse`` as a gRPC deserializer that never raises: malformed bytes become `Undecodable`."""

    def deserialize(buf: bytes) -> Any:
        try:
            return parse(buf)
        except Exception as e:  # protobuf's DecodeError, or anything a hostile buffer provokes
            return Undecodable(len(buf), bounded(f"{type(e).__name__}: {e}", 200))

    return deserialize
