"""One run-folder lifecycle (p2pfl/runfolder.py) shared by every driver."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from p2pfl.config import load_config
from p2pfl.runfolder import RunFolder, keep_rounds, peer_metrics_path
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
    own = re.compile(r"\b(write_summary|plot_accuracy|write_inputs|summarize|MetricsWriter)\(|\bProgress\(")
    offenders = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel in ("runfolder.py", "display.py"):  # display.py: the one progress-bar factory (sweep's counts cells)
            continue
        offenders += [f"{rel}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1)
                      if own.search(line) and not line.lstrip().startswith(("def ", "#"))]
    assert offenders == []


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_node_writes_its_part_of_a_shared_run_folder(tmp_path: Path) -> None:
    """`p2pfl node` goes through the same lifecycle: the inputs once for the whole deployment, its own
    metrics-<peer>.jsonl with the wall clock, repaired against its checkpoint on a restart; launch
    then merges the peers' files and finishes the folder like every other driver."""
    cfg = load_config(tiny_config(tmp_path, rounds=6))
    topo = load_topology(cfg.topology)
    run_dir = tmp_path / "run"
    p0 = RunFolder.for_peer(run_dir, cfg, topo, None, "p0")
    assert {p.name for p in run_dir.iterdir()} == {"config.yaml", "topology.yaml", "metrics-p0.jsonl"}
    written = p0.record({"round": 0, "peer": "p0", "acc": 0.5, "bytes_sent": 10, "bytes_recv": 10})
    assert written["time"] > 0 and _lines(peer_metrics_path(run_dir, "p0")) == [written]
    (run_dir / "config.yaml").write_text("first: peer\n")  # a second peer leaves the inputs alone
    p1 = RunFolder.for_peer(run_dir, cfg, topo, None, "p1")
    assert (run_dir / "config.yaml").read_text() == "first: peer\n"
    p1.record({"round": 0, "peer": "p1", "acc": 0.7})
    p0.close()
    p1.close()

    # p0 killed after checkpointing round 4 (resumes at 5) but before that round's metrics line,
    # with a duplicate and a torn line left behind: exactly rounds 0..4 once each, then appended
    path = peer_metrics_path(run_dir, "p0")
    path.write_text("".join(json.dumps({"round": r, "peer": "p0"}) + "\n" for r in (0, 1, 1, 2, 3))
                    + '{"round": 4, "pe')
    again = RunFolder.for_peer(run_dir, cfg, topo, None, "p0", resume_at=5,
                               checkpoint_record={"round": 4, "peer": "p0", "acc": 0.9})
    again.record({"round": 5, "peer": "p0", "acc": 0.95})
    again.close()
    assert [r["round"] for r in _lines(path)] == [0, 1, 2, 3, 4, 5] and _lines(path)[4]["acc"] == 0.9

    launch = RunFolder.start(run_dir, cfg, topo, None, "launch")
    launch.merge_peer_files(["p0", "p1"])
    summary = launch.finish(["p0", "p1"])
    assert [(r["round"], r["peer"]) for r in _lines(run_dir / "metrics.jsonl")] == \
        [(0, "p0"), (0, "p1"), (1, "p0"), (2, "p0"), (3, "p0"), (4, "p0"), (5, "p0")]
    assert summary["mode"] == "launch" and summary["peers"] == 2


def test_keep_rounds_keeps_every_peer_of_a_shared_file(tmp_path: Path) -> None:
    """The same repair serves a simulation's metrics.jsonl (all peers) when it resumes."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"round": r, "peer": p}) + "\n" for r in (0, 1, 2) for p in ("p0", "p1"))
                    + json.dumps({"round": 1, "peer": "p1"}) + "\n")
    assert keep_rounds(path, 2) == 4
    assert [(r["round"], r["peer"]) for r in _lines(path)] == [(0, "p0"), (0, "p1"), (1, "p0"), (1, "p1")]
