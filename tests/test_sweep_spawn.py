"""How a sweep starts a cell's process: beside a gRPC runtime already running in the sweep's process
(a test session, a notebook that ran a peer), and pinned to the cell's cores."""

from __future__ import annotations

import os
import shutil
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from p2pfl.sweep import spawn_cell


@pytest.mark.timeout(120)
def test_cells_start_cleanly_beside_a_live_grpc_runtime(tmp_path: Path) -> None:
    """Forking (rather than vforking) with gRPC's poller running let its fork handlers abort about 1
    child in 10 before exec (SIGABRT, 'epoll_wait error: Bad file descriptor'): 60 starts all exit 0."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=10)  # the event engine's poller is running
        true = shutil.which("true") or "/bin/true"
        codes = []
        for k in range(60):
            with (tmp_path / f"log{k}.txt").open("wb") as log:
                proc = spawn_cell([true], log)
                codes.append(proc.wait(timeout=30))
        assert codes == [0] * 60, [(k, c, (tmp_path / f"log{k}.txt").read_text(errors="replace")[:200])
                                   for k, c in enumerate(codes) if c]
    finally:
        channel.close()
        server.stop(grace=None)


@pytest.mark.timeout(60)
def test_a_cell_runs_on_its_cores_and_the_sweep_keeps_its_own(tmp_path: Path) -> None:
    before = os.sched_getaffinity(0)
    core = min(before)
    with (tmp_path / "log.txt").open("wb") as log:
        proc = spawn_cell([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], log,
                          cores=[core])
        assert proc.wait(timeout=30) == 0
    assert (tmp_path / "log.txt").read_text().split() == [f"[{core}]"]
    assert os.sched_getaffinity(0) == before
    with (tmp_path / "log2.txt").open("wb") as log:
        proc = spawn_cell([sys.executable, "-c", "import os; print(len(os.sched_getaffinity(0)))"], log)
        assert proc.wait(timeout=30) == 0
    assert (tmp_path / "log2.txt").read_text().split() == [str(len(before))]
    # its own session: a Ctrl-C in the sweep's terminal does not reach it
    with (tmp_path / "log3.txt").open("wb") as log:
        proc = spawn_cell([sys.executable, "-c", "import os; print(os.getsid(0) == os.getpid())"], log)
        assert proc.wait(timeout=30) == 0
    assert (tmp_path / "log3.txt").read_text().split() == ["True"]
