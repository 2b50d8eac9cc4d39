"""Handing a scarce thing to waiting peers: the model pool.

DESIGN: one model object per worker with each peer's tensors swapped in, not N modules. A
peer binds its flat buffer into a borrowed model (zero copy), computes, and returns it. The
pool size also caps how many peers compute at once. Waiters are served by priority (the
round they are in, then their index): a peer that others wait on at a synchronous barrier goes
first, so the workers idle less.

A returned item is handed straight to the first waiter, which alone is woken (its own lock):
with many peer threads, waking them all on every return (one shared condition) cost
thousands of futile wake-ups per round. Which peer computes when never changes a result (each
peer's randomness is its own), only how long the others wait.

In the simulation a worker's peers take turns (`p2pfl.turns.Turns`) and never wait for the
model: only the peer whose turn it is computes, and it returns the model before it waits for its
neighbours.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

from torch import nn

T = TypeVar("T")


class _Waiter(Generic[T]):
    """One blocked borrower: a lock held until an item is handed over, and the slot it lands in."""

    __slots__ = ("gate", "item")

    def __init__(self) -> None:
        self.gate = threading.Lock()
        self.gate.acquire()
        self.item: T | None = None


class HandoffPool(Generic[T]):
    """A fixed set of items lent to threads; a returned item goes to the waiter of smallest priority."""

    def __init__(self, items: list[T]) -> None:
        self._free: list[T] = list(items)
        self._waiting: list[tuple[tuple, int, _Waiter[T]]] = []  # heap of (priority, ticket, waiter)
        self._lock = threading.Lock()
        self._ticket = itertools.count()
        self.size = len(items)

    def acquire(self, priority: tuple = ()) -> T:
        """Take an item, waiting (behind smaller priorities, then earlier arrivals) if none is free."""
        with self._lock:
            if self._free:  # nobody waits while an item is free: a return goes to the first waiter
                return self._free.pop()
            waiter: _Waiter[T] = _Waiter()
            heapq.heappush(self._waiting, (priority, next(self._ticket), waiter))
        waiter.gate.acquire()  # released by `release` once the item is in `waiter.item`
        assert waiter.item is not None
        return waiter.item

    def release(self, item: T) -> None:
        """Give ``item`` back: to the first waiter if any (waking it alone), else to the free list."""
        with self._lock:
            if not self._waiting:
                self._free.append(item)
                return
            _, _, waiter = heapq.heappop(self._waiting)
            waiter.item = item
        waiter.gate.release()


class ModelPool(HandoffPool[nn.Module]):
    def __init__(self, factory: Callable[[], nn.Module], size: int) -> None:
        super().__init__([factory() for _ in range(size)])

    @contextmanager
    def borrow(self, priority: tuple = ()) -> Iterator[nn.Module]:
        """Borrow a model; among waiters the smallest ``priority`` (then the earliest) is served first."""
        model = self.acquire(priority)
        try:
            yield model
        finally:
            for p in model.parameters():
                p.grad = None
            self.release(model)
