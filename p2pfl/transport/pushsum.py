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

import math
import threading
import zlib
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

from p2pfl.storage import STORAGE_ERRNOS, append_line
from p2pfl.transport.logs import SERVICE_LOG

__all__ = ["FINAL_RESERVE", "MU_FLOOR", "SETTLE_FRACTION", "ReceiverLedger", "absorb_line", "claim_credit", "debit",
           "debt_bound", "logged_totals", "parse_absorb_line", "settle_budget", "withholds"]

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


def claim_credit(claim: float | None, absorbed: float, high: float | None = None) -> float:
    """What a receiver absorbs when a sender's running total given (``claim``, before its push) exceeds
    its own running total absorbed from it: the pushes it mixed and lost with its state.

    ``high`` is the most this peer ever had absorbed from that sender (its durable high-water mark:
    checkpoint and write-ahead log). An honest sender's total given never exceeds it -- every total
    it holds is one this peer told it in an ``OK`` (and logged first) -- so a claim above it is
    evidence of nothing and counts only up to it (issue 68: an in-window claim of 1000 settled 997)."""
    if claim is None:
        return 0.0
    if high is not None:
        claim = min(claim, high)
    return claim - absorbed if claim > absorbed else 0.0


def debt_bound(absorbed: float | None, offered: float | None) -> float | None:
    """The receiver's reported total absorbed, counted only up to ``offered``: the running total of the
    shares this sender ever offered it (pushed, whatever their fate). A receiver cannot have absorbed
    more than was pushed to it, so a larger report is evidence of nothing (a hostile receiver would
    otherwise drain its sender's weight to the floor, step after step). None: no report."""
    if absorbed is None or offered is None:
        return absorbed
    return min(absorbed, offered)


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


Key = tuple[str, int, int]  # (sender, round, step) of a push


def absorb_line(sender: str, round: int, step: int, total: float) -> str:
    """One line of the receiver's write-ahead log: the fields and their CRC-32. The CRC tells a line
    torn by a full disk or a kill (``p0 3 0 0.7`` cut from ``p0 3 0 0.75``: the same shape, another
    total) from a whole one; a torn line is later followed by a newline, so shape alone cannot."""
    body = f"{sender} {round} {step} {total!r}"
    return f"{body} {zlib.crc32(body.encode()):08x}"


def parse_absorb_line(line: str) -> tuple[str, int, int, float] | None:
    """(sender, round, step, total) of a whole `absorb_line`, or None (torn, or not one)."""
    body, _, crc = line.rstrip("\n").rpartition(" ")
    parts = body.split()
    if len(parts) != 4 or not (parts[1].isdigit() and parts[2].isdigit()) or crc != f"{zlib.crc32(body.encode()):08x}":
        return None
    try:
        total = float(parts[3])
    except ValueError:
        return None
    if not (math.isfinite(total) and total >= 0):
        return None
    return parts[0], int(parts[1]), int(parts[2]), total


