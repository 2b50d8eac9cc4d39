"""The peer service under a hostile or broken caller: fair quotas, server-side deadlines, bounded
stop(), bounded logs, and the smaller holes of issue 10 (Status, two-CN certificates, scalars in
the checksum, the CA key's place). Real gRPC servers over mutual TLS on loopback."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import stat
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from p2pfl.config import NetworkConfig
from p2pfl.models.layout import TensorSpec
from p2pfl.payload import Payload
from p2pfl.proto import peer_pb2, peer_pb2_grpc
from p2pfl.security import TLSConfig, caller_peer_id, make_certs
from p2pfl.topology import Topology, parse_topology
from p2pfl.transport.grpc_service import PULL_METHOD, PUSH_METHOD, PeerServer, channel_options
from p2pfl.transport.grpc_transport import GrpcTransport
from p2pfl.transport.limits import RateLimitedLog, bounded
from p2pfl.wire import Expectation, Reason, WireError, decode, encode, scalars_crc
from tests.swarm import CHUNK, SPECS, certs, client_channel, free_ports, message, ring, rpc_error

__all__ = ["certs"]  # the module-scoped certificate fixture (p0..p3 and "intruder"), shared

S = grpc.StatusCode
LOG = "p2pfl.transport.grpc_service"


def _complete(n: int) -> Topology:
    ids = [f"p{i}" for i in range(n)]
    return parse_topology({
        "name": f"test-complete-{n}",
        "peers": [{"id": p, "address": f"127.0.0.1:{port}"} for p, port in zip(ids, free_ports(n), strict=True)],
        "edges": [[a, b] for i, a in enumerate(ids) for b in ids[i + 1:]],
    })


def _server(topo: Topology, peer: str, certs: Path, *, specs: tuple[TensorSpec, ...] = SPECS, mode: str = "pull",
            chunk: int = CHUNK, **kw: Any) -> PeerServer:
    s = PeerServer()
    s.start(topo.address(peer), topo, peer, expected_specs=specs, scalar_keys=["weight"], mode=mode,
            tls=TLSConfig.load(certs, peer), chunk_bytes=chunk, max_message_mb=8, **kw)
    return s


@contextlib.contextmanager
def _serving(topo: Topology, peer: str, certs: Path, **kw: Any) -> Iterator[PeerServer]:
    s = _server(topo, peer, certs, **kw)
    try:
        yield s
    finally:
        s.stop(0)


def _wait_until(cond: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


def _no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert not bad, [r.getMessage()[:200] for r in bad]


# ---- fair service: one neighbour cannot starve the others (issue 10, item 3) --------------------------

BIG = (TensorSpec("body.w", (1024, 1024), 0, 1 << 20),)  # 4 MiB: far more than a stream's flow-control window


def _big(topo: Topology, peer: str, r: int) -> Payload:
    g = torch.Generator().manual_seed(zlib.crc32(f"{peer}/{r}".encode()))
    return Payload(peer, r, 0, topo.hash(), BIG, torch.randn(1 << 20, generator=g), {"weight": 0.25})


@pytest.mark.timeout(120)
def test_one_neighbour_with_a_valid_certificate_cannot_starve_the_others(certs: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """24 Pulls it never reads + 24 Pulls of a step never published, all from p1 (a neighbour, valid
    certificate, no client deadline): p1 gets its quota and RESOURCE_EXHAUSTED for the rest at once,
    the other neighbours get their round, and the server cuts p1's calls after its own deadlines."""
    topo = _complete(4)
    ids = list(topo.ids)
    cfg = NetworkConfig(chunk_kb=1024, max_message_mb=8, round_timeout_s=20.0)
    servers: dict[str, PeerServer] = {}
    transports: dict[str, GrpcTransport] = {}
    try:
        for p in ids:
            servers[p] = _server(topo, p, certs, specs=BIG, chunk=1 << 20, max_wait_s=12.0,
                                 max_call_s=16.0)
            transports[p] = GrpcTransport(p, topo, servers[p], tls=TLSConfig.load(certs, p), network_cfg=cfg,
                                          expected_specs=BIG, scalar_keys=["weight"])
        p0 = servers["p0"]
        quota = 8  # PeerServer's default max_calls_per_peer
        assert p0._executor is not None and p0._executor._max_workers >= 3 * quota + 4  # the quota binds, not the pool
        p0.publish(_big(topo, "p0", 0))

        # the attacker's own client: no flow-control window growth, so what it does not read stays unsent
        creds = TLSConfig.load(certs, "p1").channel_credentials()
        opts = [*channel_options(1 << 20, "p0"), ("grpc.http2.bdp_probe", 0)]
        with grpc.secure_channel(topo.address("p0"), creds, options=opts) as ch:
            pull = ch.unary_stream(PULL_METHOD, request_serializer=peer_pb2.PullRequest.SerializeToString,
                                   response_deserializer=lambda b: b)
            h = topo.hash()
            unread: list[Any] = []
            never: list[Any] = []
            for _ in range(24):  # interleaved, so that (usually) both kinds are admitted
                unread.append(pull(peer_pb2.PullRequest(requester="p1", round=0, step=0, topology_hash=h)))
                never.append(pull(peer_pb2.PullRequest(requester="p1", round=0, step=7, topology_hash=h)))
            calls = unread + never
            t0 = time.monotonic()
            # the excess is refused at once; what is admitted waits (unpublished) or stalls (unread)

            def refused() -> list[Any]:
                return [c for c in calls if c.done() and c.code() == S.RESOURCE_EXHAUSTED]

            assert _wait_until(lambda: len(refused()) >= len(calls) - quota, 10.0)
            assert time.monotonic() - t0 < 10.0  # answered at once, not after a server-side deadline
            assert "peer 'p1' has 8 calls in progress on 'p0' already (the limit)" in (refused()[0].details() or "")
            assert p0.calls_in_progress("p1") == quota

            # meanwhile the others get their round (p1 too runs its round: it serves, and pulls within its quota)
            round0 = {p: _big(topo, p, 0) for p in ids}
            results: dict[str, Any] = {}

            def run(p: str) -> None:
                results[p] = transports[p].exchange(round0[p], topo.plan(p, 0), 15.0)

            threads = [threading.Thread(target=run, args=(p,)) for p in ids]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            for p in ("p0", "p2", "p3"):
                assert results[p].missing == [], (p, results[p].missing)
                for q, m in results[p].received.items():
                    assert torch.equal(m.flat, round0[q].flat)
            assert p0.calls_in_progress("p1") == quota  # p1's calls were still holding their slots throughout

            # server-side deadlines: p1 set none, yet its calls end (waits after max_wait_s, streams at max_call_s)
            assert _wait_until(lambda: p0.calls_in_progress() == 0, 30.0)
            assert _wait_until(lambda: all(c.done() for c in never), 5.0)
            assert {c.code() for c in never} <= {S.RESOURCE_EXHAUSTED, S.DEADLINE_EXCEEDED}
            assert len(refused()) == len(calls) - quota
            if any(c.code() != S.RESOURCE_EXHAUSTED for c in unread if c.done()) or sum(
                    c.code() == S.DEADLINE_EXCEEDED for c in never) < quota:  # some unread streams were admitted
                assert any("p0: cut Pull from p1 after" in r.getMessage() for r in caplog.records)
            for c in calls:
                c.cancel()
    finally:
        for t in transports.values():
            t.close()
        for s in servers.values():
            s.stop(0)


