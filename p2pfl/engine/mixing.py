"""One gossip step of the batched engine as sparse matrices, built from the peers' mixing plans.

The plans name, for each peer, its self weight and its in-neighbours' weights; here they become
one sparse ``[rows, columns]`` weight matrix (``p2pfl.algorithms.combine``'s convention: row i's
own payload is column i, the other columns are the payloads it may read: every peer's in one
process, or this rank's peers' then the halo rows of other ranks). The entries are collected in
one pass over the plans (O(edges)) and the matrix is built from the index lists at once: a step
holds O(edges) numbers, not a dense O(peers^2) matrix filled peer pair by peer pair.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from p2pfl.algorithms.combine import mix_rows, sparse_weights
from p2pfl.topology import MixingPlan


@dataclass
class StepMixing:
    """What one gossip step mixes, for ``rows`` peers: ``weights`` (raw plan weights, self and the
    in-neighbours whose payload arrived), ``arrived`` (1 per arrived in-neighbour, self left out),
    ``recv`` (bytes each row received, ``[rows]`` int64) and ``refused`` ((row, sender) of each
    payload a receiver refused: not finite, as a wire receiver refuses it)."""

    weights: torch.Tensor
    arrived: torch.Tensor
    recv: torch.Tensor
    refused: list[tuple[int, str]]


def step_mixing(plans: Sequence[MixingPlan], column: Mapping[str, int], ok: torch.Tensor, size: torch.Tensor,
                columns: int, device: torch.device) -> StepMixing:
    """The step's matrices for the peers of ``plans`` (row i: ``plans[i]``'s peer, column i its own payload).

    ``column[j]``: the column of sender ``j``'s payload; ``ok``/``size`` (CPU, ``[columns]``): whether
    that payload is accepted (finite) and its wire size. A refused payload leaves its weight out,
    as a missing message does in the exact engine (pull mode renormalizes over the rest)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    senders: list[str | None] = []  # the sender of each entry (None: the row's own payload)
    for i, plan in enumerate(plans):
        inw = plan.in_weights
        rows.extend([i] * (len(inw) + 1))
        cols.append(i)
        cols.extend(column[j] for j in inw)
        values.append(plan.self_weight)
        values.extend(inw.values())
        senders.append(None)
        senders.extend(inw)
    r = torch.tensor(rows, dtype=torch.int64)
    c = torch.tensor(cols, dtype=torch.int64)
    v = torch.tensor(values, dtype=torch.float64)
    own = c == r
    kept = own | ok[c]
    arrived = kept & ~own
    shape = (len(plans), columns)
    recv = torch.zeros(len(plans), dtype=torch.int64).index_add_(0, r[arrived], size[c[arrived]])
    refused = [(rows[e], senders[e]) for e in (~kept).nonzero().flatten().tolist()]
    return StepMixing(weights=sparse_weights(r[kept], c[kept], v[kept], shape, device),
                      arrived=sparse_weights(r[arrived], c[arrived], torch.ones(int(arrived.sum()),
                                                                                 dtype=torch.float64), shape, device),
                      recv=recv, refused=refused)  # type: ignore[arg-type]


def consensus_distances(arrived: torch.Tensor, body: torch.Tensor) -> list[float]:
    """Each row's distance to the mean of the in-neighbours' bodies that arrived (0 when none did);
    ``body`` holds a row per column of ``arrived`` (the rows' own first)."""
    rows = arrived.shape[0]
    count = torch.zeros(rows, dtype=torch.float64, device=body.device).index_add_(
        0, arrived.indices()[0], arrived.values())
    dist = torch.linalg.vector_norm(body[:rows] - mix_rows(arrived, body, renormalize=True), dim=1)
    return torch.where(count > 0, dist, torch.zeros_like(dist)).tolist()
