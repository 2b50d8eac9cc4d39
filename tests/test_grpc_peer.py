"""Real peer servers on loopback: exchanges over mutual TLS, waiting, missing peers, every rejection."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from p2pfl.payload import Payload
from p2pfl.proto import peer_pb2, peer_pb2_grpc
from p2pfl.topology import Topology, parse_topology
from p2pfl.transport.base import ExchangeResult, TransportError
from p2pfl.transport.grpc_service import PeerServer, channel_options
from p2pfl.transport.grpc_transport import GrpcTransport
from p2pfl.transport.memory import MemoryHub, MemoryTransport
from p2pfl.wire import encode, encode_frames
from tests.swarm import (
    CFG_TLS,
    CHUNK,
    NUMEL,
    SPECS,
    certs,
    client_channel,
    cluster,
    free_ports,
    message,
    ring,
    rpc_error,
)

__all__ = ["certs"]  # the module-scoped certificate fixture (tests/swarm.py)


def assert_same(a: Payload, b: Payload) -> None:
    assert (a.sender, a.round, a.step, a.topology_hash, a.manifest, a.scalars) == (
        b.sender, b.round, b.step, b.topology_hash, b.manifest, b.scalars)
    assert torch.equal(a.flat.view(torch.int32), b.flat.view(torch.int32))


def memory_exchange_all(mem: dict[str, MemoryTransport], topo: Topology,
                        msgs: dict[str, Payload]) -> dict[str, ExchangeResult]:
    out: dict[str, ExchangeResult] = {}

    def run(p: str) -> None:
        m = msgs[p]
        out[p] = mem[p].exchange(m, topo.plan(p, m.round, m.step), 5.0)

    threads = [threading.Thread(target=run, args=(p,)) for p in msgs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


# ---- exchanges --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_tls_exchange_matches_memory_transport_bitwise(certs: Path) -> None:
    topo = ring(3)
    hub = MemoryHub()
    mem = {p: MemoryTransport(hub, p) for p in topo.ids}
    total_recv = total_sent = 0
    with cluster(topo, topo.ids, certs) as c:
        for r in range(2):
            msgs = {p: message(topo, p, r) for p in topo.ids}
            wire = {p: encode_frames(m, CHUNK).wire_bytes for p, m in msgs.items()}
            got = c.exchange_all(msgs)
            for p in topo.ids:
                res = got[p]
                assert res.missing == []
                assert list(res.received) == list(topo.plan(p, r).in_weights)
                for q, m in res.received.items():
                    assert_same(m, msgs[q])
                # every payload has the same size: exactly what was read off the wire
                assert res.bytes_recv == sum(wire[q] for q in res.received)
                total_recv += res.bytes_recv
                total_sent += res.bytes_sent
            # the in-memory transport hands over the very same messages
            mem_results = memory_exchange_all(mem, topo, msgs)
            for p in topo.ids:
                assert set(mem_results[p].received) == set(got[p].received)
                for q, m in mem_results[p].received.items():
                    assert_same(got[p].received[q], m)
        served = sum(s.served_bytes for s in c.servers.values())
        assert served == total_recv  # every byte served was received, and counted once
        assert total_sent == served  # each round's payload counted once per reader, in its own round
        assert sum(s.pulls_served for s in c.servers.values()) == 2 * 3 * 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_insecure_exchange(mode: str) -> None:
    topo = ring(3)
    with cluster(topo, topo.ids, None, mode=mode) as c:
        for r in range(2):
            msgs = {p: message(topo, p, r) for p in topo.ids}
            got = c.exchange_all(msgs)
            for p in topo.ids:
                res = got[p]
                assert res.missing == []
                assert set(res.received) == set(topo.plan(p, r, mode=mode).in_weights)
                for q, m in res.received.items():
                    assert_same(m, msgs[q])
                assert res.bytes_recv == sum(encode_frames(msgs[q], CHUNK).wire_bytes for q in res.received)
            assert all(s.inbox == {} for s in c.servers.values())


@pytest.mark.timeout(60)
def test_random_schedule_exchange(certs: Path) -> None:
    """Per-round random neighbours: the servers authorize each pull by that round's plan."""
    ids = ["p0", "p1", "p2", "p3"]
    topo = parse_topology({
        "name": "test-random", "directed": True, "weights": "uniform",
        "peers": [{"id": p, "address": f"127.0.0.1:{port}"} for p, port in zip(ids, free_ports(4), strict=True)],
        "schedule": {"kind": "random_pull", "k": 1},
    })
    with cluster(topo, ids, certs) as c:
        seen = set()
        for r in range(3):
            msgs = {p: message(topo, p, r) for p in ids}
            got = c.exchange_all(msgs)
            for p in ids:
                assert got[p].missing == []
                assert list(got[p].received) == list(topo.plan(p, r).in_weights)
                seen.update((p, q) for q in got[p].received)
                for q, m in got[p].received.items():
                    assert_same(m, msgs[q])
        assert len(seen) > 4  # the neighbours did change between rounds


