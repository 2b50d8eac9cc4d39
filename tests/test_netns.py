"""Multi-host deployment without Docker: every peer in its own network namespace, with its own address.

Why this test: a compose deployment puts each peer in its own network stack (own IP, own loopback)
joined to the others by a bridge, and talks mutual TLS between hosts. Network namespaces joined by
veth pairs to a bridge are exactly that, minus the image, so this runs the real ``p2pfl node``
command, with certificates from `make_certs` as in the containers, across separate "hosts", on any
Linux machine where the test may create namespaces (root, or CAP_NET_ADMIN + CAP_SYS_ADMIN).

The lab is isolated: the bridge lives in a dedicated switch namespace and every veth pair is created
directly inside the namespaces it joins, so the root namespace gains no interface, address or
route, and traffic only ever goes to the lab's own addresses. Everything the lab made (namespaces,
and with them their veths and the bridge; node processes) is removed by a finalizer, also when the
test fails. Names carry a random per-run tag, so concurrent runs do not collide.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from p2pfl.security.certs import make_certs
from p2pfl.topology import parse_topology
from tests.conftest import tiny_config

PEERS = ["p0", "p1", "p2", "p3"]
ROUNDS = 3
PORT = 50051
SUBNET = "10.231.0"  # addresses exist only inside the lab's namespaces
RUN_DEADLINE_S = 140.0  # for all nodes together; the test's own timeout is 180 s


@dataclass
class Lab:
    """Namespaces of one test run: ``namespaces[peer]`` has address ``addresses[peer]`` on a shared bridge."""

    tag: str
    switch: str
    namespaces: dict[str, str] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    created: list[str] = field(default_factory=list)

    def exec_argv(self, peer: str, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[peer], *argv]


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {res.stderr.strip()}")


def _netns_unavailable() -> str | None:
    """Why this machine cannot run the lab, or None: tried by adding (and removing) a probe namespace."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux-only"
    if shutil.which("ip") is None:
        return "the iproute2 `ip` command is not installed"
    probe = f"p2pfl-probe-{secrets.token_hex(4)}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        return f"this process may not create network namespaces (`ip netns add`: {res.stderr.strip()})"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _teardown(lab: Lab) -> None:
    """Kill the lab's processes, then delete its namespaces (which destroys their veths and the bridge)."""
    for proc in lab.procs.values():
        _kill_group(proc)
    for ns in reversed(lab.created):
        res = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
        for pid in res.stdout.split():  # anything left running inside the namespace
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    lab.created.clear()


