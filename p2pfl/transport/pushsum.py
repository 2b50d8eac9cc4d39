"""Push-sum's weight rules, in one place (docs/protocol.md, "Push-sum mass").

Push-sum (``dfedpgp``, ``mix_mode: push``) is right only while ``sum_i mu_i = n`` and every mu stays
away from zero: DFedPGP trains its body with step ``lr / mu`` and de-biases with ``z = u / mu``, so
a weight near zero is a step size near infinity (the issue-68 run: a neighbour's loss at 3e6 four
rounds after a restart, then NaN everywhere). Every rule that moves a weight outside the mixing
itself is here, with the bound it keeps:

* **withhold** (rule 7): a peer short of an in-neighbour's share in its last step, with
  ``mu < MU_FLOOR``, keeps its whole share this step; so mixing never takes a weight below
  ``W[i,i] * MU_FLOOR`` (``withholds``). The "short" flag is part of the checkpointed state: a
  restarted peer withholds exactly as its uninterrupted self would have (before, a restart forgot
  it and gave half of a weight already at the floor away once more).
* **sender settles a debt** (rule 6: a receiver absorbed more than the sender's state gave): from
  what it keeps this step, at most ``SETTLE_FRACTION`` of it and never below the floor it would
  keep by withholding; the rest on its next push (``settle_budget``). In the run's last round (no later
  step trains with it) it pays all it keeps but ``FINAL_RESERVE`` of it.
* **receiver settles a claim** (rule 6: a sender durably gave more than the receiver's state
  absorbed): it absorbs the difference (``claim_credit``); a credit only raises a weight.
* **receiver restores its write-ahead log** after a restart (rule 6): per sender, the total it had
  absorbed, less the pushes whose senders answer they kept the share (their OK never arrived;
  restoring those counted them twice: issue 68's sum mu = 4.5) (``logged_totals``).
* **any other debit** (an ``OK`` that could not be sent is taken back): applied down to the floor,
  the rest deferred to the next round's settlement (``debit``), so no settlement can drive a weight
  to zero however the faults interleave; mass is conserved meanwhile (the deferred part is owed by
  this peer alone) and the last round applies it in full.

The algorithm's own constant ``p2pfl.algorithms.dfedpgp.MU`` names the scalar; nothing else here
depends on the algorithm.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

__all__ = ["FINAL_RESERVE", "MU_FLOOR", "SETTLE_FRACTION", "claim_credit", "debit", "logged_totals", "settle_budget",
           "withholds"]

#: Below this weight (the mean is 1) a peer short of an in-neighbour's share keeps its whole share.
MU_FLOOR = 0.5

#: Of what a sender keeps in one step, at most this fraction settles a debt (the rest next time).
SETTLE_FRACTION = 0.5

#: In the run's last round the debt is paid from all the sender keeps but this fraction (z = u / mu
#: needs mu > 0; no later step trains with it).
FINAL_RESERVE = 2.0 ** -20


def withholds(mu: float, short: bool) -> bool:
    """Whether a peer keeps its whole share this step (rule 7): it was short and is below the floor.

    Never without a fault (no in-neighbour is ever short), so fault-free runs are bitwise the
    simulation's."""
    return short and mu < MU_FLOOR


def settle_budget(keep: float, self_weight: float, mu: float, *, last: bool) -> float:
    """How much a sender may pay this step, over all its debts, from ``keep`` (the weight it keeps: its
    self share plus the shares nobody mixed). At most ``SETTLE_FRACTION`` of it, and never so much that
    it keeps less than it would by withholding at the floor (``self_weight * min(mu, MU_FLOOR)``); in
    the last round all but ``FINAL_RESERVE`` of it."""
    if keep <= 0:
        return 0.0
    if last:
        return keep * (1.0 - FINAL_RESERVE)
    return max(0.0, min(keep * SETTLE_FRACTION, keep - self_weight * min(mu, MU_FLOOR)))


def claim_credit(claim: float | None, absorbed: float) -> float:
    """What a receiver absorbs when a sender's running total given (``claim``, before its push) exceeds
    its own running total absorbed from it: the pushes it mixed and lost with its state."""
    if claim is None or claim <= absorbed:
        return 0.0
    return claim - absorbed


def debit(mu: float, amount: float, floor: float, *, last: bool) -> tuple[float, float]:
    """Apply a settlement ``amount`` (negative: a debit) to ``mu``: (applied, deferred).

    A credit is applied in full. A debit only down to ``floor`` (the weight this peer keeps at least);
    the rest is deferred to the next round's settlement. In the last round it is applied in full
    (no later step trains with the weight), but for ``FINAL_RESERVE`` of it."""
    if amount >= 0:
        return amount, 0.0
    room = mu * (1.0 - FINAL_RESERVE) if last else max(0.0, mu - floor)
    applied = -min(-amount, room)
    return applied, amount - applied


def logged_totals(base: Mapping[str, float], lines: Iterable[tuple[str, int, int, float]],
                  kept: Collection[tuple[str, int, int]]) -> dict[str, float]:
    """Per sender, the total absorbed a restarted receiver restores from its write-ahead log ``lines``
    (sender, round, step, total after it; in order) on top of its checkpoint's totals ``base``.

    Each line's share is its total less the one before (the checkpoint's for the first). A push in
    ``kept`` was mixed here but its sender never heard the OK and kept the share, so its share is
    left out. With nothing kept it is exactly the last logged total (the sender's own float sum, so
    the edge's totals stay bitwise equal)."""
    prev = dict(base)
    last: dict[str, float] = {}
    skip: dict[str, float] = {}
    for j, r, s, total in lines:
        if (j, r, s) in kept:
            skip[j] = skip.get(j, 0.0) + (total - prev.get(j, 0.0))
        prev[j] = last[j] = total
    return {j: t - skip.get(j, 0.0) for j, t in last.items()}
