"""``bench/reproduce/table1/run.sh``: how it seeds a claim's ``-long<N>`` folder before running it.

A ``claims/<stem>-long<N>`` sweep starts from the final checkpoints of the longest shorter one run here
(``<stem>-long<M>`` with M < N, else ``<stem>-long``): a copy of that folder makes its finished cells
``extendable``, so only the added rounds run (``p2pfl sweep`` and its resume tests cover that part). This
checks the script's own part, in bash: which folder it copies, what it leaves out, and that it never copies
over a folder that exists. ``PY`` is a recorder, so no cell runs: the script's Python calls are only logged.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
needs_git = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git checkout")


def _folder(out: Path, name: str, mark: str, cell: bool = False) -> Path:
    d = out / name
    d.mkdir(parents=True)
    (d / "mark").write_text(mark)
    (d / "sweep.json").write_text("{}")
    if cell:
        (d / "dfedadmm__seed=0" / "checkpoints").mkdir(parents=True)
        (d / "dfedadmm__seed=0" / "checkpoints" / "peer-0.safetensors").write_text(mark)
    return d


def _recorder(tmp_path: Path, out: Path) -> Path:
    """A stand-in for ``PY`` that only logs its arguments to ``out/py-calls.log``."""
    recorder = tmp_path / "py"
    recorder.write_text(f'#!/bin/sh\necho "$*" >> "{out}/py-calls.log"\n')
    recorder.chmod(recorder.stat().st_mode | stat.S_IXUSR)
    return recorder


def _run(out: Path, recorder: Path, *sweeps: str) -> list[str]:
    env = {**os.environ, "PY": str(recorder), "OUT": str(out), "COMMIT": "HEAD"}
    proc = subprocess.run(["bash", "bench/reproduce/table1/run.sh", *sweeps], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return (out / "py-calls.log").read_text().splitlines()


@needs_git
@pytest.mark.timeout(180)
def test_a_long_claim_is_seeded_from_the_longest_shorter_folder_and_only_once(tmp_path: Path) -> None:
    out = tmp_path / "reproduce"
    recorder = _recorder(tmp_path, out)
    _folder(out, "claims-dfedadmm-long", "100")
    _folder(out, "claims-dfedadmm-long200", "200", cell=True)
    _folder(out, "claims-dfedadmm-long250-gpu", "gpu")  # a GPU twin is not a source
    _folder(out, "claims-dfedadmm-long280.tmp", "tmp")  # nor an unfinished copy
    _folder(out, "claims-dfedadmm-long400", "400")  # nor a longer file's folder

    calls = _run(out, recorder, "claims/dfedadmm-long300")
    seeded = out / "claims-dfedadmm-long300"
    assert (seeded / "mark").read_text() == "200"
    assert (seeded / "dfedadmm__seed=0/checkpoints/peer-0.safetensors").read_text() == "200"
    assert not (seeded / "sweep.json").exists()  # the sweep writes its own plan
    assert not (out / "claims-dfedadmm-long300.tmp").exists()
    assert "claims-dfedadmm-long300: seeded from claims-dfedadmm-long200's final checkpoints" in (
        out / "table1-progress.log").read_text()
    assert calls[-1] == (f"-m p2pfl.cli sweep bench/reproduce/claims/dfedadmm-long300.yaml --out {seeded} --quiet")

    # a folder that exists (a run under way, or finished) is never copied over
    (seeded / "mark").write_text("mine")
    _run(out, recorder, "claims/dfedadmm-long300")
    assert (seeded / "mark").read_text() == "mine"
    # with no numbered shorter folder, the source is the plain -long one; a claim without -long<N> is not seeded
    shutil.rmtree(out / "claims-dfedadmm-long200")
    shutil.rmtree(seeded)
    _run(out, recorder, "claims/dfedadmm-long300", "claims/dfedadmm")
    assert (seeded / "mark").read_text() == "100"
    assert not (out / "claims-dfedadmm").exists()


@needs_git
@pytest.mark.timeout(180)
def test_a_sweep_file_missing_from_the_snapshot_is_named_and_nothing_is_seeded_or_run(tmp_path: Path) -> None:
    # The snapshot's commit predates the file (a name no commit has stands in for it): the progress log names
    # the file and the snapshot, the shorter folder is not copied, and no sweep starts; the next sweep still runs.
    out = tmp_path / "reproduce"
    recorder = _recorder(tmp_path, out)
    _folder(out, "claims-nosuchclaim-long", "100")
    calls = _run(out, recorder, "claims/nosuchclaim-long200", "claims/dfedadmm")
    progress = (out / "table1-progress.log").read_text()
    assert "claims-nosuchclaim-long200: bench/reproduce/claims/nosuchclaim-long200.yaml is not in the code snapshot" in progress
    assert not (out / "claims-nosuchclaim-long200").exists()
    assert not any("nosuchclaim" in c for c in calls)
    assert calls[-1].startswith("-m p2pfl.cli sweep bench/reproduce/claims/dfedadmm.yaml ")
