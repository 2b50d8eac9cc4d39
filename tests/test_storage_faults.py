"""Storage faults and exactly-once records (issue 68, parts 5 and 6; docs/bad-input.md, "Storage",
docs/protocol.md, "Metrics and checkpoint").

In process: the durable writer never leaves a torn file, retries a storage fault with backoff (one
line each), and gives up after its budget with one ``PATH: problem`` line; a resumed peer replays
the rounds it may have published before it catches up. On real ``p2pfl node`` processes (mutual
TLS, loopback): a full disk or a read-only run folder at a random round (drawn from a printed seed)
is waited out, or stops every peer in one line (exit 74) and a restart resumes it; a kill -9 at a
random instant leaves every round a neighbour mixed recorded exactly once.

The storage faults are injected through ``P2PFL_FAULT_STORAGE`` (`p2pfl.storage`), and, where the
test runs as root and may mount, on a real tmpfs filled up or remounted read-only.
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from p2pfl import storage
from p2pfl.checkpoint import load_checkpoint, save_checkpoint, verify_checkpoint
from p2pfl.config import load_config
from p2pfl.experiment import Experiment
from p2pfl.modelpool import ModelPool
from p2pfl.storage import EXIT_STORAGE, FAULT_ENV, JsonlLog, StorageError, atomic_write, read_jsonl
from p2pfl.transport.base import ExchangeResult, Transport
from tests.conftest import tiny_config
from tests.swarm import free_base_port, records, spawn_node
from tests.test_gossip_faults import PEERS, fault_rng, peers, random_instant, wait_rounds


@pytest.fixture
def fault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Set the storage fault this process injects: ``fault("ENOSPC")``, ``fault(None)`` to clear it.
    The retry budget is 0.3 s meanwhile (a test sets another with `storage.configure`)."""
    ctl = tmp_path / "storage-fault"
    monkeypatch.setenv(FAULT_ENV, str(ctl))

    def set_(name: str | None) -> None:
        if name is None:
            ctl.unlink(missing_ok=True)
        else:
            ctl.write_text(name)

    storage.configure(0.3)
    try:
        yield set_
    finally:
        storage.configure(storage.DEFAULT_RETRY_S)


def _clear_after(set_fault, seconds: float) -> threading.Thread:
    th = threading.Thread(target=lambda: (time.sleep(seconds), set_fault(None)), daemon=True)
    th.start()
    return th


# -- the durable writer, in process ------------------------------------------------------------------
def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path: Path, fault) -> None:
    target = tmp_path / "summary.json"
    atomic_write(target, "old\n")
    for name, code in (("ENOSPC", errno.ENOSPC), ("EROFS", errno.EROFS), ("EIO", errno.EIO)):
        fault(name)
        with pytest.raises(StorageError) as info:
            atomic_write(target, "new\n" * 1000)
        msg = str(info.value)
        assert msg.startswith(f"{target}: cannot write: {os.strerror(code)}") and "\n" not in msg, msg
        assert target.read_text() == "old\n"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["storage-fault", "summary.json"]


