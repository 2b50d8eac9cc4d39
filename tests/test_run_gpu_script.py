"""``bench/reproduce/run_gpu.sh``, the script a lent GPU runs: dry-run here on the CPU (``DEV=cpu``).

A mistake in it costs a lease (15 minutes of device time, no second try), so this runs it for real on a
copy of the repository: one cell selected with ``SWEEP:GLOB`` (``p2pfl sweep --only``), 1 round on an
8-peer ring, and checks what comes back: the generated sweep's four keys, only the selected cell run,
the evidence archive (this run's cells only) and the progress line.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _copy_tree(dest: Path) -> None:
    """The tracked files (less the committed evidence, which the script never reads), as a lease gets them."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        if rel.startswith("docs/results/runs/") or not (ROOT / rel).is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git checkout")
@pytest.mark.timeout(300)
def test_run_gpu_runs_only_the_selected_cell_and_returns_its_evidence(tmp_path: Path) -> None:
    tree, out = tmp_path / "tree", tmp_path / "out"
    _copy_tree(tree)
    env = {**os.environ, "PY": sys.executable, "OUT": str(out), "DEV": "cpu", "NOWHEELS": "1", "JOBS": "1",
           "DEADLINE": "240", "SET": f"rounds=1 topology={tree / 'topology/ring-8.yaml'}"}
    proc = subprocess.run(["bash", "bench/reproduce/run_gpu.sh", "random-pi0.1-seeds12:dpsgd__seed=1,nope*"],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=280)
    # a glob that matches no cell is refused as a whole, before anything runs (p2pfl sweep exits 2)
    assert "sweep 1 rc 2" in proc.stdout, proc.stdout + proc.stderr
    assert "matches none of the sweep's 6 cells" in (out / "t1-random-pi0.1-seeds12-gpu.log").read_text()

    shutil.rmtree(out)
    # a finished cell an earlier lease left on the machine (runs/ stays while it is warm): not this run's
    stale = tree / "runs/reproduce/t1-random-pi0.5-seed0-gpu/deprl-steps__seed=0"
    shutil.copytree(ROOT / "docs/results/runs" / stale.relative_to(tree / "runs/reproduce"), stale)
    with gzip.open(stale / "metrics.jsonl.gz", "rb") as f:
        (stale / "metrics.jsonl").write_bytes(f.read())
    proc = subprocess.run(["bash", "bench/reproduce/run_gpu.sh", "random-pi0.1-seeds12:dpsgd__seed=1"],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=280)
    assert "sweep 1 rc 0" in proc.stdout, proc.stdout + proc.stderr
    folder = tree / "runs/reproduce/t1-random-pi0.1-seeds12-gpu"
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == ["dpsgd__seed=1"]
    cfg = yaml.safe_load((folder / "dpsgd__seed=1" / "config.yaml").read_text())
    assert cfg["device"] == "cpu" and cfg["tf32"] is False and cfg["simulation"]["engine"] == "batched"
    assert cfg["algorithm"]["name"] == "dpsgd" and cfg["seed"] == 1 and cfg["rounds"] == 1
    status = {c["name"]: c["status"] for c in json.loads((folder / "sweep.json").read_text())["cells"]}
    assert status["dpsgd__seed=1"] == "done" and sum(s == "unselected" for s in status.values()) == 5
    assert "t1-random-pi0.1-seeds12-gpu/dpsgd__seed=1: finished at round 1" in (out / "progress.txt").read_text()
    with tarfile.open(out / "gpu-evidence.tar.gz") as tar:
        names = {n.removeprefix("./") for n in tar.getnames()}
    assert {"t1-random-pi0.1-seeds12-gpu/dpsgd__seed=1/summary.json",
            "t1-random-pi0.1-seeds12-gpu/dpsgd__seed=1/config.yaml"} <= names
    assert not any("checkpoints" in n for n in names)
    assert not any(n.startswith("t1-random-pi0.5") for n in names)  # the stale cell stayed behind
    assert "collected t1-random-pi0.1-seeds12-gpu/dpsgd__seed=1" in proc.stdout
    assert "collected t1-random-pi0.5" not in proc.stdout
    assert not (out / "gpu-partial.tar.gz").exists()  # nothing was cut off