@pytest.mark.timeout(30)
def test_a_neighbour_that_restarts_is_pulled_again(certs: Path) -> None:
    topo = ring(3)
    with cluster(topo, ["p0", "p1"], certs) as c:
        c.servers["p0"].publish(message(topo, "p0", 0))
        assert_same(c.transports["p1"].pull("p0", 0, 0, 5.0)[0], message(topo, "p0", 0))
        c.transports.pop("p0").close()
        c.servers.pop("p0").stop(0)
        with pytest.raises(TransportError):
            c.transports["p1"].pull("p0", 1, 0, 0.3)
        c.start("p0")  # same address, fresh process state
        c.servers["p0"].publish(message(topo, "p0", 1))
        assert_same(c.transports["p1"].pull("p0", 1, 0, 5.0)[0], message(topo, "p0", 1))


@pytest.mark.timeout(30)
def test_pull_waits_for_a_later_publish(certs: Path) -> None:
    topo = ring(3)
    with cluster(topo, ["p0", "p1"], certs) as c:
        msg = message(topo, "p0", 0)
        out: dict[str, Any] = {}
        t = threading.Thread(target=lambda: out.setdefault("r", c.transports["p1"].pull("p0", 0, 0, 10.0)))
        t0 = time.monotonic()
        t.start()
        time.sleep(0.4)
        assert t.is_alive()  # waiting on the server, not failing
        c.servers["p0"].publish(msg)
        t.join(10)
        got, nbytes = out["r"]
        assert time.monotonic() - t0 >= 0.4
        assert_same(got, msg)
        assert nbytes == encode_frames(msg, CHUNK).wire_bytes


@pytest.mark.timeout(30)
def test_a_peer_that_starts_late_is_waited_for(certs: Path) -> None:
    topo = ring(3)
    with cluster(topo, ["p1"], certs) as c:
        out: dict[str, Any] = {}
        t = threading.Thread(target=lambda: out.setdefault("r", c.transports["p1"].pull("p0", 0, 0, 10.0)))
        t.start()
        time.sleep(0.5)
        c.start("p0")
        msg = message(topo, "p0", 0)
        c.servers["p0"].publish(msg)
        t.join(10)
        assert_same(out["r"][0], msg)


@pytest.mark.timeout(30)
def test_missing_neighbour_ends_in_missing_within_the_deadline(certs: Path) -> None:
    topo = ring(4)  # p0 pulls from p1 and p3; p3 is never started
    with cluster(topo, ["p0", "p1"], certs) as c:
        c.servers["p1"].publish(message(topo, "p1", 0))
        t0 = time.monotonic()
        res = c.transports["p0"].exchange(message(topo, "p0", 0), topo.plan("p0", 0), 1.0)
        elapsed = time.monotonic() - t0
        assert res.missing == ["p3"] and list(res.received) == ["p1"]
        assert 0.9 <= elapsed < 4.0
        with pytest.raises(TransportError, match="DEADLINE_EXCEEDED"):
            c.transports["p0"].pull("p3", 0, 0, 0.3)


