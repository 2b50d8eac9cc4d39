"""Shared set-ups for tests that start real peers: free ports, certificates, clusters of gRPC peers
in threads, ``p2pfl node`` processes, and run-folder readers.

One place for what several test files need (as hivemind keeps its swarm helpers), so each test
says only what it checks. Everything here cleans up after itself and has a bounded timeout.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from p2pfl.config import NetworkConfig
from p2pfl.experiment import Experiment
from p2pfl.modelpool import ModelPool
from p2pfl.models.layout import TensorSpec
from p2pfl.node_process import network_for
from p2pfl.payload import Payload
from p2pfl.security import TLSConfig, make_certs
from p2pfl.topology import Topology, parse_topology
from p2pfl.transport.base import ExchangeResult
from p2pfl.transport.grpc_service import PeerServer, channel_options
from p2pfl.transport.grpc_transport import GrpcTransport, start_grpc_peer

CHUNK = 1024  # bytes: every payload below spans several chunks


CFG_TLS = NetworkConfig(chunk_kb=1, max_message_mb=1, round_timeout_s=5.0)


CFG_INSECURE = NetworkConfig(chunk_kb=1, max_message_mb=1, round_timeout_s=5.0, insecure=True)


def _specs() -> tuple[TensorSpec, ...]:
    out, off = [], 0
    for name, shape in (("body.w", (12, 20)), ("body.b", (20,)), ("body.gn", (3, 7))):
        n = math.prod(shape)
        out.append(TensorSpec(name, shape, off, n))
        off += n
    return tuple(out)


SPECS = _specs()


NUMEL = sum(s.numel for s in SPECS)


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def ring(n: int) -> Topology:
    ports = free_ports(n)
    ids = [f"p{i}" for i in range(n)]
    return parse_topology({
        "name": f"test-ring-{n}",
        "peers": [{"id": p, "address": f"127.0.0.1:{port}"} for p, port in zip(ids, ports, strict=True)],
        "edges": [[ids[i], ids[(i + 1) % n]] for i in range(n)],
    })


def message(topo: Topology, peer: str, r: int, step: int = 0, scalars: dict[str, float] | None = None) -> Payload:
    g = torch.Generator().manual_seed(zlib.crc32(f"{peer}/{r}/{step}".encode()))
    return Payload(peer, r, step, topo.hash(), SPECS, torch.randn(NUMEL, generator=g),
                   {"weight": 0.5} if scalars is None else scalars)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    d = tmp_path_factory.mktemp("certs")
    try:
        make_certs(["p0", "p1", "p2", "p3", "intruder"], d)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


class Cluster:
    """Some peers of a topology, each a started PeerServer and its GrpcTransport."""

    def __init__(self, topo: Topology, peers: Sequence[str], certs: Path | None, *, mode: str = "pull",
                 scalar_keys: Sequence[str] = ("weight",)) -> None:
        self.topo = topo
        self.cfg = CFG_INSECURE if certs is None else CFG_TLS
        self.servers: dict[str, PeerServer] = {}
        self.transports: dict[str, GrpcTransport] = {}
        self.certs = certs
        self.mode = mode
        self.scalar_keys = scalar_keys
        try:
            for p in peers:
                self.start(p)
        except BaseException:
            self.close()
            raise

    def start(self, p: str) -> None:
        tls = TLSConfig.load(self.certs, p) if self.certs else None
        s = PeerServer()
        self.servers[p] = s
        s.start(self.topo.address(p), self.topo, p, expected_specs=SPECS, scalar_keys=self.scalar_keys,
                mode=self.mode, tls=tls, insecure=tls is None, chunk_bytes=CHUNK, max_message_mb=1)
        self.transports[p] = GrpcTransport(p, self.topo, s, tls=tls, network_cfg=self.cfg, expected_specs=SPECS,
                                           scalar_keys=self.scalar_keys)

    def exchange_all(self, msgs: dict[str, Payload], deadline_s: float = 5.0) -> dict[str, ExchangeResult]:
        out: dict[str, ExchangeResult] = {}
        errors: list[BaseException] = []

        def run(p: str) -> None:
            try:
                m = msgs[p]
                plan = self.topo.plan(p, m.round, m.step, mode=self.mode)
                out[p] = self.transports[p].exchange(m, plan, deadline_s)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(p,)) for p in msgs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(deadline_s + 10)
        if errors:
            raise errors[0]
        return out

    def close(self) -> None:
        for t in self.transports.values():
            t.close()
        for s in self.servers.values():
            s.stop(0)


@contextlib.contextmanager
def cluster(topo: Topology, peers: Sequence[str], certs: Path | None, **kw: Any) -> Iterator[Cluster]:
    c = Cluster(topo, peers, certs, **kw)
    try:
        yield c
    finally:
        c.close()


@contextlib.contextmanager
def client_channel(topo: Topology, target: str, certs: Path | None, me: str | None) -> Iterator[grpc.Channel]:
    """A raw channel to ``target`` presenting ``me``'s certificate (or plaintext when certs is None)."""
    addr = topo.address(target)
    if certs is None:
        ch = grpc.insecure_channel(addr, options=channel_options(CHUNK))
    else:
        assert me is not None
        creds = TLSConfig.load(certs, me).channel_credentials()
        ch = grpc.secure_channel(addr, creds, options=channel_options(CHUNK, target))
    try:
        yield ch
    finally:
        ch.close()


