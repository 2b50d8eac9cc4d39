"""A peer whose neighbours would refuse it fails loud, not alone (issue 68, part 3).

Its own certificate is checked at start (another CA's, expired, another id's, a key of another
certificate: one line ``error: FILE: problem``, exit 2, nothing written); ``p2pfl certs`` says when
the certificates expire and ``/metrics`` how many days are left; a peer that every neighbour
refuses (a topology one edge off, certificates of another deployment) stops non-zero within
``network.refused_rounds`` rounds and names the cause, and its neighbours' logs name it.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from p2pfl.node_metrics import NodeMetrics, parse_exposition
from p2pfl.security.certs import CertificateProblem, TLSConfig, check_own_certificate, make_certs
from p2pfl.transport.refusals import RefusalTracker, refusal_cause
from tests.conftest import tiny_config
from tests.swarm import free_base_port, spawn_node, wait_listening

PEERS = ["p0", "p1", "p2", "p3"]


def _expired_cert(certs: Path, peer: str) -> None:
    """Replace ``peer``'s certificate with one the right CA signed whose validity ended 35 days ago."""
    ca_key = serialization.load_pem_private_key((certs / "ca.key").read_bytes(), password=None)
    ca = x509.load_pem_x509_certificate((certs / "ca.crt").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, peer)]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=400)).not_valid_after(now - dt.timedelta(days=35))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(peer)]), critical=False)
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    (certs / f"{peer}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (certs / f"{peer}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))


def _another_ca(certs: Path, peer: str) -> None:
    other = certs.parent / "other-ca"
    make_certs(PEERS, other)
    for ext in ("crt", "key"):
        shutil.copy(other / f"{peer}.{ext}", certs / f"{peer}.{ext}")


def _wrong_id(certs: Path, peer: str) -> None:
    for ext in ("crt", "key"):
        shutil.copy(certs / f"p2.{ext}", certs / f"{peer}.{ext}")


def _other_key(certs: Path, peer: str) -> None:
    shutil.copy(certs / "p1.key", certs / f"{peer}.key")


