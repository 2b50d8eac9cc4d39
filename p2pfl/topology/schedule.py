"""Per-round mixing plans and the seeded random neighbour schedule.

A plan tells one peer, for one (round, gossip step), whom it mixes with and with which weights.
Plans are a pure function of (topology, seed, round, step): every peer recomputes every other
peer's random draws on its own, so no coordinator and no extra messages are needed, and the
in-memory simulation and the gRPC deployment see exactly the same graph each round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .mixing import SparseMixing

#: Schedule kinds understood by the file format.
SCHEDULE_KINDS = ("random_pull",)

#: Mixing modes: "pull" (row-stochastic, receivers average) or "push" (column-stochastic, senders split).
MODES = ("pull", "push")

# Domain-separation tag mixed into every schedule seed, so that the topology's random stream never
# coincides with another component that seeds numpy with the same (seed, round, ...) tuple.
_STREAM_TAG = 0x746F706F  # "topo"


@dataclass(frozen=True)
class Schedule:
    """A time-varying neighbour schedule (the file's ``schedule:`` block).

    ``random_pull``: every (round, step), each peer draws ``k`` distinct peers uniformly without
    replacement from its candidates (its static in-neighbours, or every other peer when the file
    has no edges) and mixes with weight ``1 / (k + 1)`` on each of them and on itself — the Dis-PFL
    scheme used by DFedMDC / DFedPGP / DFedADMM / DFedSAM. The matrix is row-stochastic, not
    symmetric. In push mode the same draws are the peers ``i`` pushes to.
    """

    kind: str
    k: int

    def to_dict(self) -> dict[str, object]:
        """The file representation."""
        return {"kind": self.kind, "k": self.k}


@dataclass(frozen=True)
class MixingPlan:
    """What one peer does in one gossip step.

    * ``mode == "pull"`` (row-stochastic W): the peer updates
      ``x_i <- self_weight * x_i + sum_j in_weights[j] * x_j``; ``in_weights`` are the peers it must
      pull from, with ``W[i, j]``. ``out_weights`` lists the peers that will pull from it this step,
      with ``W[k, i]`` — the transport uses it to know who may ask for its payload.
    * ``mode == "push"`` (column-stochastic W): the peer sends ``out_weights[k] * x_i`` (and the same
      share of its push-sum weight) to each ``k`` and keeps ``self_weight * x_i``; ``in_weights`` are
      the senders whose pushes it must wait for, with the share ``W[i, j]`` they send.

    Dictionaries are in peer order and never contain the peer itself or zero weights.
    """

    peer: str
    round: int
    step: int
    mode: str
    self_weight: float
    in_weights: dict[str, float]
    out_weights: dict[str, float]


def _check_counter(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


def check_mode(mode: str) -> None:
    """Refuse anything but "pull" / "push" (a typo must not silently give the wrong matrix)."""
    if mode not in MODES:
        raise ValueError(f"unknown mixing mode {mode!r}; expected one of {', '.join(MODES)}")


def draw_peers(
    candidates: Sequence[int], k: int, *, seed: int, round: int, step: int, index: int
) -> np.ndarray:
    """The ``k`` distinct peers (sorted indices) that peer ``index`` picks at (round, step).

    Seeded per (seed, round, step, peer index) rather than from one stream for all peers, so one
    peer's draw can be recomputed without replaying everyone's, and the result does not depend on
    the order in which peers are processed.
    """
    for name, value in (("seed", seed), ("round", round), ("step", step)):
        _check_counter(name, value)
    cand = np.asarray(candidates, dtype=np.int64)
    if k > cand.size:
        raise ValueError(f"cannot draw {k} peers from {cand.size} candidates")
    rng = np.random.default_rng([_STREAM_TAG, int(seed), int(round), int(step), int(index)])
    picked = rng.choice(cand.size, size=k, replace=False)
    return np.sort(cand[picked])


def random_matrix(
    candidates: Sequence[Sequence[int]], k: int, *, seed: int, round: int, step: int, mode: str
) -> np.ndarray:
    """The (round, step) matrix of a ``random_pull`` schedule.

    ``candidates[i]`` are the peers ``i`` may draw: in pull mode the ones it can pull from, in push
    mode the ones it can push to. Pull: ``W[i, j] = 1/(k+1)`` for ``j`` in ``{i} ∪ draws(i)``
    (row-stochastic). Push: ``W[j, i] = 1/(k+1)`` for the same sets (column-stochastic).
    """
    return random_sparse(candidates, k, seed=seed, round=round, step=step, mode=mode).toarray()


def random_sparse(
    candidates: Sequence[Sequence[int]], k: int, *, seed: int, round: int, step: int, mode: str
) -> SparseMixing:
    """`random_matrix` in sparse form: O(n k) memory instead of n x n."""
    check_mode(mode)
    n = len(candidates)
    share = 1.0 / (k + 1)
    rows = []
    for i, cand in enumerate(candidates):
        drawn = draw_peers(cand, k, seed=seed, round=round, step=step, index=i)
        cols = np.append(drawn, i)
        rows.append((cols, np.full(cols.size, share)))
    w = SparseMixing.from_rows(n, rows)
    return w if mode == "pull" else w.transpose()


def plan_from_matrix(
    ids: Sequence[str], w: np.ndarray | SparseMixing, index: int, *, round: int, step: int, mode: str
) -> MixingPlan:
    """Read peer ``index``'s plan off the full matrix (row ``index`` and column ``index``).

    Deriving every plan from the one matrix guarantees that the plans of all peers agree: ``k``
    appears in ``i``'s ``out_weights`` exactly when ``i`` appears in ``k``'s ``in_weights``, with the
    same weight ``W[k, i]``.
    """
    check_mode(mode)
    if not isinstance(w, SparseMixing):
        w = SparseMixing.from_dense(w)
    cols, row = w.row(index)
    rows, col = w.col(index)
    in_weights = {ids[j]: float(v) for j, v in zip(cols.tolist(), row, strict=True) if j != index}
    out_weights = {ids[k]: float(v) for k, v in zip(rows.tolist(), col, strict=True) if k != index}
    return MixingPlan(
        peer=ids[index],
        round=int(round),
        step=int(step),
        mode=mode,
        self_weight=w.get(index, index),
        in_weights=in_weights,
        out_weights=out_weights,
    )
