"""Diagnostic: the same committed cells read under every metric the authors' code leaves open.

DePRL's public code (GYan58/AAAI24-DePRL at 341e890, the only upload) never computes the number its
Table 1 reports: ``PFL.Logging`` (``Main.py:45-47``) evaluates every client and discards the result, and
the round loop (``Main.py:61-170``) calls neither it nor ``evaluate``. What it does fix is a client's own
score: correct / samples on its local test set, ``None`` when that set has 10 samples or fewer
(``Sims.py:347-370``). So the readings a Table 1 entry could be are open along three axes, and this
script measures each from a cell's committed ``metrics.jsonl.gz`` and ``partition.json.gz``:

- **final mean**: the mean over peers of the last round's accuracy (what ``docs/results.md`` reports);
- **over >10**: the same mean over peers whose local test set has more than 10 samples (the peers the
  authors' ``evaluate`` scores at all);
- **pooled**: every peer's correct answers over every peer's test samples at the last round (one test
  set split across peers, a large peer counting for more);
- **best round**: the highest per-round mean over all rounds (a "best accuracy" log, as many FL
  codebases keep).

Reads cells only; writes nothing but its report::

    python bench/reproduce/diag_metric_readings.py docs/results/runs/t1-ring-pi0.1-authors/deprl-authors__seed=0 ...

Prints one Markdown row per cell, then one row per seed group (mean ± sample std over the seeds of one
method: a sweep's ``-seed0``/``-seeds12`` files hold seeds of the same method, so they pool), then one JSON
line with every reading and every group. The group rows are what the README's seed-mean table quotes
(``tests/test_diag_metric_readings.py`` checks the committed README against the committed JSON line).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

# the run-folder readers of the other evidence-only diagnostic (this script's folder is on sys.path when
# it runs as a script; tests load it from there too)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from diag_body_collapse import _open, accuracies_by_round  # noqa: E402

# Sims.py:348: a client with this many test samples or fewer returns no accuracy
AUTHORS_MIN_TEST = 10


@dataclass(frozen=True)
class Readings:
    """One cell's final accuracy (%) under each reading, and how many peers the >10 rule drops."""

    cell: str
    rounds: int
    final_mean: float
    over_10: float
    pooled: float
    best_round: float
    best_round_at: int
    peers: int
    peers_dropped: int


def _peer_index(peer: str) -> int:
    """``p17`` -> 17: the committed Table 1 topologies list p0..pN-1 in partition order."""
    if not (peer.startswith("p") and peer[1:].isdigit()):
        raise SystemExit(f"peer id {peer!r} is not of the form pN")
    return int(peer[1:])


def readings(by_round: dict[int, dict[str, float]], n_test: list[int], cell: str = "") -> Readings:
    """The four readings from every peer's accuracy per evaluated round and its test-set size."""
    last = max(by_round)
    final = {_peer_index(p): a for p, a in by_round[last].items()}
    if sorted(final) != list(range(len(n_test))):
        raise SystemExit(f"{cell}: {len(final)} peers evaluated in round {last}, {len(n_test)} in the partition")
    kept = [i for i in final if n_test[i] > AUTHORS_MIN_TEST]
    means = {r: statistics.fmean(accs.values()) for r, accs in by_round.items() if len(accs) == len(n_test)}
    best_at = min(means, key=lambda r: (-means[r], r))  # the earliest round of the highest mean
    return Readings(
        cell=cell,
        rounds=last + 1,
        final_mean=100 * statistics.fmean(final.values()),
        over_10=100 * statistics.fmean(final[i] for i in kept) if kept else float("nan"),
        pooled=100 * sum(final[i] * n_test[i] for i in final) / sum(n_test),
        best_round=100 * means[best_at],
        best_round_at=best_at,
        peers=len(final),
        peers_dropped=len(final) - len(kept),
    )


def read_cell(cell: Path) -> Readings:
    with _open(cell, "partition.json") as f:
        n_test = [len(idx) for idx in json.load(f)["test"]]
    return readings(accuracies_by_round(cell), n_test, f"{cell.parent.name}/{cell.name}")


def cell_row(r: Readings) -> str:
    """One cell's Markdown row, as the README's per-cell table quotes it."""
    return (f"| {r.cell} | {r.final_mean:.2f} | {r.over_10:.2f} | {r.pooled:.2f} | "
            f"{r.best_round:.2f} ({r.best_round_at}) | {r.peers_dropped} of {r.peers} |")


#: ``t1-ring-pi0.1-seeds12/dpsgd__seed=2`` -> sweep ``t1-ring-pi0.1`` (the seed files of one sweep pool), case ``dpsgd``
CELL_NAME = re.compile(r"^(?P<sweep>.+?)(?:-seed0|-seeds12)?/(?P<case>.+)__seed=(?P<seed>\d+)$")
READINGS = ("final_mean", "over_10", "pooled", "best_round")


@dataclass(frozen=True)
class Group:
    """One method's seeds pooled: each reading's mean and sample std (0 for one seed), %."""

    group: str
    seeds: list[int]
    mean: dict[str, float]
    std: dict[str, float]


def seed_groups(rows: list[Readings]) -> list[Group]:
    """The cells grouped by ``sweep/case`` (seed files of one sweep pooled), in first-seen order."""
    by: dict[str, list[tuple[int, Readings]]] = {}
    for r in rows:
        m = CELL_NAME.match(r.cell)
        if m is None:
            raise SystemExit(f"cell {r.cell!r} is not of the form SWEEP/CASE__seed=N")
        by.setdefault(f"{m['sweep']}/{m['case']}", []).append((int(m["seed"]), r))
    out = []
    for name, members in by.items():
        seeds = sorted(s for s, _ in members)
        if len(set(seeds)) != len(seeds):
            raise SystemExit(f"group {name}: seed listed twice ({seeds})")
        vals = {k: [getattr(r, k) for _, r in members] for k in READINGS}
        out.append(Group(name, seeds, {k: statistics.fmean(v) for k, v in vals.items()},
                         {k: statistics.stdev(v) if len(v) > 1 else 0.0 for k, v in vals.items()}))
    return out


def group_row(g: Group) -> str:
    """The Markdown cells of a group's readings, as the README quotes them: ``mean ± std`` each."""
    return " | ".join(f"{g.mean[k]:.2f} ± {g.std[k]:.2f}" for k in READINGS)


def main(cells: list[Path]) -> None:
    rows = [read_cell(c) for c in cells]
    print("| cell | final mean | over >10 | pooled | best round (at) | peers dropped by >10 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(cell_row(r))
    groups = seed_groups(rows)
    print()
    print("| group | seeds | final mean | over >10 | pooled | best round |")
    print("|---|---|---|---|---|---|")
    for g in groups:
        print(f"| {g.group} | {','.join(map(str, g.seeds))} | {group_row(g)} |")
    print(json.dumps({"diag": "metric_readings", "cells": [asdict(r) for r in rows],
                      "groups": [asdict(g) for g in groups]}))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main([Path(a) for a in sys.argv[1:]])
