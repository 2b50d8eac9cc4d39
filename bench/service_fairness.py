"""Issue 10, item 3 as a measurement: can one neighbour with a valid certificate starve the others?

Four real peer services (complete graph, mutual TLS, loopback; a 4 MiB payload, far more than a
stream's flow-control window). The attacker, p1, opens ``--unread`` Pulls of p0's published
payload that it never reads and ``--never`` Pulls of a step p0 never publishes, with no client
deadline, through its own client (no flow-control window growth). Then all four peers run round 0
with a ``--deadline`` second step deadline (p1 too: it serves honestly). Repeated ``--reps`` times,
fresh servers each time.

Figures: how many of the attacker's calls were refused at once (RESOURCE_EXHAUSTED), how many of
p0's honest neighbours (p2, p3) got p0's payload, and the round's wall time. The last line is one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import socket
import statistics
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import grpc
import torch

from p2pfl.config import NetworkConfig
from p2pfl.models.layout import TensorSpec
from p2pfl.payload import Payload
from p2pfl.proto import peer_pb2
from p2pfl.security import TLSConfig, make_certs
from p2pfl.topology import Topology, parse_topology
from p2pfl.transport.grpc_service import PULL_METHOD, PeerServer, channel_options
from p2pfl.transport.grpc_transport import GrpcTransport

IDS = ["p0", "p1", "p2", "p3"]
SPECS = (TensorSpec("body.w", (1024, 1024), 0, 1 << 20),)


def _topology() -> Topology:
    socks = [socket.socket() for _ in IDS]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
    return parse_topology({
        "name": "fairness", "peers": [{"id": p, "address": f"127.0.0.1:{q}"} for p, q in zip(IDS, ports, strict=True)],
        "edges": [[a, b] for i, a in enumerate(IDS) for b in IDS[i + 1:]],
    })


def _message(topo: Topology, peer: str) -> Payload:
    g = torch.Generator().manual_seed(zlib.crc32(peer.encode()))
    return Payload(peer, 0, 0, topo.hash(), SPECS, torch.randn(1 << 20, generator=g), {"weight": 0.25})


def one_attack(certs: Path, unread: int, never: int, deadline: float) -> dict[str, Any]:
    topo = _topology()
    cfg = NetworkConfig(chunk_kb=1024, max_message_mb=8, round_timeout_s=deadline)
    servers: dict[str, PeerServer] = {}
    transports: dict[str, GrpcTransport] = {}
    try:
        for p in IDS:
            servers[p] = PeerServer()
            servers[p].start(topo.address(p), topo, p, expected_specs=SPECS, scalar_keys=["weight"],
                             tls=TLSConfig.load(certs, p), chunk_bytes=1 << 20, max_message_mb=8, max_wait_s=60.0)
            transports[p] = GrpcTransport(p, topo, servers[p], tls=TLSConfig.load(certs, p), network_cfg=cfg,
                                          expected_specs=SPECS, scalar_keys=["weight"])
        servers["p0"].publish(_message(topo, "p0"))
        opts = [*channel_options(1 << 20, "p0"), ("grpc.http2.bdp_probe", 0)]
        with grpc.secure_channel(topo.address("p0"), TLSConfig.load(certs, "p1").channel_credentials(),
                                 options=opts) as ch:
            pull = ch.unary_stream(PULL_METHOD, request_serializer=peer_pb2.PullRequest.SerializeToString,
                                   response_deserializer=lambda b: b)
            steps = [0] * unread + [7] * never
            calls = [pull(peer_pb2.PullRequest(requester="p1", round=0, step=s, topology_hash=topo.hash()))
                     for s in steps]
            time.sleep(2.0)
            refused = sum(c.done() and c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for c in calls)
            results: dict[str, Any] = {}

            def run(p: str) -> None:
                results[p] = transports[p].exchange(_message(topo, p), topo.plan(p, 0), deadline)

            t0 = time.monotonic()
            threads = [threading.Thread(target=run, args=(p,)) for p in IDS]
            for t in threads:
                t.start()
            for t in threads:
                t.join(deadline + 30)
            wall = time.monotonic() - t0
            for c in calls:
                c.cancel()
        return {
            "refused_at_once": int(refused),
            "honest_got_p0": sum("p0" in results[p].received for p in ("p2", "p3")),
            "round_wall_s": wall,
            "missing": {p: sorted(results[p].missing) for p in IDS},
        }
    finally:
        for t in transports.values():
            t.close()
        for s in servers.values():
            s.stop(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--unread", type=int, default=24)
    ap.add_argument("--never", type=int, default=24)
    ap.add_argument("--deadline", type=float, default=10.0)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    certs = Path(tempfile.mkdtemp(prefix="p2pfl-fairness-"))
    try:
        make_certs(IDS, certs)
        runs = [one_attack(certs, args.unread, args.never, args.deadline) for _ in range(args.reps)]
    finally:
        shutil.rmtree(certs, ignore_errors=True)
    for r in runs:
        print(f"refused at once {r['refused_at_once']}/{args.unread + args.never}, honest neighbours served "
              f"{r['honest_got_p0']}/2, round {r['round_wall_s']:.2f}s, missing {r['missing']}")
    walls = [r["round_wall_s"] for r in runs]
    print(json.dumps({
        "bench": "service_fairness", "reps": args.reps, "attack_calls": args.unread + args.never,
        "deadline_s": args.deadline,
        "refused_at_once_min": min(r["refused_at_once"] for r in runs),
        "honest_served_min": min(r["honest_got_p0"] for r in runs),
        "round_wall_s_min": round(min(walls), 2), "round_wall_s_median": round(statistics.median(walls), 2),
    }))


if __name__ == "__main__":
    main()