def test_a_storage_fault_is_retried_with_one_line_each_until_it_clears(tmp_path: Path, fault,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    fault("ENOSPC")
    _clear_after(fault, 0.6)
    storage.configure(30)
    with caplog.at_level(logging.WARNING, logger="p2pfl.storage"):
        t0 = time.monotonic()
        atomic_write(tmp_path / "a.txt", "done")
    assert (tmp_path / "a.txt").read_text() == "done"
    assert time.monotonic() - t0 < 5
    lines = [r.getMessage() for r in caplog.records]
    assert 2 <= len(lines) <= 8, lines  # backoff 0.1, 0.2, 0.4 ...: a handful in 0.6 s, not a busy loop
    assert all("No space left on device; retrying in" in m and "\n" not in m for m in lines), lines
    assert not any(r.exc_info for r in caplog.records)


def test_jsonl_appends_stay_whole_lines_through_a_write_cut_short_and_a_torn_tail(tmp_path: Path, fault) -> None:
    path = tmp_path / "metrics-p0.jsonl"
    w = JsonlLog(path, truncate=True)
    w.append({"round": 0, "peer": "p0"})
    storage.configure(30)
    fault("ENOSPC")  # each attempt writes half a line, then fails
    _clear_after(fault, 0.5)
    w.append({"round": 1, "peer": "p0"})
    w.append({"round": 2, "peer": "p0"})
    w.close()
    assert path.read_text().endswith("\n")
    assert [r["round"] for r in read_jsonl(path)] == [0, 1, 2]
    with open(path, "a") as f:  # a kill in the middle of a line
        f.write('{"peer": "p0", "rou')
    assert [r["round"] for r in read_jsonl(path)] == [0, 1, 2]  # a reader skips it
    w = JsonlLog(path)  # the writer cuts it off before appending
    w.append({"round": 3, "peer": "p0"})
    w.close()
    assert [r["round"] for r in read_jsonl(path)] == [0, 1, 2, 3]
    assert len(path.read_text().splitlines()) == 4


def test_giving_up_leaves_no_part_of_a_line(tmp_path: Path, fault) -> None:
    path = tmp_path / "m.jsonl"
    w = JsonlLog(path, truncate=True)
    w.append({"round": 0})
    fault("ENOSPC")
    try:
        with pytest.raises(StorageError, match=r"m\.jsonl: cannot append to: No space left on device"):
            w.append({"round": 1})
    finally:
        fault(None)
        w.close()
    assert path.read_text() == '{"round": 0}\n'


def test_a_checkpoint_that_cannot_be_written_leaves_the_last_one_intact(tmp_path: Path, fault) -> None:
    from p2pfl.algorithms.base import PeerState

    path = tmp_path / "checkpoints" / "p0.npz"
    gen = torch.Generator().manual_seed(1)
    state = PeerState(peer_id="p0", params=torch.arange(6.0), round=3)
    save_checkpoint(path, state, gen)
    state.params += 1
    state.round = 4
    for name in ("ENOSPC", "EROFS"):
        fault(name)
        with pytest.raises(StorageError):
            save_checkpoint(path, state, gen)
    fault(None)
    assert verify_checkpoint(path, peer_id="p0", shapes={"params": (6,)}).round == 3
    assert torch.equal(load_checkpoint(path)[0].params, torch.arange(6.0))
    assert [p.name for p in path.parent.iterdir()] == ["p0.npz"]


def test_other_os_errors_are_not_retried(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    t0 = time.monotonic()
    with pytest.raises(OSError) as info:
        atomic_write(tmp_path / "file" / "under-a-file.json", "{}")  # ENOTDIR: a bug, not the storage
    assert not isinstance(info.value, StorageError) and time.monotonic() - t0 < 1


# -- exactly once: the rounds a resumed peer may have published are replayed first -----------------------
class _Ahead(Transport):
    """No neighbour answers an exchange; every in-neighbour proves round ``ahead`` (or nothing)."""

    def __init__(self, ahead: int | None) -> None:
        self.ahead = ahead

    def exchange(self, message, plan, deadline_s):  # noqa: ANN001, ANN201
        return ExchangeResult(received={}, missing=sorted(plan.in_weights))

    def proven_rounds(self, peers, probe, timeout_s):  # noqa: ANN001, ANN201
        return {} if self.ahead is None else {p: self.ahead for p in peers}


@pytest.mark.parametrize("every", [1, 2])
def test_a_resumed_peer_records_its_published_rounds_before_it_fast_forwards(tmp_path: Path, every: int) -> None:
    """Resumed at round 4 with its in-neighbours proved at round 9: the round(s) it may have published
    before the kill (4, and 5 when it checkpoints every 2 rounds) are run and recorded, then it
    fast-forwards; before, it jumped from 4 to 9 and the neighbours' mix of its round 4 had no record."""
    cfg = load_config(tiny_config(tmp_path, rounds=12, checkpoint={"every": every}))
    exp = Experiment.from_config(cfg)
    run = tmp_path / "run"
    first: list[dict] = []
    exp.make_node("p3", transport=_Ahead(None), models=ModelPool(exp.model_factory, 1), record=first.append,
                  run_dir=run, rounds=4).run()
    assert [r["round"] for r in first] == [0, 1, 2, 3]
    again: list[dict] = []
    node = exp.make_node("p3", transport=_Ahead(9), models=ModelPool(exp.model_factory, 1), record=again.append,
                         run_dir=run)
    assert node.resume() and node.state.round == 4
    node.rejoin()
    node.run()
    replayed = [4] if every == 1 else [4, 5]
    assert [r["round"] for r in again] == [*replayed, 9, 10, 11]
    assert again[len(replayed)]["fast_forward_from"] == replayed[-1] + 1
    assert node.published_through(4) == replayed[-1] and node.published_through(11) == 11


# -- real processes -------------------------------------------------------------------------------------
def _spawn_all(cfg: Path, out: Path, tmp: Path, env: dict[str, str]) -> dict[str, subprocess.Popen]:
    return {pid: spawn_node(cfg, pid, out, tmp / "certs", tmp / f"{pid}.log", env=env) for pid in PEERS}


def _no_traceback(tmp: Path) -> None:
    for pid in PEERS:
        text = (tmp / f"{pid}.log").read_text()
        assert "Traceback" not in text, text[-3000:]


def _each_round_once(out: Path, rounds: int) -> None:
    for pid in PEERS:
        got = [r["round"] for r in records(out / f"metrics-{pid}.jsonl")]
        assert got == list(range(rounds)), (pid, got)


def _storage_lines(tmp: Path) -> int:
    """Log lines saying a write failed: the durable writer's retries, and the push-sum receiver's
    write-ahead log line (tried once per pass while the push waits; in push mode a full disk stops
    every step there, before any metrics or checkpoint is written)."""
    lines = [x for pid in PEERS for x in (tmp / f"{pid}.log").read_text().splitlines()]
    return sum(1 for x in lines if "storage: " in x or ("push-sum: " in x and "cannot append: " in x))


def _hold_until_struck(tmp: Path, seconds: float, bound_s: float = 30.0) -> None:
    """Keep a fault ``seconds`` (drawn), and on until some peer has tried a write and logged its line:
    on a loaded machine a round can outlast the draw, and a fault nobody met proves nothing. Bounded
    well inside the 60 s retry budget, so the peers still wait it out."""
    time.sleep(seconds)
    end = time.monotonic() + bound_s
    while _storage_lines(tmp) == 0 and time.monotonic() < end:
        time.sleep(0.2)


def _mode(mode: str) -> dict:
    """tiny_config's arguments for a mode: pull (dfedavg, ring) or push-sum (dfedpgp, directed ring)."""
    if mode == "pull":
        return {}
    return {"kind": "directed_ring", "algorithm": {"name": "dfedpgp", "mix_mode": "push", "body_local": 1,
                                                  "head_local": 1}}


def _mass_kept(out: Path, mode: str, rounds: int) -> None:
    """Push-sum: sum of the peers' durable weights = n at the end, nothing NaN (`test_pushsum_faults`)."""
    if mode == "push":
        from tests.test_pushsum_faults import assert_mass_and_finite

        assert_mass_and_finite(out, rounds)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_full_disk_at_a_random_round_is_waited_out(tmp_path: Path, mode: str) -> None:
    """Every write of all four peers fails with ENOSPC (half a line, half a checkpoint written) for 1-3 s
    from a random round: they retry, their neighbours wait, and all finish with every round once. In
    push-sum the receivers' write-ahead log lines fail too (pushes wait, unmixed): the mass stays n."""
    rng = fault_rng()
    rounds = 8
    ctl = tmp_path / "storage-fault"
    cfg = tiny_config(tmp_path, base_port=free_base_port(), rounds=rounds, network={"round_timeout_s": 60.0},
                      **_mode(mode))
    out = tmp_path / "run"
    with peers(cfg, out, tmp_path, env={FAULT_ENV: str(ctl)}) as procs:
        random_instant(out, rng.choice(PEERS), rng, procs, tmp_path, 2, 4)
        ctl.write_text("ENOSPC")
        _hold_until_struck(tmp_path, rng.uniform(1.0, 3.0))
        ctl.unlink()
        for pid, p in procs.items():
            assert p.wait(90) == 0, (tmp_path / f"{pid}.log").read_text()[-3000:]
    _each_round_once(out, rounds)
    _no_traceback(tmp_path)
    assert _storage_lines(tmp_path) >= 1  # it did strike, and was logged on one line
    _mass_kept(out, mode, rounds)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_read_only_run_folder_stops_every_peer_in_one_line_and_a_restart_resumes(tmp_path: Path, mode: str) -> None:
    """The run folder turns read-only at a random round and stays so past the retry budget (1 s): every
    peer stops with one line ``error: PATH: ... Read-only file system ...`` and exit 74, no traceback;
    restarted once it is writable, they resume and every round is recorded exactly once (push-sum: and
    the mass is n at the end, whatever each peer had mixed, logged or checkpointed when it stopped)."""
    rng = fault_rng()
    rounds = 8
    ctl = tmp_path / "storage-fault"
    cfg = tiny_config(tmp_path, base_port=free_base_port(), rounds=rounds,
                      network={"round_timeout_s": 4.0, "probe_s": 0.5}, checkpoint={"storage_retry_s": 1.0},
                      **_mode(mode))
    out = tmp_path / "run"
    env = {FAULT_ENV: str(ctl)}
    with peers(cfg, out, tmp_path, env=env) as procs:
        random_instant(out, rng.choice(PEERS), rng, procs, tmp_path, 2, 4)
        ctl.write_text("EROFS")
        codes = {pid: p.wait(60) for pid, p in procs.items()}
        assert codes == dict.fromkeys(PEERS, EXIT_STORAGE), codes
        for pid in PEERS:
            last = (tmp_path / f"{pid}.log").read_text().strip().splitlines()[-1]
            assert last.startswith("error: ") and "Read-only file system" in last, (pid, last)
        _no_traceback(tmp_path)
        assert max(len(records(out / f"metrics-{pid}.jsonl")) for pid in PEERS) < rounds
        # a peer that lagged in round 0 when the fault struck has no checkpoint: it starts over (its
        # records are still each round once, below); every other one resumes from its checkpoint
        had = [pid for pid in PEERS if (out / "checkpoints" / f"{pid}.npz").exists()]
        assert had, "the fault struck before any checkpoint: nothing to resume"
        ctl.unlink()
        procs.update(_spawn_all(cfg, out, tmp_path, env))
        for pid, p in procs.items():
            assert p.wait(90) == 0, (tmp_path / f"{pid}.log").read_text()[-3000:]
    assert all("resum" in (tmp_path / f"{pid}.log").read_text() for pid in had), had
    _each_round_once(out, rounds)
    _mass_kept(out, mode, rounds)


# The soak's own helpers (bench/soak.py), one definition for both: whether a tmpfs can be mounted here,
# and a ballast file that takes every free byte of a file system.
_soak_spec = importlib.util.spec_from_file_location("bench_soak", Path(__file__).parents[1] / "bench" / "soak.py")
soak = importlib.util.module_from_spec(_soak_spec)
sys.modules["bench_soak"] = soak  # its dataclasses look their module up while they are made
_soak_spec.loader.exec_module(soak)  # type: ignore[union-attr]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["full", "read-only"])
def test_a_real_tmpfs_full_or_read_only_at_a_random_round_is_waited_out(tmp_path: Path, kind: str) -> None:
    """The same on a real device: the run folder on a 16 MiB tmpfs that fills up (a filler file takes
    every free byte) or turns read-only (a read-only bind mount over it) for 1-3 s at a random round."""
    if not soak.can_mount(tmp_path):
        pytest.skip("needs root and mount (a tmpfs); the P2PFL_FAULT_STORAGE tests cover the rest")
    rng = fault_rng()
    rounds = 8
    out = tmp_path / "run"
    out.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(out)], check=True)
    try:
        cfg = tiny_config(tmp_path, base_port=free_base_port(), rounds=rounds, network={"round_timeout_s": 60.0})
        with peers(cfg, out, tmp_path) as procs:
            random_instant(out, rng.choice(PEERS), rng, procs, tmp_path, 2, 4)
            if kind == "full":
                soak.fill(out / "filler")
            else:  # a read-only bind mount over it (a remount of the tmpfs itself is refused while files are open)
                subprocess.run(["mount", "--bind", str(out), str(out)], check=True)
                subprocess.run(["mount", "-o", "remount,bind,ro", str(out)], check=True)
            _hold_until_struck(tmp_path, rng.uniform(1.0, 3.0))
            if kind == "full":
                (out / "filler").unlink()
            else:
                subprocess.run(["umount", str(out)], check=True)  # the bind mount: writable again
            for pid, p in procs.items():
                assert p.wait(90) == 0, (tmp_path / f"{pid}.log").read_text()[-3000:]
        _each_round_once(out, rounds)
        _no_traceback(tmp_path)
        assert _storage_lines(tmp_path) >= 1  # it did strike, and was logged on one line
    finally:
        while subprocess.run(["umount", "-l", str(out)], capture_output=True).returncode == 0:
            pass  # the bind mount if still there, then the tmpfs