# ---- rejections of pushes -----------------------------------------------------------------------


def _mutated(chunks: list[peer_pb2.Chunk], fn: Callable[[peer_pb2.Header], None]) -> list[peer_pb2.Chunk]:
    head = peer_pb2.Chunk()
    head.CopyFrom(chunks[0])
    fn(head.header)
    return [head, *chunks[1:]]


def _push_cases(topo: Topology) -> list[tuple[str, list[peer_pb2.Chunk], grpc.StatusCode, str]]:
    good = encode(message(topo, "p1", 0), CHUNK)
    nan_msg = message(topo, "p1", 0)
    nan_msg.flat[100] = float("nan")
    flipped = bytearray(good[1].data)
    flipped[0] ^= 0xFF

    def shape(h: peer_pb2.Header) -> None:
        h.manifest[0].shape[:] = [20, 12]

    def dtype(h: peer_pb2.Header) -> None:
        h.manifest[2].dtype = "float16"

    def name(h: peer_pb2.Header) -> None:
        h.manifest[1].name = "head.b"

    S = grpc.StatusCode
    return [
        ("data before header", good[1:], S.INVALID_ARGUMENT, "the first chunk must be the header"),
        ("duplicate header", [good[0], *good], S.INVALID_ARGUMENT, "a second header arrived"),
        ("bad name", _mutated(good, name), S.INVALID_ARGUMENT, "manifest entry 1 is tensor 'head.b', expected 'body.b'"),
        ("bad shape", _mutated(good, shape), S.INVALID_ARGUMENT, "tensor 'body.w' has shape (20, 12), expected (12, 20)"),
        ("bad dtype", _mutated(good, dtype), S.INVALID_ARGUMENT, "tensor 'body.gn' has dtype 'float16'"),
        ("nan", encode(nan_msg, CHUNK), S.INVALID_ARGUMENT, "tensor 'body.w' contains 1 non-finite value(s) (1 NaN"),
        ("inf scalar", _mutated(good, lambda h: h.scalars.__setitem__("weight", float("inf"))), S.INVALID_ARGUMENT,
         "scalar 'weight' is inf"),
        ("extra scalar", _mutated(good, lambda h: h.scalars.__setitem__("x", 1.0)), S.INVALID_ARGUMENT,
         "unexpected scalar keys ['x']"),
        ("round ahead", _mutated(good, lambda h: setattr(h, "round", 5)), S.UNAVAILABLE,
         "round 5 is more than 2 rounds ahead of this peer (round 0); retry later"),
        ("topology", _mutated(good, lambda h: setattr(h, "topology_hash", "0" * 16)), S.FAILED_PRECONDITION,
         "topology hash '0000000000000000' differs"),
        ("oversize", _mutated(good, lambda h: setattr(h, "total_bytes", 5 << 20)), S.RESOURCE_EXHAUSTED,
         f"payload declares {5 << 20} bytes, more than the limit of {1 << 20} bytes"),
        ("chunk over the gRPC limit", [good[0], peer_pb2.Chunk(data=b"\x00" * (CHUNK + (1 << 20) + 1))],
         S.RESOURCE_EXHAUSTED, "larger than max"),
        ("checksum", [good[0], peer_pb2.Chunk(data=bytes(flipped)), *good[2:]], S.DATA_LOSS, "CRC-32 of the"),
        ("truncated", good[:-1], S.DATA_LOSS, "stream ended after"),
        ("impersonation", _mutated(good, lambda h: setattr(h, "sender", "p2")), S.PERMISSION_DENIED,
         "the header names sender 'p2' but the caller's certificate is for 'p1'"),
        ("empty", [], S.INVALID_ARGUMENT, "empty push stream"),
    ]


