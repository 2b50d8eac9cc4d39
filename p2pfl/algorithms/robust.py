"""Robust mixing rules (``mixing.robust``): the one place where a peer combines what it received
when some neighbours may send well-formed garbage (docs/robust.md).

The wire checks refuse malformed payloads; they cannot refuse a valid tensor of bad values. These
rules replace the plan-weighted sum of ``p2pfl.algorithms.combine.mix_into`` (which calls
``robust_mix`` when a rule is set) for every algorithm whose mixing is that weighted sum:

* ``median``: the coordinate-wise median of self + the received neighbours (topology weights
  ignored). With ``n`` inputs of which ``f`` are bad and ``n >= 2f + 1``, every coordinate of the
  output lies within the honest inputs' range at that coordinate.
* ``trimmed_mean`` (``trim = t``): per coordinate, drop the ``t`` lowest and ``t`` highest of the
  ``n`` inputs and average the rest. With ``f <= t`` bad inputs and ``n >= 2t + 1``, the output lies
  within the honest inputs' range.
* ``clipped`` (``clip_radius = tau``), self-centred clipping: ``x_i + sum_j w_ij clip(x_j - x_i, tau)``
  where ``clip(v, tau) = v * min(1, tau / ||v||)`` (L2 norm of the whole payload) and ``w`` the
  topology's weights renormalized over what arrived. The output is within ``tau * (1 - w_ii)`` of
  the own model, and each bad neighbour moves it by at most ``w_ij * tau``, whatever it sends; no
  degree requirement, but honest neighbours further than ``tau`` are slowed down too.

Every rule is a pure function of the input *values* in the plan's fixed order, so the result is
bitwise the same under every transport (and in the exact and batched engines, which call the
same functions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from p2pfl.badinput import BadInput

if TYPE_CHECKING:
    from p2pfl.topology import Topology

RobustKind = Literal["none", "median", "trimmed_mean", "clipped"]
ROBUST_RULES: tuple[str, ...] = ("none", "median", "trimmed_mean", "clipped")


class RobustMixingError(BadInput):
    """The experiment cannot use the configured robust mixing rule (the message says why)."""


@dataclass(frozen=True)
class MixingRule:
    """``mixing.*`` of a config: the rule and its parameters."""

    robust: RobustKind = "none"
    trim: int = 1  # trimmed_mean: inputs dropped at each end, per coordinate
    clip_radius: float = 1.0  # clipped: L2 radius of a neighbour's difference to the own model

    @property
    def active(self) -> bool:
        return self.robust != "none"

    def needed_in_degree(self) -> int:
        """Fewest in-neighbours (self excluded) each peer must have for the rule's guarantee."""
        if self.robust == "median":
            return 2  # 3 inputs: 1 bad tolerated
        if self.robust == "trimmed_mean":
            return 2 * self.trim  # 2t + 1 inputs, self included
        return 1 if self.robust == "clipped" else 0

    def tolerated(self, in_degree: int) -> int:
        """How many bad in-neighbours the rule tolerates at this in-degree (self honest)."""
        n = in_degree + 1
        if self.robust == "median":
            return (n - 1) // 2
        if self.robust == "trimmed_mean":
            return self.trim if n >= 2 * self.trim + 1 else 0
        return in_degree if self.robust == "clipped" else 0  # clipped: bounded influence of each


def robust_mix(own: Tensor, inputs: Sequence[Tensor], self_w: float, weights: Sequence[float],
               rule: MixingRule) -> Tensor:
    """The rule applied to ``own`` and the received ``inputs`` (plan order); a new tensor.

    ``self_w`` and ``weights`` are the topology's weights over self and the inputs, already
    renormalized to sum to one (only ``clipped`` uses them).
    """
    if not inputs:
        return own.clone()
    if rule.robust == "clipped":
        acc = own.clone()
        tau = float(rule.clip_radius)
        for x, w in zip(inputs, weights, strict=True):
            diff = x.to(own.device) - own
            norm = float(torch.linalg.vector_norm(diff))
            scale = 1.0 if norm <= tau else tau / norm
            acc.add_(diff, alpha=float(w) * scale)
        return acc
    stack = torch.stack([own, *(x.to(own.device) for x in inputs)])
    ordered = torch.sort(stack, dim=0).values
    n = ordered.shape[0]
    if rule.robust == "median":
        mid = n // 2
        if n % 2:
            return ordered[mid].clone()
        return (ordered[mid - 1] + ordered[mid]) * 0.5
    if rule.robust == "trimmed_mean":
        t = min(int(rule.trim), (n - 1) // 2)  # fewer inputs arrived than planned: trim what can be
        return ordered[t : n - t].mean(dim=0)
    raise ValueError(f"unknown robust mixing rule {rule.robust!r}")


def min_in_degree(topology: Topology) -> int:
    """The smallest number of in-neighbours any peer mixes in a round (random schedules: their ``k``)."""
    if topology.schedule is not None:
        return int(topology.schedule.k)
    return min(len(topology.possible_in_neighbours(p)) for p in topology.ids)


def check_supported(rule: MixingRule, topology: Topology, *, algorithm: str, mode: str) -> None:
    """Refuse, up front, a rule the algorithm or the topology's degree cannot support."""
    if not rule.active:
        return
    if mode == "push":
        raise RobustMixingError(
            f"{rule.robust} needs pull mode; {algorithm} runs push-sum (mix_mode: push), whose receivers add "
            "mu-scaled numerators with column weights and divide by the mixed mu: a robust statistic of the "
            "numerators breaks the mass conservation that de-biasing relies on",
            key="mixing.robust", hint="use algorithm.mix_mode: pull")
    if algorithm == "dispfl":
        raise RobustMixingError(
            f"{rule.robust} does not apply to dispfl: its mixing averages each coordinate over the peers whose "
            "masks hold it, so a coordinate may have a single holder and no rule can outvote a bad one",
            key="mixing.robust")
    need = rule.needed_in_degree()
    have = min_in_degree(topology)
    if have < need:
        what = {"median": "a median of fewer than 3 inputs (self included) tolerates no bad neighbour",
                "trimmed_mean": f"trim {rule.trim} needs at least {2 * rule.trim + 1} inputs (self included)",
                "clipped": "a peer without in-neighbours has nothing to clip"}[rule.robust]
        raise RobustMixingError(
            f"{rule.robust} needs every peer to have at least {need} in-neighbours; topology "
            f"{topology.name!r} has a peer with {have} ({what})", key="mixing.robust")