@pytest.mark.timeout(60)
def test_a_push_stream_that_stalls_is_cut_by_the_server(certs: Path, caplog: pytest.LogCaptureFixture) -> None:
    topo = ring(3)
    good = encode(message(topo, "p1", 0), CHUNK)
    release = threading.Event()

    def stalled() -> Iterator[peer_pb2.Chunk]:
        yield good[0]
        yield good[1]
        release.wait(30)  # then nothing more: a caller that trickles, with no deadline of its own

    caplog.set_level(logging.WARNING, LOG)
    with _serving(topo, "p0", certs, mode="push", max_call_s=2.0) as s, client_channel(topo, "p0", certs, "p1") as ch:
        t0 = time.monotonic()
        fut = peer_pb2_grpc.PeerStub(ch).Push.future(stalled())
        assert _wait_until(lambda: s.calls_in_progress("p1") == 1, 5.0)
        err = rpc_error(lambda: fut.result(timeout=20))
        release.set()
        assert err.code() == S.CANCELLED
        assert 1.5 <= time.monotonic() - t0 < 15.0
        assert _wait_until(lambda: s.calls_in_progress() == 0, 5.0)
        assert s.inbox == {}
        assert any("cut Push from p1" in r.getMessage() and "call limit is 2s" in r.getMessage()
                   for r in caplog.records)