@pytest.mark.timeout(60)
def test_bad_pushes_are_rejected_and_change_nothing(certs: Path, caplog: pytest.LogCaptureFixture) -> None:
    topo = ring(3)
    with cluster(topo, topo.ids, certs, mode="push") as c, client_channel(topo, "p0", certs, "p1") as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        server = c.servers["p0"]
        for case, chunks, code, text in _push_cases(topo):
            caplog.clear()
            err = rpc_error(lambda chunks=chunks: stub.Push(iter(chunks), timeout=5, wait_for_ready=True))
            assert err.code() == code, (case, err.code(), err.details())
            assert text in (err.details() or ""), (case, err.details())
            assert server.inbox == {}, case
            if code != grpc.StatusCode.RESOURCE_EXHAUSTED or "declares" in text:  # gRPC's own limit: not ours
                assert any(text in r.getMessage() and r.levelname == "WARNING" for r in caplog.records), case

        # a good push waits for the receiver's decision; a second one for the same key meanwhile is refused
        good = encode(message(topo, "p1", 0), CHUNK)
        pending = stub.Push.future(iter(good), timeout=10)
        t0 = time.monotonic()
        while not server.inbox and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert list(server.inbox) == [("p1", 0, 0)]
        err = rpc_error(lambda: stub.Push(iter(good), timeout=5))
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS
        taken = server.take([("p1", 0, 0)], time.monotonic() + 1)
        assert_same(taken["p1"][0], message(topo, "p1", 0))
        assert pending.result().bytes_received == sum(ch.ByteSize() for ch in good)  # answered: mixed
        # a repeat of a mixed push is answered OK with 0 bytes (deduplicated, not mixed twice)
        assert stub.Push(iter(good), timeout=5).bytes_received == 0 and server.inbox == {}
        # a push for a step the receiver closed without it is ABORTED: the sender keeps its mass
        assert server.take([("p1", 2, 0)], time.monotonic() + 0.1) == {}
        err = rpc_error(lambda: stub.Push(iter(encode(message(topo, "p1", 2), CHUNK)), timeout=5))
        assert err.code() == grpc.StatusCode.ABORTED and "mixed without this payload" in (err.details() or "")
        assert server.inbox == {}

        # and the real exchange still works afterwards
        msgs = {p: message(topo, p, 1) for p in topo.ids}
        got = c.exchange_all(msgs)
        for p in topo.ids:
            assert got[p].missing == []
            for q, m in got[p].received.items():
                assert_same(m, msgs[q])


@pytest.mark.timeout(30)
def test_push_to_a_pull_mode_peer_is_refused(certs: Path) -> None:
    topo = ring(3)
    with cluster(topo, ["p0"], certs) as c, client_channel(topo, "p0", certs, "p1") as ch:
        err = rpc_error(lambda: peer_pb2_grpc.PeerStub(ch).Push(iter(encode(message(topo, "p1", 0), CHUNK)), timeout=5))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "mixes in pull mode; it takes no pushes" in (err.details() or "")
        assert c.servers["p0"].inbox == {}


# ---- rejections of pulls and of callers -----------------------------------------------------------


