"""Wire compression (``wire.compression``), DisPFL's bit-packed masks and exact byte accounting.

Round trips through the real codec, refusals of malformed compressed payloads, top-k's error
feedback (kept in the peer state and checkpointed), and simulate == gRPC (bitwise parameters,
equal byte counts) for a compressed run.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from p2pfl.config import ConfigError, load_config
from p2pfl.experiment import Experiment
from p2pfl.models.layout import TensorSpec
from p2pfl.payload import Payload
from p2pfl.proto import peer_pb2
from p2pfl.simulation import simulate
from p2pfl.wire import codec
from p2pfl.wire.codec import Decoder, encode_frames, parse_frame, wire_size
from p2pfl.wire.compress import TOPK_REF, WireFormat, compress_outgoing, densify, topk_count
from p2pfl.wire.validate import Expectation, Reason, WireError
from tests.conftest import assert_same_bytes, tiny_config
from tests.swarm import free_base_port, run_grpc

SPECS = (TensorSpec("w", (4, 5), 0, 20), TensorSpec("b", (5,), 20, 5), TensorSpec("mask/w", (4, 5), 25, 20, "bit"))
FLOAT = SPECS[:2]


def _message(specs=SPECS, seed: int = 0) -> Payload:
    g = torch.Generator().manual_seed(seed)
    n = sum(s.numel for s in specs)
    flat = torch.randn(n, generator=g)
    for s in specs:
        if s.dtype == "bit":
            flat[s.offset : s.offset + s.numel] = (torch.rand(s.numel, generator=g) > 0.5).float()
    return Payload("p0", 2, 0, "hash", specs, flat, {"mu": 1.0})


def _expect(specs=SPECS, fmt: WireFormat | None = None) -> Expectation:
    return Expectation(specs, 2, 0, "hash", frozenset({"p0"}), frozenset({"mu"}), wire=fmt or WireFormat())


def _roundtrip(msg: Payload, exp: Expectation, chunk: int = 16) -> tuple[Payload, int]:
    payload = encode_frames(msg, chunk)
    dec = Decoder(exp)
    for f in payload:
        dec.feed(parse_frame(f))
    out = dec.finish()
    assert payload.wire_bytes == dec.wire_bytes == wire_size(msg, chunk)
    return out, payload.wire_bytes


@pytest.mark.parametrize("comp", ["none", "fp16", "bf16"])
def test_float_modes_round_trip_bitwise_and_bits_are_packed(comp: str) -> None:
    fmt = WireFormat(comp)
    sent = compress_outgoing(_message(), fmt, {}, bit_ranges=((25, 20),))
    out, nbytes = _roundtrip(sent, _expect(fmt=fmt))
    assert torch.equal(out.flat, sent.flat)
    # what the receiver sees is the value rounded to the 2-byte float, masks untouched
    if comp != "none":
        dtype = torch.float16 if comp == "fp16" else torch.bfloat16
        assert torch.equal(sent.flat[:25], _message().flat[:25].to(dtype).float())
    assert torch.equal(sent.flat[25:], _message().flat[25:])
    per = 4 if comp == "none" else 2
    assert codec.encoded_nbytes(SPECS, comp) == 25 * per + 3  # 20 mask bits -> 3 bytes


def test_topk_round_trip_densify_and_error_feedback() -> None:
    fmt = WireFormat("topk", 0.2)
    extra: dict[str, torch.Tensor] = {}
    x = _message(FLOAT)
    k = topk_count(25, 0.2)
    seen = torch.zeros(25, dtype=torch.bool)
    for _ in range(5):  # a constant model: the residual sends every coordinate within 1/ratio rounds
        sent = compress_outgoing(x, fmt, extra)
        assert sent.indices is not None and sent.indices.numel() == k
        out, nbytes = _roundtrip(sent, _expect(FLOAT, fmt))
        assert torch.equal(out.indices, sent.indices) and torch.equal(out.flat, sent.flat)
        assert nbytes < wire_size(x, 16)
        seen[sent.indices] = True
        own = torch.full((25,), 7.0)
        full = densify(out, own)
        assert torch.equal(full.flat[sent.indices], x.flat[sent.indices])
        rest = torch.ones(25, dtype=torch.bool)
        rest[sent.indices] = False
        assert bool((full.flat[rest] == 7.0).all())  # unsent coordinates: the receiver's own values
    assert bool(seen.all()) and torch.equal(extra[TOPK_REF], x.flat)


def test_topk_reference_is_checkpointed(tmp_path: Path) -> None:
    from p2pfl.algorithms.base import PeerState
    from p2pfl.checkpoint import load_checkpoint, save_checkpoint

    state = PeerState("p0", torch.randn(25))
    compress_outgoing(_message(FLOAT), WireFormat("topk", 0.3), state.extra)
    save_checkpoint(tmp_path / "c.npz", state, torch.Generator(), meta={})
    back, _, _ = load_checkpoint(tmp_path / "c.npz", torch.device("cpu"))
    assert torch.equal(back.extra[TOPK_REF], state.extra[TOPK_REF])


def _frames(msg: Payload, data: bytes, **header_fields) -> list[bytes]:
    """Frames of ``msg``'s header with raw tensor bytes ``data`` (and a correct CRC over them)."""
    header = codec._header(msg, len(data), 0)
    crc = codec.crc32_combine(codec.scalars_crc(dict(header.scalars)), zlib.crc32(data), len(data))
    header.crc32 = crc
    for k, v in header_fields.items():
        setattr(header, k, v)
    return [peer_pb2.Chunk(header=header).SerializeToString(), peer_pb2.Chunk(data=data).SerializeToString()]