class ReceiverLedger:
    """The receiver side of the push-sum ledger (rule 6), owned by a push-mode `PeerServer`.

    Per sender, the running total of weight absorbed from it (checkpointed with the state it
    belongs to); the claim (sender's running total given, before its push) of each waiting push;
    the total right after each mixed push (its reply) and the share it added until it is answered;
    the weight settled since the node last took it; and the write-ahead log of the totals
    (``log_path``, appended and fsync'd before an ``OK`` leaves). ``lock`` is the server's condition:
    `absorb` runs inside `PeerServer.take`'s atomic step, so a push is decided, mixed and accounted
    at once.
    """

    def __init__(self, lock: threading.Condition) -> None:
        self._lock = lock
        self._totals: dict[str, float] = {}
        self._claims: dict[Key, float] = {}
        self._after: dict[Key, float] = {}
        self._shares: dict[Key, float] = {}
        self._settled: dict[str, float] = {}
        #: Per sender, the most ever absorbed from it (checkpointed, raised by the write-ahead log's
        #: lines): the bound on what an honest sender can claim it gave (`claim_credit`).
        self._high: dict[str, float] = {}
        #: Senders whose claims are ignored until a restarted peer's resumed round is over: its recovery
        #: (rule 4) and write-ahead log restore what it lost; a claim on top would count it twice.
        self.held: frozenset[str] = frozenset()
        self.log_path: Path | None = None
        self._log_failing = False  # the write-ahead log's last append failed (one warning a spell)

    # -- the totals ---------------------------------------------------------------------------------
    def totals(self) -> dict[str, float]:
        """Per sender, the running total absorbed (goes into the checkpoint)."""
        with self._lock:
            return dict(self._totals)

    def total(self, sender: str) -> float:
        with self._lock:
            return self._totals.get(sender, 0.0)

    def restore(self, totals: Mapping[str, float], high: Mapping[str, float] | None = None) -> None:
        """The totals of the checkpoint being resumed (the state they are consistent with), and its
        high-water marks (a checkpoint without them: the totals)."""
        with self._lock:
            self._totals = {str(k): float(v) for k, v in totals.items()}
            marks = dict(self._high)  # raised by the write-ahead log's lines already read
            for k, v in self._totals.items():
                marks[k] = max(marks.get(k, 0.0), v)
            for k, v in dict(high or {}).items():
                marks[str(k)] = max(marks.get(str(k), 0.0), float(v))
            self._high = marks

    def highs(self) -> dict[str, float]:
        """Per sender, the most ever absorbed from it (goes into the checkpoint)."""
        with self._lock:
            return dict(self._high)

    def raise_high(self, sender: str, total: float) -> None:
        """A total this peer once logged as absorbed from ``sender`` (its write-ahead log): the mark rises to it."""
        with self._lock:
            if total > self._high.get(sender, 0.0):
                self._high[sender] = total

    def raise_to(self, sender: str, total: float) -> float:
        """Raise the total absorbed from ``sender`` to ``total`` (one this peer durably had before a
        restart); return the difference, for the node's mu (0 if not below)."""
        with self._lock:
            have = self._totals.get(sender, 0.0)
            if total <= have:
                return 0.0
            self._totals[sender] = total
            self._high[sender] = max(self._high.get(sender, 0.0), total)
            return total - have

    # -- settlement ---------------------------------------------------------------------------------
    def note(self, sender: str, amount: float) -> None:
        """Add ``amount`` to the weight settled with ``sender`` (handed to the node by `pop`)."""
        if amount:
            with self._lock:
                self._settled[sender] = self._settled.get(sender, 0.0) + amount

    def pop(self) -> dict[str, float]:
        """Weight settled since the last call, per sender (the node adds it to its mu)."""
        with self._lock:
            out, self._settled = self._settled, {}
            return out

    def settle_claim(self, sender: str, claim: float) -> None:
        """An accepted contact from ``sender`` claims it durably gave ``claim`` in total: raise this
        peer's total to it and settle the difference (`claim_credit`), unless its claims are held."""
        with self._lock:
            if sender in self.held:
                return
            have = self._totals.get(sender, 0.0)
            self._warn_above_high(sender, claim)
            credit = claim_credit(claim, have, self._high.get(sender, 0.0))
            if credit:
                self._totals[sender] = min(claim, self._high.get(sender, 0.0))  # the sender's own total: A = G
                self._settled[sender] = self._settled.get(sender, 0.0) + credit

    # -- one push's life ----------------------------------------------------------------------------
    def hold_claim(self, key: Key, claim: float | None) -> None:
        """The claim of a push now waiting in the inbox (settled when `absorb` mixes it)."""
        if claim is not None:
            with self._lock:
                self._claims[key] = claim

    def drop_claim(self, key: Key) -> None:
        """The push of ``key`` leaves the inbox unmixed, or is a recovered payload (no claim with it)."""
        with self._lock:
            self._claims.pop(key, None)

    def absorb(self, key: Key, share: float) -> bool:
        """``key`` is being mixed (lock held by `take`): settle its claim, then add its ``share``
        (the weight ``combine`` applies: W[i, j] * mu_j); logged before the OK can leave.

        The log line is written once, not retried: False when the storage refused it (nothing
        changed; `take` leaves the push waiting and tries again after releasing the lock, so a full
        disk never holds the server's lock for the storage's retry budget)."""
        j, r, s = key
        with self._lock:
            total = self._totals.get(j, 0.0)
            claim = self._claims.get(key)
            high = self._high.get(j, 0.0)
            credit = 0.0 if j in self.held else claim_credit(claim, total, high)
            if credit:
                assert claim is not None
                total = min(claim, high)  # exactly the sender's total (not a sum that may round): A = G again
            total = total + share
            if not self._log_once(j, r, s, total):
                return False
            if j not in self.held:
                self._warn_above_high(j, claim)
            self._claims.pop(key, None)
            if credit:
                self._settled[j] = self._settled.get(j, 0.0) + credit
            self._totals[j] = total
            self._high[j] = max(high, total)
            self._after[key] = total
            self._shares[key] = share
            return True

    def answered(self, key: Key) -> float:
        """The total to tell the sender of ``key`` (right after it was mixed, or now); the share is final."""
        with self._lock:
            self._shares.pop(key, None)
            return self._after.get(key, self._totals.get(key[0], 0.0))

    def unanswered(self, key: Key) -> float:
        """``key`` was mixed but its OK cannot be sent: the sender keeps the share (rule 2), so it is
        given back (logged, settled as a debit); returns it (0: nothing to give back)."""
        j, r, s = key
        with self._lock:
            share = self._shares.pop(key, 0.0)
            if not share:
                return 0.0
            total = self._totals.get(j, 0.0) - share
            self._totals[j] = total
            self._after[key] = total
            self._settled[j] = self._settled.get(j, 0.0) - share
            self._log(j, r, s, total)
            return share

    def forget(self, key: Key) -> None:
        """``key``'s decision is no longer remembered (pruned): neither is its reply."""
        with self._lock:
            self._after.pop(key, None)
            self._shares.pop(key, None)

    def _warn_above_high(self, sender: str, claim: float | None) -> None:
        """(lock held) One line when ``sender`` claims more than this peer ever absorbed from it."""
        high = self._high.get(sender, 0.0)
        if claim is not None and claim > high:
            SERVICE_LOG.warning("push-sum: %r claims it gave %.6g in total, more than was ever absorbed from it "
                                "here (%.6g); counted only up to that", sender, claim, high)

    def _log_once(self, j: str, r: int, s: int, total: float) -> bool:
        """`_log` in one attempt: False (one warning per failing spell) when the storage refuses it."""
        if self.log_path is None:
            return True
        try:
            append_line(self.log_path, absorb_line(j, r, s, total), retry=False)
        except OSError as exc:
            if exc.errno not in STORAGE_ERRNOS:
                raise
            if not self._log_failing:
                SERVICE_LOG.warning("push-sum: %s: cannot append: %s; pushes wait until it can (not mixed meanwhile)",
                                    self.log_path, exc.strerror or exc)
            self._log_failing = True
            return False
        if self._log_failing:
            SERVICE_LOG.warning("push-sum: %s: appending again", self.log_path)
        self._log_failing = False
        return True

    def _log(self, j: str, r: int, s: int, total: float) -> None:
        """Append (fsync'd) the total absorbed from ``j`` after (r, s): durable before the OK leaves."""
        if self.log_path is not None:  # a whole line, fsync'd; a storage fault retried (p2pfl.storage)
            append_line(self.log_path, absorb_line(j, r, s, total))
