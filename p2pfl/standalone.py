"""One peer as its own process (``p2pfl node``), a local multi-process launch (``p2pfl launch``),
and a health probe (``p2pfl health``).

A standalone peer serves the gRPC peer service on the address its topology gives it, runs the
same Node round loop as the simulation over the gRPC transport, checkpoints every round and
resumes from its checkpoint when restarted. SIGTERM stops it cleanly between rounds.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from p2pfl.config import ExperimentConfig
from p2pfl.health import check_health  # noqa: F401  (re-exported: its home is p2pfl.health)

log = logging.getLogger(__name__)


def network_for(cfg: ExperimentConfig, certs: Path | None, insecure: bool) -> Any:
    """The config's network settings with the command line's TLS choice applied (never a silent fallback)."""
    net = cfg.network
    if insecure:
        return net.model_copy(update={"insecure": True, "certs": None})
    certs_dir = str(certs) if certs is not None else net.certs
    if not certs_dir and not net.insecure:
        raise ValueError("no certificates: pass --certs DIR (made by `p2pfl certs`) or --insecure for plaintext")
    return net.model_copy(update={"certs": certs_dir})


def run_node(cfg: ExperimentConfig, peer_id: str, out_dir: Path, *, certs: Path | None = None,
             insecure: bool = False, stop: threading.Event | None = None, threads: int = 1,
             metrics_port: int | None = None, metrics_host: str = "127.0.0.1") -> dict[str, Any]:
    """Serve and run one peer to the end (or until ``stop``); return its last metrics record.

    ``metrics_port``: also serve Prometheus ``/metrics`` there (0: any free port; None: off).
    """
    import torch

    from p2pfl.checkpoint import checkpoint_info
    from p2pfl.experiment import Experiment
    from p2pfl.modelpool import ModelPool
    from p2pfl.runfolder import RunFolder
    from p2pfl.transport.grpc_transport import start_grpc_peer

    torch.set_num_threads(threads)  # 1 thread: bitwise the same as the simulation on CPU
    exp = Experiment.from_config(cfg)
    if peer_id not in exp.topology.ids:
        raise ValueError(f"peer {peer_id!r} is not in topology {cfg.topology} (peers: {', '.join(exp.topology.ids)})")
    exp.topology.address(peer_id)  # placed? (a graph-only topology needs an address book: one-line TopologyError)
    network = network_for(cfg, certs, insecure)
    algo = exp.new_algorithm()
    if cfg.network.mode == "async" and algo.mode != "pull":
        raise ValueError(f"network.mode: async needs pull mode; {cfg.algorithm_name} mixes in {algo.mode} mode "
                         "(push-sum's mass accounting needs the round barrier)")
    out_dir.mkdir(parents=True, exist_ok=True)
    # The checkpoint is read before serving, so a restarted peer answers its resumed round at once
    # (docs/protocol.md, "Rejoin").
    ckpt_path = out_dir / "checkpoints" / f"{peer_id}.npz"
    start_round, ckpt_record = checkpoint_info(ckpt_path) if cfg.checkpoint_every else (0, None)
    transport = start_grpc_peer(exp.topology, peer_id, network, expected_specs=algo.wire_specs(),
                                scalar_keys=algo.wire_scalars(), seed=cfg.seed, mode=algo.mode,
                                start_round=start_round,
                                pushes_log=ckpt_path.with_suffix(".pushes") if cfg.checkpoint_every else None)
    last: dict[str, Any] = {}
    telemetry = None
    run: RunFolder | None = None
    try:
        if metrics_port is not None:
            from p2pfl.node_metrics import NodeTelemetry

            nbrs = exp.topology.possible_in_neighbours(peer_id) | exp.topology.possible_out_neighbours(peer_id)
            telemetry = NodeTelemetry(peer_id, nbrs, cfg.rounds, host=metrics_host, port=metrics_port,
                                      probe=lambda n: int(transport.status(n, timeout_s=2.0).round))
        ckpt_exists = cfg.checkpoint_every > 0 and ckpt_path.exists()
        # resuming: metrics-<peer>.jsonl holds exactly rounds < start_round, once each (a kill may
        # have cut either write); the run folder's one lifecycle, as simulate and launch use it
        run = RunFolder.for_peer(out_dir, cfg, exp.topology, exp.partition, peer_id,
                                 resume_at=start_round if ckpt_exists else None, checkpoint_record=ckpt_record)

        def record(rec: dict[str, Any]) -> None:
            rec = run.record(rec)
            last.clear()
            last.update(rec)
            if telemetry is not None:
                telemetry.observe(rec)

        node = exp.make_node(peer_id, transport=transport, models=ModelPool(exp.model_factory, 1), record=record,
                             run_dir=out_dir, stop=stop)
        if node.resume():
            log.warning("%s: resuming at round %d", peer_id, node.state.round)
            if telemetry is not None:
                telemetry.resumed(node.state.round)
            node.rejoin()
        node.run()
    finally:
        if run is not None:
            run.close()
        if telemetry is not None:
            telemetry.close()
        transport.close()
    return last


def node_main(cfg: ExperimentConfig, peer_id: str, out_dir: Path, certs: Path | None, insecure: bool,
              threads: int, metrics_port: int | None = None, metrics_host: str = "127.0.0.1") -> int:
    """``p2pfl node``: SIGTERM/SIGINT stop between rounds; exit 0 when done or stopped cleanly."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.warning("%s: signal %d: stopping after this round", peer_id, signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    run_node(cfg, peer_id, out_dir, certs=certs, insecure=insecure, stop=stop, threads=threads,
             metrics_port=metrics_port, metrics_host=metrics_host)
    return 0


# -- launch ----------------------------------------------------------------------------------------
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
