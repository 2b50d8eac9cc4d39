"""Wire throughput: the ResNet-18 shared part through the real peer service vs raw gRPC vs flwr serde.

What is measured (median of ``--reps`` repetitions after one warm-up, same process, loopback):

* ``ours``: tensors -> wire -> tensors on the receiver through `PeerServer` / `GrpcTransport`:
  the sender publishes (encode + CRC-32, once), the receiver pulls, validates (manifest, sizes,
  checksum, NaN/Inf) and gets a float32 tensor. Timed from before ``publish`` to the decoded
  Payload. Also a full symmetric ``exchange`` of two peers (both publish and pull at once).
* ``raw``: a minimal bytes-streaming gRPC service defined here: the server slices the same float32
  buffer into chunks of the same size, the client copies them into a preallocated buffer and views
  it as a tensor. Same channel and server options, same TLS material. No header, no validation.
* ``flwr``: Flower's own serialization of the same tensors: ``flwr.app.ArrayRecord`` built from
  the named torch views (np.save per array) and ``flwr.common.serde.array_record_to_proto(...)
  .SerializeToString()``; and back (``FromString`` -> ``array_record_from_proto`` ->
  ``to_torch_state_dict``). That is what flwr puts in its protobuf messages; it includes no
  network transfer, so it is an upper bound for any flwr-based wire path.

MB/s are 10^6 bytes of tensor data per second. Ratios are raw / ours (1.0 = as fast as bare bytes):
``ratio`` is the median of per-rep wall-time ratios, ``min_ratio`` that of the fastest reps, and
``cpu_ratio`` the median per-rep ratio of this process's CPU time (both peers live in it), the
figure to trust on a shared, loaded host. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pfl.config import NetworkConfig  # noqa: E402
from p2pfl.models.layout import TensorSpec  # noqa: E402
from p2pfl.payload import Payload  # noqa: E402
from p2pfl.security import TLSConfig, make_certs  # noqa: E402
from p2pfl.topology import Topology, parse_topology  # noqa: E402
from p2pfl.transport.grpc_service import PeerServer, channel_options, server_options  # noqa: E402
from p2pfl.transport.grpc_transport import GrpcTransport  # noqa: E402
from p2pfl.wire.codec import crc32 as codec_crc32  # noqa: E402
from p2pfl.wire.validate import all_finite  # noqa: E402

RAW_METHOD = "/bench.Raw/Pull"
NUMEL_RESNET18_BODY = 11_168_832


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def payload_specs(numel: int | None) -> tuple[TensorSpec, ...]:
    """The GroupNorm ResNet-18 body's manifest (or one vector of ``numel`` elements)."""
    if numel is None:
        from p2pfl.models import build_model, split_parameter_names
        from p2pfl.models.layout import ParamLayout

        model = build_model("resnet18", (3, 32, 32), 10)
        shared, personal = split_parameter_names(model)
        return ParamLayout.from_model(model, shared, personal).shared_specs()
    return (TensorSpec("body", (numel,), 0, numel),)


