"""``p2pfl launch``: one ``p2pfl node`` process per peer on loopback, their logs streamed, their metrics merged.

Each peer is a real process running exactly what a container runs (``p2pfl.node_process``); this
module only starts them, watches them and finishes the shared run folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from p2pfl.config import ExperimentConfig


def launch(config: Path, cfg: ExperimentConfig, out_dir: Path, sets: list[str], *, insecure: bool = False,
           timeout_s: float | None = None, verbose: bool = False) -> dict[str, Any]:
    """Start one ``p2pfl node`` process per peer on loopback, stream their logs, merge their metrics."""
    from p2pfl.experiment import Experiment
    from p2pfl.runfolder import RunFolder

    exp = Experiment.from_config(cfg)
    topo = exp.topology
    if exp.app_spec is not None:
        exp.layout  # noqa: B018 - a broken ClientApp is refused here, before the run folder and the peers
    run = RunFolder.start(out_dir, cfg, topo, exp.partition, "launch")
    if not topo.has_addresses:
        # A graph-only topology and no address book: place the peers on loopback ports free now, in an
        # address book the run folder keeps (the topology, and so its hash, stay as they are).
        from p2pfl.topology.addressbook import loopback_book

        book = out_dir / "addresses.yaml"
        loopback_book(topo).dump(book, topo)
        sets = [*sets, f"network.addresses={book.resolve()}"]
    certs_dir = out_dir / "certs"
    if not insecure:
        import tempfile

        from p2pfl.security.certs import make_certs

        # Every peer reads certs_dir: the CA key must not be there (it mints any peer's identity).
        # It lives only in a private temporary folder while the certificates are issued, so each
        # launch makes a fresh CA; the peers of a launch are started (and restarted) together.
        with tempfile.TemporaryDirectory(prefix="p2pfl-ca-") as ca_key_dir:
            make_certs(list(topo.ids), certs_dir, ca_key_dir=ca_key_dir, overwrite=True)
    procs: dict[str, subprocess.Popen] = {}
    pumps: list[threading.Thread] = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for pid in topo.ids:
        cmd = [sys.executable, "-m", "p2pfl.cli", "node", "--config", str(config), "--peer", pid, "--out", str(out_dir)]
        for s in sets:
            cmd += ["--set", s]
        cmd += ["--insecure"] if insecure else ["--certs", str(certs_dir)]
        if verbose:
            cmd.append("--verbose")
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                             start_new_session=True)
        procs[pid] = p
        th = threading.Thread(target=_pump, args=(pid, p), daemon=True)
        th.start()
        pumps.append(th)
    failed: dict[str, int] = {}
    try:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for pid, p in procs.items():
            left = None if deadline is None else max(0.1, deadline - time.monotonic())
            try:
                rc = p.wait(timeout=left)
            except subprocess.TimeoutExpired:
                rc = -1
                p.kill()
            if rc != 0:
                failed[pid] = rc
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
        for th in pumps:
            th.join(timeout=5)
    run.merge_peer_files(list(topo.ids))
    return run.finish(list(topo.ids), {"failed_peers": failed, "tls": not insecure},
                      title=f"{cfg.name}: {cfg.algorithm_name} (launch)")


def _pump(pid: str, proc: subprocess.Popen) -> None:
    """Prefix and stream one peer's output."""
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(f"[{pid}] {line}")
        sys.stdout.flush()

