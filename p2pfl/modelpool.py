"""A small pool of model objects that peers borrow to train and evaluate.

DESIGN: one model object per worker with each peer's tensors swapped in, not N modules. A
peer binds its flat buffer into a borrowed model (zero copy), computes, and returns it. The
pool size also caps how many peers compute at once. Waiters are served by priority (the
round they are in, then their index): a peer that others wait on at a synchronous barrier goes
first, so the workers idle less.

A returned model is handed straight to the first waiter, which alone is woken (its own lock):
with 64 peer threads per worker, waking them all on every return (one shared condition) cost
thousands of futile wake-ups per round. Which peer computes when never changes a result (each
peer's randomness is its own), only how long the others wait.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import nn


class _Waiter:
    """One blocked borrower: a lock held until a model is handed over, and the slot it lands in."""

    __slots__ = ("gate", "model")

    def __init__(self) -> None:
        self.gate = threading.Lock()
        self.gate.acquire()
        self.model: nn.Module | None = None


class ModelPool:
    def __init__(self, factory: Callable[[], nn.Module], size: int) -> None:
        self._free: list[nn.Module] = [factory() for _ in range(size)]
        self._waiting: list[tuple[tuple, int, _Waiter]] = []  # heap of (priority, ticket, waiter)
        self._lock = threading.Lock()
        self._ticket = itertools.count()
        self.size = size

    def _acquire(self, priority: tuple) -> nn.Module:
        with self._lock:
            if self._free:  # nobody waits while a model is free: a return goes to the first waiter
                return self._free.pop()
            waiter = _Waiter()
            heapq.heappush(self._waiting, (priority, next(self._ticket), waiter))
        waiter.gate.acquire()  # released by `_release` once the model is in `waiter.model`
        assert waiter.model is not None
        return waiter.model

    def _release(self, model: nn.Module) -> None:
        with self._lock:
            if not self._waiting:
                self._free.append(model)
                return
            _, _, waiter = heapq.heappop(self._waiting)
            waiter.model = model
        waiter.gate.release()

    @contextmanager
    def borrow(self, priority: tuple = ()) -> Iterator[nn.Module]:
        """Borrow a model; among waiters the smallest ``priority`` (then the earliest) is served first."""
        model = self._acquire(priority)
        try:
            yield model
        finally:
            for p in model.parameters():
                p.grad = None
            self._release(model)