def median_rate(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e6


def _identity(b: bytes) -> bytes:
    return b


# ---- raw gRPC baseline ---------------------------------------------------------------------------


class RawPeer:
    """A minimal bytes-streaming service: serve one float32 buffer's bytes in chunks."""

    def __init__(self, flat: torch.Tensor, chunk: int, tls: TLSConfig | None) -> None:
        self.view = memoryview(flat.numpy()).cast("B")
        self.chunk = chunk
        self.server = grpc.server(futures.ThreadPoolExecutor(4), options=server_options(chunk))
        handler = grpc.unary_stream_rpc_method_handler(
            self._pull, request_deserializer=_identity, response_serializer=_identity
        )
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Raw", {"Pull": handler}),))
        addr = "127.0.0.1:0"
        self.port = (
            self.server.add_secure_port(addr, tls.server_credentials()) if tls else self.server.add_insecure_port(addr)
        )
        self.server.start()

    def _pull(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        v, c = self.view, self.chunk
        for i in range(0, v.nbytes, c):
            yield bytes(v[i : i + c])


def raw_client(port: int, chunk: int, tls: TLSConfig | None, target: str) -> tuple[grpc.Channel, Callable[..., Any]]:
    addr = f"127.0.0.1:{port}"
    if tls:
        ch = grpc.secure_channel(addr, tls.channel_credentials(), options=channel_options(chunk, target))
    else:
        ch = grpc.insecure_channel(addr, options=channel_options(chunk))
    return ch, ch.unary_stream(RAW_METHOD, request_serializer=_identity, response_deserializer=_identity)


def raw_receive(call: Callable[..., Any], nbytes: int) -> torch.Tensor:
    """Copy the streamed bytes into one preallocated buffer (np.empty, as the codec does) and view it."""
    buf = np.empty(nbytes, dtype=np.uint8)
    mv = memoryview(buf)
    pos = 0
    for b in call(b"", timeout=60):
        mv[pos : pos + len(b)] = b
        pos += len(b)
    assert pos == nbytes
    return torch.from_numpy(buf.view(np.float32))


# ---- measurements --------------------------------------------------------------------------------


def two_peer_topology() -> Topology:
    return parse_topology(
        {
            "name": "bench-pair",
            "peers": [{"id": p, "address": f"127.0.0.1:{_free_port()}"} for p in ("p0", "p1")],
            "edges": [["p0", "p1"]],
        }
    )


class OursPair:
    """Two real peers (PeerServer + GrpcTransport) joined by one edge."""

    def __init__(self, specs: tuple[TensorSpec, ...], flats: dict[str, torch.Tensor], chunk: int,
                 certs: Path | None) -> None:
        self.specs, self.flats = specs, flats
        self.topo = two_peer_topology()
        self.hash = self.topo.hash()
        self.round = 0
        cfg = NetworkConfig(chunk_kb=chunk // 1024, max_message_mb=256, insecure=certs is None)
        self.servers: dict[str, PeerServer] = {}
        self.trans: dict[str, GrpcTransport] = {}
        try:
            for p in ("p0", "p1"):
                tls = TLSConfig.load(certs, p) if certs else None
                s = PeerServer()
                self.servers[p] = s
                s.start(self.topo.address(p), self.topo, p, expected_specs=specs, tls=tls, insecure=tls is None,
                        chunk_bytes=chunk, max_message_mb=256)
                self.trans[p] = GrpcTransport(p, self.topo, s, tls=tls, network_cfg=cfg, expected_specs=specs)
        except BaseException:
            self.close()
            raise

    def one_way(self) -> float:
        """p0 publishes (encode once), p1 pulls and decodes: seconds."""
        r, self.round = self.round, self.round + 1
        msg = Payload("p0", r, 0, self.hash, self.specs, self.flats["p0"], {})
        self.servers["p1"].set_round(r)  # keep the pair's rounds together for the exchanges that follow
        t0 = time.perf_counter()
        self.servers["p0"].publish(msg)
        got, _ = self.trans["p1"].pull("p0", r, 0, 60.0)
        dt = time.perf_counter() - t0
        assert torch.equal(got.flat, self.flats["p0"]) and got.manifest == self.specs
        return dt

    def exchange(self) -> float:
        """Both peers run `exchange` at once (each publishes and pulls the other's payload): seconds."""
        r, self.round = self.round, self.round + 1
        results: dict[str, Any] = {}

        def run(p: str) -> None:
            m = Payload(p, r, 0, self.hash, self.specs, self.flats[p], {})
            results[p] = self.trans[p].exchange(m, self.topo.plan(p, r), 60.0)

        dt = _run_pair(run)
        for p, q in (("p0", "p1"), ("p1", "p0")):
            assert not results[p].missing, results[p].missing
            assert torch.equal(results[p].received[q].flat, self.flats[q])
        return dt

    def close(self) -> None:
        for t in self.trans.values():
            t.close()
        for s in self.servers.values():
            s.stop(0)


class RawPair:
    """Two minimal bytes-streaming servers and a client of each for the other."""

    def __init__(self, flats: dict[str, torch.Tensor], chunk: int, certs: Path | None) -> None:
        self.flats = flats
        self.nbytes = flats["p0"].numel() * 4
        self.peers: dict[str, RawPeer] = {}
        self.chans: list[grpc.Channel] = []
        self.calls: dict[str, Callable[..., Any]] = {}
        try:
            for p in ("p0", "p1"):
                self.peers[p] = RawPeer(flats[p], chunk, TLSConfig.load(certs, p) if certs else None)
            for me, other in (("p1", "p0"), ("p0", "p1")):
                tls = TLSConfig.load(certs, me) if certs else None
                ch, call = raw_client(self.peers[other].port, chunk, tls, other)
                self.chans.append(ch)
                self.calls[me] = call
        except BaseException:
            self.close()
            raise

    def one_way(self) -> float:
        t0 = time.perf_counter()
        got = raw_receive(self.calls["p1"], self.nbytes)
        dt = time.perf_counter() - t0
        assert torch.equal(got, self.flats["p0"])
        return dt

    def exchange(self) -> float:
        out: dict[str, torch.Tensor] = {}

        def run(me: str) -> None:
            out[me] = raw_receive(self.calls[me], self.nbytes)

        dt = _run_pair(run)
        assert torch.equal(out["p1"], self.flats["p0"]) and torch.equal(out["p0"], self.flats["p1"])
        return dt

    def close(self) -> None:
        for ch in self.chans:
            ch.close()
        for p in self.peers.values():
            p.server.stop(0)


def _run_pair(fn: Callable[[str], None]) -> float:
    errors: list[BaseException] = []

    def guarded(p: str) -> None:
        try:
            fn(p)
        except BaseException as e:  # re-raised in the caller
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(p,)) for p in ("p0", "p1")]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return dt


def measure(specs: tuple[TensorSpec, ...], flats: dict[str, torch.Tensor], chunk: int, certs: Path | None,
            reps: int) -> dict[str, dict[str, float]]:
    """Interleave ours and raw rep by rep (the host may be shared: both see the same load)."""
    nbytes = flats["p0"].numel() * 4
    ours = OursPair(specs, flats, chunk, certs)
    try:
        raw = RawPair(flats, chunk, certs)
        try:
            times: dict[str, list[float]] = {k: [] for k in ("ours1", "raw1", "ours2", "raw2")}
            cpu: dict[str, list[float]] = {k: [] for k in times}
            for i in range(reps + 1):  # the first round is a warm-up
                pairs = [("ours1", ours.one_way), ("raw1", raw.one_way), ("ours2", ours.exchange),
                         ("raw2", raw.exchange)]
                if i % 2:
                    pairs.reverse()
                for key, fn in pairs:
                    c0 = time.process_time()
                    dt = fn()
                    dc = time.process_time() - c0
                    if i:
                        times[key].append(dt)
                        cpu[key].append(dc)
        finally:
            raw.close()
    finally:
        ours.close()
    def ratio(series: dict[str, list[float]], ours_key: str, raw_key: str) -> float:
        return statistics.median(r / o for o, r in zip(series[ours_key], series[raw_key], strict=True))

    return {
        "ours": {"one_way": median_rate(nbytes, times["ours1"]), "exchange": median_rate(2 * nbytes, times["ours2"])},
        "raw": {"one_way": median_rate(nbytes, times["raw1"]), "exchange": median_rate(2 * nbytes, times["raw2"])},
        "ratio": {"one_way": ratio(times, "ours1", "raw1"), "exchange": ratio(times, "ours2", "raw2")},
        # CPU seconds of this process (both peers live in it) per transfer, raw / ours: on a shared,
        # loaded host wall time mostly measures the scheduler; CPU time is what the code costs.
        "cpu_ratio": {"one_way": ratio(cpu, "ours1", "raw1"), "exchange": ratio(cpu, "ours2", "raw2")},
        "min_ratio": {"one_way": min(times["raw1"]) / min(times["ours1"]),
                      "exchange": min(times["raw2"]) / min(times["ours2"])},
    }


def measure_flwr(specs: tuple[TensorSpec, ...], flat: torch.Tensor, reps: int) -> dict[str, float] | None:
    try:
        from flwr.app import ArrayRecord
        from flwr.common.serde import array_record_from_proto, array_record_to_proto
        from flwr.proto.recorddict_pb2 import ArrayRecord as ProtoArrayRecord
    except ImportError as e:  # pragma: no cover - flwr is a dependency
        print(f"flwr not importable ({e}); skipping", file=sys.stderr)
        return None
    nbytes = flat.numel() * 4
    views = {s.name: flat[s.offset : s.offset + s.numel].view(s.shape) for s in specs}
    ser: list[float] = []
    de: list[float] = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        blob = array_record_to_proto(ArrayRecord(views)).SerializeToString()
        t1 = time.perf_counter()
        back = array_record_from_proto(ProtoArrayRecord.FromString(blob)).to_torch_state_dict()
        t2 = time.perf_counter()
        assert all(torch.equal(back[k], v) for k, v in views.items())
        if i:
            ser.append(t1 - t0)
            de.append(t2 - t1)
        del blob, back
    return {
        "serialize": median_rate(nbytes, ser),
        "deserialize": median_rate(nbytes, de),
        "roundtrip": median_rate(nbytes, [a + b for a, b in zip(ser, de, strict=True)]),
    }


def measure_checks(flat: torch.Tensor, reps: int) -> dict[str, float]:
    """What the receiver's and sender's checks cost alone (single thread): why ours trails raw bytes.

    Also the checksum candidates, for the choice of CRC-32 over SHA-256.
    """
    view = memoryview(flat.numpy()).cast("B")
    values = flat.numpy()
    out: dict[str, list[float]] = {"crc32": [], "crc32_zlib": [], "sha256": [], "finite": []}
    fns: dict[str, Callable[[], object]] = {
        "crc32": lambda: codec_crc32(view),  # what the wire runs (ISA-L where installed)
        "crc32_zlib": lambda: zlib.crc32(view),
        "sha256": lambda: hashlib.sha256(view).digest(),
        "finite": lambda: all_finite(values),
    }
    for i in range(reps + 1):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if i:
                out[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chunk-kb", type=int, default=1024)
    ap.add_argument("--numel", type=int, default=None,
                    help="send one vector of this many float32 instead of the ResNet-18 body manifest")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)

    specs = payload_specs(args.numel)
    numel = sum(s.numel for s in specs)
    gen = torch.Generator().manual_seed(0)
    flats = {p: torch.randn(numel, generator=gen) for p in ("p0", "p1")}
    chunk = args.chunk_kb * 1024
    mb = numel * 4 / 1e6
    print(f"payload: {len(specs)} tensors, {numel} float32 = {mb:.1f} MB; chunk {args.chunk_kb} KiB; "
          f"reps {args.reps} (median)")

    load_before = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="p2pfl-bench-wire-"))
    res: dict[str, Any] = {}
    try:
        make_certs(["p0", "p1"], tmp)
        for name, certs in (("plain", None), ("tls", tmp)):
            m = measure(specs, flats, chunk, certs, args.reps)
            res[name] = m
            for kind in ("one_way", "exchange"):
                print(f"{name:5s} {kind:8s}: ours {m['ours'][kind]:7.0f} MB/s   raw gRPC {m['raw'][kind]:7.0f} MB/s"
                      f"   ratio {m['ratio'][kind]:.2f} (median of per-rep ratios; of the fastest reps "
                      f"{m['min_ratio'][kind]:.2f}; CPU time {m['cpu_ratio'][kind]:.2f})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fl = measure_flwr(specs, flats["p0"], args.reps)
    if fl:
        print(f"flwr ArrayRecord->proto bytes: serialize {fl['serialize']:.0f} MB/s, "
              f"deserialize {fl['deserialize']:.0f} MB/s, round trip {fl['roundtrip']:.0f} MB/s (no network)")

    checks = measure_checks(flats["p0"], args.reps)
    nbytes = numel * 4
    print(f"checks alone (1 thread): CRC-32 {checks['crc32'] * 1e3:.1f} ms ({nbytes / checks['crc32'] / 1e6:.0f} MB/s; "
          f"zlib's {nbytes / checks['crc32_zlib'] / 1e6:.0f} MB/s; SHA-256 would be {nbytes / checks['sha256'] / 1e6:.0f} MB/s), NaN/Inf scan {checks['finite'] * 1e3:.1f} ms; "
          f"sender and receiver each run the CRC")
    load_after = os.getloadavg()[0]
    print(f"host load average (1 min): {load_before:.1f} before, {load_after:.1f} after, on {os.cpu_count()} CPUs")

    plain, tls = res["plain"], res["tls"]
    summary = {
        "payload_mb": round(mb, 2),
        "chunk_kb": args.chunk_kb,
        "reps": args.reps,
        "mb_per_s": round(plain["ours"]["one_way"], 1),
        "raw_grpc_mb_per_s": round(plain["raw"]["one_way"], 1),
        "ratio": round(plain["ratio"]["one_way"], 3),
        "tls_mb_per_s": round(tls["ours"]["one_way"], 1),
        "tls_raw_grpc_mb_per_s": round(tls["raw"]["one_way"], 1),
        "tls_ratio": round(tls["ratio"]["one_way"], 3),
        "exchange_mb_per_s": round(plain["ours"]["exchange"], 1),
        "exchange_raw_grpc_mb_per_s": round(plain["raw"]["exchange"], 1),
        "exchange_ratio": round(plain["ratio"]["exchange"], 3),
        "tls_exchange_mb_per_s": round(tls["ours"]["exchange"], 1),
        "tls_exchange_raw_grpc_mb_per_s": round(tls["raw"]["exchange"], 1),
        "tls_exchange_ratio": round(tls["ratio"]["exchange"], 3),
        "cpu_ratio": round(plain["cpu_ratio"]["one_way"], 3),
        "exchange_cpu_ratio": round(plain["cpu_ratio"]["exchange"], 3),
        "tls_cpu_ratio": round(tls["cpu_ratio"]["one_way"], 3),
        "tls_exchange_cpu_ratio": round(tls["cpu_ratio"]["exchange"], 3),
        "min_ratio": round(plain["min_ratio"]["one_way"], 3),
        "exchange_min_ratio": round(plain["min_ratio"]["exchange"], 3),
        "flwr_serialize_mb_per_s": round(fl["serialize"], 1) if fl else None,
        "flwr_deserialize_mb_per_s": round(fl["deserialize"], 1) if fl else None,
        "flwr_roundtrip_mb_per_s": round(fl["roundtrip"], 1) if fl else None,
        "ours_ms": round(nbytes / plain["ours"]["one_way"] / 1e3, 1),
        "raw_grpc_ms": round(nbytes / plain["raw"]["one_way"] / 1e3, 1),
        "crc32_ms": round(checks["crc32"] * 1e3, 1),
        "crc32_mb_per_s": round(nbytes / checks["crc32"] / 1e6, 1),
        "crc32_zlib_mb_per_s": round(nbytes / checks["crc32_zlib"] / 1e6, 1),
        "sha256_mb_per_s": round(nbytes / checks["sha256"] / 1e6, 1),
        "finite_scan_ms": round(checks["finite"] * 1e3, 1),
        "cpus": os.cpu_count(),
        "load_avg_1m": [round(load_before, 2), round(load_after, 2)],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
