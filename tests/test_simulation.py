"""The single-host simulation: run folder, metrics schema, determinism, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from p2pfl.cli import _mount, app
from p2pfl.config import load_config
from p2pfl.simulation import simulate
from tests.conftest import tiny_config

FIELDS = {"round", "peer", "acc", "loss", "bytes_sent", "bytes_recv", "consensus_dist", "seconds"}


def _accs(run: Path) -> list[tuple[int, str, float]]:
    return [(r["round"], r["peer"], r["acc"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.timeout(120)
def test_simulation_writes_run_folder_and_is_deterministic(tmp_path: Path) -> None:
    cfg = load_config(tiny_config(tmp_path))
    s1 = simulate(cfg, tmp_path / "a", progress=False)
    s2 = simulate(cfg, tmp_path / "b", progress=False)
    run = tmp_path / "a"
    for name in ("config.yaml", "topology.yaml", "partition.json", "metrics.jsonl", "summary.json", "accuracy.png"):
        assert (run / name).exists(), name
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 4 * 3 and all(FIELDS <= set(r) for r in recs)
    assert all(r["bytes_sent"] > 0 and r["bytes_recv"] > 0 for r in recs)
    assert _accs(run) == _accs(tmp_path / "b")  # same seed, same accuracies
    assert s1["final_acc_mean"] == s2["final_acc_mean"] and s1["rounds"] == 3
    assert sorted((run / "checkpoints").iterdir())[0].name == "p0.npz"


@pytest.mark.timeout(120)
def test_worker_count_does_not_change_results(tmp_path: Path) -> None:
    """One process (threads) and two worker processes (bridged board) give bitwise equal runs."""
    import numpy as np

    cfg1 = load_config(tiny_config(tmp_path), ["simulation.workers=1"])
    cfg2 = load_config(tiny_config(tmp_path), ["simulation.workers=2"])
    simulate(cfg1, tmp_path / "w1", progress=False)
    simulate(cfg2, tmp_path / "w2", progress=False)
    assert _accs(tmp_path / "w1") == _accs(tmp_path / "w2")
    for pid in ("p0", "p1", "p2", "p3"):
        with np.load(tmp_path / "w1" / "checkpoints" / f"{pid}.npz") as a, \
                np.load(tmp_path / "w2" / "checkpoints" / f"{pid}.npz") as b:
            assert np.array_equal(a["params"], b["params"])


@pytest.mark.timeout(120)
def test_local_sends_nothing_and_cli_overrides(tmp_path: Path) -> None:
    path = tiny_config(tmp_path)
    _mount()
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["simulate", "--config", str(path), "--set", "algorithm.name=local",
                                   "--set", "rounds=2", "--out", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["round"] for r in recs} == {0, 1}
    assert all(r["bytes_sent"] == 0 and r["bytes_recv"] == 0 for r in recs)
    assert "personalized accuracy" in res.output


def test_cli_refuses_bad_config(tmp_path: Path) -> None:
    path = tiny_config(tmp_path)
    _mount()
    res = CliRunner().invoke(app, ["simulate", "--config", str(path), "--set", "rounds=0"])
    assert res.exit_code == 2 and "rounds: must be >= 1" in res.output  # 2: bad input, one line
