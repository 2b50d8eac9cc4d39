"""Interrupted simulations and sweep cells continue from their last common checkpoint, not round 0."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

import p2pfl.engine.exact as exact
import p2pfl.simulation as sim
from p2pfl.config import ExperimentConfig, load_config
from p2pfl.resume import prepare_resume, resumable
from p2pfl.sweep import load_sweep, run_sweep
from tests.conftest import records_without_times, tiny_config

PEERS = ["p0", "p1", "p2", "p3"]
DEPRL = {"name": "deprl", "tau": 1, "tau_unit": "epochs", "rep_steps": 1, "rep_unit": "epochs", "lr_decay": 1.0}


def _records(run: Path) -> list[tuple[int, str, float | None]]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["round"], r["peer"], r.get("acc")) for r in recs]


def _killed_run(cfg: ExperimentConfig, run: Path, kept_round: int) -> None:
    """A run folder as a kill leaves it: no summary; every peer has checkpointed ``kept_round``
    but only p0 got further (the peers' latest checkpoints hold different rounds)."""
    keep = exact.drop_generations
    exact.drop_generations = lambda run_dir: None  # as if killed right after the last round
    try:
        sim.simulate(cfg, run, progress=False)
    finally:
        exact.drop_generations = keep
    (run / "summary.json").unlink()
    for f in (run / "checkpoints" / "gen").iterdir():
        if int(f.name.removesuffix(".npz").rpartition(".r")[2]) > kept_round and not f.name.startswith("p0."):
            f.unlink()


@pytest.mark.timeout(180)
def test_resumed_run_equals_uninterrupted_run(tmp_path: Path) -> None:
    cfg = load_config(tiny_config(tmp_path, rounds=6, algorithm=DEPRL, checkpoint={"every": 2}))
    full = tmp_path / "full"
    sim.simulate(cfg, full, progress=False)
    assert not (full / "checkpoints" / "gen").exists()  # a finished run keeps only its final checkpoints

    cut = tmp_path / "cut"
    _killed_run(cfg, cut, kept_round=4)
    assert resumable(cut, PEERS)
    summary = sim.simulate(cfg, cut, progress=False, resume=True)
    assert summary["resumed_from_round"] == 4
    assert _records(cut) == _records(full)  # rounds 0-3 kept, 4-5 recomputed bitwise
    for pid in PEERS:
        with np.load(full / "checkpoints" / f"{pid}.npz") as a, np.load(cut / "checkpoints" / f"{pid}.npz") as b:
            assert np.array_equal(a["params"], b["params"])


def test_prepare_resume_without_common_generation_starts_over(tmp_path: Path) -> None:
    gen = tmp_path / "checkpoints" / "gen"
    gen.mkdir(parents=True)
    (gen / "p0.r2.npz").write_bytes(b"x")  # only one peer got there
    assert not resumable(tmp_path, PEERS)
    assert prepare_resume(tmp_path, PEERS) == 0
    assert not gen.exists()


@pytest.mark.timeout(240)
def test_sweep_resumes_interrupted_cell_from_checkpoint(tmp_path: Path) -> None:
    base = tiny_config(tmp_path, rounds=4, algorithm=DEPRL, checkpoint={"every": 2})
    sweep = tmp_path / "s.yaml"
    sweep.write_text(yaml.safe_dump({"name": "s", "base": str(base), "grid": {"seed": [3]}}))
    spec = load_sweep(sweep)
    out = tmp_path / "out"
    run_sweep(spec, out, progress=False)
    cell = out / "seed=3"
    done = _records(cell)

    _killed_run(load_config(cell / "config.yaml"), cell, kept_round=2)
    (cell / "marker").write_text("kept")  # a resumed cell is continued, not deleted and recreated
    res = run_sweep(spec, out, progress=False)
    assert [c.status for c in res.cells] == ["done"]
    assert (cell / "marker").exists()
    assert "--resume" in (cell / "log.txt").read_text()
    assert json.loads((cell / "summary.json").read_text())["resumed_from_round"] == 2
    assert _records(cell) == done


@pytest.mark.timeout(240)
def test_background_sweep_stops_on_sigterm_and_leaves_a_resumable_cell(tmp_path: Path) -> None:
    """A sweep started in the background (SIGINT ignored, as `cmd &` does) stops its cell on SIGTERM."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from p2pfl.sweep import can_resume, load_sweep, plan_cells

    base = tiny_config(tmp_path, rounds=2000, algorithm=DEPRL, checkpoint={"every": 2})
    sweep = tmp_path / "s.yaml"
    sweep.write_text(yaml.safe_dump({"name": "s", "base": str(base)}))
    out = tmp_path / "out"

    def cell_pids() -> list[int]:
        found = subprocess.run(["pgrep", "-f", "--", f"simulate --config {out / 'base'}"], capture_output=True,
                               text=True).stdout.split()
        return [int(p) for p in found]

    log = (tmp_path / "sweep.log").open("wb")
    # started as `cmd &` starts it: SIGINT ignored (a shell's trap, not preexec_fn: forking this process,
    # whose gRPC runtime may be running, can abort the child; see p2pfl.sweep.spawn_cell)
    command = [sys.executable, "-m", "p2pfl.cli", "sweep", str(sweep), "--out", str(out), "--quiet"]
    proc = subprocess.Popen(["sh", "-c", "trap '' INT; exec \"$@\"", "sh", *command],
                            stdout=log, stderr=subprocess.STDOUT)

    def said() -> str:
        cell_log = out / "base" / "log.txt"
        return ((tmp_path / "sweep.log").read_text(errors="replace")[-3000:]
                + (cell_log.read_text(errors="replace")[-3000:] if cell_log.exists() else ""))

    try:
        gen = out / "base" / "checkpoints" / "gen"
        deadline = time.monotonic() + 180
        while not (gen.is_dir() and len(list(gen.glob("p3.r*.npz"))) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, (proc.poll(), said())
            time.sleep(0.2)
        running = cell_pids()
        assert running  # the cell and its two worker processes
        (cell_pid,) = [pid for pid in running if _parent(pid) == proc.pid]
        assert not _ignores_sigint(cell_pid)  # the sweep ignored it at start; its cell must not
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
        time.sleep(0.5)
        assert not [pid for pid in running if pid in cell_pids()]  # all of them stopped
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in cell_pids():
            os.kill(pid, signal.SIGKILL)
        log.close()
    assert not (out / "base" / "summary.json").exists()
    cell = plan_cells(load_sweep(sweep))[0]
    assert can_resume(out / "base", cell.config)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _ignores_sigint(pid: int) -> bool:
    mask = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigIgn:"))
    return bool(int(mask.split()[1], 16) >> (2 - 1) & 1)  # bit n-1 is signal n; SIGINT is 2


def test_keep_generation_keeps_the_last_three_of_each_peer_including_a_resumed_runs(tmp_path: Path) -> None:
    """The hook lists the folder once (a resumed run's generations count), then prunes from memory."""
    from types import SimpleNamespace

    from p2pfl.resume import GENERATIONS, keep_generation

    ckpt_dir = tmp_path / "checkpoints"
    gen = ckpt_dir / "gen"
    gen.mkdir(parents=True)
    for peer in ("a", "b"):
        (ckpt_dir / f"{peer}.npz").write_bytes(peer.encode())
    (gen / "a.r2.npz").write_bytes(b"old")  # left by an earlier (interrupted) run
    (gen / "b.r2.npz").write_bytes(b"other peer")
    calls: list[int] = []
    node = SimpleNamespace(checkpoint_path=ckpt_dir / "a.npz", peer_id="a", rounds=9, on_round=calls.append)
    hook = keep_generation(node, every=2)
    assert hook is not None
    for r in range(2, 9):
        hook(r)
    assert calls == list(range(2, 9))  # the node's own hook still runs, after
    kept = sorted(f.name for f in gen.iterdir())
    # rounds done 4, 6, 8 and 9 (the last) were linked; the 3 newest of peer a stay; b is untouched
    assert GENERATIONS == 3
    assert kept == ["a.r6.npz", "a.r8.npz", "a.r9.npz", "b.r2.npz"]


@pytest.mark.timeout(240)
def test_a_batched_run_killed_with_sigkill_resumes_where_every_peer_checkpointed(tmp_path: Path) -> None:
    """A real kill -9 of a batched ``p2pfl simulate`` mid-run; ``--resume`` continues from the last
    generation every peer has and ends with exactly the records (times aside) and final checkpoints
    of a run that was never stopped."""
    import signal
    import subprocess
    import sys
    import time

    cfg_path = tiny_config(tmp_path, rounds=40, algorithm=DEPRL, checkpoint={"every": 2},
                           simulation={"workers": 1, "engine": "batched"})
    full, cut = tmp_path / "full", tmp_path / "cut"

    def cli(out: Path, *more: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "p2pfl.cli", "simulate", "--config", str(cfg_path),
                                 "--out", str(out), "--quiet", *more],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    proc = cli(cut)
    try:
        gen = cut / "checkpoints" / "gen"
        deadline = time.monotonic() + 120
        while not (gen.is_dir() and len(list(gen.glob("p3.r*.npz"))) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not (cut / "summary.json").exists() and resumable(cut, PEERS)
    for run, more in ((cut, ("--resume",)), (full, ())):
        done = cli(run, *more)
        _, err = done.communicate(timeout=150)
        assert done.returncode == 0, err.decode(errors="replace")[-2000:]
    resumed_from = json.loads((cut / "summary.json").read_text())["resumed_from_round"]
    assert 0 < resumed_from < 40 and resumed_from % 2 == 0

    assert records_without_times(cut) == records_without_times(full)  # each peer-round once, the resumed rounds bitwise
    for pid in PEERS:
        with np.load(full / "checkpoints" / f"{pid}.npz") as a, np.load(cut / "checkpoints" / f"{pid}.npz") as b:
            assert all(np.array_equal(a[k], b[k]) for k in a.files)


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


@pytest.mark.timeout(120)
def test_resume_of_a_finished_run_at_its_rounds_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """``--resume`` on a finished run used to start it over from round 0, rewriting its folder."""
    from p2pfl.resume import ResumeError

    cfg_path = tiny_config(tmp_path, rounds=2, algorithm=DEPRL, checkpoint={"every": 2})
    run = tmp_path / "run"
    sim.simulate(load_config(cfg_path), run, progress=False)
    before = _tree(run)
    with pytest.raises(ResumeError, match="finished its 2 rounds; nothing to resume; set rounds above 2"):
        sim.simulate(load_config(cfg_path), run, progress=False, resume=True)
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "p2pfl.cli", "simulate", "--config", str(cfg_path), "--out", str(run),
                          "--resume", "--quiet"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("error: --resume: ") and "set rounds above 2 to extend it" in res.stderr
    assert _tree(run) == before
    (run / "checkpoints" / "p1.npz").unlink()  # no final checkpoint of every peer: nothing to extend from either
    before = _tree(run)
    with pytest.raises(ResumeError, match="without final checkpoints of every peer"):
        sim.simulate(load_config(tiny_config(tmp_path, rounds=4, algorithm=DEPRL)), run, progress=False, resume=True)
    assert _tree(run) == before


@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine", ["exact", "batched"])
def test_a_finished_run_extended_to_more_rounds_equals_the_longer_run(tmp_path: Path, engine: str) -> None:
    """No algorithm is told the number of rounds, so 4 rounds extended to 6 from the final checkpoints
    are the 6-round run: the same records and final checkpoints (RNG included)."""
    extra = {"algorithm": DEPRL, "checkpoint": {"every": 2}, "simulation": {"workers": 1, "engine": engine}}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    longer = tmp_path / "longer"
    sim.simulate(load_config(tiny_config(tmp_path / "a", rounds=6, **extra)), longer, progress=False)
    run = tmp_path / "run"
    sim.simulate(load_config(tiny_config(tmp_path / "b", rounds=4, **extra)), run, progress=False)
    summary = sim.simulate(load_config(tiny_config(tmp_path / "b", rounds=6, **extra)), run, progress=False,
                           resume=True)
    assert (summary["resumed_from_round"], summary["rounds"]) == (4, 6)
    assert yaml.safe_load((run / "config.yaml").read_text())["rounds"] == 6
    assert _records(run) == _records(longer)
    for pid in PEERS:
        with np.load(longer / "checkpoints" / f"{pid}.npz") as a, np.load(run / "checkpoints" / f"{pid}.npz") as b:
            assert all(np.array_equal(a[k], b[k]) for k in a.files if k != "meta"), pid


@pytest.mark.timeout(240)
def test_a_sweep_with_more_rounds_extends_its_finished_cells(tmp_path: Path) -> None:
    base = tiny_config(tmp_path, rounds=2, algorithm=DEPRL, checkpoint={"every": 2})
    sweep = tmp_path / "s.yaml"
    sweep.write_text(yaml.safe_dump({"name": "s", "base": str(base), "grid": {"seed": [3]}}))
    out = tmp_path / "out"
    run_sweep(load_sweep(sweep), out, progress=False)
    cell = out / "seed=3"
    (cell / "marker").write_text("kept")
    sweep.write_text(yaml.safe_dump({"name": "s", "base": str(base), "set": ["rounds=4"], "grid": {"seed": [3]}}))
    res = run_sweep(load_sweep(sweep), out, progress=False)
    assert [(c.found, c.status) for c in res.cells] == [("extendable", "done")]
    assert (cell / "marker").exists() and "--resume" in (cell / "log.txt").read_text()
    summary = json.loads((cell / "summary.json").read_text())
    assert (summary["resumed_from_round"], summary["rounds"]) == (2, 4)
    assert sorted({r for r, _, _ in _records(cell)}) == [0, 1, 2, 3]  # every round once per peer
    assert len(_records(cell)) == 4 * len(PEERS)
    # a finished cell with another change than more rounds is still rerun from scratch
    sweep.write_text(yaml.safe_dump({"name": "s", "base": str(base), "set": ["rounds=3"], "grid": {"seed": [3]}}))
    res = run_sweep(load_sweep(sweep), out, progress=False)
    assert [(c.found, c.status) for c in res.cells] == [("stale", "done")] and not (cell / "marker").exists()
