"""The update rules, written once over parameter tensors, for one peer or for a stack of peers.

Why a module of plain tensor functions: the ``exact`` engine trains one peer at a time through a
bound ``nn.Module``, the ``batched`` engine trains every peer of a worker at once on stacked
tensors ``[peers, ...]``. Both call these functions, so there is one definition of each rule:

* ``sgd_step_``: SGD with coupled weight decay and heavy-ball momentum, op for op what
  ``torch.optim.SGD`` does on one tensor (so the exact path keeps its bits);
* ``sam_perturbation``: SAM's ``rho * g / ||g||`` with one global L2 norm over a block;
* ``clip_grads``: gradient-norm clipping as ``torch.nn.utils.clip_grad_norm_`` computes it.

``bdims`` is the number of leading peer dimensions: 0 for one peer (each tensor is a parameter),
1 for a stack (each tensor is ``[peers, *shape]``; norms are per peer). ``active`` (stack only) is
a ``[peers]`` boolean: a peer whose epoch has ended does not move, nor does its momentum buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

Scalar = float | Tensor  # a float for every peer alike, or a [peers] tensor


def per_peer(value: Tensor, like: Tensor) -> Tensor:
    """A ``[peers]`` vector shaped to broadcast against ``like`` = ``[peers, *shape]``."""
    return value.reshape(value.shape[0], *([1] * (like.dim() - 1))).to(like.dtype)


def block_norm(tensors: Sequence[Tensor], bdims: int = 0) -> Tensor:
    """Global L2 norm over a block of tensors (per peer when ``bdims`` is 1)."""
    if bdims == 0:
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors]))
    parts = [torch.linalg.vector_norm(t.reshape(t.shape[0], -1), dim=1) for t in tensors]
    return torch.linalg.vector_norm(torch.stack(parts, dim=1), dim=1)


def sam_perturbation(grads: Sequence[Tensor], rho: float, bdims: int = 0) -> list[Tensor]:
    """SAM's ascent step ``e = rho * g / (||g|| + 1e-12)``, one global norm over the block."""
    scale = float(rho) / (block_norm(grads, bdims) + 1e-12)
    if bdims == 0:
        return [g * scale for g in grads]
    return [g * per_peer(scale, g) for g in grads]


def clip_grads(grads: Sequence[Tensor], max_norm: float, bdims: int = 0) -> list[Tensor]:
    """Scale a block's gradients so that its global norm is at most ``max_norm`` (eps 1e-6, as torch)."""
    coef = (float(max_norm) / (block_norm(grads, bdims) + 1e-6)).clamp(max=1.0)
    if bdims == 0:
        return [g * coef for g in grads]
    return [g * per_peer(coef, g) for g in grads]


def sgd_step_(params: Sequence[Tensor], grads: Sequence[Tensor], bufs: list[Tensor | None], *, lr: Scalar,
              momentum: float = 0.0, weight_decay: float = 0.0, active: Tensor | None = None) -> None:
    """One SGD step in place: ``d = g + wd * p``; ``b = m * b + d``, ``d = b``; ``p -= lr * d``.

    ``bufs`` holds the momentum buffers (``None`` before the first step: then ``b = d``, as
    ``torch.optim.SGD`` clones it). ``lr`` is a float, or a ``[peers]`` tensor for a stack whose
    peers step with different rates (DFedPGP's ``eta / mu`` in push-sum mode).
    """
    if momentum == 0 and active is None and not isinstance(lr, Tensor) and params:
        # The common case in two multi-tensor calls instead of two ops per tensor (the per-op
        # Python and dispatch cost was ~5% of a small CNN's CPU step). The same elementwise
        # kernels per tensor, so the same bits.
        if len(params) != len(grads):
            raise ValueError(f"{len(params)} parameters but {len(grads)} gradients")
        ds = list(grads) if weight_decay == 0 else torch._foreach_add(list(grads), list(params), alpha=weight_decay)
        torch._foreach_add_(list(params), ds, alpha=-lr)
        return
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        d = g if weight_decay == 0 else g.add(p, alpha=weight_decay)
        if momentum != 0:
            buf = bufs[i]
            new = d.clone() if buf is None else buf.mul(momentum).add_(d)
            if active is not None and buf is not None:
                new = torch.where(per_peer(active, new).bool(), new, buf)
            bufs[i] = new
            d = new
        if active is not None:
            d = torch.where(per_peer(active, d).bool(), d, torch.zeros((), dtype=d.dtype, device=d.device))
        if isinstance(lr, Tensor):
            p.sub_(d * per_peer(lr, d))
        else:
            p.add_(d, alpha=-lr)
