"""bench/reproduce/diag_metric_readings.py: one cell's accuracy under each reading the authors' code leaves open."""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
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
