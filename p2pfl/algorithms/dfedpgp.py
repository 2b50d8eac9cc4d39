"""DFedPGP: decentralized federated partial gradient push (spec 001, the CVPR 2024 supplement).

A peer trains its personal head (the final linear layer), then its shared body, then mixes the
body together with a scalar push-sum weight mu over a (possibly directed, time-varying) graph.
Only the body and mu are sent; the head never leaves the node.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from p2pfl.algorithms.alternating import Phase, alternating_update, check_alternating
from p2pfl.algorithms.base import Algorithm, HyperparameterError, PeerState, TrainContext
from p2pfl.algorithms.combine import mix_into, mix_rows, mix_scalar
from p2pfl.payload import Payload
from p2pfl.topology import MixingPlan

MU = "mu"  # the push-sum weight: in state.scalars and as a message scalar


class DFedPGP(Algorithm):
    """DFedPGP (spec 001 §1.2): alternating head -> body training, push-sum gossip of the body.

    **State convention** (spec 001 §1.2, "decide, document and test"). The peer keeps the
    *de-biased* body z_i = u_i / mu_i in ``state.params`` (so the model it trains and evaluates is
    the personalized (z_i, v_i)) and mu_i in ``state.scalars["mu"]`` (a Python float, i.e. float64,
    starting at 1). Gradients are taken at z and applied to the numerator u, the SGP convention of
    the paper's proofs: u <- u - eta_u * grad F(z). With mu fixed during the round this is exactly
    z <- z - (eta_u / mu) * grad F(z), so the body phase runs SGD on z with learning rate
    eta_u / mu_i^t (momentum and the coupled weight decay, whose gradient is also taken at z, carry
    over unchanged). Before sending, ``outgoing`` converts back to the numerator u = mu * z; after
    mixing, ``combine`` divides by the mixed mu. The head phase is plain SGD at z (Lemma 1's
    reading; the proofs' u_i^t in T_{1,v} is the inconsistent one, §1.2).

    **Mixing** (``mix_mode``):

    * ``pull`` (default; the paper's experiments, spec 001 §1.3): row-stochastic weights from the
      topology, e.g. the random-pull schedule's uniform 1/(n+1) over n in-neighbours + self
      (eq. 6). mu is mixed with the same coefficients and, being a convex combination of ones,
      stays exactly 1 (the last-ulp rounding of the weighted sum is snapped to 1.0, so z = u
      bitwise); a neighbour announcing mu != 1 in pull mode is a configuration error and raises.
    * ``push`` (the theory's column-stochastic push-sum): ``mode`` is ``"push"``, the receiver
      applies W[i, j] to the unscaled numerator of sender j (``mix_into``/``mix_scalar`` with no
      renormalization), so sum_i mu_i = m and sum_i u_i changes only by the local steps; a lost
      message loses its mass in both u and mu alike, which the ratio z = u / mu absorbs.

    Hyperparameters (spec 001 §3, Table 8; the supplement gives no K_u/K_v split):

    * ``lr_head`` = ``lr_body`` = 0.1 (the one "Local Learning Rate"), ``momentum`` = 0.9,
      ``weight_decay`` = 5e-4 (Table 8).
    * ``lr_decay`` = 0.998 per round: Table 8's "0.9" per round is implausible (0.9^500 ~ 1e-24);
      0.998 is the Dis-PFL code's per-round decay the spec recommends.
    * ``body_local`` = 5 epochs (Table 8's "Local Interval" 5, the shared part's epochs as in the
      DFedMDC lineage), ``head_local`` = 1 epoch (the DFedMDC paper's head epochs for Dirichlet
      splits; [R], unknown for DFedPGP), ``local_unit`` = ``epochs`` (``steps`` gives K_u/K_v
      minibatch steps as in the proofs).
    """

    name = "dfedpgp"
    shares = "shared"
    defaults: ClassVar[dict[str, Any]] = {
        "lr_head": 0.1, "lr_body": 0.1, "head_local": 1, "body_local": 5, "local_unit": "epochs",
        "momentum": 0.9, "weight_decay": 5e-4, "lr_decay": 0.998, "mix_mode": "pull",
    }

    @classmethod
    def check(cls, hp: dict[str, Any]) -> None:
        super().check(hp)
        check_alternating(cls.name, hp)
        if hp["mix_mode"] not in ("pull", "push"):
            raise HyperparameterError(f"{cls.name}: mix_mode must be pull or push, got {hp['mix_mode']!r}")

    @classmethod
    def mode_of(cls, hp: dict[str, Any]) -> str:
        return str(hp["mix_mode"])

    def init_state(self, state: PeerState, generator: torch.Generator) -> None:
        state.scalars[MU] = 1.0

    def phases(self, round: int, mu: float | torch.Tensor) -> tuple[Phase, Phase]:
        unit = self.hp["local_unit"]
        common = {"unit": unit, "momentum": float(self.hp["momentum"]), "weight_decay": float(self.hp["weight_decay"])}
        head = Phase(lr=self.lr("lr_head", round), amount=float(self.hp["head_local"]), **common)
        # gradient at z applied to u = mu * z  <=>  a z-space step of eta_u / mu (see the class docs)
        body = Phase(lr=self.lr("lr_body", round) / mu, amount=float(self.hp["body_local"]), **common)
        return head, body

    def local_update(self, state: PeerState, ctx: TrainContext, round: int) -> dict[str, float]:
        mu = state.scalars[MU]  # a float, or a [peers] float64 tensor in the batched engine
        head, body = self.phases(round, mu if isinstance(mu, torch.Tensor) else float(mu))
        return alternating_update(ctx, head, body)

    def wire_scalars(self) -> tuple[str, ...]:
        """Every message carries the push-sum weight, so receivers insist on it."""
        return ("mu",)

    def outgoing(self, state: PeerState, round: int, step: int) -> tuple[torch.Tensor, dict[str, float]]:
        """The numerator u = mu * z of the body, and mu (float64) as the message scalar ``mu``."""
        mu = state.scalars[MU]
        z = state.params[..., : self.layout.num_shared]
        if isinstance(mu, torch.Tensor):  # a stack of peers (batched engine)
            return (z if bool((mu == 1.0).all()) else z * mu.unsqueeze(-1).to(z.dtype)), {MU: mu}
        mu = float(mu)
        return (z if mu == 1.0 else z * mu), {MU: mu}

    def combine(self, state: PeerState, round: int, step: int, own: Payload,
                received: dict[str, Payload], plan: MixingPlan) -> None:
        """Mix numerators and mu with the same coefficients, then de-bias: z = u / mu."""
        pull = self.mode == "pull"
        for j, m in received.items():
            if MU not in m.scalars:
                raise ValueError(f"{self.name}: message from {j} carries no push-sum weight {MU!r}")
            if pull and float(m.scalars[MU]) != 1.0:
                raise ValueError(f"{self.name}: {j} sent mu={m.scalars[MU]} in pull mode; all peers must use the "
                                 "same mix_mode")
        n = own.flat.numel()
        mu = mix_scalar(float(own.scalars[MU]), plan, received, MU, renormalize=pull)
        if not (math.isfinite(mu) and mu > 0):
            raise FloatingPointError(f"{self.name}: push-sum weight became {mu}")
        body = state.params[:n]
        mix_into(body, own.flat, plan, received, renormalize=pull, rule=self.mixing if pull else None)
        if pull:
            if abs(mu - 1.0) > 1e-9:  # cannot happen with row-stochastic weights and mu_j = 1
                raise FloatingPointError(f"{self.name}: pull-mode mu drifted to {mu}")
            mu = 1.0  # a convex combination of ones: snap the last-ulp rounding away
        else:
            body.div_(mu)
        state.scalars[MU] = mu


    def combine_stacked(self, state: PeerState, round: int, step: int, own: torch.Tensor,
                        scalars: dict[str, torch.Tensor], weights: torch.Tensor) -> None:
        """``combine`` for a stack of peers: numerators and mu mixed by one matrix product each."""
        pull = self.mode == "pull"
        mu = mix_rows(weights, scalars[MU].to(torch.float64).unsqueeze(1), renormalize=pull).squeeze(1)
        if not bool((torch.isfinite(mu) & (mu > 0)).all()):
            raise FloatingPointError(f"{self.name}: push-sum weight became {mu.min().item()}")
        body = mix_rows(weights, own, renormalize=pull, rule=self.mixing if pull else None)
        if pull:
            if float((mu - 1.0).abs().max()) > 1e-9:
                raise FloatingPointError(f"{self.name}: pull-mode mu drifted to {mu}")
            mu = torch.ones_like(mu)
        else:
            body = body / mu.unsqueeze(-1).to(body.dtype)
        state.params[:, : own.shape[1]] = body
        state.scalars[MU] = mu


PRESETS: dict[str, dict[str, Any]] = {
    # Table 8 + the documented readings above; pull mode = the paper's experiments.
    "dfedpgp-paper": dict(DFedPGP.defaults),
}
