"""DisPFL (Dai et al., ICML 2022): personalized federated learning through personal sparse masks.

The baseline that specs 000 (DFedMDC), 001 (DFedPGP), 003 (DFedSAM) and 004 (DePRL) compare
against. Every peer holds one model of the common architecture, kept sparse by a personal 0/1
mask; personalization lives entirely in the masks (spec 004 §2 Baselines: "a single global parameter w,
and each worker learns an individual 0/1 mask m_i"). A round is:

1. **local sparse training**: ``local_epochs`` of SGD on the whole model, the mask re-applied
   after every optimizer step, so weights outside the mask are exactly zero;
2. **mask evolution** (prune, then regrow): drop the fraction ``anneal_factor * (1 + cos(pi t/T)) / 2``
   of each layer's active weights with the smallest magnitude, regrow as many inactive coordinates
   with the largest gradient magnitude (one minibatch); per-layer density is exactly constant;
3. **gossip**: send the masked weights *and* the mask (the receiver must know which weights the
   sender holds: a zero weight and an absent weight look alike);
4. **masked aggregation**: each coordinate of the own mask becomes the plan-weighted average over
   the peers (self included) whose masks hold it; coordinates outside the own mask stay zero.

Choices on the ambiguities (spec sections in brackets)
-----------------------------------------------------
* **Order: mask evolution after local training, before sending** [001 §2 Baselines table:
  "train, then prune/regrow"; 000 §3 Baselines table]. The message therefore carries the *new* mask, and coordinates
  regrown this round (weight 0) are filled by the neighbours that hold them in the aggregation that
  follows: that is how a regrown weight gets a useful initial value in DisPFL. Evaluation then sees
  the aggregated model (the Node evaluates after ``combine``); which of the two DisPFL reports is
  open [000 §2.3 A8].
* **What is sparse**: the weights of conv and linear layers (every parameter tensor with two or
  more dimensions), the final linear layer included — DisPFL masks the whole network. Biases and
  normalization (GroupNorm) parameters — the 1-D tensors — are dense and exchanged dense, the
  usual sparse-training (RigL/ERK) convention: they are a negligible share of the parameters, and
  ERK would make them dense anyway (their ERK ratio is 1).
* **Density**: ``density`` is the dense ratio over the prunable tensors, default 0.5 [000 §7:
  "sparsity ... 0.5 corresponds to the Dis-PFL dense_ratio of 0.5"; 000 checklist 10; 001 §2].
  The layer-wise split is ``distribution: erk`` (Erdős–Rényi-kernel, the DisPFL code's default: layer density
  proportional to ``sum(shape) / prod(shape)``, layers that would exceed 1 made dense and the rest
  rescaled) or ``uniform`` (every prunable layer at ``density``). A layer's active count is
  ``round(density_l * numel)``, at least 1.
* **Initial masks are personal, initial weights are common** [001 §1.2 (c): "Dis-PFL's script uses
  --different_initial for masks only; model weights share one init"]: each layer's active set is a
  uniformly random subset drawn from the peer's own generator; the common initial model is masked.
* **Annealing horizon**: ``anneal_rounds`` is T in the cosine schedule. Algorithms are not told the
  experiment's number of rounds, so T is a hyperparameter (default 500, DisPFL's CIFAR
  ``comm_round``); set it to the run's ``rounds``. Rounds past T use t = T (fraction 0). Round t is
  0-based, so round 0 prunes ``anneal_factor`` of the active weights, as DisPFL does.
* **Prune/regrow details**: the prune count is ``ceil(fraction * active)`` per layer (DisPFL rounds
  up); fully dense layers are left alone. Regrowth picks among *all* coordinates inactive after
  pruning, the just-pruned ones included (as in RigL); a coordinate pruned and regrown in the same
  round keeps its value (its mask bit never changed), every other newly active coordinate starts at
  zero. Ties go to the lowest index (``smallest_k``), so the result is deterministic.
  ``regrow: gradient`` (DisPFL's rule) uses the loss gradient of the trained, masked model on one
  minibatch drawn from the peer's own generator; ``regrow: random`` (DisPFL's ablation) draws the
  regrown set uniformly from the same generator. ``evolve_masks: false`` keeps the initial masks.
* **Local optimizer** [000 §2.3 A5, A10; 001 §2 (Dis-PFL code details)]: SGD, lr 0.1 decayed ×0.998 per
  round, weight decay 5e-4, 5 local epochs, the optimizer re-created every round (momentum local to
  the round), gradient-norm clipping at 10. Momentum defaults to 0, the DisPFL code's default
  [001 §2: "Dis-PFL's --momentum defaults to 0"]; spec 000 (checklist 10) runs every method,
  Dis-PFL included, with momentum 0.9 — the ``dispfl-dfedmdc`` preset does that.
* **What goes on the wire**: ``shares = "all"``: the whole masked model (the final linear layer
  too — DisPFL has no personal head; the layout's head/body split is ignored here) followed by one
  0/1 tensor ``mask/<name>`` per prunable tensor, declared ``bit`` in the manifest, so the codec sends
  it bit-packed (32x smaller than float32; ``p2pfl.wire.compress``). Dense tensors carry no mask
  (everyone holds them).
* **Aggregation weights**: DisPFL averages each coordinate uniformly over the models that hold it.
  Here each peer's plan weight (self weight and ``W[i, j]``) is renormalized per coordinate over the
  holders, which is DisPFL's rule exactly when the plan is uniform (``random_pull``: 1/(k+1)), and
  handles a missing neighbour for free (it holds nothing). Sums run in plan order, so the result is
  bitwise reproducible. Nothing from a peer is trusted: received mask values count as "held" when
  > 0.5, and a sender's weights outside its own mask are ignored.
* **Topology**: DisPFL's experiments pull from 10 uniformly random peers per round plus self with
  weight 1/11 [000 §2.3 A3; 001 §1.3] — use a ``random_pull`` topology with ``k: 10``. Spec 001
  §1.3 says the DFedPGP paper ran Dis-PFL on a symmetric undirected random graph instead; both work
  here, since the aggregation renormalizes per coordinate. Presets cannot set the topology.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from p2pfl.algorithms.base import Algorithm, HyperparameterError, PeerState, TrainContext
from p2pfl.algorithms.combine import mix_rows, mix_weights
from p2pfl.algorithms.local_sgd import Phase
from p2pfl.models.layout import ParamLayout, TensorSpec
from p2pfl.payload import Payload
from p2pfl.topology import MixingPlan

log = logging.getLogger(__name__)

#: Key of the flat 0/1 mask in ``PeerState.extra`` (same length as ``params``; 1 on dense tensors).
MASK_KEY = "mask"
#: Prefix of the mask tensors on the wire.
MASK_PREFIX = "mask/"

PRESETS: dict[str, dict[str, Any]] = {
    # DisPFL's own setting (paper + official code): dense ratio 0.5, ERK, cosine annealing with
    # factor 0.5 over 500 rounds, gradient regrowth, lr 0.1 ×0.998/round, wd 5e-4, 5 epochs,
    # momentum 0, clip 10. Pair with a random_pull topology (k = 10).
    "dispfl-paper": {
        "lr": 0.1, "lr_decay": 0.998, "local_epochs": 5, "momentum": 0.0, "weight_decay": 5e-4,
        "grad_clip": 10.0, "density": 0.5, "distribution": "erk", "anneal_factor": 0.5,
        "anneal_rounds": 500, "regrow": "gradient", "evolve_masks": True,
    },
    # Dis-PFL as the DFedMDC / DFedPGP papers ran it: the same, but momentum 0.9 for every method
    # (spec 000 checklist 10, spec 001 Table 8 settings).
    "dispfl-dfedmdc": {
        "lr": 0.1, "lr_decay": 0.998, "local_epochs": 5, "momentum": 0.9, "weight_decay": 5e-4,
        "grad_clip": 10.0, "density": 0.5, "distribution": "erk", "anneal_factor": 0.5,
        "anneal_rounds": 500, "regrow": "gradient", "evolve_masks": True,
    },
}

DISTRIBUTIONS = ("erk", "uniform")
REGROW = ("gradient", "random")


def prunable_specs(layout: ParamLayout) -> tuple[TensorSpec, ...]:
    """The masked tensors: conv/linear weights (>= 2 dims), in layout (= flat offset) order."""
    return tuple(s for s in layout.specs if len(s.shape) >= 2)


def layer_densities(specs: tuple[TensorSpec, ...], density: float, distribution: str) -> dict[str, float]:
    """Per-layer dense ratios whose parameter-weighted mean is ``density``.

    ERK: ``d_l = eps * sum(shape_l) / numel_l`` with one ``eps`` for all layers; a layer whose
    ``d_l`` would exceed 1 is made dense and ``eps`` recomputed over the rest, until none does.
    """
    if distribution == "uniform":
        return {s.name: float(density) for s in specs}
    budget = float(density) * sum(s.numel for s in specs)
    dense: set[str] = set()
    while True:
        rest = [s for s in specs if s.name not in dense]
        if not rest:
            return {s.name: 1.0 for s in specs}
        left = budget - sum(s.numel for s in specs if s.name in dense)
        eps = left / sum(sum(s.shape) for s in rest)
        over = [s for s in rest if eps * sum(s.shape) / s.numel > 1.0]
        if not over:
            out = {s.name: 1.0 for s in specs if s.name in dense}
            out.update({s.name: eps * sum(s.shape) / s.numel for s in rest})
            return out
        dense.update(s.name for s in over)


def smallest_k(score: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean selector of the ``k`` smallest entries of a 1-D ``score``; ties go to the lowest index.

    Why not ``topk`` or ``sort``: ``topk`` leaves the order of ties unspecified, and a stable sort is
    several times slower than this O(n) selection on large layers. The result depends only on the
    values, so every peer and every run makes the same choice.
    """
    out = torch.zeros_like(score, dtype=torch.bool)
    if k <= 0:
        return out
    if k >= score.numel():
        return ~out
    kth = torch.kthvalue(score, k).values
    out = score < kth
    need = k - int(out.sum())
    if need > 0:
        ties = torch.nonzero(score == kth).flatten()[:need]
        out[ties] = True
    return out