def rpc_error(fn: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value  # type: ignore[return-value]


def _below_ephemeral(n: int) -> tuple[int, int]:
    """Where to draw ``n`` listening ports: below the kernel's ephemeral range when there is room (free
    now, a port in that range can be taken by any outgoing connection before the peer binds it)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    return (20000, low - n - 1) if low - n - 1 > 21000 else (20000, 60000)


def free_base_port(n: int = 4) -> int:
    """A base port with ``n`` consecutive free loopback ports."""
    lo, hi = _below_ephemeral(n)
    for _ in range(200):
        base = random.randint(lo, hi)
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def wait_listening(ports: Sequence[int], timeout_s: float = 90.0, procs: Sequence[subprocess.Popen] = ()) -> None:
    """Until every port accepts a TCP connection on loopback (a peer's server is up), bounded; fails at once
    when one of ``procs`` has exited. Tests whose outcome depends on who is up first (not only on what the
    peers do once they meet) start the peers in that order, instead of racing their imports."""
    end = time.monotonic() + timeout_s
    for port in ports:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
                break
            except OSError:
                dead = [p.args for p in procs if p.poll() is not None]
                assert not dead, f"exited before listening: {dead}"
                assert time.monotonic() < end, f"port {port} not listening after {timeout_s:.0f} s"
                time.sleep(0.2)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def params(run: Path, pid: str) -> np.ndarray:
    with np.load(run / "checkpoints" / f"{pid}.npz") as z:
        return z["params"].copy()


def spawn_node(cfg: Path, pid: str, out: Path, certs: Path, log: Path,
               env: dict[str, str] | None = None) -> subprocess.Popen:
    """``p2pfl node`` for ``pid`` (its output appended to ``log``); ``env``: more environment variables."""
    return subprocess.Popen([sys.executable, "-m", "p2pfl.cli", "node", "--config", str(cfg), "--peer", pid,
                             "--out", str(out), "--certs", str(certs)],
                            stdout=open(log, "a"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **env} if env else None)


def run_grpc(cfg, tmp_path: Path) -> tuple[list, list[dict]]:
    """Run ``cfg``'s peers as threads, each with its own gRPC server over mutual TLS (as in
    test_grpc_equivalence); return the nodes and their records."""
    certs = tmp_path / "certs"
    exp = Experiment.from_config(cfg)
    make_certs(list(exp.topology.ids), certs)
    network = network_for(cfg, certs, insecure=False)
    algo = exp.new_algorithm()
    transports = [start_grpc_peer(exp.topology, pid, network, expected_specs=algo.wire_specs(),
                                  scalar_keys=algo.wire_scalars(), seed=cfg.seed, mode=algo.mode)
                  for pid in exp.topology.ids]
    records: list[dict] = []
    errors: list[BaseException] = []
    torch.set_num_threads(1)
    try:
        nodes = [exp.make_node(pid, transport=t, models=ModelPool(exp.model_factory, 1), record=records.append,
                               run_dir=tmp_path / "grpc") for pid, t in zip(exp.topology.ids, transports, strict=True)]

        def run(node) -> None:
            try:
                node.run()
            except BaseException as exc:  # noqa: BLE001 - surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(n,)) for n in nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)
    finally:
        for t in transports:
            t.close()
    return nodes, records
