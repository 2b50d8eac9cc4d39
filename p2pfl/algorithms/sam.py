"""The one SAM (sharpness-aware minimization) implementation every algorithm uses.

Plain (non-adaptive) SAM as in DFedSAM, DFedSMDC and DFedADMM-SAM: take the gradient g on a
minibatch, move to w + rho * g / ||g|| (one *global* L2 norm over the perturbed parameters; the
rule is ``rules.sam_perturbation``, shared with the batched engine), take the gradient there on
the *same* minibatch, restore w exactly, and let the optimizer step with the perturbed gradient. With rho = 0 the perturbation is zero and the step is bitwise the
plain SGD step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from p2pfl.algorithms.rules import sam_perturbation

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def sam_gradient(model: nn.Module, params: list[nn.Parameter], x: torch.Tensor, y: torch.Tensor, rho: float,
                 loss_fn: LossFn = F.cross_entropy) -> torch.Tensor:
    """Leave in ``p.grad`` the loss gradient at the SAM-perturbed point; weights end unchanged.

    Returns the loss at the unperturbed point (what training curves report).
    """
    loss = loss_fn(model(x), y)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
    saved = [p.detach().clone() for p in params]  # restore exactly: (w + e) - e != w in floating point
    with torch.no_grad():
        for p, e in zip(params, sam_perturbation(grads, rho), strict=True):
            p.add_(e)
    for p in params:
        p.grad = None
    loss_fn(model(x), y).backward()
    with torch.no_grad():
        for p, w in zip(params, saved, strict=True):
            p.copy_(w)
    return loss.detach()


def sam_step(model: nn.Module, params: list[nn.Parameter], rho: float,
             loss_fn: LossFn = F.cross_entropy) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A step function for ``run_sgd``: SAM gradient over ``params``."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return sam_gradient(model, params, x, y, rho, loss_fn)

    return step
