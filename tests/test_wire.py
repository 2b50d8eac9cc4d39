"""The wire codec: bitwise round trips and every rejection rule of the receiver."""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Callable

import numpy as np
import pytest
import torch

from p2pfl.models.layout import TensorSpec
from p2pfl.payload import Payload
from p2pfl.proto import peer_pb2
from p2pfl.wire import (
    Decoder,
    Expectation,
    RawData,
    Reason,
    WireError,
    decode,
    encode,
    encode_frames,
    parse_frame,
)
from p2pfl.wire.crc import crc32, crc32_combine
from p2pfl.wire.validate import all_finite

HASH = "0123456789abcdef"


def specs_of(*shapes: tuple[str, tuple[int, ...]]) -> tuple[TensorSpec, ...]:
    out, off = [], 0
    for name, shape in shapes:
        n = math.prod(shape)
        out.append(TensorSpec(name, shape, off, n))
        off += n
    return tuple(out)


SPECS = specs_of(
    ("conv.weight", (4, 3, 3, 3)), ("conv.bias", (4,)), ("norm.weight", (0,)), ("fc.weight", (5, 7)), ("s", (1,))
)
NUMEL = sum(s.numel for s in SPECS)


def make_msg(specs: tuple[TensorSpec, ...] = SPECS, *, sender: str = "p1", round: int = 2, step: int = 1,
             scalars: dict[str, float] | None = None, seed: int = 0) -> Payload:
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(sum(s.numel for s in specs), generator=g)
    if flat.numel() >= 4:  # values whose bits a lossy path would change
        flat[:4] = torch.tensor([-0.0, 1e-45, 3.4028235e38, -1.1754944e-38])
    return Payload(sender, round, step, HASH, specs, flat, {"weight": 0.25} if scalars is None else scalars)


def expect(specs: tuple[TensorSpec, ...] = SPECS, *, senders: tuple[str, ...] = ("p1", "p2"), round: int = 2,
           step: int = 1, scalar_keys: tuple[str, ...] = ("weight",), max_bytes: int = 1 << 20,
           topology_hash: str = HASH) -> Expectation:
    return Expectation(specs=specs, round=round, step=step, topology_hash=topology_hash,
                       senders=frozenset(senders), scalar_keys=frozenset(scalar_keys), max_bytes=max_bytes)


def assert_same(a: Payload, b: Payload) -> None:
    assert (a.sender, a.round, a.step, a.topology_hash) == (b.sender, b.round, b.step, b.topology_hash)
    assert a.manifest == b.manifest
    assert a.scalars == b.scalars
    assert a.flat.dtype == b.flat.dtype == torch.float32
    assert torch.equal(a.flat.view(torch.int32), b.flat.view(torch.int32))  # bitwise, -0.0 included


# ---- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [7, 64, 1000, 1 << 20])
@pytest.mark.parametrize("parallel", [False, True])
def test_round_trip_chunks_bitwise(chunk: int, parallel: bool) -> None:
    msg = make_msg()
    chunks = encode(msg, chunk)
    assert chunks[0].WhichOneof("body") == "header"
    assert len(chunks) == 1 + -(-NUMEL * 4 // chunk)
    got = decode(chunks, expect(), parallel_min_bytes=0 if parallel else 1 << 30)
    assert_same(got, msg)


@pytest.mark.parametrize("chunk", [5, 64, 1 << 20])
@pytest.mark.parametrize("parallel", [False, True])
def test_round_trip_frames_bitwise(chunk: int, parallel: bool) -> None:
    msg = make_msg(scalars={"weight": 0.1, "other": -3.5e300})
    payload = encode_frames(msg, chunk)
    items = [parse_frame(f) for f in payload]
    assert isinstance(items[0], peer_pb2.Chunk) and all(isinstance(i, RawData) for i in items[1:])
    dec = Decoder(expect(scalar_keys=("weight", "other")), parallel_min_bytes=0 if parallel else 1 << 30)
    for item in items:
        dec.feed(item)
    assert_same(dec.finish(), msg)
    assert dec.wire_bytes == payload.wire_bytes == sum(len(f) for f in payload)


def test_frames_are_the_protobuf_serialization() -> None:
    msg = make_msg()
    chunks = encode(msg, 100)
    payload = encode_frames(msg, 100)
    frames = payload.frames
    assert len(frames) == len(chunks) == len(payload)
    assert peer_pb2.Chunk.FromString(frames[0]) == chunks[0]
    assert list(frames[1:]) == [c.SerializeToString() for c in chunks[1:]]
    assert payload.chunks() == chunks
    assert payload.wire_bytes == sum(c.ByteSize() for c in chunks)


def test_round_trip_various_shapes_and_no_scalars() -> None:
    for specs in (specs_of(("v", (1,))), specs_of(("a", (2, 2)), ("b", (3, 1, 1))), specs_of(("big", (3000,)))):
        msg = make_msg(specs, scalars={})
        assert_same(decode(encode(msg, 33), expect(specs, scalar_keys=())), msg)


def test_encode_takes_non_contiguous_and_refuses_bad_messages() -> None:
    base = torch.arange(2 * NUMEL, dtype=torch.float32)
    msg = Payload("p1", 2, 1, HASH, SPECS, base[::2], {"weight": 1.0})  # strided view
    got = decode(encode(msg), expect())
    assert torch.equal(got.flat, base[::2])
    with pytest.raises(ValueError, match="float32"):
        encode(Payload("p1", 2, 1, HASH, SPECS, torch.zeros(NUMEL, dtype=torch.float64), {}))
    gap = (TensorSpec("a", (2,), 0, 2), TensorSpec("b", (2,), 3, 2))
    with pytest.raises(ValueError, match="back to back"):
        encode(Payload("p1", 2, 1, HASH, gap, torch.zeros(5), {}))
    with pytest.raises(ValueError, match="covers"):
        encode(Payload("p1", 2, 1, HASH, SPECS, torch.zeros(NUMEL + 1), {}))


def test_parse_frame_falls_back_to_protobuf() -> None:
    # A data field written twice is valid protobuf (the last one wins) but not the fast path's shape.
    twice = peer_pb2.Chunk(data=b"abc").SerializeToString() + peer_pb2.Chunk(data=b"xy").SerializeToString()
    got = parse_frame(twice)
    assert isinstance(got, peer_pb2.Chunk) and got.data == b"xy"
    raw = parse_frame(peer_pb2.Chunk(data=b"\x00" * 300).SerializeToString())
    assert isinstance(raw, RawData) and bytes(raw.data) == b"\x00" * 300 and raw.wire_len == 303
    assert isinstance(parse_frame(peer_pb2.Chunk(data=b"").SerializeToString()), RawData)


def test_crc32_combine_and_parallel_crc() -> None:
    for la, lb in [(0, 5), (5, 0), (1, 1), (100, 1 << 20), (12345, 54321)]:
        a, b = os.urandom(la), os.urandom(lb)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), lb) == zlib.crc32(a + b)
    data = os.urandom(9 << 20)
    assert crc32(memoryview(data), piece=1 << 20) == zlib.crc32(data)


