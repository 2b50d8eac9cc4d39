"""A small pool of model objects that peers borrow to train and evaluate.

DESIGN: one model object per worker with each peer's tensors swapped in, not N modules. A
peer binds its flat buffer into a borrowed model (zero copy), trains, and returns it. The pool
size also caps how many peers compute at once (the simulation's worker count).
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import nn


class ModelPool:
    def __init__(self, factory: Callable[[], nn.Module], size: int) -> None:
        self._free: queue.SimpleQueue[nn.Module] = queue.SimpleQueue()
        for _ in range(size):
            self._free.put(factory())
        self.size = size

    @contextmanager
    def borrow(self) -> Iterator[nn.Module]:
        model = self._free.get()
        try:
            yield model
        finally:
            for p in model.parameters():
                p.grad = None
            self._free.put(model)
