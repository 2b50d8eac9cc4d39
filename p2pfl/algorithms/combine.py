"""The one mixing routine: a plan-weighted sum of flat buffers, in a fixed order.

Summation order is the plan's in-neighbour order (never arrival order), so the result is
bitwise identical whichever transport delivered the payloads and whenever they arrived.
"""

from __future__ import annotations

import logging

import torch

from p2pfl.algorithms.robust import MixingRule, robust_mix
from p2pfl.payload import Payload
from p2pfl.topology import MixingPlan

log = logging.getLogger(__name__)


def mix_weights(plan: MixingPlan, arrived: set[str] | dict, renormalize: bool) -> tuple[float, dict[str, float]]:
    """Self weight and neighbour weights over what arrived.

    Pull mode (row-stochastic) renormalizes over the neighbours that arrived, so a late or
    dead neighbour does not shrink the model; push-sum (``renormalize=False``) keeps the raw
    column weights, because the push-sum weight tracks the lost mass.
    """
    weights = {j: w for j, w in plan.in_weights.items() if j in arrived}
    self_w = plan.self_weight
    if renormalize:
        total = self_w + sum(weights.values())
        self_w = self_w / total
        weights = {j: w / total for j, w in weights.items()}
    return self_w, weights


def mix_into(out: torch.Tensor, own: torch.Tensor, plan: MixingPlan, received: dict[str, Payload],
             renormalize: bool = True, rule: MixingRule | None = None) -> None:
    """``out <- w_self * own + sum_j w_j * received[j]``, over flat buffers (``out`` may alias ``own``).

    With a robust ``rule`` (``mixing.robust``, pull mode only) the rule replaces the weighted sum,
    over the same inputs in the same (plan) order: ``p2pfl.algorithms.robust.robust_mix``.
    """
    self_w, weights = mix_weights(plan, received, renormalize)
    missing = [j for j in plan.in_weights if j not in received]
    if missing:
        log.warning("round %d step %d: mixing without %s (weights %s)", plan.round, plan.step,
                    ",".join(missing), "renormalized" if renormalize else "as planned")
    if rule is not None and rule.active:
        order = [j for j in plan.in_weights if j in weights]
        out.copy_(robust_mix(own, [received[j].flat for j in order], self_w, [weights[j] for j in order], rule))
        return
    # Accumulate in `out` itself when it is `own` or apart from it (the Node's case: `own` is the
    # published snapshot): no temporary and no copy back, the same operations in the same order,
    # so the same bits. A partial overlap or another device needs a temporary.
    same = out.data_ptr() == own.data_ptr() and out.stride() == own.stride()
    direct = out.device == own.device and out.dtype == own.dtype and (same or not _overlap(out, own))
    acc = out if direct else torch.empty_like(own)
    torch.mul(own, self_w, out=acc)
    for j in plan.in_weights:  # fixed order => bitwise reproducible
        if j in weights:
            acc.add_(received[j].flat.to(acc.device, non_blocking=True), alpha=weights[j])
    if acc is not out:
        out.copy_(acc)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors may share memory: byte ranges for contiguous ones, else the same storage."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    if not (a.is_contiguous() and b.is_contiguous()):
        return True
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def mix_scalar(own: float, plan: MixingPlan, received: dict[str, Payload], key: str,
               renormalize: bool = True) -> float:
    """Mix a scalar carried in the messages (e.g. the push-sum weight) with the plan's weights."""
    self_w, weights = mix_weights(plan, received, renormalize)
    total = self_w * float(own)
    for j in plan.in_weights:
        if j in weights:
            total += weights[j] * float(received[j].scalars[key])
    return total


