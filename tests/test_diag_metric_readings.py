"""bench/reproduce/diag_metric_readings.py: one cell's accuracy under each reading the authors' code leaves open."""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "diag_metric_readings", Path(__file__).parents[1] / "bench/reproduce/diag_metric_readings.py")
assert _spec is not None and _spec.loader is not None
diag = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = diag  # its dataclass looks its module up
_spec.loader.exec_module(diag)


def _cell(folder: Path, recs: list[dict], test_sizes: list[int]) -> Path:
    folder.mkdir(parents=True)
    with gzip.open(folder / "metrics.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    start, test = 0, []
    for n in test_sizes:
        test.append(list(range(start, start + n)))
        start += n
    with gzip.open(folder / "partition.json.gz", "wt") as f:
        json.dump({"train": [[0]] * len(test_sizes), "test": test}, f)
    return folder


def test_each_reading_weighs_the_peers_as_it_says(tmp_path: Path) -> None:
    # p1 has 10 test samples (the authors' evaluate scores it None), p0 and p2 more
    recs = [{"peer": "p0", "round": 4, "acc": 0.9}, {"peer": "p1", "round": 4, "acc": 0.6},
            {"peer": "p2", "round": 4, "acc": 0.9},
            {"peer": "p0", "round": 9, "acc": 0.8}, {"peer": "p1", "round": 9, "acc": 0.2},
            {"peer": "p2", "round": 9, "acc": 0.5},
            {"peer": "p0", "round": 10, "train_loss": 0.1}]  # a round without evaluation is no round here
    r = diag.read_cell(_cell(tmp_path / "sweep" / "case__seed=0", recs, [30, 10, 60]))
    assert r.cell == "sweep/case__seed=0" and r.rounds == 10 and r.peers == 3 and r.peers_dropped == 1
    assert math.isclose(r.final_mean, 100 * (0.8 + 0.2 + 0.5) / 3)
    assert math.isclose(r.over_10, 100 * (0.8 + 0.5) / 2)
    assert math.isclose(r.pooled, 100 * (0.8 * 30 + 0.2 * 10 + 0.5 * 60) / 100)
    assert math.isclose(r.best_round, 100 * 2.4 / 3) and r.best_round_at == 4


def test_the_best_round_is_the_earliest_of_equal_means_and_partial_rounds_do_not_count() -> None:
    by_round = {0: {"p0": 0.4, "p1": 0.4}, 1: {"p0": 1.0}, 2: {"p0": 0.6, "p1": 0.4}, 3: {"p0": 0.4, "p1": 0.6}}
    r = diag.readings(by_round, [20, 20])
    assert r.best_round_at == 2 and math.isclose(r.best_round, 50.0)  # round 1 lacks p1: not a round mean


def test_a_cell_whose_peers_do_not_match_its_partition_is_refused(tmp_path: Path) -> None:
    recs = [{"peer": "p0", "round": 0, "acc": 0.5}, {"peer": "p2", "round": 0, "acc": 0.5}]
    with pytest.raises(SystemExit, match="2 peers evaluated in round 0, 2 in the partition"):
        diag.read_cell(_cell(tmp_path / "s" / "c", recs, [20, 20]))
    with pytest.raises(SystemExit, match="not of the form pN"):
        diag.readings({0: {"alice": 0.5}}, [20])


def _row(cell: str, final: float) -> diag.Readings:
    return diag.Readings(cell=cell, rounds=100, final_mean=final, over_10=final + 1, pooled=final + 2,
                         best_round=final + 3, best_round_at=9, peers=2, peers_dropped=0)


def test_seed_files_of_one_sweep_pool_into_one_group_and_other_sweeps_do_not() -> None:
    rows = [_row("t1-ring-pi0.1-seed0/dpsgd__seed=0", 80.0), _row("t1-ring-pi0.1-seeds12/dpsgd__seed=1", 82.0),
            _row("t1-ring-pi0.1-seeds12/dpsgd__seed=2", 84.0), _row("t1-ring-pi0.1-authors/dpsgd__seed=0", 90.0),
            _row("t1-ring-pi0.1-authors/dpsgd-authors__seed=0", 70.0)]
    groups = {g.group: g for g in diag.seed_groups(rows)}
    assert list(groups) == ["t1-ring-pi0.1/dpsgd", "t1-ring-pi0.1-authors/dpsgd", "t1-ring-pi0.1-authors/dpsgd-authors"]
    g = groups["t1-ring-pi0.1/dpsgd"]
    assert g.seeds == [0, 1, 2] and math.isclose(g.mean["final_mean"], 82.0) and math.isclose(g.std["final_mean"], 2.0)
    assert math.isclose(g.mean["best_round"], 85.0)
    one = groups["t1-ring-pi0.1-authors/dpsgd"]
    assert one.seeds == [0] and one.std["pooled"] == 0.0  # one seed: no spread, not a NaN
    assert diag.group_row(g) == "82.00 ± 2.00 | 83.00 ± 2.00 | 84.00 ± 2.00 | 85.00 ± 2.00"


def test_a_seed_twice_in_one_group_or_a_nameless_cell_is_refused() -> None:
    with pytest.raises(SystemExit, match="seed listed twice"):
        diag.seed_groups([_row("t1-x-seed0/a__seed=0", 1.0), _row("t1-x/a__seed=0", 2.0)])
    with pytest.raises(SystemExit, match="not of the form SWEEP/CASE__seed=N"):
        diag.seed_groups([_row("t1-x/a", 1.0)])


def test_the_committed_readme_quotes_the_committed_readings() -> None:
    """Every row of the README's two tables is what readings.json holds, and its groups follow from its cells."""
    folder = Path(__file__).parents[1] / "docs/results/diagnostics/metric-readings"
    data = json.loads((folder / "readings.json").read_text())
    cells = [diag.Readings(**c) for c in data["cells"]]
    groups = diag.seed_groups(cells)
    assert [json.loads(json.dumps(diag.asdict(g))) for g in groups] == data["groups"]
    readme = (folder / "README.md").read_text()
    cell_rows = {m[1]: m[0] for m in re.findall(r"^(\| (t1-\S+__seed=\d+) \|.*)$", readme, re.M)}
    assert sorted(cell_rows) == sorted(c.cell for c in cells)
    for c in cells:
        assert cell_rows[c.cell] == diag.cell_row(c)
    quoted = re.findall(r"^\| 0\.\d \| [^|]+ \| `([^`]+)`: ([\d,]+) \| ([^|]+\|[^|]+\|[^|]+\|[^|]+)\|", readme, re.M)
    assert len(quoted) >= 17
    by = {g.group: g for g in groups}
    for name, seeds, row in quoted:
        g = by[name]
        assert seeds == ",".join(map(str, g.seeds)), name
        assert row.strip() == diag.group_row(g), name