# ---- rejections -------------------------------------------------------------------------------


def _with_header(mutate: Callable[[peer_pb2.Header], None]) -> Callable[[list[peer_pb2.Chunk]], list[peer_pb2.Chunk]]:
    def apply(chunks: list[peer_pb2.Chunk]) -> list[peer_pb2.Chunk]:
        head = peer_pb2.Chunk()
        head.CopyFrom(chunks[0])
        mutate(head.header)
        return [head, *chunks[1:]]

    return apply


def _set(field: str, value: object) -> Callable[[peer_pb2.Header], None]:
    return lambda h: setattr(h, field, value)


def _shape(h: peer_pb2.Header) -> None:
    h.manifest[3].shape[:] = [7, 5]


def _dtype(h: peer_pb2.Header) -> None:
    h.manifest[1].dtype = "float64"


def _drop_entry(h: peer_pb2.Header) -> None:
    del h.manifest[4]


def _extra_entry(h: peer_pb2.Header) -> None:
    h.manifest.add(name="extra", dtype="float32", shape=[1])


def _scalar(key: str, value: float) -> Callable[[peer_pb2.Header], None]:
    return lambda h: h.scalars.__setitem__(key, value)


def _flip_byte(chunks: list[peer_pb2.Chunk]) -> list[peer_pb2.Chunk]:
    data = bytearray(chunks[2].data)
    data[3] ^= 0x01
    return [*chunks[:2], peer_pb2.Chunk(data=bytes(data)), *chunks[3:]]


def _extra_data(chunks: list[peer_pb2.Chunk]) -> list[peer_pb2.Chunk]:
    return [*chunks, peer_pb2.Chunk(data=b"\x00" * 8)]


def _poisoned(value: float, index: int) -> list[peer_pb2.Chunk]:
    msg = make_msg()
    msg.flat[index] = value
    return encode(msg, 64)


