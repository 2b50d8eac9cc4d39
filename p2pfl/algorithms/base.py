"""The Algorithm seam: a local update rule, what goes on the wire, and how received payloads combine.

Algorithms never open sockets, never know the transport and never read files: the Node hands
them a peer's state, a bound model and the peer's data, and later the payloads its neighbours
sent for (round, step) together with that step's mixing plan.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from p2pfl.algorithms.hyperparameters import HyperparameterError, typed_hyperparameters
from p2pfl.algorithms.local_sgd import TrainContext
from p2pfl.algorithms.robust import MixingRule
from p2pfl.models.layout import ParamLayout, TensorSpec
from p2pfl.payload import Payload
from p2pfl.topology import MixingPlan

__all__ = ["Algorithm", "HyperparameterError", "PeerState", "TrainContext", "finite_or_raise"]


@dataclass
class PeerState:
    """Everything one peer owns between rounds, as tensors (checkpointable, no pickle).

    ``params`` is the flat ``[shared | personal]`` buffer of the model (see ParamLayout);
    ``extra`` holds algorithm state such as ADMM duals or DisPFL masks; ``scalars`` holds
    scalar state such as the push-sum weight.
    """

    peer_id: str
    params: torch.Tensor
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, float] = field(default_factory=dict)
    round: int = 0  # the next round to run


class Algorithm(ABC):
    """Base class. Subclasses set ``name``, ``defaults`` and implement ``local_update``.

    ``shares`` says what goes on the wire: ``"shared"`` (the body; personalized methods) or
    ``"all"`` (the whole model; full-sharing baselines). ``mode`` is the mixing mode the
    topology plans with: ``"pull"`` (row-stochastic) or ``"push"`` (column-stochastic, push-sum).
    """

    name: ClassVar[str]
    shares: ClassVar[str] = "shared"
    defaults: ClassVar[dict[str, Any]] = {}
    #: whether ``local_update`` is written over ``TrainContext.train``/``gradients`` only, so that the
    #: batched engine can run it on stacked peers (False: a rule with its own loss, exact engine only)
    batched: ClassVar[bool] = True
    #: ``mixing.*``: the robust rule ``combine`` mixes with (none: the plain weighted sum); set by the Experiment.
    mixing: MixingRule = MixingRule()

    def __init__(self, hp: dict[str, Any], layout: ParamLayout) -> None:
        # One typed schema per algorithm (types, ranges, unknown keys); check() adds cross-field rules.
        self.hp: dict[str, Any] = typed_hyperparameters(type(self), hp)
        self.layout = layout
        self.check(self.hp)

    # -- configuration ---------------------------------------------------------------------
    @classmethod
    def check(cls, hp: dict[str, Any]) -> None:
        """Check hyperparameters; raise HyperparameterError naming the bad one."""
        for key in ("lr", "lr_head", "lr_body"):
            if key in hp and not float(hp[key]) > 0:
                raise HyperparameterError(f"{cls.name}: {key} must be > 0")

    @property
    def mode(self) -> str:
        """The mixing mode the topology plans with (see ``mode_of``)."""
        return type(self).mode_of(self.hp)

    @classmethod
    def mode_of(cls, hp: dict[str, Any]) -> str:
        """``pull`` (row-stochastic) or ``push`` (push-sum), read from the hyperparameters alone."""
        return "pull"

    def gossip_steps(self) -> int:
        """Number of exchanges per round (0: no communication)."""
        return 1

    def lr(self, key: str, round: int) -> float:
        """Learning rate ``key`` at ``round`` with the per-round multiplicative decay ``lr_decay``."""
        return float(self.hp[key]) * float(self.hp.get("lr_decay", 1.0)) ** round

    # -- state -----------------------------------------------------------------------------
    def init_state(self, state: PeerState, generator: torch.Generator) -> None:
        """Create algorithm state (duals, masks, weights) in ``state.extra``/``state.scalars``."""
        return None

    # -- the round ---------------------------------------------------------------------------
    @abstractmethod
    def local_update(self, state: PeerState, ctx: TrainContext, round: int) -> dict[str, float]:
        """Train in place on ``state.params`` (through ``ctx.model``); return train metrics."""

    def wire_specs(self) -> tuple[TensorSpec, ...]:
        """The tensors this algorithm puts on the wire; receivers validate against it."""
        return self.layout.shared_specs() if self.shares == "shared" else self.layout.specs

    def wire_scalars(self) -> tuple[str, ...]:
        """Names of the scalars every message carries (e.g. the push-sum weight); receivers check them."""
        return ()

    def outgoing(self, state: PeerState, round: int, step: int) -> tuple[torch.Tensor, dict[str, float]]:
        """The flat tensor and scalars to send for (round, step). Default: the shared prefix."""
        n = self.layout.num_shared if self.shares == "shared" else self.layout.numel
        return state.params[..., :n], {}

    def combine(self, state: PeerState, round: int, step: int, own: Payload,
                received: dict[str, Payload], plan: MixingPlan) -> None:
        """Replace the sent part by the plan-weighted mix of ``own`` and what arrived."""
        from p2pfl.algorithms.combine import mix_into

        n = own.flat.numel()
        mix_into(state.params[:n], own.flat, plan, received, renormalize=self.mode == "pull", rule=self.mixing)


    def combine_stacked(self, state: PeerState, round: int, step: int, own: torch.Tensor,
                        scalars: dict[str, torch.Tensor], weights: torch.Tensor) -> None:
        """``combine`` for a stack of peers (batched engine): ``own`` is ``[peers, m]``, the stacked
        ``outgoing`` (and, on a rank of several, the halo rows after the peers' own); ``weights`` the raw
        plan weights, sparse ``[peers, rows of own]`` (see ``combine.mix_rows``): the result is ``[peers, m]``.
        """
        from p2pfl.algorithms.combine import mix_rows

        state.params[:, : own.shape[1]] = mix_rows(weights, own, renormalize=self.mode == "pull", rule=self.mixing)


def finite_or_raise(value: float, what: str) -> float:
    """Training must not silently continue on NaN/Inf (it would be refused on the wire anyway)."""
    if not math.isfinite(value):
        raise FloatingPointError(f"{what} is not finite ({value})")
    return value
