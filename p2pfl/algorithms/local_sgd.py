"""The one local-training loop every algorithm builds on (the ``exact`` engine: one peer at a time).

Batches come only from the peer's own generator, so a peer's training is bitwise the same in
any process or thread. Momentum is local to a call (a round's phase): the Dis-PFL code's
convention, which the papers follow. The arithmetic of a step (SGD, SAM, clipping) is in
``rules``, shared with the batched engine; this module only drives it through a bound model.

Algorithms describe their local work as ``Phase`` values and call ``ctx.train(block, phase)``;
the context decides the engine (``TrainContext`` here, ``BatchedContext`` for stacks of peers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from p2pfl.algorithms.hyperparameters import HyperparameterError
from p2pfl.algorithms.rules import Scalar, clip_grads, sgd_step_

if TYPE_CHECKING:
    from p2pfl.data.loader import PeerData
    from p2pfl.models.layout import ParamLayout

# A step function computes the loss on (x, y), leaves the gradients in ``p.grad``, and returns
# the loss; the loop then applies the update rule. SAM supplies its own.
StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# An extra gradient term per parameter, ``(name, current value) -> term`` (e.g. ADMM's dual and
# prox terms); the value is one peer's tensor, or ``[peers, *shape]`` in the batched engine.
GradTerm = Callable[[str, Tensor], Tensor]

UNITS = ("steps", "epochs")


@dataclass(frozen=True)
class Phase:
    """How one block of parameters trains in one round.

    ``amount`` is counted in ``unit``: ``"steps"`` = that many fresh random minibatches,
    ``"epochs"`` = that many shuffled passes over the peer's data (fractions allowed, see
    ``batches``). ``sam_rho > 0`` makes every step a SAM step over this block; ``grad_clip > 0``
    clips the block's gradient norm (after SAM, before weight decay and momentum). ``lr`` may be
    a ``[peers]`` tensor in the batched engine.
    """

    lr: Scalar
    amount: float
    unit: str = "epochs"
    momentum: float = 0.0
    weight_decay: float = 0.0
    sam_rho: float = 0.0
    grad_clip: float = 0.0

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise HyperparameterError(f"unit must be one of {UNITS}, got {self.unit!r}")
        if self.amount < 0:
            raise HyperparameterError(f"local amount must be >= 0, got {self.amount}")
        if self.unit == "steps" and float(self.amount) != int(self.amount):
            raise HyperparameterError(f"a number of steps must be an integer, got {self.amount}")
        if self.sam_rho < 0:
            raise HyperparameterError(f"SAM rho must be >= 0, got {self.sam_rho}")

    @property
    def empty(self) -> bool:
        return float(self.amount) == 0.0

    def work(self) -> dict[str, float | int]:
        """``batches`` keyword arguments for this phase's length."""
        return {"steps": int(self.amount)} if self.unit == "steps" else {"epochs": float(self.amount)}


def position_batches(data: PeerData, generator: torch.Generator, *, epochs: float | None = None,
                     steps: int | None = None) -> Iterator[torch.Tensor]:
    """Minibatch positions: ``epochs`` full shuffled passes, or ``steps`` random minibatches.

    Fractional epochs end with ``round(frac * steps_per_epoch)`` (at least 1) random minibatches.
    Every engine draws through this function, so a peer's batches are the same in all of them.
    """
    if (epochs is None) == (steps is None):
        raise ValueError("give exactly one of epochs or steps")
    if steps is not None:
        for _ in range(int(steps)):
            yield data.sample_positions(generator)
        return
    whole = int(epochs)
    for _ in range(whole):
        yield from data.epoch_positions(generator)
    frac = float(epochs) - whole
    if frac > 0:
        n = max(1, round(frac * data.steps_per_epoch()))
        for _ in range(n):
            yield data.sample_positions(generator)