CASES: list[tuple[str, Callable[[list[peer_pb2.Chunk]], list[peer_pb2.Chunk]], dict[str, object], Reason, str]] = [
    ("missing header", lambda c: c[1:], {}, Reason.MISSING_HEADER, "data arrived before the header"),
    ("only header missing", lambda c: [], {}, Reason.MISSING_HEADER, "no header"),
    ("duplicate header", lambda c: [c[0], c[0], *c[1:]], {}, Reason.DUPLICATE_HEADER, "second header"),
    ("empty chunk", lambda c: [c[0], peer_pb2.Chunk(), *c[1:]], {}, Reason.EMPTY_CHUNK, "neither a header nor data"),
    ("bad name", lambda c: c, {"specs": specs_of(("conv.weight", (4, 3, 3, 3)), ("conv.b", (4,)),
                                                 ("norm.weight", (0,)), ("fc.weight", (5, 7)), ("s", (1,)))},
     Reason.MANIFEST, "manifest entry 1 is tensor 'conv.bias', expected 'conv.b'"),
    ("bad shape", _with_header(_shape), {}, Reason.MANIFEST,
     "tensor 'fc.weight' has shape (7, 5), expected (5, 7)"),
    ("bad dtype", _with_header(_dtype), {}, Reason.DTYPE, "tensor 'conv.bias' has dtype 'float64'; only float32"),
    ("missing tensor", _with_header(_drop_entry), {}, Reason.MANIFEST, "tensor 's' is missing"),
    ("extra tensor", _with_header(_extra_entry), {}, Reason.MANIFEST, "unexpected tensor 'extra'"),
    ("unexpected scalar", _with_header(_scalar("bogus", 1.0)), {}, Reason.SCALARS, "unexpected scalar keys ['bogus']"),
    ("missing scalar", lambda c: c, {"scalar_keys": ("weight", "w2")}, Reason.SCALARS, "missing scalar keys ['w2']"),
    ("nan scalar", _with_header(_scalar("weight", float("nan"))), {}, Reason.NON_FINITE, "scalar 'weight' is nan"),
    ("inf scalar", _with_header(_scalar("weight", float("inf"))), {}, Reason.NON_FINITE, "scalar 'weight' is inf"),
    ("nan tensor", lambda c: _poisoned(float("nan"), 110), {}, Reason.NON_FINITE,
     "tensor 'conv.bias' contains 1 non-finite value(s) (1 NaN, 0 Inf)"),
    ("inf tensor", lambda c: _poisoned(float("-inf"), NUMEL - 1), {}, Reason.NON_FINITE,
     "tensor 's' contains 1 non-finite value(s) (0 NaN, 1 Inf)"),
    ("wrong round", lambda c: c, {"round": 3}, Reason.ROUND, "payload is for round 2, expected round 3"),
    ("wrong step", lambda c: c, {"step": 0}, Reason.STEP, "payload is for step 1 of round 2, expected step 0"),
    ("hash mismatch", lambda c: c, {"topology_hash": "fedcba9876543210"}, Reason.TOPOLOGY,
     "topology hash '0123456789abcdef' differs from this peer's 'fedcba9876543210'"),
    ("sender not a neighbour", lambda c: c, {"senders": ("p0", "p2")}, Reason.SENDER,
     "sender 'p1' is not an allowed in-neighbour at round 2 step 1 (allowed: p0, p2)"),
    ("oversize declared", _with_header(_set("total_bytes", 1 << 40)), {}, Reason.OVERSIZE,
     f"payload declares {1 << 40} bytes, more than the limit of {1 << 20} bytes"),
    ("oversize stream", _extra_data, {"max_bytes": NUMEL * 4}, Reason.OVERSIZE,
     f"stream exceeds the limit of {NUMEL * 4} bytes"),
    ("more than declared", _extra_data, {}, Reason.LENGTH, f"more than the {NUMEL * 4} bytes its header declares"),
    ("length mismatch", _with_header(_set("total_bytes", NUMEL * 4 - 4)), {}, Reason.LENGTH,
     f"header declares {NUMEL * 4 - 4} bytes but the manifest needs {NUMEL * 4} bytes"),
    ("checksum", _flip_byte, {}, Reason.CHECKSUM, f"CRC-32 of the {NUMEL * 4} received bytes is"),
    ("truncated", lambda c: c[:-1], {}, Reason.TRUNCATED,
     f"stream ended after {(NUMEL * 4 - 1) // 64 * 64} of {NUMEL * 4} bytes"),
]


@pytest.mark.parametrize("parallel", [False, True], ids=["inline", "workers"])
@pytest.mark.parametrize(("name", "mutate", "exp_kw", "reason", "text"), CASES, ids=[c[0] for c in CASES])
def test_rejections(name: str, mutate: Callable[[list[peer_pb2.Chunk]], list[peer_pb2.Chunk]],
                    exp_kw: dict[str, object], reason: Reason, text: str, parallel: bool) -> None:
    chunks = mutate(encode(make_msg(), 64))
    with pytest.raises(WireError) as info:
        decode(chunks, expect(**exp_kw), parallel_min_bytes=0 if parallel else 1 << 30)  # type: ignore[arg-type]
    assert info.value.code == reason
    assert text in str(info.value), str(info.value)


def test_oversize_is_refused_before_buffering() -> None:
    """A huge declared size fails at the header: nothing of that size is ever allocated."""
    dec = Decoder(expect())
    head = _with_header(_set("total_bytes", 1 << 62))(encode(make_msg(), 64))[0]
    with pytest.raises(WireError) as info:
        dec.feed(head)
    assert info.value.code == Reason.OVERSIZE
    assert dec.header is None and dec.received == 0


def test_all_finite_fast_path_and_overflow() -> None:
    x = np.ones(1000, dtype=np.float32)
    assert all_finite(x) and all_finite(x[:0])
    x[10] = 3e38  # its square overflows the fast path: the exact scan decides
    assert all_finite(x)
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.copy()
        y[500] = bad
        assert not all_finite(y)
