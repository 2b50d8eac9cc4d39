"""One run-folder lifecycle (p2pfl/runfolder.py) shared by every driver."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from p2pfl.config import load_config
from p2pfl.runfolder import RunFolder
from p2pfl.topology import load_topology
from tests.conftest import tiny_config


def test_run_folder_lifecycle(tmp_path: Path) -> None:
    cfg = load_config(tiny_config(tmp_path, rounds=2))
    topo = load_topology(cfg.topology)
    run = RunFolder.start(tmp_path / "run", cfg, topo, None, "simulate")
    assert {p.name for p in (tmp_path / "run").iterdir()} == {"config.yaml", "topology.yaml", "metrics.jsonl"}
    run.show_progress(8)
    for r in (1, 0):  # out of order, as peers finish
        for pid in reversed(topo.ids):
            run.record({"round": r, "peer": pid, "acc": 0.5 + 0.1 * r, "bytes_sent": 10})
    summary = run.finish(list(topo.ids), {"workers": 3})
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(x["round"], x["peer"]) for x in recs] == [(r, p) for r in (0, 1) for p in topo.ids]  # sorted
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved == summary
    assert summary["mode"] == "simulate" and summary["name"] == "tiny" and summary["workers"] == 3
    assert summary["rounds"] == 2 and summary["final_acc_mean"] == pytest.approx(0.6)
    assert summary["wall_seconds"] >= 0 and summary["wall_seconds_per_round"] is not None
    assert (tmp_path / "run" / "accuracy.png").stat().st_size > 1000
    run.close()  # idempotent


def test_resumed_run_appends(tmp_path: Path) -> None:
    cfg = load_config(tiny_config(tmp_path, rounds=2))
    topo = load_topology(cfg.topology)
    first = RunFolder.start(tmp_path / "run", cfg, topo, None, "simulate")
    first.record({"round": 0, "peer": "p0", "acc": 0.5})
    first.close()
    again = RunFolder.start(tmp_path / "run", cfg, topo, None, "simulate", append=True)
    again.record({"round": 1, "peer": "p0", "acc": 0.7})
    summary = again.finish(["p0"], rounds_run=1)
    assert summary["acc_mean_per_round"] == {"0": 0.5, "1": 0.7}


def test_drivers_share_the_run_folder() -> None:
    """No driver writes a summary, draws a plot or builds a progress bar of its own."""
    root = Path(__file__).resolve().parents[1] / "p2pfl"
    own = re.compile(r"\b(write_summary|plot_accuracy|write_inputs|summarize)\(|\bProgress\(")
    offenders = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel in ("runfolder.py", "sweep.py"):  # sweep's bar counts cells, not peer-rounds
            continue
        offenders += [f"{rel}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1)
                      if own.search(line) and not line.lstrip().startswith(("def ", "#"))]
    assert offenders == []
