"""Evidence-only progress (issue 68, part 1; docs/protocol.md, "Catching up"): a peer's round moves only
through its own training or validated payloads of its in-neighbours -- never through the round a Pull
or Push claims, nor a Status answer -- and a refused message changes no state at all.

The attack the operator found: one authenticated neighbour sends a single Pull (pull mode) or Push
(push-sum) claiming a far round; it was refused "more than 2 rounds ahead", and yet its target
fast-forwarded to the claimed round and its neighbours followed. Here a hostile client holding a
real neighbour certificate sends such claims at random instants (drawn in rounds, seeded by
``P2PFL_FAULT_SEED``, printed) into a run of real ``p2pfl node`` processes on a directed ring; every
peer records every round, and the final parameters equal an unattacked run's bitwise.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from p2pfl.proto import peer_pb2
from p2pfl.security import TLSConfig
from p2pfl.topology import Topology, generate, parse_topology
from p2pfl.transport.grpc_service import (
    EVIDENCE_MD,
    GIVEN_MD,
    KEEP_MD,
    PULL_METHOD,
    PUSH_METHOD,
    PeerServer,
    channel_options,
)
from p2pfl.transport.progress import RoundEvidence, catch_up_target, majority_round
from p2pfl.wire.codec import encode_frames
from tests.conftest import tiny_config
from tests.swarm import CHUNK, SPECS, certs, cluster, free_base_port, free_ports, message, params, records
from tests.test_gossip_faults import PEERS, fault_rng, finish, peers, random_instant

__all__ = ["certs"]  # the module-scoped certificate fixture (p0..p3), shared

S = grpc.StatusCode


def test_majority_round_and_the_catch_up_rule() -> None:
    assert majority_round({}, []) == -1
    assert majority_round({"a": 9}, ["a"]) == 9  # in-degree 1: that one in-neighbour
    assert majority_round({"a": 9}, ["a", "b"]) == -1  # one of two proves nothing
    assert majority_round({"a": 9, "b": 7}, ["a", "b"]) == 7  # the least advanced of the majority
    assert majority_round({"a": 9, "b": 7, "c": 1}, ["a", "b", "c"]) == 7
    assert majority_round({"a": 9, "x": 50}, ["a", "b", "c"]) == -1  # not an in-neighbour: ignored
    # push: any proven later round; pull: only beyond the window (closer ones still serve this peer)
    assert catch_up_target(5, {"a": 6}, ["a"], push=True, window=2, rounds=20) == 6
    assert catch_up_target(5, {"a": 7}, ["a"], push=False, window=2, rounds=20) is None
    assert catch_up_target(5, {"a": 8}, ["a"], push=False, window=2, rounds=20) == 8
    assert catch_up_target(5, {"a": 20}, ["a"], push=True, window=2, rounds=20) is None  # past the run
    assert catch_up_target(5, {"a": 5}, ["a"], push=True, window=2, rounds=20) is None
    p = RoundEvidence()
    p.saw("a", 3)
    p.saw("a", 2)
    assert p.rounds(["a", "b"]) == {"a": 3}


def _ring(n: int) -> Topology:
    """A directed ring p0 -> p1 -> ... -> p0 on loopback: p1's in-neighbour is p0, its out-neighbour p2."""
    ids = [f"p{i}" for i in range(n)]
    return parse_topology({"name": f"test-directed-ring-{n}", "directed": True,
                           "peers": [{"id": p, "address": f"127.0.0.1:{port}"}
                                     for p, port in zip(ids, free_ports(n), strict=True)],
                           "edges": [[a, ids[(i + 1) % n]] for i, a in enumerate(ids)]})


