"""One gossip step of the batched engine as sparse matrices, built from the step's mixing matrix.

The plans name, for each peer, its self weight and its in-neighbours' weights; here the rank's rows of
the step's mixing matrix (`Topology.sparse_matrix`, what every plan is read from: `plan_from_matrix`)
become `StepEntries`, index arrays gathered with numpy at once (no MixingPlan object, no Python loop
over peers: at 10,000 peers the plans' loop was most of a gossip step's own time), cached by the engine
for as long as the matrix is the same (a static graph: the whole run). A step's entries then become
one sparse ``[rows, columns]`` weight matrix (``p2pfl.algorithms.combine``'s convention: row i's own
payload is column i, the other columns are the payloads it may read: every peer's in one process, or
this rank's peers' then the halo rows of other ranks): O(edges) numbers, not a dense O(peers^2) matrix.
`entries_from_plans` gives the same entries from MixingPlan objects (tests/test_batched_ranks.py
checks that both agree).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from p2pfl.algorithms.combine import mix_rows, sparse_weights
from p2pfl.topology import MixingPlan
from p2pfl.topology.mixing import SparseMixing


@dataclass(frozen=True)
class StepEntries:
    """The plans of some peers (the rows) for one gossip step, as index arrays of one entry each, row
    by row, each row's self entry first, then its in-neighbours in column order (a plan's order).

    ``rows``: the entry's row; ``senders``: the global index of the peer whose payload it weighs (the
    row's own peer for its self entry); ``values``: the plan's weight (float64); ``own``: the row's
    self entry; ``out_degree``: per row, how many peers read its payload (its plan's out_weights)."""

    rows: np.ndarray
    senders: np.ndarray
    values: np.ndarray
    own: np.ndarray
    out_degree: np.ndarray

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepEntries):
            return NotImplemented
        return all(np.array_equal(getattr(self, k), getattr(other, k))
                   for k in ("rows", "senders", "values", "own", "out_degree"))

    __hash__ = None  # type: ignore[assignment]

    def readers(self, held: np.ndarray) -> list[int]:
        """The senders whose payloads these rows read and ``held`` (a mask over all peers) lacks."""
        s = np.unique(self.senders[~self.own])
        return s[~held[s]].tolist()


def entries_from_matrix(w: SparseMixing, peers: Sequence[int] | np.ndarray) -> StepEntries:
    """Rows ``peers`` (global indices, in row order) of the step's matrix ``w``: what their plans say
    (`plan_from_matrix`), gathered from the CSR arrays at once."""
    g = np.asarray(peers, dtype=np.int64)
    rows_n = len(g)
    starts, lens = w.indptr[g], w.indptr[g + 1] - w.indptr[g]
    row_of = np.repeat(np.arange(rows_n, dtype=np.int64), lens)
    pos = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens) + np.repeat(starts, lens)
    cols, vals = w.indices[pos], w.data[pos]
    diag = cols == g[row_of]
    self_w = np.zeros(rows_n, dtype=np.float64)
    self_w[row_of[diag]] = vals[diag]
    off = ~diag
    # self entries first in the concatenation: a stable sort by row puts each before its in-neighbours
    rows = np.concatenate([np.arange(rows_n, dtype=np.int64), row_of[off]])
    order = np.argsort(rows, kind="stable")
    # out-degree: the column's non-zeros, its diagonal left out (`plan_from_matrix`'s out_weights)
    all_rows = np.repeat(np.arange(w.n, dtype=np.int64), np.diff(w.indptr))
    col_count = np.bincount(w.indices, minlength=w.n) - np.bincount(w.indices[w.indices == all_rows], minlength=w.n)
    return StepEntries(rows=rows[order], senders=np.concatenate([g, cols[off]])[order],
                       values=np.concatenate([self_w, vals[off]])[order],
                       own=np.concatenate([np.ones(rows_n, dtype=bool), np.zeros(int(off.sum()), dtype=bool)])[order],
                       out_degree=col_count[g])


def entries_from_plans(plans: Sequence[MixingPlan], index: Mapping[str, int]) -> StepEntries:
    """The same entries from MixingPlan objects (``index``: a peer's global index), peer by peer."""
    rows: list[int] = []
    senders: list[int] = []
    values: list[float] = []
    own: list[bool] = []
    for i, plan in enumerate(plans):
        inw = plan.in_weights
        rows.extend([i] * (len(inw) + 1))
        senders.append(index[plan.peer])
        senders.extend(index[j] for j in inw)
        values.append(plan.self_weight)
        values.extend(inw.values())
        own.append(True)
        own.extend([False] * len(inw))
    return StepEntries(rows=np.array(rows, dtype=np.int64), senders=np.array(senders, dtype=np.int64),
                       values=np.array(values, dtype=np.float64), own=np.array(own, dtype=bool),
                       out_degree=np.array([len(p.out_weights) for p in plans], dtype=np.int64))


@dataclass
class StepMixing:
    """What one gossip step mixes, for ``rows`` peers: ``weights`` (raw plan weights, self and the
    in-neighbours whose payload arrived), ``arrived`` (1 per arrived in-neighbour, self left out),
    ``recv`` (bytes each row received, ``[rows]`` int64) and ``refused`` ((row, global index of the
    sender) of each payload a receiver refused: not finite, as a wire receiver refuses it)."""

    weights: torch.Tensor
    arrived: torch.Tensor
    recv: torch.Tensor
    refused: list[tuple[int, int]]


def step_mixing(entries: StepEntries, column_of: np.ndarray, ok: torch.Tensor, size: torch.Tensor, columns: int,
                device: torch.device) -> StepMixing:
    """The step's matrices for the rows of ``entries`` (row i: column i its own payload).

    ``column_of[g]``: the column of peer ``g``'s payload (global index; -1 where no column holds it);
    ``ok``/``size`` (CPU, ``[columns]``): whether that payload is accepted (finite) and its wire size.
    A refused payload leaves its weight out, as a missing message does in the exact engine (pull
    mode renormalizes over the rest)."""
    r = torch.from_numpy(entries.rows)
    c = torch.from_numpy(column_of[entries.senders])
    if bool((c < 0).any()):
        raise ValueError("a plan reads a payload that no column holds")
    v = torch.from_numpy(entries.values)
    own = torch.from_numpy(entries.own)
    kept = own | ok[c]
    arrived = kept & ~own
    rows = len(entries.out_degree)
    shape = (rows, columns)
    recv = torch.zeros(rows, dtype=torch.int64).index_add_(0, r[arrived], size[c[arrived]])
    bad = (~kept).nonzero().flatten().numpy()
    refused = list(zip(entries.rows[bad].tolist(), entries.senders[bad].tolist(), strict=True))
    return StepMixing(weights=sparse_weights(r[kept], c[kept], v[kept], shape, device),
                      arrived=sparse_weights(r[arrived], c[arrived], torch.ones(int(arrived.sum()),
                                                                                 dtype=torch.float64), shape, device),
                      recv=recv, refused=refused)


def consensus_distances(arrived: torch.Tensor, body: torch.Tensor) -> list[float]:
    """Each row's distance to the mean of the in-neighbours' bodies that arrived (0 when none did);
    ``body`` holds a row per column of ``arrived`` (the rows' own first)."""
    rows = arrived.shape[0]
    count = torch.zeros(rows, dtype=torch.float64, device=body.device).index_add_(
        0, arrived.indices()[0], arrived.values())
    dist = torch.linalg.vector_norm(body[:rows] - mix_rows(arrived, body, renormalize=True), dim=1)
    return torch.where(count > 0, dist, torch.zeros_like(dist)).tolist()