def batches(ctx: TrainContext, *, epochs: float | None = None, steps: int | None = None
            ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``epochs`` full shuffled passes, or ``steps`` random minibatches (exactly one of them)."""
    for pos in position_batches(ctx.data, ctx.generator, epochs=epochs, steps=steps):
        yield ctx.data.train_batch(pos)


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
            step_fn: StepFn | None = None, after_step: Callable[[], None] | None = None,
            grad_clip: float = 0.0, grad_term: GradTerm | None = None, names: list[str] | None = None,
            source: Iterable[tuple[Tensor, Tensor]] | None = None) -> float:
    """SGD over ``params`` only (others frozen); returns the mean training loss.

    Per minibatch (``source``, by default the peer's ``batches``): ``step_fn`` leaves the loss
    gradient in ``p.grad``; then ``clip_grads`` (``grad_clip`` > 0), plus ``grad_term(name, p)``
    (``names`` gives the names), then the shared ``sgd_step_`` rule, then ``after_step``.
    """
    model = ctx.model
    step_fn = step_fn or loss_step(model)
    # The rule itself, not a ``torch.optim.Optimizer`` around it: the first Optimizer a process
    # builds imports torch._dynamo (measured: ~8 s CPU and ~160 MB RSS per simulation worker),
    # and each step through one pays its profiling wrapper. Momentum buffers live for this call.
    bufs: list[Tensor | None] = [None] * len(params)
    total, count = 0.0, 0
    model.train()
    if source is None:
        source = batches(ctx, epochs=epochs, steps=steps)
    with trainable(model, params):
        for x, y in source:
            for p in params:
                p.grad = None
            loss = step_fn(x, y)
            with torch.no_grad():
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                if grad_clip > 0:
                    grads = clip_grads(grads, grad_clip)
                if grad_term is not None:
                    assert names is not None, "grad_term needs the parameter names"
                    grads = [g.add(grad_term(n, p)) for n, p, g in zip(names, params, grads, strict=True)]
                sgd_step_(params, grads, bufs, lr=lr, momentum=momentum, weight_decay=weight_decay)
            if after_step is not None:
                after_step()
            total += float(loss.detach())
            count += 1
    return total / max(count, 1)


def block_names(ctx_layout, block: str) -> list[str]:
    """Parameter names of a block: ``all`` (layout order), ``shared`` (body) or ``personal`` (head)."""
    if block == "all":
        return [s.name for s in ctx_layout.specs]
    if block == "shared":
        return list(ctx_layout.shared_names)
    if block == "personal":
        return list(ctx_layout.personal_names)
    raise ValueError(f"unknown parameter block {block!r}")


def train_exact(ctx: TrainContext, block: str, phase: Phase, *, grad_term: GradTerm | None = None,
                project: Tensor | None = None) -> float | None:
    """One phase for one peer through its bound model; None when the phase is empty.

    ``project`` is a flat 0/1 vector (the layout's length) re-applied to the parameters after
    every step (DisPFL's mask).
    """
    from p2pfl.algorithms.sam import sam_step

    if phase.empty:
        return None
    names = block_names(ctx.layout, block)
    named = dict(ctx.model.named_parameters())
    params = [named[n] for n in names]
    step_fn = sam_step(ctx.model, params, phase.sam_rho) if phase.sam_rho > 0 else None
    after = None
    if project is not None:
        views = ctx.layout.views(project)
        pairs = [(p, views[n]) for n, p in named.items()]

        def after() -> None:
            with torch.no_grad():
                for p, m in pairs:
                    p.mul_(m)

    lr = phase.lr
    if isinstance(lr, Tensor):
        lr = float(lr)
    source = None
    if block == "personal" and use_frozen_cache(ctx.cache_frozen) and can_represent(ctx.model) \
            and frozen_cache_pays(phase, ctx.data):
        # The body is frozen for the whole phase: its features of the phase's minibatches are
        # computed once, and the head trains on them (same minibatches, same update rule).
        head = ctx.model.head()  # type: ignore[operator]
        source = frozen_feature_batches(ctx.model, ctx.data, ctx.generator, phase)
        step_fn = sam_step(head, params, phase.sam_rho) if phase.sam_rho > 0 else loss_step(head)
    return run_sgd(ctx, params, lr=lr, momentum=phase.momentum, weight_decay=phase.weight_decay,
                   step_fn=step_fn, after_step=after, grad_clip=phase.grad_clip, grad_term=grad_term,
                   names=names, source=source, **phase.work())


# -- frozen-body phases ---------------------------------------------------------------------------
#: Rows per forward pass when computing a frozen body's features (larger batches of a conv body
#: run slower per sample on a CPU once their activations leave the cache).
FEATURE_ROWS = 256
#: Whether head phases train on cached body features (every engine, every mode).
FROZEN_BODY_CACHE = True


def use_frozen_cache(flag: bool | None) -> bool:
    """A context's own setting, else the module default (read at call time, so tests can flip it)."""
    return FROZEN_BODY_CACHE if flag is None else bool(flag)


def frozen_cache_pays(phase: Phase, data: PeerData) -> bool:
    """Whether a head phase visits samples more than once, so cached features are reused.

    Measured (``bench/frozen_body.py``): a phase that sees each sample once (one epoch, or a few
    random minibatches) gains nothing from computing the features apart and loses a little; two
    or more epochs save most of the head phase. So those phases keep the plain path, bit for bit.
    """
    if phase.unit == "epochs":
        return float(phase.amount) > 1.0
    return int(phase.amount) * data.batch_size > data.num_train


def can_represent(model: nn.Module) -> bool:
    """Whether ``model`` is ``head(represent(x))`` (the zoo's ``PersonalModel``)."""
    from p2pfl.models.base import PersonalModel

    return isinstance(model, PersonalModel) and type(model).represent is not PersonalModel.represent


def phase_plan(data: PeerData, generator: torch.Generator, phase: Phase) -> tuple[list[Tensor], Tensor, list[Tensor]]:
    """All minibatch positions of a phase, drawn up front (the same draws, in the same order).

    Returns ``(plan, needed, rows)``: the positions per step, the distinct positions (sorted), and
    per step the rows of ``needed`` that its minibatch takes.
    """
    plan = list(position_batches(data, generator, **phase.work()))
    if not plan:
        return plan, torch.zeros(0, dtype=torch.int64), []
    needed, inverse = torch.unique(torch.cat(plan), return_inverse=True)
    return plan, needed, list(torch.split(inverse, [int(p.numel()) for p in plan]))


@torch.no_grad()
def frozen_features(model: nn.Module, data: PeerData, positions: Tensor) -> tuple[Tensor, Tensor]:
    """The body's features (and the labels) of the samples at ``positions``, in chunks."""
    model.train()  # as the uncached path computes them (no zoo layer depends on the mode)
    feats, labels = [], []
    for start in range(0, int(positions.numel()), FEATURE_ROWS):
        x, y = data.train_batch(positions[start : start + FEATURE_ROWS])
        feats.append(model.represent(x))  # type: ignore[operator]
        labels.append(y)
    return torch.cat(feats), torch.cat(labels)


def frozen_feature_batches(model: nn.Module, data: PeerData, generator: torch.Generator,
                           phase: Phase) -> list[tuple[Tensor, Tensor]]:
    """The phase's minibatches as (features, labels): the body runs once per distinct sample."""
    _, needed, rows = phase_plan(data, generator, phase)
    if not rows:
        return []
    feats, labels = frozen_features(model, data, needed)
    return [(feats.index_select(0, r), labels.index_select(0, r)) for r in rows]


@dataclass
class TrainContext:
    """What an algorithm may use to train one peer for one round."""

    model: nn.Module  # parameters bound (as views) to state.params
    layout: ParamLayout
    data: PeerData
    generator: torch.Generator  # this peer's own randomness (minibatch order)
    device: torch.device
    #: Head phases (body frozen) train on the body's features computed once per phase; None:
    #: ``local_sgd.FROZEN_BODY_CACHE``, the same in every mode (so simulate and launch agree).
    cache_frozen: bool | None = None

    #: False here; True for the batched engine's context, whose tensors are ``[peers, ...]``.
    batched: ClassVar[bool] = False

    def train(self, block: str, phase: Phase, *, grad_term: GradTerm | None = None,
              project: torch.Tensor | None = None) -> float | None:
        """Train ``block`` (``all`` | ``shared`` | ``personal``; the rest frozen) for one phase.

        Returns the phase's mean loss, or None for an empty phase. The batched engine's context
        has the same method over stacked peers; algorithms call only this, never an engine.
        """
        return train_exact(self, block, phase, grad_term=grad_term, project=project)

    def gradients(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Loss gradient of the named parameters on one minibatch drawn from the peer's generator."""
        named = dict(self.model.named_parameters())
        targets = [named[n] for n in names]
        x, y = self.data.train_batch(self.data.sample_positions(self.generator))
        self.model.train()
        with trainable(self.model, targets):
            loss = F.cross_entropy(self.model(x), y)
            grads = torch.autograd.grad(loss, targets)
        return {n: g.detach() for n, g in zip(names, grads, strict=True)}