@pytest.mark.timeout(30)
def test_bad_pulls_are_rejected(certs: Path) -> None:
    topo = ring(3)
    h = topo.hash()
    with cluster(topo, ["p0"], certs) as c, client_channel(topo, "p0", certs, "p1") as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        for r in range(4):
            c.servers["p0"].publish(message(topo, "p0", r))
        assert c.servers["p0"].published() == [(1, 0), (2, 0), (3, 0)]  # older than the window (2) dropped

        def pull(**kw: Any) -> list[peer_pb2.Chunk]:
            req = {"requester": "p1", "round": 3, "step": 0, "topology_hash": h, **kw}
            return list(stub.Pull(peer_pb2.PullRequest(**req), timeout=0.5 if req["round"] == 4 else 2))

        S = grpc.StatusCode
        for kw, code, text in [
            ({"requester": "p2"}, S.PERMISSION_DENIED, "claims to be 'p2' but its certificate is for 'p1'"),
            ({"topology_hash": "f" * 16}, S.FAILED_PRECONDITION, "topology hash 'ffffffffffffffff' differs"),
            ({"round": 0}, S.OUT_OF_RANGE, "round 0 is no longer served: this peer is at round 3"),
            ({"round": 6}, S.UNAVAILABLE, "round 6 is more than 2 rounds ahead of this peer (round 3)"),
            ({"round": 4}, S.DEADLINE_EXCEEDED, ""),  # plausible but never published: waits, then gives up
        ]:
            err = rpc_error(lambda kw=kw: pull(**kw))
            assert err.code() == code, (kw, err.code(), err.details())
            assert text in (err.details() or ""), (kw, err.details())
        # the generated stub reads the same stream the transport does
        chunks = pull()
        assert chunks[0].header.sender == "p0" and chunks[0].header.round == 3
        assert sum(len(x.data) for x in chunks[1:]) == NUMEL * 4


@pytest.mark.timeout(30)
def test_non_neighbour_certificates_are_denied(certs: Path) -> None:
    topo = ring(4)  # p0's neighbours are p1 and p3
    with cluster(topo, ["p0"], certs) as c:
        c.servers["p0"].publish(message(topo, "p0", 0))
        for who in ("p2", "intruder"):
            with client_channel(topo, "p0", certs, who) as ch:
                req = peer_pb2.PullRequest(requester=who, round=0, step=0, topology_hash=topo.hash())
                err = rpc_error(lambda ch=ch, req=req: list(peer_pb2_grpc.PeerStub(ch).Pull(req, timeout=5)))
                assert err.code() == grpc.StatusCode.PERMISSION_DENIED
                assert f"peer {who!r} is not an out-neighbour of 'p0'" in (err.details() or "")
        assert c.servers["p0"].pulls_served == 0


@pytest.mark.timeout(30)
def test_a_client_without_certificate_cannot_connect(certs: Path) -> None:
    topo = ring(3)
    with cluster(topo, ["p0"], certs) as c:
        c.servers["p0"].publish(message(topo, "p0", 0))
        req = peer_pb2.StatusRequest()
        ca = (certs / "ca.crt").read_bytes()
        no_cert = grpc.secure_channel(topo.address("p0"), grpc.ssl_channel_credentials(ca),
                                      options=channel_options(CHUNK, "p0"))
        plain = grpc.insecure_channel(topo.address("p0"))
        try:
            for ch in (no_cert, plain):
                err = rpc_error(lambda ch=ch: peer_pb2_grpc.PeerStub(ch).Status(req, timeout=2))
                assert err.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            no_cert.close()
            plain.close()


@pytest.mark.timeout(30)
def test_status_and_health(certs: Path) -> None:
    topo = ring(3)
    with cluster(topo, ["p0", "p1"], certs) as c:
        c.servers["p0"].publish(message(topo, "p0", 2))
        st = c.transports["p1"].status("p0")
        assert (st.peer_id, st.round, st.topology_hash) == ("p0", 2, topo.hash())
        assert st.version
        with client_channel(topo, "p0", certs, "p1") as ch:
            hc = health_pb2_grpc.HealthStub(ch)
            for service in ("", "p2pfl.peer.Peer"):
                resp = hc.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_needs_an_explicit_insecure(certs: Path) -> None:
    topo = ring(3)
    with pytest.raises(ValueError, match="insecure=True"):
        PeerServer().start(topo.address("p0"), topo, "p0", expected_specs=SPECS)
    with cluster(topo, ["p0"], None) as c, pytest.raises(ValueError, match="network.insecure"):
        GrpcTransport("p0", topo, c.servers["p0"], tls=None, network_cfg=CFG_TLS, expected_specs=SPECS)
