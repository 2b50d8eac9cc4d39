"""The simulation on torch.distributed: peers sharded over 1, 2 and 4 gloo ranks record bitwise what
one process records, whether the ranks are forked by a plain ``p2pfl simulate`` (``simulation.workers``)
or started by ``torchrun``; a failure on any rank ends every rank and is reported by rank 0."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from p2pfl.config import load_config
from p2pfl.engine import frames as rankframes
from p2pfl.simulation import SimulationError, simulate
from tests.conftest import TIMES, records_without_times, tiny_config

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "peers" / "demo.yaml"
FMNIST = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")

#: The demo (8 peers on a ring, Fashion-MNIST, cnn_small), cut to 2 rounds of 500 samples per peer.
SHORT = ["rounds=2", "data.partition.samples_per_client=500", "checkpoint.every=1"]
ALGORITHMS = {
    "dfedavg": ["algorithm.name=dfedavg"],
    "dpsgd": ["algorithm.name=dpsgd"],
    "deprl": ["algorithm.name=deprl"],
    "dfedpgp-push": ["algorithm.name=dfedpgp", "algorithm.mix_mode=push"],
}

needs_fmnist = pytest.mark.skipif(not FMNIST.exists() and not os.environ.get("P2PFL_DATA"),
                                  reason="Fashion-MNIST not installed (make data)")


def _checkpoints(run: Path) -> dict[str, dict[str, Any]]:
    """Every peer's checkpoint: its arrays, and its metadata less the record's timings."""
    out = {}
    for f in sorted((run / "checkpoints").glob("*.npz")):
        with np.load(f) as z:
            arrays = {k: z[k] for k in z.files if k != "meta"}
            meta = json.loads(bytes(z["meta"]).decode()) if "meta" in z.files else {}
        rec = meta.get("record")
        if isinstance(rec, dict):
            meta["record"] = {k: v for k, v in rec.items() if k not in TIMES}
        out[f.name] = {"arrays": arrays, "meta": meta}
    return out


def assert_same_run(a: Path, b: Path) -> None:
    """Bitwise the same records (timings aside) and the same checkpoints."""
    ra, rb = records_without_times(a), records_without_times(b)
    assert len(ra) == len(rb) > 0
    assert ra == rb
    ca, cb = _checkpoints(a), _checkpoints(b)
    assert sorted(ca) == sorted(cb) and ca
    for name in ca:
        assert sorted(ca[name]["arrays"]) == sorted(cb[name]["arrays"]), name
        for k, v in ca[name]["arrays"].items():
            assert np.array_equal(v, cb[name]["arrays"][k]), (name, k)
        assert ca[name]["meta"] == cb[name]["meta"], name


_reference: dict[str, tuple[Path, float]] = {}


def _one_process(algo: str, tmp_root: Path) -> Path:
    """The one-process run of ``algo`` on the short demo (made once per test session)."""
    if algo not in _reference:
        cfg = load_config(DEMO, [*SHORT, *ALGORITHMS[algo], "simulation.workers=1"])
        out = tmp_root / f"ref-{algo}"
        t0 = time.perf_counter()
        summary = simulate(cfg, out, progress=False)
        _reference[algo] = (out, time.perf_counter() - t0)
        assert summary["workers"] == 1
    return _reference[algo][0]


@pytest.fixture(scope="module")
def ref_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("reference")


@needs_fmnist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("algo", list(ALGORITHMS))
def test_two_and_four_forked_ranks_equal_one_process(algo: str, ref_root: Path, tmp_path: Path) -> None:
    ref = _one_process(algo, ref_root)
    for ranks in (2, 4):
        cfg = load_config(DEMO, [*SHORT, *ALGORITHMS[algo], f"simulation.workers={ranks}"])
        t0 = time.perf_counter()
        summary = simulate(cfg, tmp_path / f"r{ranks}", progress=False)
        wall = time.perf_counter() - t0
        assert summary["workers"] == ranks
        assert_same_run(ref, tmp_path / f"r{ranks}")
        print(f"{algo}: 1 process {_reference[algo][1]:.1f} s, {ranks} ranks {wall:.1f} s")


@needs_fmnist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("algo", ["dpsgd", "dfedpgp-push"])
def test_one_payload_per_step_equals_one_process(algo: str, ref_root: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """With STEP_BYTES so small that each exchange step carries one payload to a rank (the others wait
    in the rank's queue for later steps, earliest reader first), 4 ranks record what one process does."""
    from p2pfl.engine import exact

    monkeypatch.setattr(exact, "STEP_BYTES", 1)  # the forked ranks inherit it
    monkeypatch.setattr(exact, "TRIM_EVERY_S", 0.0)  # and trim at every step
    ref = _one_process(algo, ref_root)
    cfg = load_config(DEMO, [*SHORT, *ALGORITHMS[algo], "simulation.workers=4"])
    assert simulate(cfg, tmp_path / "r4", progress=False)["workers"] == 4
    assert_same_run(ref, tmp_path / "r4")


def _torchrun() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def _run_torchrun(args: list[str], timeout: float, cwd: Path = ROOT, path: Sequence[Path] = (),
                  env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``torchrun ... -m p2pfl.cli simulate ARGS`` in a session of its own, killed whole on a timeout
    (``path``: folders put first on the ranks' ``PYTHONPATH``; ``env``: more variables)."""
    env = {**os.environ, **(env or {}),
           "PYTHONPATH": os.pathsep.join([*map(str, path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {timeout} s:\n{out[-3000:]}")
    return subprocess.CompletedProcess(args, proc.returncode, out, "")


@needs_fmnist
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("algo", "nproc"), [("dfedpgp-push", 2), ("dfedavg", 4)])
def test_torchrun_ranks_equal_one_process(algo: str, nproc: int, ref_root: Path, tmp_path: Path) -> None:
    """``torchrun --standalone --nproc-per-node K -m p2pfl.cli simulate``: each process a gloo rank."""
    ref = _one_process(algo, ref_root)
    out = tmp_path / "run"
    sets = [a for s in [*SHORT, *ALGORITHMS[algo]] for a in ("--set", s)]
    t0 = time.perf_counter()
    res = _run_torchrun([*_torchrun(), "--standalone", f"--nproc-per-node={nproc}", "-m", "p2pfl.cli", "simulate",
                         "-c", str(DEMO), *sets, "--out", str(out), "-q"], timeout=500)
    assert res.returncode == 0, res.stdout[-4000:]
    assert res.stdout.count("run folder:") == 1  # rank 0 alone prints the summary
    assert json.loads((out / "summary.json").read_text())["workers"] == nproc
    assert_same_run(ref, out)
    print(f"{algo}: 1 process {_reference[algo][1]:.1f} s, torchrun {nproc} ranks {time.perf_counter() - t0:.1f} s")


@pytest.mark.timeout(300)
def test_torchrun_tiny_and_plain_simulate_agree(tmp_path: Path) -> None:
    """The synthetic experiment (no dataset needed): torchrun's 2 ranks, 3 forked ranks, one process.

    torchrun without --out: every rank names the folder after torchrun's run id (--standalone's)."""
    path = tiny_config(tmp_path, peers=6, checkpoint={"every": 1})
    simulate(load_config(path, ["simulation.workers=1"]), tmp_path / "one", progress=False)
    simulate(load_config(path, ["simulation.workers=3"]), tmp_path / "three", progress=False)
    res = _run_torchrun([*_torchrun(), "--standalone", "--nproc-per-node=2", "-m", "p2pfl.cli", "simulate",
                         "-c", str(path), "-q"], timeout=240, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-4000:]
    (tr,) = (tmp_path / "runs").iterdir()  # one folder, made by both ranks
    assert tr.name.startswith("tiny-dfedavg-") and res.stdout.count("run folder:") == 1
    assert_same_run(tmp_path / "one", tmp_path / "three")
    assert_same_run(tmp_path / "one", tr)


@pytest.mark.timeout(120)
def test_a_failing_peer_on_another_rank_ends_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from p2pfl.experiment import Experiment

    real = Experiment.make_node

    def make_node(self, pid, **kw):  # the forked ranks inherit this
        if pid == "p3":
            raise ValueError("p3 cannot start")
        return real(self, pid, **kw)

    monkeypatch.setattr(Experiment, "make_node", make_node)
    cfg = load_config(tiny_config(tmp_path, peers=4, rounds=3), ["simulation.workers=2"])
    with pytest.raises(SimulationError, match="(?s)peer p3 failed.*p3 cannot start"):  # p3 runs on rank 1
        simulate(cfg, tmp_path / "run", progress=False)


@pytest.mark.timeout(120)
def test_a_rank_that_dies_ends_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from p2pfl.experiment import Experiment

    real = Experiment.make_node
    parent = os.getpid()

    def make_node(self, pid, **kw):
        if pid == "p3" and os.getpid() != parent:
            os._exit(7)  # rank 1 killed
        return real(self, pid, **kw)

    monkeypatch.setattr(Experiment, "make_node", make_node)
    cfg = load_config(tiny_config(tmp_path, peers=4, rounds=3), ["simulation.workers=2"])
    with pytest.raises(SimulationError, match="died"):
        simulate(cfg, tmp_path / "run", progress=False)


def test_the_bytes_between_ranks_carry_payload_frames_records_and_errors() -> None:
    import torch

    from p2pfl.payload import Payload
    from p2pfl.storage import StorageError

    buf = bytearray()
    msg = Payload("p7", 3, 1, "h", (), torch.zeros(2), {})
    rankframes.pack_payload(buf, msg, 123, 2, (b"header", b"", b"\x00data"))
    rankframes.pack_records(buf, [{"round": 0, "peer": "p1"}, {"round": 0, "peer": "é"}])
    raised = rankframes.pack_failure(buf, ValueError("bad é"), "peer p1")
    rankframes.pack_failure(buf, StorageError("/run/p1/metrics.jsonl", "no space left on device"), "rank 1")
    got = list(rankframes.entries(memoryview(bytes(buf))))
    assert [k for k, _ in got] == [rankframes.PAYLOAD, rankframes.RECORDS, rankframes.ERROR, rankframes.STORAGE]
    sender, r, step, size, count, parts = rankframes.unpack_payload(got[0][1])
    assert (sender, r, step, size, count) == ("p7", 3, 1, 123, 2)
    assert [bytes(f) for f in parts] == [b"header", b"", b"\x00data"]
    assert rankframes.read_records(got[1][1]) == [{"round": 0, "peer": "p1"}, {"round": 0, "peer": "é"}]
    assert rankframes.read_failure(*got[1]) is None  # records are no failure
    error = rankframes.read_failure(*got[2])
    assert isinstance(error, rankframes.SimulationError) and str(error) == str(raised)
    assert str(error).startswith("peer p1 failed: ") and "ValueError: bad é" in str(error)
    storage = rankframes.read_failure(*got[3])  # the one line `p2pfl node` prints, not a traceback
    assert isinstance(storage, StorageError)
    assert (storage.path, storage.problem) == ("/run/p1/metrics.jsonl", "no space left on device")


def test_payload_entry_from_frame_parts_is_the_frames_entry() -> None:
    """The exchange step writes a payload's frames from `EncodedPayload.frame_parts` (the tensor bytes
    copied once, into the outbox): the same entry as from the built frames."""
    import torch

    from p2pfl.models.layout import TensorSpec
    from p2pfl.payload import Payload
    from p2pfl.wire.codec import encode_frames

    spec = TensorSpec("w", (70_000,), 0, 70_000)
    msg = Payload("p3", 2, 0, "h", (spec,), torch.arange(70_000, dtype=torch.float32), {"mu": 0.5})
    enc = encode_frames(msg, 64 * 1024)
    from_parts, from_frames = bytearray(), bytearray()
    rankframes.pack_payload(from_parts, msg, 9, 1, [enc.frame_parts(i) for i in range(len(enc))])
    rankframes.pack_payload(from_frames, msg, 9, 1, encode_frames(msg, 64 * 1024).frames)
    assert len(enc) > 2 and from_parts == from_frames


def test_torchrun_without_out_or_run_id_is_refused(tmp_path: Path) -> None:
    """Every rank must name the same folder: the default (a timestamp) could differ between them."""
    from typer.testing import CliRunner

    from p2pfl.cli import _mount, app

    _mount()
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
           "TORCHELASTIC_RUN_ID": "none"}
    res = CliRunner().invoke(app, ["simulate", "-c", str(tiny_config(tmp_path))], env=env)
    assert res.exit_code != 0 and "--out" in res.output
    shutil.rmtree(tmp_path / "runs", ignore_errors=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
def test_a_wait_no_message_can_end_is_a_deadlock_not_a_week(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            workers: int) -> None:
    """Every rank idle, nothing moving, no pause to wait out: the ranks agree it is a deadlock and
    raise, instead of waiting out the readers' one-week deadline."""
    from p2pfl.transport.memory import MemoryHub

    real = MemoryHub.take_gated

    def take_gated(self, keys, *args, **kwargs):  # p1 also waits for a peer that does not exist
        if any(k[0] == "p0" for k in keys) and any(k[0] == "p2" for k in keys):
            keys = [*keys, ("ghost", keys[0][1], keys[0][2])]
        return real(self, keys, *args, **kwargs)

    monkeypatch.setattr(MemoryHub, "take_gated", take_gated)
    cfg = load_config(tiny_config(tmp_path, peers=4, rounds=2), [f"simulation.workers={workers}"])
    with pytest.raises(SimulationError, match="deadlock"):
        simulate(cfg, tmp_path / "run", progress=False)


@pytest.mark.timeout(300)
def test_torchrun_resume_goes_on_as_one_process_would(tmp_path: Path) -> None:
    """Rank 0 puts the checkpoints back before any rank's peers read theirs (`--resume` extends a
    finished 2-round run to 3 rounds over 2 torchrun ranks): the same run as 3 rounds in one process."""
    path = tiny_config(tmp_path, peers=6, rounds=3, checkpoint={"every": 1})
    simulate(load_config(path, ["simulation.workers=1"]), tmp_path / "one", progress=False)
    run = [*_torchrun(), "--standalone", "--nproc-per-node=2", "-m", "p2pfl.cli", "simulate", "-c", str(path),
           "--out", str(tmp_path / "tr"), "-q"]
    for extra in (["--set", "rounds=2"], ["--resume"]):
        res = _run_torchrun([*run, *extra], timeout=200)
        assert res.returncode == 0, res.stdout[-4000:]
    assert json.loads((tmp_path / "tr" / "summary.json").read_text())["resumed_from_round"] == 2
    assert_same_run(tmp_path / "one", tmp_path / "tr")


@pytest.mark.timeout(120)
def test_a_storage_error_on_another_rank_is_raised_by_rank_0_as_one(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A write the run folder's storage refused (`StorageError`: one line, exit 74 in the CLI) stays one
    when it happens on another rank."""
    from p2pfl.experiment import Experiment
    from p2pfl.storage import StorageError

    real = Experiment.make_node

    def make_node(self, pid, **kw):
        if pid == "p3":
            raise StorageError(tmp_path / "run" / "checkpoints" / "p3.npz", "No space left on device")
        return real(self, pid, **kw)

    monkeypatch.setattr(Experiment, "make_node", make_node)
    cfg = load_config(tiny_config(tmp_path, peers=4, rounds=2), ["simulation.workers=2"])
    with pytest.raises(StorageError) as info:  # p3 runs on rank 1
        simulate(cfg, tmp_path / "run", progress=False)
    assert info.value.path.endswith("p3.npz") and info.value.problem == "No space left on device"
