"""Resuming a parameter-server baseline on Flower (``run_baseline(resume=True)``, ``p2pfl flower --resume``).

An interrupted run continues from the last round that the server and every node checkpointed and
records exactly what an uninterrupted run records: the same accuracies and losses, bitwise, round
by round. Faults: a node's handler that fails mid-run (in-process runtime), and a ``p2pfl flower``
process killed with SIGKILL (the CLI, as a sweep runs it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from p2pfl.centralized.baselines import SERVER, run_baseline
from p2pfl.config import load_config
from p2pfl.resume import _generations
from p2pfl.sweep import simulate_command
from tests.conftest import tiny_config

#: (baseline, local rule): a personal head kept by the node (FedRep), a personal model (Ditto), a
#: personal head added to the global one (FedRoD), the whole model averaged (FedAvg)
CASES = [
    ("fedrep", {"name": "deprl", "tau": 2, "rep_steps": 2}),
    ("ditto", {"name": "ditto"}),
    ("fedrod", {"name": "fedrod"}),
    ("fedavg", {"name": "dfedavg", "lr": 0.1, "local_epochs": 1}),
]
KEYS = ("round", "peer", "acc", "loss", "train_loss", "bytes_sent", "bytes_recv")


def _records(run: Path) -> list[dict[str, Any]]:
    return [{k: r[k] for k in KEYS} for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("baseline", "algorithm"), CASES, ids=[c[0] for c in CASES])
def test_a_run_that_failed_mid_way_resumes_to_the_uninterrupted_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                         baseline: str, algorithm: dict) -> None:
    cfg = load_config(tiny_config(tmp_path, rounds=5, algorithm=algorithm, checkpoint={"every": 2}))
    whole = run_baseline(cfg, tmp_path / "whole", baseline, runtime="in-process")
    assert whole["resumed_from_round"] == 0

    from p2pfl.centralized import baselines

    real = baselines.BaselinePeers.train

    def fails_in_round_4(self: Any, msg: Any, context: Any) -> Any:  # a node crashes mid-run
        if int(baselines.number(baselines.record_of(msg.content, "config", baselines.ConfigRecord),
                                "server-round")) == 4:
            raise RuntimeError("injected: the node died in round 4")
        return real(self, msg, context)

    monkeypatch.setattr(baselines.BaselinePeers, "train", fails_in_round_4)
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected"):
        run_baseline(cfg, run, baseline, runtime="in-process")
    gens = sorted(p.name for p in (run / "checkpoints" / "gen").iterdir())
    assert f"{SERVER}.r2.npz" in gens and "p0.r2.npz" in gens and not any(".r4." in g for g in gens)
    assert len(_records(run)) == 3 * 4  # rounds 0-2 were recorded before the failure
    monkeypatch.setattr(baselines.BaselinePeers, "train", real)

    resumed = run_baseline(cfg, run, baseline, runtime="in-process", resume=True)
    assert resumed["resumed_from_round"] == 2
    assert _records(run) == _records(tmp_path / "whole")  # round 2 recorded again, once; all bitwise equal
    assert resumed["final_acc_mean"] == whole["final_acc_mean"]
    assert not (run / "checkpoints").exists()  # a finished run keeps no checkpoint (none is a final model)


@pytest.mark.timeout(180)
def test_a_killed_flower_process_resumes_from_its_last_checkpoint(tmp_path: Path) -> None:
    """SIGKILL to ``p2pfl flower`` mid-run, then ``--resume`` (the command a sweep runs): same records."""
    rounds = 40
    path = tiny_config(tmp_path, rounds=rounds, algorithm=CASES[0][1], checkpoint={"every": 1})
    whole = tmp_path / "whole"
    run_baseline(load_config(path), whole, "fedrep", runtime="in-process")

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "p2pfl.cli", "flower", "--config", str(path), "--out", str(run),
           "--baseline", "fedrep", "--runtime", "in-process", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        # round 3 or later: a generation lives for a few rounds only (older ones are pruned), and a
        # starved poller could miss round 3's alone
        gens = run / "checkpoints" / "gen"
        while not any(r >= 3 and SERVER in peers for r, peers in _generations(gens).items()):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before round 3"
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert not (run / "summary.json").exists(), "killed after the run finished: nothing was interrupted"

    done = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert 3 <= summary["resumed_from_round"] < rounds
    assert _records(run) == _records(whole)


def test_a_sweep_resumes_a_flower_cell_with_the_flag() -> None:
    cmd = simulate_command(Path("cell"), resume=True, flower="fedrep")
    assert cmd[3] == "flower" and cmd[-1] == "--resume"
    assert "--resume" not in simulate_command(Path("cell"), resume=False, flower="fedrep")
