"""A small pool of model objects that peers borrow to train and evaluate.

DESIGN: one model object per worker with each peer's tensors swapped in, not N modules. A
peer binds its flat buffer into a borrowed model (zero copy), computes, and returns it. The
pool size also caps how many peers compute at once. Waiters are served by priority (the
round they are in, then their index): a peer that others wait on at a synchronous barrier goes
first, so the workers idle less.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import nn


class ModelPool:
    def __init__(self, factory: Callable[[], nn.Module], size: int) -> None:
        self._free: list[nn.Module] = [factory() for _ in range(size)]
        self._waiting: list[tuple[tuple, int]] = []
        self._cond = threading.Condition()
        self._ticket = itertools.count()
        self.size = size

    @contextmanager
    def borrow(self, priority: tuple = ()) -> Iterator[nn.Module]:
        """Borrow a model; among waiters the smallest ``priority`` (then the earliest) is served first."""
        with self._cond:
            entry = (priority, next(self._ticket))
            heapq.heappush(self._waiting, entry)
            while not (self._free and self._waiting[0] == entry):
                self._cond.wait()
            heapq.heappop(self._waiting)
            model = self._free.pop()
            self._cond.notify_all()
        try:
            yield model
        finally:
            for p in model.parameters():
                p.grad = None
            with self._cond:
                self._free.append(model)
                self._cond.notify_all()
