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
    n = len(neighbours)
    deg = np.array([len(nb) for nb in neighbours], dtype=np.int64)
    w = np.zeros((n, n), dtype=np.float64)
    for i, nb in enumerate(neighbours):
        for j in nb:
            w[i, j] = 1.0 / (1.0 + max(deg[i], deg[j]))
    # Self weight last, from the exact row sum, so rows sum to 1 up to one rounding.
    w[np.arange(n), np.arange(n)] = 1.0 - w.sum(axis=1)
    return w


def uniform_pull_matrix(in_neighbours: Adjacency) -> np.ndarray:
    """Row-stochastic uniform averaging: ``W[i, j] = 1 / (d_in(i) + 1)`` for ``j`` in ``{i} ∪ N_in(i)``.

    Each peer averages itself and everything it pulls with equal weight (D-PSGD / Dis-PFL style);
    it needs no knowledge of the neighbours' degrees. The price: the matrix is doubly stochastic
    only on regular graphs, so on irregular graphs the network average drifts.
    """
    n = len(in_neighbours)
    w = np.zeros((n, n), dtype=np.float64)
    for i, nb in enumerate(in_neighbours):
        share = 1.0 / (len(nb) + 1)
        w[i, i] = share
        for j in nb:
            w[i, j] = share
    return w


def uniform_push_matrix(out_neighbours: Adjacency) -> np.ndarray:
    """Column-stochastic uniform splitting: ``W[k, i] = 1 / (d_out(i) + 1)`` for ``k`` in ``{i} ∪ N_out(i)``.

    This is the push-sum rule: peer ``i`` keeps one share and pushes one share to each
    out-neighbour, so the sum of values (and of push-sum weights) over all peers is conserved.
    """
    n = len(out_neighbours)
    w = np.zeros((n, n), dtype=np.float64)
    for i, nb in enumerate(out_neighbours):
        share = 1.0 / (len(nb) + 1)
        w[i, i] = share
        for k in nb:
            w[k, i] = share
    return w


def is_row_stochastic(w: np.ndarray, tol: float = TOL) -> bool:
    """Non-negative with every row summing to 1 (within ``tol``)."""
    return bool(np.all(w >= -tol) and np.allclose(w.sum(axis=1), 1.0, rtol=0.0, atol=tol))


def is_column_stochastic(w: np.ndarray, tol: float = TOL) -> bool:
    """Non-negative with every column summing to 1 (within ``tol``)."""
    return is_row_stochastic(w.T, tol)


def is_doubly_stochastic(w: np.ndarray, tol: float = TOL) -> bool:
    """Both row- and column-stochastic: the average of all peers' values is preserved by mixing."""
    return is_row_stochastic(w, tol) and is_column_stochastic(w, tol)


def is_symmetric(w: np.ndarray, tol: float = TOL) -> bool:
    """``W == W^T`` within ``tol``."""
    return bool(np.allclose(w, w.T, rtol=0.0, atol=tol))


def spectral_gap(w: np.ndarray) -> float:
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
