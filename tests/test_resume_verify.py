"""A resume verifies its checkpoint before it writes anything (issue 68, part 4).

Each bad checkpoint given to a real ``p2pfl node`` process (another peer's, truncated, bit-flipped,
empty, written under another ``lr`` or model width) is one line ``error: FILE: problem``, exit 2,
and the run folder is byte-identical afterwards; a deliberate config change is accepted with
``--accept-config-change`` and recorded in ``config-changes.jsonl``, for ``simulate --resume`` too.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import yaml

from p2pfl.checkpoint import CheckpointError, load_checkpoint, verify_checkpoint
from p2pfl.config import load_config
from p2pfl.simulation import simulate
from tests.conftest import tiny_config
from tests.swarm import free_base_port


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> SHA-256 of its bytes)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _node(cfg: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "p2pfl.cli", "node", "--config", str(cfg), "--peer", "p0",
                           "--out", str(out), "--insecure", *extra], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A finished 2-round run folder (config, topology, checkpoints of every peer) and its config."""
    tmp = tmp_path_factory.mktemp("resume-verify")
    cfg = tiny_config(tmp, rounds=2, base_port=free_base_port())
    simulate(load_config(cfg), tmp / "run", progress=False)
    return cfg, tmp / "run"


def _copy(finished: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    cfg, run = finished
    shutil.copytree(run, tmp_path / "run")
    return cfg, tmp_path / "run"


def _other_peers(ck: Path) -> None:
    shutil.copy(ck.with_name("p1.npz"), ck)


def _truncated(ck: Path) -> None:
    data = ck.read_bytes()
    ck.write_bytes(data[: len(data) // 2])


def _bit_flipped(ck: Path) -> None:
    data = bytearray(ck.read_bytes())
    data[len(data) // 3] ^= 0x10
    ck.write_bytes(bytes(data))


def _empty(ck: Path) -> None:
    ck.write_bytes(b"")


CASES: list[tuple[str, Callable[[Path], None], list[str], str]] = [
    ("other-peer", _other_peers, [], "is the checkpoint of peer 'p1', not of 'p0'"),
    ("truncated", _truncated, [], "is not a readable checkpoint (truncated or corrupted"),
    ("bit-flipped", _bit_flipped, [], "is not a readable checkpoint (truncated or corrupted"),
    ("empty", _empty, [], "is empty (0 bytes)"),
    ("changed-lr", lambda ck: None, ["--set", "algorithm.lr=0.05"], "under another config (changed: algorithm.lr)"),
    ("changed-width", lambda ck: None, ["--set", "model.hidden=16"], "the model's parameters have shape (3268,)"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "damage", "extra", "needle"), CASES, ids=[c[0] for c in CASES])
def test_a_bad_checkpoint_is_one_line_exit_2_and_the_folder_is_untouched(
        finished: tuple[Path, Path], tmp_path: Path, name: str, damage: Callable[[Path], None], extra: list[str],
        needle: str) -> None:
    cfg, run = _copy(finished, tmp_path)
    ck = run / "checkpoints" / "p0.npz"
    damage(ck)
    before = _snapshot(run)
    proc = _node(cfg, run, *extra)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {ck}: "), proc.stderr[-2000:]
    assert needle in lines[0], lines[0]
    assert _snapshot(run) == before  # nothing written, nothing appended, nothing removed


@pytest.mark.timeout(300)
def test_a_changed_lr_is_accepted_with_the_flag_and_recorded(finished: tuple[Path, Path], tmp_path: Path) -> None:
    cfg, run = _copy(finished, tmp_path)
    proc = _node(cfg, run, "--set", "algorithm.lr=0.05", "--accept-config-change",
                 "--set", "network.probe_s=0.2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    changes = [json.loads(line) for line in (run / "config-changes.jsonl").read_text().splitlines()]
    assert len(changes) == 1
    ch = changes[0]
    assert ch["peers"] == ["p0"] and ch["round"] == 2 and ch["changed"] == ["algorithm.lr"]
    assert ch["old"]["config"] != ch["new"]["config"] and ch["old"]["topology"] == ch["new"]["topology"]
    assert yaml.safe_load((run / "config.yaml").read_text())["algorithm"]["lr"] == 0.05  # the folder says so
    assert "changed config (algorithm.lr)" in proc.stderr


@pytest.mark.timeout(300)
def test_simulate_resume_refuses_a_changed_config_unless_accepted(finished: tuple[Path, Path],
                                                                  tmp_path: Path) -> None:
    cfg, run = _copy(finished, tmp_path)
    before = _snapshot(run)
    changed = load_config(cfg, ["algorithm.lr=0.05", "rounds=3"])
    with pytest.raises(CheckpointError, match="changed: algorithm.lr"):
        simulate(changed, run, progress=False, resume=True)
    assert _snapshot(run) == before
    summary = simulate(changed, run, progress=False, resume=True, accept_config_change=True)
    assert summary["resumed_from_round"] == 2 and summary["rounds"] == 3
    changes = [json.loads(line) for line in (run / "config-changes.jsonl").read_text().splitlines()]
    assert [c["peers"] for c in changes] == [["p0", "p1", "p2", "p3"]] and changes[0]["changed"] == ["algorithm.lr"]
    # the checkpoints written after the change carry the new fingerprint: the next resume is plain
    simulate(load_config(cfg, ["algorithm.lr=0.05", "rounds=4"]), run, progress=False, resume=True)


def test_the_checksum_covers_every_array(finished: tuple[Path, Path], tmp_path: Path) -> None:
    """A checkpoint rewritten as a valid zip with one value changed (zip CRCs recomputed) is refused
    by its own checksum; one of format 1 (no checksum, no fingerprint) is still read."""
    _, run = _copy(finished, tmp_path)
    ck = run / "checkpoints" / "p0.npz"
    with np.load(ck, allow_pickle=False) as z:
        arrays = {k: z[k].copy() for k in z.files}
    arrays["params"][0] += 1.0
    with open(ck, "wb") as f:
        np.savez(f, **arrays)
    shapes = {"params": tuple(arrays["params"].shape)}
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        verify_checkpoint(ck, peer_id="p0", shapes=shapes)
    meta = json.loads(bytes(arrays["meta"]).decode())
    meta = {k: v for k, v in meta.items() if k not in ("crc32", "run")} | {"format": 1}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    with open(ck, "wb") as f:
        np.savez(f, **arrays)
    got = verify_checkpoint(ck, peer_id="p0", shapes=shapes)
    assert got.round == 2 and got.run is None
    assert load_checkpoint(ck)[0].round == 2
