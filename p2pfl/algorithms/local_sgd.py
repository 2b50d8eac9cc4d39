"""The one local-training loop every algorithm builds on.

Batches come only from the peer's own generator, so a peer's training is bitwise the same in
any process or thread. Optimizers are created per call: momentum is local to a round (the
Dis-PFL code's convention, which the papers follow).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from p2pfl.algorithms.base import TrainContext

# A step function computes the loss on (x, y), calls backward, and returns the loss; the loop
# then applies the optimizer. SAM and ADMM supply their own.
StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def batches(ctx: TrainContext, *, epochs: float | None = None, steps: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``epochs`` full shuffled passes, or ``steps`` random minibatches (exactly one of them)."""
    if (epochs is None) == (steps is None):
        raise ValueError("give exactly one of epochs or steps")
    if steps is not None:
        for _ in range(int(steps)):
            yield ctx.data.sample_batch(ctx.generator)
        return
    whole = int(epochs)
    for _ in range(whole):
        yield from ctx.data.epoch(ctx.generator)
    frac = float(epochs) - whole
    if frac > 0:
        n = max(1, round(frac * ctx.data.steps_per_epoch()))
        for _ in range(n):
            yield ctx.data.sample_batch(ctx.generator)


def loss_step(model: nn.Module) -> StepFn:
    """Plain step: cross-entropy, backward."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return step


@contextmanager
def trainable(model: nn.Module, params: Iterable[nn.Parameter]):
    """Only ``params`` require grad inside the block (the frozen block gets no gradient work)."""
    keep = {id(p) for p in params}
    saved = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in saved:
        p.requires_grad_(id(p) in keep)
    try:
        yield
    finally:
        for p, flag in saved:
            p.requires_grad_(flag)


def run_sgd(ctx: TrainContext, params: list[nn.Parameter], *, lr: float, epochs: float | None = None,
            steps: int | None = None, momentum: float = 0.0, weight_decay: float = 0.0,
            step_fn: StepFn | None = None, after_step: Callable[[], None] | None = None) -> float:
    """SGD over ``params`` only (others frozen); returns the mean training loss."""
    model = ctx.model
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    step_fn = step_fn or loss_step(model)
    total, count = 0.0, 0
    model.train()
    with trainable(model, params):
        for x, y in batches(ctx, epochs=epochs, steps=steps):
            opt.zero_grad(set_to_none=True)
            loss = step_fn(x, y)
            opt.step()
            if after_step is not None:
                after_step()
            total += float(loss.detach())
            count += 1
    return total / max(count, 1)