def _attack(topo: Topology, target: str, certs: Path, *, puller: str | None, pusher: str | None,
            claims: list[int], given: float = 1000.0) -> list[S]:
    """What a hostile client with a neighbour's real certificate sends: Pulls (plain and asking for
    evidence) as ``puller``, Pushes (a payload, and a withhold) as ``pusher``, each claiming every
    round in ``claims`` and a large running total given. Returns the status codes it got."""
    codes: list[S] = []
    h = topo.hash()
    for me, kind in ((puller, "pull"), (pusher, "push")):
        if me is None:
            continue
        creds = TLSConfig.load(certs, me).channel_credentials()
        with grpc.secure_channel(topo.address(target), creds, options=channel_options(CHUNK, target)) as ch:
            pull = ch.unary_stream(PULL_METHOD, request_serializer=peer_pb2.PullRequest.SerializeToString,
                                   response_deserializer=lambda b: b)
            push = ch.stream_unary(PUSH_METHOD, request_serializer=lambda b: b,
                                   response_deserializer=peer_pb2.PushReply.FromString)
            for r in claims:
                if kind == "pull":
                    for md in (None, ((EVIDENCE_MD, "1"),)):
                        try:
                            list(pull(peer_pb2.PullRequest(requester=me, round=r, step=0, topology_hash=h),
                                      timeout=5, metadata=md))
                            codes.append(S.OK)
                        except grpc.RpcError as e:
                            codes.append(e.code())
                else:
                    frames = list(encode_frames(message(topo, me, r, scalars={"mu": 1.0}), CHUNK))
                    for md in (((GIVEN_MD, repr(given)),), ((GIVEN_MD, repr(given)), (KEEP_MD, "1"))):
                        try:
                            push(iter(frames), timeout=5, metadata=md)
                            codes.append(S.OK)
                        except grpc.RpcError as e:
                            codes.append(e.code())
    return codes


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_refused_claim_changes_no_state(certs: Path, mode: str) -> None:
    """In process: out-of-window Pulls and Pushes from authenticated neighbours are refused and leave
    no trace: no evidence of progress, no push-sum weight settled, nothing absorbed, round unchanged."""
    topo = _ring(3)
    scalars = ("mu",) if mode == "push" else ("weight",)
    with cluster(topo, topo.ids, certs, mode=mode, scalar_keys=scalars) as c:
        target = c.servers["p1"]
        codes = _attack(topo, "p1", certs, puller="p2", pusher="p0" if mode == "push" else None,
                        claims=[5, 40, 280])
        assert codes and S.OK not in codes, codes
        assert target.progress.rounds(topo.ids) == {}
        assert target.round == 0 and target.absorbed() == {} and target.pop_settled() == {}
        assert target.inbox == {}
        # the evidence a catch-up would ask for is not there either: nothing proves those rounds
        assert c.transports["p1"].proven_rounds(["p0"], ["p0"], 0.5) == {}


def test_a_claim_behind_the_window_settles_nothing(certs: Path) -> None:
    """Push-sum: a Push (and a withhold) from an in-neighbour's certificate for a round it really pushed
    and this peer mixed, long ago (behind the window), with a claimed running total given of 1000. It is
    answered as a repeat (OK with 0 bytes; the withhold ABORTED) -- and its claim settles nothing. Found by
    bench/soak.py (seed 5, push): before, the duplicate settled the claim and the target's mu jumped by
    998 (sum mu = n + 998 until the sender's debits clawed it back over 200 rounds)."""
    topo = _ring(3)
    mu = {"mu": 1.0}
    with cluster(topo, topo.ids, certs, mode="push", scalar_keys=("mu",)) as c:
        for r in range(6):  # every push mixed; p1 is now in round 6, its window rounds 4..8
            res = c.exchange_all({p: message(topo, p, r, scalars=mu) for p in topo.ids})
            assert all(not x.missing for x in res.values()), res
        c.servers["p1"].set_round(6)
        before = c.servers["p1"].absorbed()
        codes = _attack(topo, "p1", certs, puller=None, pusher="p0", claims=[0, 1])
        assert codes == [S.OK, S.ABORTED] * 2, codes  # answered as repeats of decided keys
        assert c.servers["p1"].absorbed() == before and c.servers["p1"].pop_settled() == {}


def test_only_a_validated_payload_proves_a_round(certs: Path) -> None:
    """Push mode: a push taken into the inbox is evidence of its round; an evidence Pull of a push-mode
    peer's published payload is evidence too (and is never mixed). A Status answer is not."""
    topo = _ring(3)
    with cluster(topo, topo.ids, certs, mode="push", scalar_keys=("mu",)) as c:
        p0, p1 = c.transports["p0"], c.transports["p1"]
        for r in range(3):  # p0 runs ahead alone (as a push-mode peer publishes what it pushes)
            c.servers["p0"].publish(message(topo, "p0", r, scalars={"mu": 1.0}))
        assert p1.proven_rounds(["p0"], [], 0.5) == {}  # nothing seen, nothing asked
        assert p1.proven_rounds(["p0"], ["p0"], 2.0) == {"p0": 2}  # Status said 2; its payload proved it
        assert c.servers["p1"].inbox == {} and c.servers["p1"].absorbed() == {}  # proof is never mixed
        assert p0.server.absorbed() == {}