def _refused(frames: list[bytes], exp: Expectation) -> WireError:
    dec = Decoder(exp)
    with pytest.raises(WireError) as info:
        for f in frames:
            dec.feed(parse_frame(f))
        dec.finish()
    return info.value


def test_malformed_compressed_payloads_are_refused() -> None:
    fmt = WireFormat("topk", 0.2)
    exp = _expect(FLOAT, fmt)
    sent = compress_outgoing(_message(FLOAT), fmt, {})
    good = bytes(memoryview(codec._encoded(sent, sent.flat.numpy())))
    k = sent.indices.numel()
    idx = sent.indices.numpy().astype("<i4")
    # indices out of order, out of range, negative
    for bad in (idx[::-1].copy(), np.concatenate([idx[:-1], [25]]).astype("<i4"),
                np.concatenate([[-1], idx[1:]]).astype("<i4")):
        err = _refused(_frames(sent, bad.tobytes() + good[4 * k:]), exp)
        assert err.code == Reason.INDICES and "strictly increasing" in err.message
    # a count the config does not give, and a compression the config does not use
    err = _refused(_frames(sent, good, count=k + 1), exp)
    assert err.code == Reason.COMPRESSION
    err = _refused(_frames(sent, good), _expect(FLOAT, WireFormat("topk", 0.5)))
    assert err.code == Reason.COMPRESSION and "topk_ratio" in err.message
    half = compress_outgoing(_message(FLOAT), WireFormat("fp16"), {})
    err = _refused(list(encode_frames(half)), _expect(FLOAT))
    assert err.code == Reason.COMPRESSION and "'fp16'" in err.message
    err = _refused(list(encode_frames(_message(FLOAT))), _expect(FLOAT, WireFormat("bf16")))
    assert err.code == Reason.COMPRESSION
    # fp16 overflow arrives as Inf: refused like any non-finite payload
    big = dataclasses.replace(_message(FLOAT), flat=torch.full((25,), 1e6))
    err = _refused(list(encode_frames(compress_outgoing(big, WireFormat("fp16"), {}))), _expect(FLOAT, WireFormat("fp16")))
    assert err.code == Reason.NON_FINITE
    # bit tensors: non-zero padding bits; a mask sent as float32 when a bit tensor is expected
    msg = _message()
    data = bytearray(codec._encoded(msg, msg.flat.numpy()))
    data[-1] |= 0x80  # 20 bits use 4 bits of the last byte
    err = _refused(_frames(msg, bytes(data)), _expect())
    assert err.code == Reason.MALFORMED and "padding" in err.message
    as_float = dataclasses.replace(msg, manifest=(*SPECS[:2], dataclasses.replace(SPECS[2], dtype="float32")))
    err = _refused(list(encode_frames(as_float)), _expect())
    assert err.code == Reason.DTYPE