# -- the batched engine: one sparse matrix product per gossip step --------------------------------
# Row i of a weight matrix (``[rows, columns]``, a coalesced sparse COO tensor of float64) is peer
# i's plan: its self weight in column i, its in-neighbours' weights in their columns where their
# payload arrived, nothing elsewhere; the same numbers ``mix_weights`` gives the exact engine, so
# ``W @ X`` is ``mix_into`` for every peer at once (summed in another order: equal up to float
# reassociation). Columns ``rows..`` may hold rows of peers a rank does not own (the halo, a rank
# of the batched engine over ``torch.distributed``); row i's own payload is always column i.
# Sparse, so a step costs O(edges) in memory and time, not O(peers^2).
def sparse_weights(rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, shape: tuple[int, int],
                   device: torch.device | None = None) -> torch.Tensor:
    """The weight matrix with ``values`` at ``(rows, cols)`` (1-D tensors, one entry each; repeated
    entries are summed), as every mixing helper below takes it."""
    index = torch.stack([rows.to(torch.int64), cols.to(torch.int64)])
    w = torch.sparse_coo_tensor(index, values.to(torch.float64), shape, check_invariants=True).coalesce()
    return w if device is None else w.to(device)


def _sparse(weights: torch.Tensor) -> torch.Tensor:
    """``weights`` as a coalesced sparse COO tensor (a dense one, as tests write them, is converted)."""
    w = weights if weights.layout == torch.sparse_coo else weights.to_sparse()
    return w if w.is_coalesced() else w.coalesce()


def row_normalized(weights: torch.Tensor) -> torch.Tensor:
    """Pull mode: each row divided by its sum (``mix_weights(..., renormalize=True)`` for all peers)."""
    w = _sparse(weights)
    rows, values = w.indices()[0], w.values()
    sums = torch.zeros(w.shape[0], dtype=values.dtype, device=values.device).index_add_(0, rows, values)
    return torch.sparse_coo_tensor(w.indices(), values / sums[rows], w.shape, is_coalesced=True,
                                   check_invariants=False)  # the indices of a checked matrix


def mix_rows(weights: torch.Tensor, stacked: torch.Tensor, renormalize: bool = True,
             rule: MixingRule | None = None) -> torch.Tensor:
    """``W @ X``: every peer's plan-weighted mix of the stacked payloads ``X`` = ``[columns, m]``
    (``renormalize=False``: the raw weights, push-sum's column weights or a per-coordinate mean's).

    A robust ``rule`` is applied peer by peer (``robust_rows``: a sort per peer does not vectorize
    into one product), with the exact engine's function.
    """
    w = _sparse(weights)
    if rule is not None and rule.active:
        return robust_rows(w, stacked, rule)
    if renormalize:
        w = row_normalized(w)
    return torch.sparse.mm(w.to(stacked.dtype), stacked)


def row_entries(weights: torch.Tensor) -> list[tuple[list[int], list[float]]]:
    """Each row's nonzero columns and their weights, in column order (one host copy for all rows)."""
    w = _sparse(weights)
    rows, cols = (t.tolist() for t in w.indices().cpu())
    values = w.values().cpu().tolist()
    out: list[tuple[list[int], list[float]]] = [([], []) for _ in range(w.shape[0])]
    for i, j, v in zip(rows, cols, values, strict=True):
        out[i][0].append(j)
        out[i][1].append(v)
    return out


def robust_rows(weights: torch.Tensor, stacked: torch.Tensor, rule: MixingRule) -> torch.Tensor:
    """``robust_mix`` for every row of a weight matrix (raw plan weights): row ``i`` mixes its own
    payload (column ``i``) with the columns of its other nonzeros, the weights renormalized over them."""
    out = torch.empty(weights.shape[0], *stacked.shape[1:], dtype=stacked.dtype, device=stacked.device)
    for i, (cols, values) in enumerate(row_entries(weights)):
        self_w = sum(v for j, v in zip(cols, values, strict=True) if j == i)
        nbrs = [(j, v) for j, v in zip(cols, values, strict=True) if j != i and v > 0]
        total = self_w + sum(v for _, v in nbrs)
        out[i] = robust_mix(stacked[i], [stacked[j] for j, _ in nbrs], self_w / total,
                            [v / total for _, v in nbrs], rule)
    return out