def _run(cfg: Path, out: Path, tmp: Path, attack: dict | None = None) -> None:
    """All four peers to the end; ``attack``: the hostile client fires at random instants of the target's run."""
    with peers(cfg, out, tmp) as procs:
        if attack is not None:
            rng = fault_rng()
            got: list[S] = []
            for _ in range(3):
                random_instant(out, attack["target"], rng, procs, tmp, 1, 4)
                now = len(records(out / f"metrics-{attack['target']}.jsonl"))
                # beyond the window (4) of where the target can be meanwhile, within the run, and past it.
                # Far beyond: with all peers up a round takes ~20 ms, and the attacker's handshakes and six
                # calls on a loaded machine can take as long as several rounds (now + 8 left 4 rounds' margin)
                claims = [now + 20, now + 21, 280]
                got += _attack(attack["topo"], attack["target"], tmp / "certs", puller=attack["puller"],
                               pusher=attack["pusher"], claims=claims)
            assert got and S.OK not in got, got
            print("attack answered:", sorted({c.name for c in got}))
        finish(procs, tmp)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_out_of_window_claims_from_an_authenticated_neighbour_move_no_peer(tmp_path: Path, mode: str) -> None:
    """Directed ring of 4 real peers (mutual TLS), pull mode (dfedavg) or push-sum (dfedpgp): p1's
    out-neighbour's certificate sends Pulls, its in-neighbour's Pushes (with a large claimed total
    given), for rounds beyond the window, at three random instants. No peer skips or repeats a round,
    nothing fast-forwards, and every peer's final parameters (and push-sum weight) are bitwise those of
    the same run without the attacker."""
    rounds = 40  # the first attack claims rounds up to about 4 + 21 (`_run`): within the run
    algo = ({"name": "dfedpgp", "mix_mode": "push", "body_local": 1, "head_local": 1} if mode == "push"
            else {"name": "dfedavg", "lr": 0.1, "local_epochs": 1})
    base = free_base_port()
    finals: dict[str, dict[str, np.ndarray]] = {}
    for name in ("clean", "attacked"):
        d = tmp_path / name
        d.mkdir()
        cfg = tiny_config(d, base_port=base, rounds=rounds, kind="directed_ring", algorithm=algo,
                          # window 4: in pull mode on a directed ring of 4 an in-neighbour may run up to
                          # 3 rounds ahead of a slow peer's pull without any fault (it needs only the
                          # publishes around the ring); with window 2 a loaded machine then saw a round
                          # "no longer served" in the unattacked run
                          network={"round_timeout_s": 30.0, "probe_s": 0.5, "window": 4})
        topo = generate("directed_ring", 4, base_port=base)  # as tiny_config wrote it
        attack = None if name == "clean" else {"target": "p1", "topo": topo,
                                               "puller": "p2", "pusher": "p0" if mode == "push" else None}
        _run(cfg, d / "run", d, attack)
        finals[name] = {p: params(d / "run", p) for p in PEERS}
        for p in PEERS:
            recs = records(d / "run" / f"metrics-{p}.jsonl")
            assert [r["round"] for r in recs] == list(range(rounds)), (name, p, [r["round"] for r in recs])
            assert not any("fast_forward_from" in r or r["missing"] for r in recs), (name, p)
            assert "fast-forwarding" not in (d / f"{p}.log").read_text()
        if mode == "push":
            mus = [records(d / "run" / f"metrics-{p}.jsonl")[-1]["mu"] for p in PEERS]
            assert abs(sum(mus) - len(PEERS)) < 1e-9, mus
            # the claimed running total given (1000) settled nothing: no weight appeared anywhere
            assert not any("mu_settled" in r for p in PEERS for r in records(d / "run" / f"metrics-{p}.jsonl"))
    for p in PEERS:
        assert np.array_equal(finals["clean"][p], finals["attacked"][p]), p


def test_pull_requests_of_a_server_leave_no_progress(certs: Path) -> None:
    """A bare server: an out-neighbour pulling rounds ahead (in and out of the window) leaves nothing."""
    topo = _ring(2)
    s = PeerServer()
    s.start(topo.address("p0"), topo, "p0", expected_specs=SPECS, scalar_keys=["weight"],
            tls=TLSConfig.load(certs, "p0"), chunk_bytes=CHUNK, max_message_mb=1)
    try:
        codes = _attack(topo, "p0", certs, puller="p1", pusher=None, claims=[3, 300])
        assert codes == [S.UNAVAILABLE] * 4, codes
        assert s.progress.rounds(topo.ids) == {} and s.round == 0
    finally:
        s.stop(0)
