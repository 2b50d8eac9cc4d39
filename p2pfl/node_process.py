"""One peer as its own process (``p2pfl node``): what a container, a pod or ``p2pfl launch`` runs.

A standalone peer serves the gRPC peer service on the address its topology gives it, runs the
same Node round loop as the simulation over the gRPC transport, checkpoints every round and
resumes from its checkpoint when restarted. SIGTERM stops it cleanly between rounds.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

from p2pfl.config import ExperimentConfig

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
             metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
             accept_config_change: bool = False) -> dict[str, Any]:
    """Serve and run one peer to the end (or until ``stop``); return its last metrics record.

    ``metrics_port``: also serve Prometheus ``/metrics`` there (0: any free port; None: off).
    Before anything is written: its own certificate (`check_own_certificate`) and its checkpoint
    (`Experiment.resume_check`; ``accept_config_change``: resume it under a changed config, recorded
    in the run folder) are verified; either refused is a `BadInput` (one line, exit 2).
    Stops with `RefusedByNeighbours` when every neighbour refuses it for ``network.refused_rounds``
    rounds in a row (docs/protocol.md, "Refused by every neighbour"), and with `StorageError` when a
    write to the run folder failed for ``checkpoint.storage_retry_s`` (`p2pfl.storage`; the folder
    stays resumable).
    """
    import torch

    from p2pfl import storage
    from p2pfl.experiment import Experiment
    from p2pfl.modelpool import ModelPool
    from p2pfl.runfolder import RunFolder
    from p2pfl.transport.channels import RECONNECT_BACKOFF_MAX_S
    from p2pfl.transport.grpc_transport import start_grpc_peer

    torch.set_num_threads(threads)  # 1 thread: bitwise the same as the simulation on CPU
    storage.configure(cfg.checkpoint.storage_retry_s)  # every write to the run folder: retried this long
    exp = Experiment.from_config(cfg)
    if peer_id not in exp.topology.ids:
        raise ValueError(f"peer {peer_id!r} is not in topology {cfg.topology} (peers: {', '.join(exp.topology.ids)})")
    exp.topology.address(peer_id)  # placed? (a graph-only topology needs an address book: one-line TopologyError)
    network = network_for(cfg, certs, insecure)
    own_cert = _check_certificate(network, peer_id)
    algo = exp.new_algorithm()
    if cfg.network.mode == "async" and algo.mode != "pull":
        raise ValueError(f"network.mode: async needs pull mode; {cfg.algorithm_name} mixes in {algo.mode} mode "
                         "(push-sum's mass accounting needs the round barrier)")
    # The checkpoint is verified and read before anything is written and before serving, so a bad one
    # leaves the folder as it was, and a restarted peer answers its resumed round at once
    # (docs/protocol.md, "Rejoin").
    ckpt_path = out_dir / "checkpoints" / f"{peer_id}.npz"
    ckpt_exists = cfg.checkpoint_every > 0 and ckpt_path.exists()
    start_round, ckpt_record = 0, None
    check = exp.resume_check(out_dir, accept_config_change)
    if ckpt_exists:
        verified = check(ckpt_path, peer_id)
        start_round, ckpt_record = verified.round, verified.record
    out_dir.mkdir(parents=True, exist_ok=True)
    config_changed = bool(check.changes)
    if config_changed:  # accepted: the folder says so (and its inputs are this config's: RunFolder.for_peer)
        changed = sorted({k for ch in check.changes.values() for k in ch.changed})
        check.record(start_round)
        log.warning("%s: resuming at round %d under a changed config (%s); recorded in config-changes.jsonl",
                    peer_id, start_round, ", ".join(changed) or "keys not known")
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
            from p2pfl.security.certs import EXPIRY_WARNING_DAYS

            nbrs = exp.topology.possible_in_neighbours(peer_id) | exp.topology.possible_out_neighbours(peer_id)
            telemetry = NodeTelemetry(peer_id, nbrs, cfg.rounds, host=metrics_host, port=metrics_port,
                                      probe=lambda n: int(transport.status(n, timeout_s=2.0).round))
            if own_cert is not None:
                telemetry.certificate(own_cert.not_after.timestamp(), EXPIRY_WARNING_DAYS)
        # resuming: metrics-<peer>.jsonl holds exactly rounds < start_round, once each (a kill may
        # have cut either write); the run folder's one lifecycle, as simulate and launch use it
        run = RunFolder.for_peer(out_dir, cfg, exp.topology, exp.partition, peer_id,
                                 resume_at=start_round if ckpt_exists else None, checkpoint_record=ckpt_record,
                                 config_changed=config_changed)

        def record(rec: dict[str, Any]) -> None:
            rec = run.record(rec)
            last.clear()
            last.update(rec)
            if telemetry is not None:
                telemetry.observe(rec)

        node = exp.make_node(peer_id, transport=transport, models=ModelPool(exp.model_factory, 1), record=record,
                             run_dir=out_dir, stop=stop)
        node.on_round = stop_when_refused(node.on_round, transport, peer_id, cfg.network.refused_rounds,
                                          linger_s=1.2 * RECONNECT_BACKOFF_MAX_S + cfg.network.probe_s)
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


def _check_certificate(network: Any, peer_id: str) -> Any:
    """This peer's own certificate checked (`check_own_certificate`), with a warning in the log when it
    expires within `EXPIRY_WARNING_DAYS`; None under --insecure."""
    if network.insecure:
        return None
    from p2pfl.security.certs import EXPIRY_WARNING_DAYS, TLSConfig, check_own_certificate

    own = check_own_certificate(TLSConfig.load(network.certs, peer_id))
    days = own.days_left()
    if days < EXPIRY_WARNING_DAYS:
        log.warning("%s: its certificate %s expires in %.1f days (%s): renew it with `p2pfl certs` and the same CA",
                    peer_id, own.path.name, days, f"{own.not_after:%Y-%m-%d %H:%M} UTC")
    return own


class RefusedByNeighbours(RuntimeError):
    """Every neighbour this peer called refused it (TLS, identity, topology or config) for
    ``network.refused_rounds`` rounds in a row: it stops instead of running on alone."""


def stop_when_refused(previous: Any, transport: Any, peer_id: str, bound: int, linger_s: float = 0.0) -> Any:
    """A Node ``on_round`` hook (wrapping ``previous``) that raises `RefusedByNeighbours` once the
    transport's refusal streak (`GrpcTransport.refused_streak`) reaches ``bound`` (0: never).

    Before it raises, the peer serves on for ``linger_s``: a TLS refusal shows only on the side that
    dials (the server's failed handshake never reaches Python), and a neighbour that found this peer
    down before it started redials it only after gRPC's reconnect backoff. An asynchronous peer is
    refused for its ``bound`` rounds within a fraction of a second, so without the wait it was gone
    before any neighbour could say, in its own log, which peer it refuses and why.
    """

    def on_round(r: int) -> None:
        if previous is not None:
            previous(r)
        if bound and hasattr(transport, "refused_streak"):
            rounds, causes = transport.refused_streak()
            if rounds >= bound:
                why = "; ".join(f"{p}: {c}" for p, c in sorted(causes.items()))
                if linger_s > 0:
                    time.sleep(linger_s)
                raise RefusedByNeighbours(f"{peer_id}: every neighbour refused it for {rounds} rounds in a row "
                                          f"(up to round {r}): {why}")

    return on_round


def node_main(cfg: ExperimentConfig, peer_id: str, out_dir: Path, certs: Path | None, insecure: bool,
              threads: int, metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
              accept_config_change: bool = False) -> int:
    """``p2pfl node``: SIGTERM/SIGINT stop between rounds; exit 0 when done or stopped cleanly."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.warning("%s: signal %d: stopping after this round", peer_id, signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    run_node(cfg, peer_id, out_dir, certs=certs, insecure=insecure, stop=stop, threads=threads,
             metrics_port=metrics_port, metrics_host=metrics_host, accept_config_change=accept_config_change)
    return 0