def test_dispfl_masks_cross_the_wire_bit_packed(tmp_path: Path) -> None:
    cfg = load_config(tiny_config(tmp_path, algorithm={"name": "dispfl", "local_epochs": 1}))
    algo = Experiment.from_config(cfg).new_algorithm()
    specs = algo.wire_specs()
    masks = [s for s in specs if s.name.startswith("mask/")]
    assert masks and all(s.dtype == "bit" for s in masks)
    params = sum(s.numel for s in specs if s.dtype == "float32")
    assert codec.encoded_nbytes(specs, "none") == params * 4 + sum(-(-s.numel // 8) for s in masks)


def test_topk_refused_where_it_cannot_apply(tmp_path: Path) -> None:
    for algorithm, kind in (({"name": "dispfl"}, "ring"), ({"name": "dfedpgp", "mix_mode": "push"}, "directed_ring")):
        path = tiny_config(tmp_path, algorithm=algorithm, kind=kind, wire={"compression": "topk"})
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert "wire.compression" in str(info.value) and "\n" not in str(info.value)
    path = tiny_config(tmp_path, simulation={"engine": "batched"}, wire={"compression": "bf16"})
    with pytest.raises(ConfigError, match="wire.compression.*batched"):
        load_config(path)


# ---- simulate == gRPC, bytes included ----------------------------------------------------------------


def assert_same_as_simulation(cfg, tmp_path: Path) -> tuple[list[dict], list[dict]]:
    """Simulate and run over gRPC; parameters bitwise equal, per-peer bytes equal; return both records."""
    simulate(cfg, tmp_path / "sim", progress=False)
    sim = [json.loads(line) for line in (tmp_path / "sim" / "metrics.jsonl").read_text().splitlines()]
    nodes, records = run_grpc(cfg, tmp_path)
    assert len(records) == len(sim) == 4 * cfg.rounds and not any(r["missing"] for r in records)
    for node in nodes:
        with np.load(tmp_path / "sim" / "checkpoints" / f"{node.peer_id}.npz") as z:
            assert np.array_equal(node.state.params.numpy(), z["params"]), node.peer_id
            for key, value in node.state.extra.items():
                assert np.array_equal(value.numpy(), z[f"extra/{key}"]), key
    # What each peer read and sent over gRPC is what the simulation accounts, byte for byte, headers
    # included, round by round (docs/protocol.md, "Bytes"); a fault-free run sends what it reads.
    assert_same_bytes(sim, records)
    return sim, records


@pytest.mark.timeout(180)
def test_topk_simulate_equals_grpc_bitwise_with_the_same_bytes(tmp_path: Path) -> None:
    cfg = load_config(tiny_config(tmp_path, base_port=free_base_port(), rounds=2,
                                  wire={"compression": "topk", "topk_ratio": 0.1}))
    sim, _ = assert_same_as_simulation(cfg, tmp_path)
    specs = Experiment.from_config(cfg).new_algorithm().wire_specs()
    numel = sum(s.numel for s in specs)
    dense = codec.encoded_nbytes(specs, "none")
    sparse = codec.encoded_nbytes(specs, "topk", topk_count(numel, 0.1))
    assert sparse == topk_count(numel, 0.1) * 8 and sparse < dense / 4
    # each peer of the ring sends its payload to 2 neighbours per round: headers + 8 bytes per coordinate
    for r in sim:
        assert sparse * 2 < r["bytes_sent"] < sparse * 2 + 2 * 400


def test_remembered_wire_size_is_the_encoded_size_at_every_round_length() -> None:
    """wire_size remembers one size per header shape; the round enters only through its varint length."""
    base = _message(FLOAT)
    for r in (0, 1, 127, 128, 129, 16383, 16384, 2**21 - 1, 2**21, 2**35):
        for scalars in ({}, {"mu": 0.0}, {"mu": 1.5, "x": -2.0}):
            msg = dataclasses.replace(base, round=r, scalars=scalars)
            for chunk in (16, 1 << 20):
                assert wire_size(msg, chunk) == encode_frames(msg, chunk).wire_bytes, (r, scalars, chunk)


def test_remembered_wire_size_is_the_encoded_size_for_every_sender_length() -> None:
    """The sender enters the remembered size only through its length in bytes (one entry for all the
    peers of a worker, however many): senders of every length, across the varint boundary at 128."""
    base = _message(FLOAT)
    for sender in ("p0", "p9999", "peer-" + "x" * 57, "é" * 70, "p" * 127, "p" * 128, "p" * 300):
        for r in (0, 5):
            msg = dataclasses.replace(base, sender=sender, round=r)
            assert wire_size(msg, 1 << 20) == encode_frames(msg, 1 << 20).wire_bytes, (sender, r)
