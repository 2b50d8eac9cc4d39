"""bench/reproduce/diag_body_collapse.py: the prior-only score a collapsed body leaves each peer's head."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location(
    "diag_body_collapse", Path(__file__).parents[1] / "bench/reproduce/diag_body_collapse.py")
assert _spec is not None and _spec.loader is not None
diag = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(diag)


def test_the_prior_only_score_is_the_share_of_the_training_majority_in_the_own_test_split() -> None:
    train_y = np.array([0, 0, 1, 2, 2, 2, 1])
    test_y = np.array([0, 1, 2, 2, 0, 1, 1, 2])
    partition = {"train": [[0, 1, 2], [3, 4, 5, 6]], "test": [[0, 1, 4, 5], [2, 3, 6, 7]]}
    # peer 0 trains mostly on class 0: 2 of its 4 test samples are 0; peer 1 on class 2: 3 of 4
    assert diag.prior_only_scores(partition, train_y, test_y, 3) == [(0.5, 0.125), (0.75, 0.125)]


def test_the_final_accuracies_are_the_last_evaluated_round_of_every_peer(tmp_path: Path) -> None:
    recs = [{"peer": "p0", "round": 4, "acc": 0.2}, {"peer": "p1", "round": 4, "acc": 0.3},
            {"peer": "p0", "round": 9, "acc": 0.5}, {"peer": "p1", "round": 9, "acc": 0.6},
            {"peer": "p0", "round": 10, "train_loss": 1.0}]  # a round without evaluation does not count
    with gzip.open(tmp_path / "metrics.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    assert diag.final_accuracies(tmp_path) == (9, {"p0": 0.5, "p1": 0.6})
    (tmp_path / "metrics.jsonl.gz").unlink()
    with pytest.raises(SystemExit, match="neither metrics.jsonl nor metrics.jsonl.gz"):
        diag.final_accuracies(tmp_path)