def prune_fraction(round: int, anneal_factor: float, anneal_rounds: int) -> float:
    """``anneal_factor * (1 + cos(pi * t / T)) / 2`` with t clamped to [0, T]."""
    t = min(max(int(round), 0), int(anneal_rounds))
    return float(anneal_factor) * (1.0 + math.cos(math.pi * t / int(anneal_rounds))) / 2.0


class DisPFL(Algorithm):
    """DisPFL: personal sparse masks, masked local SGD, prune/regrow, per-coordinate masked averaging.

    Hyperparameters (defaults): ``lr`` 0.1, ``lr_decay`` 0.998 per round, ``local_epochs`` 5,
    ``momentum`` 0.0, ``weight_decay`` 5e-4, ``grad_clip`` 10.0 (0 disables), ``density`` 0.5 (dense
    ratio of the prunable tensors), ``distribution`` "erk" | "uniform", ``anneal_factor`` 0.5,
    ``anneal_rounds`` 500 (T), ``regrow`` "gradient" | "random", ``evolve_masks`` True.
    See the module docstring for every choice made on an ambiguity.
    """

    name = "dispfl"
    shares = "all"
    defaults: ClassVar[dict[str, Any]] = {
        "lr": 0.1, "lr_decay": 0.998, "local_epochs": 5, "momentum": 0.0, "weight_decay": 5e-4,
        "grad_clip": 10.0, "density": 0.5, "distribution": "erk", "anneal_factor": 0.5,
        "anneal_rounds": 500, "regrow": "gradient", "evolve_masks": True,
    }

    def __init__(self, hp: dict[str, Any], layout: ParamLayout) -> None:
        super().__init__(hp, layout)
        self.prunable = prunable_specs(layout)
        if not self.prunable:
            raise HyperparameterError(f"{self.name}: the model has no conv/linear weight to mask")
        self.densities = layer_densities(self.prunable, float(self.hp["density"]), str(self.hp["distribution"]))
        # Active count per prunable tensor: fixed at init, kept exactly by prune/regrow.
        self.active_counts = {s.name: min(s.numel, max(1, round(self.densities[s.name] * s.numel)))
                              for s in self.prunable}
        offset = layout.numel
        mask_specs = []
        for s in self.prunable:
            mask_specs.append(TensorSpec(MASK_PREFIX + s.name, s.shape, offset, s.numel, dtype="bit"))
            offset += s.numel
        self._wire = (*layout.specs, *mask_specs)
        self.num_mask = offset - layout.numel
        sel = torch.zeros(layout.numel, dtype=torch.bool)
        for s in self.prunable:
            sel[s.offset : s.offset + s.numel] = True
        self._sel = {torch.device("cpu"): sel}

    # -- configuration ---------------------------------------------------------------------
    @classmethod
    def check(cls, hp: dict[str, Any]) -> None:
        super().check(hp)
        hp = hp
        if not 0.0 < float(hp["density"]) <= 1.0:
            raise HyperparameterError(f"{cls.name}: density must be in (0, 1]")
        if hp["distribution"] not in DISTRIBUTIONS:
            raise HyperparameterError(f"{cls.name}: distribution must be one of {DISTRIBUTIONS}")
        if hp["regrow"] not in REGROW:
            raise HyperparameterError(f"{cls.name}: regrow must be one of {REGROW}")
        if not 0.0 <= float(hp["anneal_factor"]) <= 1.0:
            raise HyperparameterError(f"{cls.name}: anneal_factor must be in [0, 1]")
        if isinstance(hp["anneal_rounds"], bool) or int(hp["anneal_rounds"]) != hp["anneal_rounds"] \
                or int(hp["anneal_rounds"]) < 1:
            raise HyperparameterError(f"{cls.name}: anneal_rounds must be an integer >= 1")
        if not float(hp["local_epochs"]) > 0:
            raise HyperparameterError(f"{cls.name}: local_epochs must be > 0")
        if not 0.0 <= float(hp["momentum"]) < 1.0:
            raise HyperparameterError(f"{cls.name}: momentum must be in [0, 1)")
        if float(hp["weight_decay"]) < 0 or float(hp["grad_clip"]) < 0:
            raise HyperparameterError(f"{cls.name}: weight_decay and grad_clip must be >= 0")
        if not 0.0 < float(hp["lr_decay"]) <= 1.0:
            raise HyperparameterError(f"{cls.name}: lr_decay must be in (0, 1]")
        if not isinstance(hp["evolve_masks"], bool):
            raise HyperparameterError(f"{cls.name}: evolve_masks must be true or false")

    def selector(self, device: torch.device) -> torch.Tensor:
        """Boolean flat vector: True on the coordinates of prunable tensors (cached per device)."""
        if device not in self._sel:
            self._sel[device] = self._sel[torch.device("cpu")].to(device)
        return self._sel[device]

    # -- state -----------------------------------------------------------------------------
    def init_state(self, state: PeerState, generator: torch.Generator) -> None:
        """Draw this peer's personal mask (uniformly random active set per layer) and mask the model."""
        mask = torch.ones(self.layout.numel, dtype=torch.float32)
        for s in self.prunable:
            k = self.active_counts[s.name]
            if k < s.numel:
                layer = torch.zeros(s.numel, dtype=torch.float32)
                layer[torch.randperm(s.numel, generator=generator)[:k]] = 1.0
                mask[s.offset : s.offset + s.numel] = layer
        state.extra[MASK_KEY] = mask.to(state.params.device)
        with torch.no_grad():
            state.params.mul_(state.extra[MASK_KEY])

    # -- the round ---------------------------------------------------------------------------
    def local_update(self, state: PeerState, ctx: TrainContext, round: int) -> dict[str, Any]:
        # Written over ``state.params`` with broadcasting: one peer ``[n]`` or a stack ``[peers, n]``.
        mask = state.extra[MASK_KEY]
        with torch.no_grad():
            state.params.mul_(mask)
        # DisPFL's step: cross-entropy, gradient-norm clipping (``grad_clip``; 0 = none), SGD, mask.
        loss = ctx.train("all", Phase(lr=self.lr("lr", round), amount=float(self.hp["local_epochs"]),
                                      momentum=float(self.hp["momentum"]),
                                      weight_decay=float(self.hp["weight_decay"]),
                                      grad_clip=float(self.hp["grad_clip"])), project=mask)
        metrics: dict[str, Any] = {"train_loss": loss}
        if self.hp["evolve_masks"]:
            metrics["prune_fraction"] = self.evolve_mask(state, ctx, round)
        return metrics

    def evolve_mask(self, state: PeerState, ctx: TrainContext, round: int) -> float:
        """Prune the smallest-magnitude active weights and regrow as many; return the fraction used.

        Per peer (a batched context holds a stack: each peer's row is evolved with its own
        gradients and generator, in the same order of draws as the exact engine).
        """
        frac = prune_fraction(round, float(self.hp["anneal_factor"]), int(self.hp["anneal_rounds"]))
        if frac <= 0.0:
            return frac
        grads = self._gradients(ctx) if self.hp["regrow"] == "gradient" else None
        mask = state.extra[MASK_KEY]
        if not getattr(ctx, "batched", False):
            self._evolve_one(state.params, mask, grads, getattr(ctx, "generator", None), frac)
            return frac
        for i, gen in enumerate(ctx.generators):
            row = None if grads is None else {k: g[i] for k, g in grads.items()}
            self._evolve_one(state.params[i], mask[i], row, gen, frac)
        return frac

    def _evolve_one(self, params: torch.Tensor, mask: torch.Tensor, grads: dict[str, torch.Tensor] | None,
                    generator: torch.Generator | None, frac: float) -> None:
        """One peer's prune/regrow, in place on its flat ``params`` and ``mask``."""
        score_grow: Callable[[TensorSpec, torch.Tensor], torch.Tensor]
        if grads is not None:
            def score_grow(s: TensorSpec, candidates: torch.Tensor) -> torch.Tensor:
                return torch.where(candidates, grads[s.name].reshape(-1).abs(), -math.inf)
        else:
            def score_grow(s: TensorSpec, candidates: torch.Tensor) -> torch.Tensor:
                # Uniformly random among the candidates, from the peer's own generator.
                rnd = torch.rand(s.numel, generator=generator).to(candidates.device)
                return torch.where(candidates, rnd, -math.inf)

        with torch.no_grad():
            for s in self.prunable:
                m = mask[s.offset : s.offset + s.numel]
                w = params[s.offset : s.offset + s.numel]
                active = m > 0.5
                n_active = int(active.sum())
                if n_active == 0 or n_active == s.numel:
                    continue  # nothing to swap in a dense (or empty) layer
                k = min(math.ceil(frac * n_active), n_active)
                if k == 0:
                    continue
                # Prune: the k active weights of smallest magnitude (inactive ones never chosen).
                new = active & ~smallest_k(torch.where(active, w.abs(), math.inf), k)
                # Regrow: the k inactive coordinates of largest score (active ones never chosen).
                new |= smallest_k(-score_grow(s, ~new), k)
                m.copy_(new.to(m.dtype))
                w.mul_(m)

    def _gradients(self, ctx: TrainContext) -> dict[str, torch.Tensor]:
        """Loss gradient of the prunable tensors on one minibatch from the peer's own generator."""
        return ctx.gradients([s.name for s in self.prunable])

    # -- the wire ----------------------------------------------------------------------------
    def wire_specs(self) -> tuple[TensorSpec, ...]:
        """The whole model, then ``mask/<name>`` (0/1, bit-packed on the wire) for each prunable tensor."""
        return self._wire

    def outgoing(self, state: PeerState, round: int, step: int) -> tuple[torch.Tensor, dict[str, float]]:
        mask = state.extra[MASK_KEY]
        return torch.cat([state.params, mask[..., self.selector(mask.device)]], dim=-1), {}

    def holders(self, flat: torch.Tensor) -> torch.Tensor:
        """A message's full-length 0/1 "holds this coordinate" vector (1 on dense tensors).

        ``flat`` may be a stack ``[peers, m]`` (the batched engine): one row per peer.
        """
        n = self.layout.numel
        sel = self.selector(flat.device)
        full = torch.ones(*flat.shape[:-1], n, dtype=flat.dtype, device=flat.device)
        full[..., sel] = (flat[..., n:] > 0.5).to(flat.dtype)
        return full

    def combine(self, state: PeerState, round: int, step: int, own: Payload,
                received: dict[str, Payload], plan: MixingPlan) -> None:
        """Per coordinate: plan-weighted mean over the holders (self included); own mask decides."""
        n = self.layout.numel
        missing = [j for j in plan.in_weights if j not in received]
        if missing:
            log.warning("round %d step %d: aggregating without %s (per-coordinate renormalized)",
                        plan.round, plan.step, ",".join(missing))
        # Raw plan weights: the per-coordinate renormalization below subsumes any global one.
        self_w, weights = mix_weights(plan, received, renormalize=False)
        own_flat = own.flat.to(state.params.device)
        own_m = self.holders(own_flat)
        num = own_flat[:n] * own_m * self_w
        den = own_m * self_w
        for j in plan.in_weights:  # plan order => bitwise reproducible
            if j not in weights:
                continue
            f = received[j].flat.to(state.params.device, non_blocking=True)
            m = self.holders(f)
            num.addcmul_(f[:n], m, value=weights[j])
            den.add_(m, alpha=weights[j])
        mask = state.extra[MASK_KEY]
        held = den > 0
        mixed = torch.where(held, num / torch.where(held, den, torch.ones_like(den)), state.params)
        with torch.no_grad():
            state.params.copy_(mixed * mask)

    def combine_stacked(self, state: PeerState, round: int, step: int, own: torch.Tensor,
                        scalars: dict[str, torch.Tensor], weights: torch.Tensor) -> None:
        """``combine`` for a stack of peers: holders-weighted sums as two matrix products."""
        n = self.layout.numel
        held_by = self.holders(own)  # [rows of own, n]
        # raw plan weights: the per-coordinate renormalization subsumes any other
        num = mix_rows(weights, own[:, :n] * held_by, renormalize=False)
        den = mix_rows(weights, held_by, renormalize=False)
        held = den > 0
        mixed = torch.where(held, num / torch.where(held, den, torch.ones_like(den)), state.params)
        with torch.no_grad():
            state.params.copy_(mixed * state.extra[MASK_KEY])
