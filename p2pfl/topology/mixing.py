"""Mixing matrices and their spectral gap.

Everything here works on plain adjacency lists (peer indices), not on `Topology`, so that the
weight rules can be read and tested on their own and `spec.py` can import this module without a
cycle.

Convention used throughout the package: ``W[i, j]`` is the weight peer ``i`` gives to peer ``j``'s
value, so a gossip step is ``x_i <- sum_j W[i, j] * x_j``.

* **pull** matrices are *row*-stochastic (every row sums to 1): each peer forms a convex
  combination of what it pulled;
* **push** matrices are *column*-stochastic (every column sums to 1): each peer splits its value
  (and its push-sum weight) among the peers it pushes to, so the total mass is conserved.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: Absolute tolerance for "sums to 1", "symmetric" and "non-negative" checks. Loose enough for
#: hand-written decimals such as 0.333333, tight enough to catch a wrong weight.
TOL = 1e-6

Adjacency = Sequence[Sequence[int]]

#: Above this many peers the spectral gap is not computed (dense eigenvalues need O(n^2) memory, O(n^3) time).
DENSE_EIG_LIMIT = 2000


class SparseMixing:
    """A mixing matrix in compressed sparse row form: O(peers + edges) memory, never n x n.

    A 20,000-peer ring has 60,000 non-zeros (1.4 MB) where the dense matrix takes 3.2 GB. Rows are
    what pull mode reads (whom ``i`` pulls from), columns what push mode and the transport read
    (who pulls from ``i``); the column view is built once, on first use. ``toarray()`` gives the
    dense matrix for small topologies and for the tests.
    """

    __slots__ = ("_t", "data", "indices", "indptr", "n")

    def __init__(self, n: int, indptr: np.ndarray, indices: np.ndarray, data: np.ndarray) -> None:
        self.n = int(n)
        self.indptr = np.asarray(indptr, dtype=np.int64)
        self.indices = np.asarray(indices, dtype=np.int64)
        self.data = np.asarray(data, dtype=np.float64)
        for a in (self.indptr, self.indices, self.data):
            a.flags.writeable = False
        self._t: SparseMixing | None = None

    @classmethod
    def from_rows(cls, n: int, rows: Sequence[tuple[np.ndarray, np.ndarray]]) -> SparseMixing:
        """Build from ``rows[i] = (column indices, weights)``; entries are sorted by column, zeros dropped."""
        indptr = np.zeros(n + 1, dtype=np.int64)
        cols, vals = [], []
        for i, (c, v) in enumerate(rows):
            c = np.asarray(c, dtype=np.int64)
            v = np.asarray(v, dtype=np.float64)
            keep = v != 0
            c, v = c[keep], v[keep]
            order = np.argsort(c, kind="stable")
            cols.append(c[order])
            vals.append(v[order])
            indptr[i + 1] = indptr[i] + c.size
        return cls(n, indptr, np.concatenate(cols), np.concatenate(vals))

    @classmethod
    def from_dense(cls, w: np.ndarray) -> SparseMixing:
        w = np.asarray(w, dtype=np.float64)
        return cls.from_rows(w.shape[0], [(np.flatnonzero(r), r[np.flatnonzero(r)]) for r in w])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.n)

    @property
    def nnz(self) -> int:
        return int(self.indices.size)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(columns, weights) of row ``i``: whom ``i`` gives weight to."""
        a, b = self.indptr[i], self.indptr[i + 1]
        return self.indices[a:b], self.data[a:b]

    def transpose(self) -> SparseMixing:
        if self._t is None:
            rows = np.repeat(np.arange(self.n, dtype=np.int64), np.diff(self.indptr))
            order = np.lexsort((rows, self.indices))
            counts = np.bincount(self.indices, minlength=self.n)
            indptr = np.concatenate([[0], np.cumsum(counts)])
            self._t = SparseMixing(self.n, indptr, rows[order], self.data[order])
            self._t._t = self
        return self._t

    def col(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, weights) of column ``j``: who gives weight to ``j``."""
        return self.transpose().row(j)

    def get(self, i: int, j: int) -> float:
        c, v = self.row(i)
        k = np.searchsorted(c, j)
        return float(v[k]) if k < c.size and c[k] == j else 0.0

    def row_sums(self) -> np.ndarray:
        rows = np.repeat(np.arange(self.n), np.diff(self.indptr))
        return np.bincount(rows, weights=self.data, minlength=self.n)

    def toarray(self) -> np.ndarray:
        w = np.zeros((self.n, self.n), dtype=np.float64)
        rows = np.repeat(np.arange(self.n), np.diff(self.indptr))
        w[rows, self.indices] = self.data
        return w

    def copy(self) -> np.ndarray:
        """The dense matrix (what ``Topology.mixing_matrix`` has always returned)."""
        return self.toarray()


def _self_weights(n: int, rows: Sequence[tuple[Sequence[int], np.ndarray]]) -> np.ndarray:
    """``1 - sum_j W[i, j]`` per row, summed over a dense row buffer so the result is bit-for-bit what
    the dense construction gave (numpy's pairwise summation depends on where the zeros sit)."""
    buf = np.zeros(n, dtype=np.float64)
    out = np.empty(n, dtype=np.float64)
    for i, (cols, vals) in enumerate(rows):
        if len(vals) <= 2:  # a + b (+ zeros) is the same in any order: no O(n) buffer needed
            out[i] = 1.0 - (float(vals[0]) + float(vals[1]) if len(vals) == 2 else float(sum(vals)))
            continue
        buf[cols] = vals
        out[i] = 1.0 - buf.sum()
        buf[cols] = 0.0
    return out


def metropolis_sparse(neighbours: Adjacency) -> SparseMixing:
    """`metropolis_matrix` in sparse form (identical values)."""
    n = len(neighbours)
    deg = np.array([len(nb) for nb in neighbours], dtype=np.int64)
    off = []
    for i, nb in enumerate(neighbours):
        cols = np.asarray(nb, dtype=np.int64)
        off.append((cols, 1.0 / (1.0 + np.maximum(deg[i], deg[cols]).astype(np.float64))))
    diag = _self_weights(n, off)
    return SparseMixing.from_rows(n, [(np.append(c, i), np.append(v, diag[i])) for i, (c, v) in enumerate(off)])


def uniform_pull_sparse(in_neighbours: Adjacency) -> SparseMixing:
    """`uniform_pull_matrix` in sparse form."""
    rows = []
    for i, nb in enumerate(in_neighbours):
        cols = np.append(np.asarray(nb, dtype=np.int64), i)
        rows.append((cols, np.full(cols.size, 1.0 / (len(nb) + 1))))
    return SparseMixing.from_rows(len(in_neighbours), rows)


def uniform_push_sparse(out_neighbours: Adjacency) -> SparseMixing:
    """`uniform_push_matrix` in sparse form (the transpose of a uniform split by out-degree)."""
    return uniform_pull_sparse(out_neighbours).transpose()


def metropolis_matrix(neighbours: Adjacency) -> np.ndarray:
    """Metropolis–Hastings weights of an undirected graph.

    ``W[i, j] = 1 / (1 + max(d_i, d_j))`` on every edge and ``W[i, i] = 1 - sum_{j != i} W[i, j]``.
    Why this rule: it needs only the degrees of the two endpoints (each peer can compute it
    locally), and it is symmetric and doubly stochastic on any undirected graph, which is what the
    consensus theory of DFedSAM / DFedADMM / DePRL assumes — unlike uniform weights, which are
    doubly stochastic only on regular graphs.

    ``neighbours[i]`` must list the neighbours of ``i`` (symmetric: ``j in neighbours[i]`` iff
    ``i in neighbours[j]``).
    """
    # Self weight last, from the exact row sum, so rows sum to 1 up to one rounding.
    return metropolis_sparse(neighbours).toarray()


def uniform_pull_matrix(in_neighbours: Adjacency) -> np.ndarray:
    """Row-stochastic uniform averaging: ``W[i, j] = 1 / (d_in(i) + 1)`` for ``j`` in ``{i} ∪ N_in(i)``.

    Each peer averages itself and everything it pulls with equal weight (D-PSGD / Dis-PFL style);
    it needs no knowledge of the neighbours' degrees. The price: the matrix is doubly stochastic
    only on regular graphs, so on irregular graphs the network average drifts.
    """
    return uniform_pull_sparse(in_neighbours).toarray()


def uniform_push_matrix(out_neighbours: Adjacency) -> np.ndarray:
    """Column-stochastic uniform splitting: ``W[k, i] = 1 / (d_out(i) + 1)`` for ``k`` in ``{i} ∪ N_out(i)``.

    This is the push-sum rule: peer ``i`` keeps one share and pushes one share to each
    out-neighbour, so the sum of values (and of push-sum weights) over all peers is conserved.
    """
    return uniform_push_sparse(out_neighbours).toarray()


def is_row_stochastic(w: np.ndarray | SparseMixing, tol: float = TOL) -> bool:
    """Non-negative with every row summing to 1 (within ``tol``)."""
    if isinstance(w, SparseMixing):
        return bool(np.all(w.data >= -tol) and np.allclose(w.row_sums(), 1.0, rtol=0.0, atol=tol))
    return bool(np.all(w >= -tol) and np.allclose(w.sum(axis=1), 1.0, rtol=0.0, atol=tol))


def is_column_stochastic(w: np.ndarray | SparseMixing, tol: float = TOL) -> bool:
    """Non-negative with every column summing to 1 (within ``tol``)."""
    return is_row_stochastic(w.transpose() if isinstance(w, SparseMixing) else w.T, tol)


def is_doubly_stochastic(w: np.ndarray | SparseMixing, tol: float = TOL) -> bool:
    """Both row- and column-stochastic: the average of all peers' values is preserved by mixing."""
    return is_row_stochastic(w, tol) and is_column_stochastic(w, tol)


def is_symmetric(w: np.ndarray | SparseMixing, tol: float = TOL) -> bool:
    """``W == W^T`` within ``tol``."""
    if isinstance(w, SparseMixing):
        t = w.transpose()
        return bool(np.array_equal(w.indptr, t.indptr) and np.array_equal(w.indices, t.indices)
                    and np.allclose(w.data, t.data, rtol=0.0, atol=tol))
    return bool(np.allclose(w, w.T, rtol=0.0, atol=tol))


def spectral_gap(w: np.ndarray | SparseMixing) -> float:
    """Spectral gap ``1 - |lambda_2|`` of a stochastic mixing matrix.

    ``|lambda_2|`` is the *second largest eigenvalue modulus* (SLEM): the moduli of all
    eigenvalues are sorted in decreasing order and the second one is taken (the largest is 1 for a
    stochastic matrix). ``|lambda_2|`` is the rate at which ``W^t`` forgets the initial
    disagreement, so a larger gap means faster consensus: 1 for the uniform full graph (one step
    reaches the average), about ``4 pi^2 / (3 n^2)`` for a ring of ``n`` with weights 1/3.

    For symmetric ``W`` the eigenvalues are real and computed with ``eigvalsh`` (exact ordering,
    no spurious imaginary parts); otherwise (random pull schedules, directed graphs) the complex
    moduli are used, which describe the asymptotic rate of ``W^t`` for that fixed matrix.
    A 1 x 1 matrix (a single peer) has gap 1 by convention: there is nothing to agree on.
    """
    if isinstance(w, SparseMixing):
        if w.n > DENSE_EIG_LIMIT:
            raise ValueError(f"spectral gap of {w.n} peers not computed (dense eigenvalues; limit {DENSE_EIG_LIMIT})")
        w = w.toarray()
    w = np.asarray(w, dtype=np.float64)
    if w.ndim != 2 or w.shape[0] != w.shape[1]:
        raise ValueError(f"spectral_gap needs a square matrix, got shape {w.shape}")
    if w.shape[0] == 1:
        return 1.0
    if is_symmetric(w, tol=1e-12):
        moduli = np.abs(np.linalg.eigvalsh(w))
    else:
        moduli = np.abs(np.linalg.eigvals(w))
    moduli = np.sort(moduli)[::-1]
    return float(1.0 - moduli[1])