def _mixed(out: Path, by: str, of: str) -> set[int]:
    """The rounds in which ``by`` mixed a payload of ``of`` (``of`` not missing from its record)."""
    return {r["round"] for r in records(out / f"metrics-{by}.jsonl") if of not in r["missing"]}


@pytest.mark.timeout(150)
def test_kill9_between_the_exchange_and_the_checkpoint_leaves_the_mixed_round_recorded_once(tmp_path: Path) -> None:
    """Issue 68, part 6, on real processes: a directed ring of 4 (p2 -> p3 -> p0) with p2 slow, so that p0
    has mixed p3's round-k payload while p3 still waits for p2's; p3 is killed -9 then (k drawn from the
    printed seed, 2-5, plus a random 0-50 ms), and restarted once its neighbours are 5 rounds ahead,
    beyond the window (2 s deadline: they do not wait for it). After: every peer's rounds once, a gap
    only where it says it fast-forwarded, and p3's round k -- and every round of p3 a neighbour mixed --
    in p3's metrics. Before, p3 fast-forwarded over round k, unrecorded."""
    rng = fault_rng()
    rounds = 24
    cfg = tiny_config(tmp_path, base_port=free_base_port(), rounds=rounds, kind="directed_ring",
                      network={"round_timeout_s": 2.0, "probe_s": 1.0, "slowdown": {"p2": 60.0}})
    out = tmp_path / "run"
    with peers(cfg, out, tmp_path) as procs:
        k = rng.randint(2, 5)
        wait_rounds(out, "p3", k, procs, tmp_path)  # p3 is in round k (or later)
        t0 = time.monotonic()
        while True:  # p0 mixed p3's round k, and p3 did not record it yet: in its exchange, before its checkpoint
            assert time.monotonic() - t0 < 60, "never saw p3 between its exchange and its checkpoint"
            have = len(records(out / "metrics-p3.jsonl"))
            if have > k:
                k = have  # p3 got through round k first: the next round
            elif k in _mixed(out, "p0", "p3"):
                break
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.05))
        os.killpg(procs["p3"].pid, signal.SIGKILL)
        procs["p3"].wait(10)
        print(f"p3 killed in round {k} (p0 mixed its round-{k} payload)")
        wait_rounds(out, "p0", min(rounds - 6, k + 6), procs, tmp_path)  # 5 rounds ahead: beyond the window
        procs["p3"] = spawn_node(cfg, "p3", out, tmp_path / "certs", tmp_path / "p3.log")
        for pid, p in procs.items():
            assert p.wait(120) == 0, (tmp_path / f"{pid}.log").read_text()[-3000:]
    for pid in PEERS:
        mine = records(out / f"metrics-{pid}.jsonl")
        got = [r["round"] for r in mine]
        assert got == sorted(set(got)) and got[0] == 0, (pid, got)  # none twice
        for prev, rec in zip(mine, mine[1:], strict=False):
            if rec["round"] != prev["round"] + 1:
                assert rec.get("fast_forward_from") == prev["round"] + 1, (pid, got)
    got = [r["round"] for r in records(out / "metrics-p3.jsonl")]
    assert k in got, (k, got)
    assert _mixed(out, "p0", "p3") <= set(got), (sorted(_mixed(out, "p0", "p3") - set(got)), got)
    _no_traceback(tmp_path)
