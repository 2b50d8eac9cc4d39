"""The one alternating (block-coordinate) local update of the partial-personalization methods.

DFedMDC/DFedSMDC (spec 000 §2.2), DePRL (spec 004 §1.3) and DFedPGP (spec 001 §1.2) share one
local round shape, inherited from FedRep/FedAlt:

1. **head phase**: train the personal head v_i with the shared body frozen at its current value;
2. **body phase**: train the shared body u_i with the head frozen at the *new* v_i^{t+1}.

Each phase is a separate ``run_sgd`` call, so each has its own optimizer (own lr, momentum,
weight decay, momentum buffer reset every round) and the frozen block is not even in the
optimizer: momentum and weight decay never touch it, and ``trainable`` switches its gradients off
(spec 000 checklist 2-3, spec 001 checklist 2). Either phase may use SAM (the one implementation in
``sam.py``) over *its own* parameters only: the SAM norm is then the global L2 norm over that
block, and both SAM gradients use the same minibatch (spec 000 A6). A phase of zero length is
skipped, so "no local work" is expressible (used by tests and by push-sum checks).

Order is fixed head-then-body: all three papers put the personal phase first, and the body
gradient must see the already-updated head (spec 000 §2.1 lines 4-10, spec 001 eq. 20, spec 004
eqs. 3-7). Joint updates are deliberately not offered here; they are what the full-model
baselines do.
"""

from __future__ import annotations

from typing import Any

from p2pfl.algorithms.base import HyperparameterError, TrainContext
from p2pfl.algorithms.local_sgd import UNITS, Phase

__all__ = ["UNITS", "Phase", "alternating_update", "check_alternating", "check_amount", "check_unit", "run_phase"]


def check_unit(algo: str, key: str, value: Any) -> None:
    """Refuse a unit that is not steps/epochs, naming the hyperparameter."""
    if value not in UNITS:
        raise HyperparameterError(f"{algo}: {key} must be one of {UNITS}, got {value!r}")


def check_amount(algo: str, key: str, value: Any, unit: str) -> None:
    """A phase length must be a number >= 0 (an integer when counted in steps)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise HyperparameterError(f"{algo}: {key} must be a number, got {value!r}") from None
    if not v >= 0:
        raise HyperparameterError(f"{algo}: {key} must be >= 0, got {value!r}")
    if unit == "steps" and v != int(v):
        raise HyperparameterError(f"{algo}: {key} counts steps and must be an integer, got {value!r}")


def check_alternating(algo: str, hp: dict[str, Any], unit_key: str = "local_unit",
                      amounts: tuple[str, ...] = ("body_local", "head_local")) -> None:
    """The checks every head-then-body algorithm shares: unit, phase lengths, momentum, decay."""
    check_unit(algo, unit_key, hp[unit_key])
    for key in amounts:
        check_amount(algo, key, hp[key], hp[unit_key])
    for key in ("momentum", "weight_decay"):
        if not float(hp[key]) >= 0:
            raise HyperparameterError(f"{algo}: {key} must be >= 0")
    if not 0 < float(hp["lr_decay"]) <= 1:
        raise HyperparameterError(f"{algo}: lr_decay must be in (0, 1]")


def run_phase(ctx: TrainContext, block: str, phase: Phase) -> Any:
    """Train ``block`` (all others frozen) for one phase; its mean loss (per peer when batched), None if empty."""
    return ctx.train(block, phase)


def alternating_update(ctx: TrainContext, head: Phase, body: Phase) -> dict[str, Any]:
    """Head phase (body frozen), then body phase (new head frozen); returns the training losses.

    ``train_loss`` is the body phase's mean loss (the last model the round trained), or the head
    phase's when the body phase is empty. Works unchanged on the batched engine's context.
    """
    head_loss = run_phase(ctx, "personal", head)
    body_loss = run_phase(ctx, "shared", body)
    out: dict[str, Any] = {}
    if head_loss is not None:
        out["head_loss"] = head_loss
    if body_loss is not None:
        out["body_loss"] = body_loss
    last = body_loss if body_loss is not None else head_loss
    out["train_loss"] = 0.0 if last is None else last
    return out