CERT_CASES = [
    ("another-ca", _another_ca, "p0.crt: not signed by the CA in"),
    ("expired", _expired_cert, "p0.crt: expired on"),
    ("wrong-id", _wrong_id, "p0.crt: is for peer 'p2', not 'p0'"),
    ("other-key", _other_key, "p0.key: does not match"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("name", "spoil", "needle"), CERT_CASES, ids=[c[0] for c in CERT_CASES])
def test_a_peer_with_a_certificate_its_neighbours_would_refuse_does_not_start(
        tmp_path: Path, name: str, spoil, needle: str) -> None:
    cfg = tiny_config(tmp_path, base_port=free_base_port())
    certs, out = tmp_path / "certs", tmp_path / "run"
    make_certs(PEERS, certs)
    spoil(certs, "p0")
    proc = subprocess.run([sys.executable, "-m", "p2pfl.cli", "node", "--config", str(cfg), "--peer", "p0",
                           "--out", str(out), "--certs", str(certs)], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr[-2000:]
    assert not out.exists()  # nothing written: no run folder
    with pytest.raises(CertificateProblem):  # the library path (run_node) refuses the same way
        check_own_certificate(TLSConfig.load(certs, "p0"))


def test_certs_prints_the_expiry_and_metrics_count_the_days_left(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, base_port=free_base_port())
    before = dt.datetime.now(dt.UTC)
    proc = subprocess.run([sys.executable, "-m", "p2pfl.cli", "certs", "--config", str(cfg), "--out",
                           str(tmp_path / "certs")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    # the date is taken on both sides of the command: UTC midnight may pass while it runs
    expiries = {(t + dt.timedelta(days=365)).strftime("%Y-%m-%d") for t in (before, dt.datetime.now(dt.UTC))}
    assert any(f"expire on {e}" in proc.stdout for e in expiries), proc.stdout
    own = check_own_certificate(TLSConfig.load(tmp_path / "certs", "p0"))
    assert 364 < own.days_left() <= 365
    m = NodeMetrics("p0", ["p1"], 3)
    m.certificate(own.not_after.timestamp(), 30)
    got = parse_exposition(m.render())
    assert 364 < got["p2pfl_certificate_days_left"][(("peer", "p0"),)] <= 365
    assert got["p2pfl_certificate_expiring"][(("peer", "p0"),)] == 0
    m.certificate(time.time() + 10 * 86400, 30)
    assert parse_exposition(m.render())["p2pfl_certificate_expiring"][(("peer", "p0"),)] == 1


def test_refusals_are_told_apart_from_silence() -> None:
    assert refusal_cause("FAILED_PRECONDITION: topology hash 'a' differs from this peer's 'b'")
    assert refusal_cause("PERMISSION_DENIED: peer 'p2' is not an out-neighbour of 'p0'")
    assert refusal_cause("UNAVAILABLE: failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: "
                         "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL "
                         "routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate")
    assert refusal_cause("UNAVAILABLE: failed to connect to all addresses; last error: UNAVAILABLE: "
                         "ipv4:127.0.0.1:1: Socket closed")
    assert refusal_cause("UNAVAILABLE: failed to connect to all addresses; last error: UNAVAILABLE: "
                         "ipv4:127.0.0.1:1: Connection refused") is None
    assert refusal_cause("DEADLINE_EXCEEDED: Deadline Exceeded") is None
    t = RefusalTracker("p2")
    for r in range(3):
        t.note(r, "p1", "FAILED_PRECONDITION: topology hash")
        t.note(r, "p3", "PERMISSION_DENIED: not a neighbour")
        assert t.streak()[0] == r + 1
    assert set(t.streak()[1]) == {"p1", "p3"}
    t.note(3, "p1", "FAILED_PRECONDITION: topology hash")
    t.note(3, "p3", "DEADLINE_EXCEEDED: Deadline Exceeded")  # one silent neighbour: not refused by all
    assert t.streak() == (0, {})
    t.note(4, "p1", "FAILED_PRECONDITION: topology hash")
    t.note(4, "p3", "FAILED_PRECONDITION: topology hash")
    t.note(4, "p3", None)  # it answered in a later step: it accepts this peer
    assert t.streak() == (0, {})


def _one_edge_off(tmp_path: Path, cfg: Path) -> Path:
    """A copy of ``cfg`` whose topology has one more edge (p0-p2): another topology hash."""
    topo = yaml.safe_load((tmp_path / "topology.yaml").read_text())
    topo["edges"].append(["p0", "p2"])
    (tmp_path / "topology-off.yaml").write_text(yaml.safe_dump(topo))
    raw = yaml.safe_load(cfg.read_text())
    raw["topology"] = str(tmp_path / "topology-off.yaml")
    path = tmp_path / "config-off.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _certs_of_another_deployment(tmp_path: Path, cfg: Path) -> Path:
    """p2 gets a whole certificate folder of another CA: its own check passes, every handshake fails."""
    make_certs(PEERS, tmp_path / "certs-other")
    return cfg


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("how", "cause", "mode"), [("topology", "topology hash", "sync"),
                                                    ("tls", "TLS handshake failed", "sync"),
                                                    ("topology", "topology hash", "async"),
                                                    ("tls", "TLS handshake failed", "async")])
def test_a_peer_every_neighbour_refuses_stops_within_the_bound(tmp_path: Path, how: str, cause: str, mode: str) -> None:
    """The three good peers run far more rounds than the test watches (they are killed at its end) and are
    serving before p2 starts: so p2 meets running neighbours from its first round, and they are still there to
    log whom they refuse. (With 12 rounds each, a loaded machine let one side finish before the other had
    imported torch: p2 ran its rounds against silence, or a neighbour never called p2 at all; CI of 556af95.
    1000 rounds were not enough either: while p2 is down the good peers run about 100 rounds a second here,
    so they were done in about 10 s, and a loaded CI took longer than that to start p2; CI of 933e7bf.
    A million rounds last hours at that rate, and nothing is sized by the round count.)"""
    rounds, bound = 1_000_000, 3
    base = free_base_port()
    cfg = tiny_config(tmp_path, base_port=base, rounds=rounds,
                      network={"round_timeout_s": 3.0, "probe_s": 0.5, "refused_rounds": bound, "mode": mode})
    out, certs = tmp_path / "run", tmp_path / "certs"
    make_certs(PEERS, certs)
    bad_cfg = _one_edge_off(tmp_path, cfg) if how == "topology" else _certs_of_another_deployment(tmp_path, cfg)
    bad_certs = certs if how == "topology" else tmp_path / "certs-other"
    procs = {pid: spawn_node(cfg, pid, out, certs, tmp_path / f"{pid}.log") for pid in ("p0", "p1", "p3")}
    try:
        wait_listening([base + PEERS.index(pid) for pid in procs], procs=list(procs.values()))
        procs["p2"] = spawn_node(bad_cfg, "p2", out, bad_certs, tmp_path / "p2.log")
        code = procs["p2"].wait(150)
        log = (tmp_path / "p2.log").read_text()
        assert code == 1, log[-3000:]
        last = log.strip().splitlines()[-1]
        assert last.startswith(f"error: p2: every neighbour refused it for {bound} rounds in a row"), last
        assert "p1: " in last and "p3: " in last and cause in last, last
        done = [line for line in (out / "metrics-p2.jsonl").read_text().splitlines() if line.strip()]
        assert len(done) <= bound + 1  # stopped within the bound (round 0 may wait out a TLS deadline)
        # the neighbours' logs say whom they refuse (or cannot reach through TLS), and why. A TLS refusal
        # shows only on the side that dials (the server's handshake never reaches Python): an asynchronous
        # p2 is refused for its 3 rounds within a fraction of a second, so it serves on for gRPC's longest
        # reconnect backoff and a probe (`stop_when_refused`'s linger) before it exits, and a neighbour that
        # found it down (it was not up yet) redials it in that time and names it.
        for pid in ("p1", "p3"):
            text = (tmp_path / f"{pid}.log").read_text()
            if how == "topology":
                assert "from p2: FAILED_PRECONDITION: topology hash" in text, text[-3000:]
            else:
                assert "calls to neighbour p2 are refused: TLS handshake failed" in text, text[-3000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