@pytest.fixture
def lab(request: pytest.FixtureRequest) -> Lab:
    reason = _netns_unavailable()
    if reason is not None:
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    tag = secrets.token_hex(3)
    lab = Lab(tag=tag, switch=f"p2pfl-{tag}-sw")
    request.addfinalizer(lambda: _teardown(lab))

    _ip("netns", "add", lab.switch)
    lab.created.append(lab.switch)
    _ip("-n", lab.switch, "link", "set", "lo", "up")
    _ip("-n", lab.switch, "link", "add", "br0", "type", "bridge")
    _ip("-n", lab.switch, "link", "set", "br0", "up")
    for i, peer in enumerate(PEERS):
        ns = f"p2pfl-{tag}-{peer}"
        _ip("netns", "add", ns)
        lab.created.append(ns)
        lab.namespaces[peer] = ns
        lab.addresses[peer] = f"{SUBNET}.{10 + i}"
        _ip("-n", ns, "link", "set", "lo", "up")
        # Both ends are created inside their namespaces: the root namespace never holds them.
        _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"v{peer}", "netns", lab.switch)
        _ip("-n", lab.switch, "link", "set", f"v{peer}", "master", "br0")
        _ip("-n", lab.switch, "link", "set", f"v{peer}", "up")
        _ip("-n", ns, "addr", "add", f"{lab.addresses[peer]}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
    return lab


def _check_reachable(lab: Lab, src: str, dst: str) -> None:
    """A TCP connection from ``src``'s namespace to a listener in ``dst``'s, so a broken lab fails clearly."""
    addr = lab.addresses[dst]
    listener = subprocess.Popen(
        lab.exec_argv(dst, sys.executable, "-c",
                      f"import socket; s = socket.create_server(({addr!r}, 40404)); s.settimeout(20); "
                      "c, _ = s.accept(); c.sendall(b'ok'); c.close()"),
        start_new_session=True,
    )
    lab.procs[f"listener-{dst}"] = listener
    code = ("import socket, time\n"
            "for _ in range(100):\n"
            f"    try: print(socket.create_connection(({addr!r}, 40404), timeout=2).recv(2).decode()); break\n"
            "    except OSError: time.sleep(0.1)\n")
    res = subprocess.run(lab.exec_argv(src, sys.executable, "-c", code), capture_output=True, text=True, timeout=30)
    assert res.stdout.strip() == "ok", f"{src} cannot reach {dst} at {addr}: {res.stderr}"
    listener.wait(timeout=20)


@pytest.mark.timeout(180)
def test_peers_in_separate_network_namespaces_train_over_mutual_tls(lab: Lab, tmp_path: Path) -> None:
    # A tiny synthetic experiment whose topology addresses are the namespaces' own IPs.
    cfg = tiny_config(tmp_path, peers=len(PEERS), rounds=ROUNDS,
                      network={"round_timeout_s": 60, "quorum": 1.0})
    n = len(PEERS)
    topo = parse_topology({
        "name": "netns-ring",
        "peers": [{"id": p, "address": f"{lab.addresses[p]}:{PORT}"} for p in PEERS],
        "edges": [[PEERS[i], PEERS[(i + 1) % n]] for i in range(n)],
    })
    topo.dump(tmp_path / "topology.yaml")  # the file the config names
    certs = tmp_path / "certs"
    make_certs(PEERS, certs)  # peer id as CN and DNS SAN, as `p2pfl certs` makes them for the containers
    run_dir = tmp_path / "run"
    logs = tmp_path / "logs"
    logs.mkdir()

    _check_reachable(lab, PEERS[0], PEERS[2])

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "P2PFL_NO_DOWNLOAD": "1"}
    for peer in PEERS:
        argv = lab.exec_argv(peer, sys.executable, "-m", "p2pfl.cli", "node", "--config", str(cfg),
                             "--peer", peer, "--certs", str(certs), "--out", str(run_dir))
        with open(logs / f"{peer}.log", "wb") as log:
            lab.procs[peer] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                               start_new_session=True)

    deadline = time.monotonic() + RUN_DEADLINE_S
    while time.monotonic() < deadline and any(lab.procs[p].poll() is None for p in PEERS):
        time.sleep(0.5)

    def tails() -> str:
        return "\n".join(f"--- {p} (exit {lab.procs[p].poll()}) ---\n"
                         + (logs / f"{p}.log").read_text(errors="replace")[-3000:] for p in PEERS)

    running = [p for p in PEERS if lab.procs[p].poll() is None]
    assert not running, f"nodes still running after {RUN_DEADLINE_S:.0f}s: {running}\n{tails()}"
    codes = {p: lab.procs[p].returncode for p in PEERS}
    assert all(c == 0 for c in codes.values()), f"exit codes {codes}\n{tails()}"

    for peer in PEERS:
        path = run_dir / f"metrics-{peer}.jsonl"
        assert path.is_file(), f"{peer} wrote no {path.name}\n{tails()}"
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        assert {r["round"] for r in recs} == set(range(ROUNDS)), f"{peer}: rounds {[r['round'] for r in recs]}"
        assert all(r["peer"] == peer for r in recs)
        # quorum 1.0 already makes every exchange wait for both ring neighbours; this says bytes moved
        if all("bytes_recv" in r for r in recs):
            assert sum(r["bytes_recv"] for r in recs) > 0, f"{peer} received nothing"
        if all("missing" in r for r in recs):
            assert not any(r["missing"] for r in recs), f"{peer}: neighbours missing {[r['missing'] for r in recs]}"
        assert (run_dir / "checkpoints" / f"{peer}.npz").is_file(), f"{peer} wrote no checkpoint"