@pytest.mark.timeout(60)
def test_pull_of_an_unpublished_step_ends_without_a_client_deadline(certs: Path) -> None:
    topo = ring(3)
    with _serving(topo, "p0", certs, max_wait_s=1.0) as s, client_channel(topo, "p0", certs, "p1") as ch:
        req = peer_pb2.PullRequest(requester="p1", round=0, step=3, topology_hash=topo.hash())
        t0 = time.monotonic()
        err = rpc_error(lambda: list(peer_pb2_grpc.PeerStub(ch).Pull(req)))  # no timeout
        assert err.code() == S.DEADLINE_EXCEEDED
        assert "was not published within 1.0s" in (err.details() or "")
        assert time.monotonic() - t0 < 10.0
        assert s.calls_in_progress() == 0


# ---- stop() is bounded ------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_stop_is_bounded_after_thousands_of_malformed_pushes(certs: Path, caplog: pytest.LogCaptureFixture) -> None:
    topo = ring(3)
    caplog.set_level(logging.WARNING)
    good = encode(message(topo, "p1", 0), CHUNK)
    bad_crc = [good[0], peer_pb2.Chunk(data=b"\x00" * len(good[1].data)), *good[2:]]
    s = _server(topo, "p0", certs, mode="push", max_call_s=60.0)
    release = threading.Event()
    try:
        with client_channel(topo, "p0", certs, "p1") as ch:
            raw = ch.stream_unary(PUSH_METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            stub = peer_pb2_grpc.PeerStub(ch)
            errors: list[grpc.StatusCode] = []

            def flood(k: int) -> None:
                for i in range(k):
                    try:
                        if i % 2:
                            raw(iter([b"\xff\xfe\xfd"]), timeout=10)  # not a protobuf message at all
                        else:
                            stub.Push(iter(bad_crc), timeout=10)
                    except grpc.RpcError as e:
                        errors.append(e.code())

            threads = [threading.Thread(target=flood, args=(500,)) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(100)
            assert len(errors) == 2000
            assert set(errors) <= {S.INVALID_ARGUMENT, S.DATA_LOSS, S.RESOURCE_EXHAUSTED}, set(errors)

            def stalled() -> Iterator[peer_pb2.Chunk]:
                yield good[0]
                release.wait(60)

            hanging = [stub.Push.future(stalled()) for _ in range(3)]  # in flight when stop() comes
            assert _wait_until(lambda: s.calls_in_progress("p1") == 3, 10.0)
            t0 = time.monotonic()
            assert s.stop(grace=0.5, timeout_s=5.0) is True
            assert time.monotonic() - t0 < 6.0
            assert not s.started
            for f in hanging:
                assert rpc_error(lambda f=f: f.result(timeout=10)).code() in (S.CANCELLED, S.UNAVAILABLE)
        _no_tracebacks(caplog)
        # 2000 rejections from one caller: a bounded number of log lines
        lines = [r for r in caplog.records if r.name == LOG and "rejected Push" in r.getMessage()]
        assert 0 < len(lines) <= 2 * 20, len(lines)
    finally:
        release.set()
        s.stop(0)


@pytest.mark.timeout(60)
def test_stop_gives_up_loudly_when_calls_do_not_end(certs: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A handler stuck where neither gRPC's cancel nor the stop flag reaches it, and a gRPC shutdown
    that never reports done (what issue 10 saw after thousands of malformed pushes): stop() returns."""
    topo = ring(3)
    stuck, release = threading.Event(), threading.Event()

    def wait_forever(self: PeerServer, key: tuple[int, int], context: Any) -> None:
        stuck.set()
        release.wait(40)
        return None

    monkeypatch.setattr(PeerServer, "_wait_published", wait_forever)
    s = _server(topo, "p0", certs, max_call_s=60.0)
    real = s._server
    assert real is not None

    class NeverDone:  # the real server, whose shutdown event never fires
        def stop(self, grace: float | None) -> threading.Event:
            real.stop(grace)
            return threading.Event()

    try:
        with client_channel(topo, "p0", certs, "p1") as ch:
            req = peer_pb2.PullRequest(requester="p1", round=0, step=0, topology_hash=topo.hash())
            fut = peer_pb2_grpc.PeerStub(ch).Pull(req, timeout=30)
            assert stuck.wait(10)
            s._server = NeverDone()  # type: ignore[assignment]
            t0 = time.monotonic()
            assert s.stop(grace=0.2, timeout_s=1.0) is False
            assert time.monotonic() - t0 < 4.0
            assert not s.started
            errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
            assert any("the peer service did not stop within 1.2s (1 calls still running)" in m for m in errors), errors
            fut.cancel()
    finally:
        release.set()
        real.stop(0)


# ---- the smaller holes --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_status_answers_only_peers_of_the_topology(certs: Path) -> None:
    topo = ring(4)  # p0's neighbours are p1 and p3; p2 is in the topology; "intruder" is not
    with _serving(topo, "p0", certs) as s:
        s.publish(message(topo, "p0", 1))
        for who in ("p1", "p2"):
            with client_channel(topo, "p0", certs, who) as ch:
                st = peer_pb2_grpc.PeerStub(ch).Status(peer_pb2.StatusRequest(), timeout=5)
                assert (st.peer_id, st.round) == ("p0", 1)
        with client_channel(topo, "p0", certs, "intruder") as ch:
            err = rpc_error(lambda: peer_pb2_grpc.PeerStub(ch).Status(peer_pb2.StatusRequest(), timeout=5))
            assert err.code() == S.PERMISSION_DENIED
            assert "peer 'intruder' is not in the topology of 'p0'" in (err.details() or "")


def _assert_clean(text: str, limit: int = 1024) -> None:
    assert len(text) <= limit, len(text)
    assert text.isprintable(), repr(text[:100])


@pytest.mark.timeout(60)
def test_caller_strings_are_bounded_in_details_and_logs(certs: Path, caplog: pytest.LogCaptureFixture) -> None:
    topo = ring(3)
    huge = "\x1b[31m" + "A" * 500_000 + "\n\x00\u202e"
    caplog.set_level(logging.WARNING, LOG)
    with _serving(topo, "p0", certs, mode="push") as s, client_channel(topo, "p0", certs, "p1") as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        cases = [
            lambda: list(stub.Pull(peer_pb2.PullRequest(requester=huge, round=0, step=0, topology_hash="h"), timeout=5)),
            lambda: list(stub.Pull(peer_pb2.PullRequest(requester="p1", round=0, step=0, topology_hash=huge), timeout=5)),
        ]
        good = encode(message(topo, "p1", 0), CHUNK)
        for field in ("sender", "topology_hash"):
            head = peer_pb2.Chunk()
            head.CopyFrom(good[0])
            setattr(head.header, field, huge)
            cases.append(lambda head=head: stub.Push(iter([head, *good[1:]]), timeout=5))
        head = peer_pb2.Chunk()
        head.CopyFrom(good[0])
        head.header.manifest[0].name = huge
        cases.append(lambda head=head: stub.Push(iter([head, *good[1:]]), timeout=5))
        for case in cases:
            caplog.clear()
            err = rpc_error(case)
            assert err.code() in (S.PERMISSION_DENIED, S.FAILED_PRECONDITION, S.INVALID_ARGUMENT), err.code()
            _assert_clean(err.details() or "")
            assert "AAAA" in (err.details() or "")  # an excerpt, not nothing
            msgs = [r.getMessage() for r in caplog.records if r.name == LOG]
            assert msgs
            for m in msgs:
                _assert_clean(m, 1200)
        assert s.inbox == {}
    assert bounded("a\x1bb" * 1000, 50) == "a\\x1bba\\x1bba\\x1bba\\x1bba\\... (3000 chars)"
    assert bounded("short\tline") == "short\\tline"


@pytest.mark.timeout(60)
def test_undecodable_messages_are_refused_in_one_line(certs: Path, caplog: pytest.LogCaptureFixture) -> None:
    topo = ring(3)
    caplog.set_level(logging.DEBUG)
    with _serving(topo, "p0", certs, mode="push") as s, client_channel(topo, "p0", certs, "p1") as ch:
        raw_push = ch.stream_unary(PUSH_METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        raw_pull = ch.unary_stream(PULL_METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        good = encode(message(topo, "p1", 0), CHUNK)

        err = rpc_error(lambda: raw_push(iter([b"\xff\xff\xff"]), timeout=5))
        assert err.code() == S.INVALID_ARGUMENT
        assert "chunk 0 (3 bytes) is not a valid Chunk message" in (err.details() or "")
        # garbage after a good header: refused naming the chunk
        err = rpc_error(lambda: raw_push(iter([good[0].SerializeToString(), b"\x12\xff\x01"]), timeout=5))
        assert err.code() == S.INVALID_ARGUMENT
        assert "chunk 1 (3 bytes) is not a valid Chunk message" in (err.details() or "")
        err = rpc_error(lambda: list(raw_pull(b"\x0a\xff\xff\xff", timeout=5)))
        assert err.code() == S.INVALID_ARGUMENT
        assert "is not a valid Pull request message" in (err.details() or "")
        lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(lines) == 3, [r.getMessage() for r in lines]
        assert all(r.name == LOG for r in lines)
        _no_tracebacks(caplog)

        # repeated rejections from one caller are rate-limited, then summarized
        caplog.clear()
        for _ in range(60):
            rpc_error(lambda: raw_push(iter([b"\xff"]), timeout=5))
        lines = [r for r in caplog.records if r.name == LOG]
        assert len(lines) <= 20, len(lines)
        assert s.inbox == {}


def test_rate_limited_log_summarizes_what_it_suppressed(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.ratelimit")
    caplog.set_level(logging.INFO, "test.ratelimit")
    rl = RateLimitedLog(logger, burst=3, interval_s=0.3)
    logged = [rl(logging.WARNING, "p1", "bad %d", i) for i in range(10)]
    assert logged == [True] * 3 + [False] * 7
    assert rl(logging.WARNING, "p2", "other") is True  # another caller has its own quota
    time.sleep(0.35)
    assert rl(logging.WARNING, "p1", "bad again") is True
    assert "7 similar messages about this caller suppressed" in caplog.records[-1].getMessage()


def _two_cn_cert(certs: Path, tmp: Path) -> TLSConfig:
    """A certificate the deployment CA signed, whose subject has two CNs (p1, then p2) and both as SANs."""
    ca_key = serialization.load_pem_private_key((certs / "ca.key").read_bytes(), password=None)
    ca = x509.load_pem_x509_certificate((certs / "ca.crt").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "p1"),
                                 x509.NameAttribute(NameOID.COMMON_NAME, "p2")]))
        .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("p1"), x509.DNSName("p2")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    (tmp / "ca.crt").write_bytes((certs / "ca.crt").read_bytes())
    (tmp / "p1.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp / "p1.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
    return TLSConfig.load(tmp, "p1")


@pytest.mark.timeout(60)
def test_a_certificate_with_two_common_names_is_refused(certs: Path, tmp_path: Path) -> None:
    topo = ring(3)
    tls = _two_cn_cert(certs, tmp_path)
    pem = tls.cert.read_bytes()

    class Ctx:
        def auth_context(self) -> dict[str, list[bytes]]:  # what gRPC reports: one CN only
            return {"transport_security_type": [b"ssl"], "x509_common_name": [b"p1"],
                    "x509_subject_alternative_name": [b"p1", b"p2"], "x509_pem_cert": [pem]}

    assert caller_peer_id(Ctx()) is None
    with _serving(topo, "p0", certs) as s:
        s.publish(message(topo, "p0", 0))
        ch = grpc.secure_channel(topo.address("p0"), tls.channel_credentials(), options=channel_options(CHUNK, "p0"))
        try:
            req = peer_pb2.PullRequest(requester="p1", round=0, step=0, topology_hash=topo.hash())
            err = rpc_error(lambda: list(peer_pb2_grpc.PeerStub(ch).Pull(req, timeout=5)))
            assert err.code() == S.UNAUTHENTICATED
            assert "no usable peer certificate" in (err.details() or "")
        finally:
            ch.close()
        assert s.pulls_served == 0
        # the same peer with its own certificate is served
        with client_channel(topo, "p0", certs, "p1") as ch2:
            assert list(peer_pb2_grpc.PeerStub(ch2).Pull(req, timeout=5))


def _expect(topo: Topology) -> Expectation:
    return Expectation(specs=SPECS, round=0, step=0, topology_hash=topo.hash(), senders=frozenset({"p1"}),
                       scalar_keys=frozenset({"weight"}), max_bytes=1 << 20)


@pytest.mark.timeout(60)
def test_header_scalars_are_inside_the_checksum(certs: Path) -> None:
    topo = ring(3)
    good = encode(message(topo, "p1", 0, scalars={"weight": 0.5}), CHUNK)
    assert good[0].header.wire_version == 2
    tensor_crc = zlib.crc32(b"".join(c.data for c in good[1:]))
    assert good[0].header.crc32 != tensor_crc  # the scalars are in it
    plain = encode(message(topo, "p1", 0, scalars={}), CHUNK)
    assert scalars_crc({}) == 0 and plain[0].header.crc32 == tensor_crc  # none: the tensor bytes' CRC alone

    def with_header(fn: Any) -> list[peer_pb2.Chunk]:
        head = peer_pb2.Chunk()
        head.CopyFrom(good[0])
        fn(head.header)
        return [head, *good[1:]]

    flipped = with_header(lambda h: h.scalars.__setitem__("weight", 0.25))  # a push-sum weight corrupted
    with pytest.raises(WireError) as info:
        decode(flipped, _expect(topo))
    assert info.value.code == Reason.CHECKSUM
    old = with_header(lambda h: setattr(h, "wire_version", 0))  # a sender from before the scalars were covered
    with pytest.raises(WireError) as info:
        decode(old, _expect(topo))
    assert info.value.code == Reason.VERSION and "wire version 0" in info.value.message
    assert decode(good, _expect(topo)).scalars == {"weight": 0.5}

    with _serving(topo, "p0", certs, mode="push") as s, client_channel(topo, "p0", certs, "p1") as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        err = rpc_error(lambda: stub.Push(iter(flipped), timeout=5))
        assert err.code() == S.DATA_LOSS and "scalars included" in (err.details() or "")
        err = rpc_error(lambda: stub.Push(iter(old), timeout=5))
        assert err.code() == S.FAILED_PRECONDITION and "wire version 0" in (err.details() or "")
        assert s.inbox == {}


def test_the_ca_key_can_live_outside_the_certificate_folder(tmp_path: Path) -> None:
    out, private = tmp_path / "certs", tmp_path / "private" / "ca"
    out.mkdir()
    (out / "ca.key").write_text("stale key of an older layout")
    make_certs(["p0", "p1"], out, ca_key_dir=private)
    assert not (out / "ca.key").exists()
    assert stat.S_IMODE((private / "ca.key").stat().st_mode) == 0o600
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    x509.load_pem_x509_certificate((out / "p1.crt").read_bytes()).verify_directly_issued_by(ca)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    make_certs(["p0", "p1", "p2"], out, ca_key_dir=private)  # idempotent with the key kept aside
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert all(after[k] == v for k, v in before.items()) and "p2.crt" in after and "ca.key" not in after


def test_certs_command_keeps_the_ca_key_aside(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from p2pfl.cli import app
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path)
    out, private = tmp_path / "certs", tmp_path / "ca-private"
    res = CliRunner().invoke(app, ["certs", "--config", str(cfg), "--out", str(out), "--ca-key-dir", str(private)])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == sorted(["ca.crt", *(f"p{i}.{e}" for i in range(4) for e in ("crt", "key"))])
    assert (private / "ca.key").is_file()


def test_call_limits_quota_per_neighbour_and_one_shared_by_the_rest() -> None:
    from p2pfl.transport.limits import UNKNOWN, CallLimits

    lim = CallLimits({"p1", "p3"}, per_peer=2, unknown=3)
    assert lim.workers == 2 * 2 + 3 + 4
    assert [lim.enter("p1") for _ in range(3)] == [("p1", 2), ("p1", 2), None]
    assert lim.enter("p3") == ("p3", 2)  # another neighbour is not affected
    assert [lim.enter(who) for who in ("intruder", "p2", None, "x")] == [(UNKNOWN, 3)] * 3 + [None]
    lim.leave("p1")
    assert lim.enter("p1") == ("p1", 2) and lim.active("p1") == 2 and lim.active() == 2 + 1 + 3
    with pytest.raises(ValueError, match="call limits must be >= 1"):
        CallLimits({"p1"}, per_peer=0, unknown=1)
