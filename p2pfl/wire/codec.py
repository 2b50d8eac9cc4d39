"""Tensors <-> wire chunks: a header, then the raw little-endian float32 bytes in ~1 MiB pieces.

Why this shape: the payload is one contiguous float32 vector (the flat shared part), so the bytes
on the wire are exactly its memory; the manifest (names, shapes) lets the receiver check and view
it. No pickle, no ``torch.load``: the receiver reassembles into one preallocated buffer and views
it with ``torch.from_numpy`` after every check has passed (`p2pfl.wire.validate`).

Two representations of the same chunks:

* `encode` / `decode` work on ``peer_pb2.Chunk`` messages (what a generated stub sends/yields);
* `encode_frames` produces the serialized Chunks directly (one copy of the tensor bytes) and
  `parse_frame` reads a serialized Chunk back, returning a data chunk as a zero-copy view. The
  gRPC service and transport use these as their (de)serializers, which removes a full protobuf
  copy of the payload on each side; the bytes on the wire are identical, so generated stubs
  interoperate.

The checksum (`p2pfl.wire.crc`) is CRC-32 (zlib) of the header's scalars (canonically encoded, `scalars_crc`: a
push-sum weight is as much payload as the tensors) followed by all tensor bytes, in the header;
``Header.wire_version`` says so (`WIRE_VERSION`). CRC-32 was measured at ~2.4-2.7 GB/s on
the 2-core dev host against ~1.7 GB/s for SHA-256 and ~0.6 GB/s for BLAKE2b (``bench/wire.py``
prints the figures). It catches corruption and reassembly bugs; authenticity is TLS's job. Being
in the header, the sender computes it before the first byte leaves (split over the wire worker
threads for large payloads); the receiver copies each chunk into place as it arrives and checks
(CRC-32, NaN/Inf) every ``CHECK_BYTES`` region it completed, while that region is still in cache.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
from collections.abc import Iterable, Iterator
from concurrent import futures
from typing import NamedTuple

import numpy as np
import torch

from p2pfl.models.layout import TensorSpec
from p2pfl.payload import Payload
from p2pfl.proto import peer_pb2
from p2pfl.wire.compress import BIT, VALUE_BYTES, pack_bits, unpack_bits
from p2pfl.wire.crc import crc32, crc32_combine, scalars_crc, wire_pool
from p2pfl.wire.validate import (
    WIRE_VERSION,
    Expectation,
    Reason,
    WireError,
    all_finite,
    check_finite,
    check_header,
    encoded_nbytes,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "PARALLEL_MIN_BYTES",
    "Decoder",
    "EncodedPayload",
    "RawData",
    "decode",
    "encode",
    "encode_frames",
    "parse_frame",
    "wire_size",
]

DEFAULT_CHUNK_BYTES = 1 << 20
#: The receiver checks (CRC-32 + NaN/Inf scan) the payload in regions of this many bytes, as they complete.
CHECK_BYTES = 4 << 20
#: Payloads at least this large have their regions checked on the wire worker threads instead of in the
#: receiving thread. Off by default: on the 2-core dev host the hand-off cost more CPU than the overlap
#: with reception saved (bench/wire.py: ~8% more CPU per transfer than checking in place); a host
#: with spare cores may pass a smaller value to `Decoder`.
PARALLEL_MIN_BYTES = 1 << 62

# Protobuf tags of Chunk's oneof fields (field number << 3 | wire type 2 = length-delimited).
_TAG_HEADER = (1 << 3) | 2
_TAG_DATA = (2 << 3) | 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


# ---- encoding -----------------------------------------------------------------------------------


def _check_layout(msg: Payload, flat: torch.Tensor) -> None:
    offset = 0
    for s in msg.manifest:
        numel = math.prod(s.shape)
        if s.offset != offset or s.numel != numel:
            raise ValueError(
                f"manifest entry {s.name!r} is not laid out back to back (offset {s.offset}, numel {s.numel}, "
                f"expected offset {offset}, numel {numel})"
            )
        offset += s.numel
    if offset != flat.numel():
        raise ValueError(f"manifest covers {offset} elements but flat has {flat.numel()}")


def _plain(msg: Payload) -> bool:
    """Whether the tensor bytes are ``flat``'s own memory (float32, nothing packed): the zero-copy path."""
    return (msg.compression or "none") == "none" and all(s.dtype != BIT for s in msg.manifest)


def _encoded(msg: Payload, arr: np.ndarray) -> np.ndarray:
    """The tensor bytes of a compressed payload or one with bit tensors (one new buffer)."""
    comp = msg.compression or "none"
    if comp == "topk":
        if msg.indices is None:
            raise ValueError("a top-k message must carry its indices")
        idx = msg.indices.detach().cpu().numpy()
        return np.concatenate([idx.astype("<i4").view(np.uint8), arr[idx].astype("<f4").view(np.uint8)])
    parts = []
    for s in msg.manifest:
        part = arr[s.offset : s.offset + s.numel]
        if s.dtype == BIT:
            parts.append(pack_bits(part))
        elif comp == "fp16":
            parts.append(part.astype("<f2").view(np.uint8))
        elif comp == "bf16":
            half = torch.from_numpy(np.ascontiguousarray(part)).to(torch.bfloat16).view(torch.int16).numpy()
            parts.append(half.astype("<i2").view(np.uint8))
        else:
            parts.append(part.astype("<f4").view(np.uint8))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)


def _header(msg: Payload, nbytes: int, crc: int) -> peer_pb2.Header:
    comp = msg.compression or "none"
    return peer_pb2.Header(
        sender=msg.sender,
        round=msg.round,
        step=msg.step,
        topology_hash=msg.topology_hash,
        manifest=[peer_pb2.TensorEntry(name=s.name, dtype=s.dtype, shape=list(s.shape)) for s in msg.manifest],
        scalars={str(k): float(v) for k, v in msg.scalars.items()},
        total_bytes=nbytes,
        crc32=crc,
        wire_version=WIRE_VERSION,
        compression="" if comp == "none" else comp,
        count=0 if msg.indices is None else int(msg.indices.numel()),
    )


def _payload_view(msg: Payload) -> tuple[peer_pb2.Header, memoryview]:
    """The header and a byte view of the encoded tensor bytes (``msg.flat`` itself on CPU when float32)."""
    flat = msg.flat.detach()
    if flat.dtype != torch.float32:
        raise ValueError(f"message flat must be float32, got {flat.dtype}")
    if flat.dim() != 1:
        raise ValueError(f"message flat must be 1-D, got shape {tuple(flat.shape)}")
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    _check_layout(msg, flat)
    arr = flat.numpy()
    if _plain(msg):
        if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
            arr = arr.astype("<f4")
        view = memoryview(arr).cast("B")
    else:
        view = memoryview(_encoded(msg, arr))
    scalars = {str(k): float(v) for k, v in msg.scalars.items()}
    header = _header(msg, view.nbytes, crc32_combine(scalars_crc(scalars), crc32(view), view.nbytes))
    return header, view


def _frames_bytes(header: peer_pb2.Header, nbytes: int, chunk_bytes: int) -> int:
    """Serialized size of the header Chunk and the data Chunks of ``nbytes`` tensor bytes."""
    sizes = [min(chunk_bytes, nbytes - i) for i in range(0, nbytes, chunk_bytes)]
    return peer_pb2.Chunk(header=header).ByteSize() + sum(1 + len(_varint(n)) + n for n in sizes)


def wire_size(msg: Payload, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Bytes ``encode_frames(msg, chunk_bytes)`` puts on the wire (``EncodedPayload.wire_bytes``), computed
    without encoding: the in-memory simulation accounts its traffic with it. The CRC is a fixed32, so
    its value does not change the size, except 0, which proto3 leaves out (5 bytes, 1 payload in 2**32).

    Remembered per header shape: the round enters the size only through its varint's length (0 is
    left out), and the sender only through its length in bytes, so all peers' messages of one
    round length share one entry. Building the header was ~80 us per message inside a simulation
    worker (cold caches), for the same number every round. (Keyed by the sender itself, a worker
    of more than ~2,000 peers cycled through the whole cache and missed on every message, issue 71.)"""
    count = 0 if msg.indices is None else int(msg.indices.numel())
    r = msg.round
    # the smallest round with r's varint length (r itself when 0, or negative: never on the wire)
    rep = r if r <= 0 else 1 << (7 * ((r.bit_length() - 1) // 7))
    scalars = tuple((str(k), float(v)) for k, v in msg.scalars.items())
    return _sized(len(msg.sender.encode("utf-8")), rep, msg.step, msg.topology_hash, msg.manifest, scalars,
                  msg.compression or "none", count, chunk_bytes)


@functools.lru_cache(maxsize=4096)
def _sized(sender_bytes: int, round: int, step: int, topology_hash: str, manifest: tuple,
           scalars: tuple[tuple[str, float], ...], compression: str, count: int, chunk_bytes: int) -> int:
    """`wire_size` of a header of this shape (``round``: the representative of its varint length;
    ``sender_bytes``: the sender's length, which a stand-in sender of as many ASCII bytes has)."""
    nbytes = encoded_nbytes(manifest, compression, count)
    probe = Payload("p" * sender_bytes, round, step, topology_hash, manifest, torch.empty(0), dict(scalars), compression,
                    None if count == 0 else torch.empty(count, dtype=torch.int64))
    return _frames_bytes(_header(probe, nbytes, 0xFFFFFFFF), nbytes, chunk_bytes)


def _check_chunk_bytes(chunk_bytes: int) -> None:
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be a positive integer, got {chunk_bytes!r}")


def encode(msg: Payload, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[peer_pb2.Chunk]:
    """``msg`` as Chunk messages: the header, then the tensor bytes in pieces of ``chunk_bytes``."""
    _check_chunk_bytes(chunk_bytes)
    header, view = _payload_view(msg)
    chunks = [peer_pb2.Chunk(header=header)]
    chunks.extend(
        peer_pb2.Chunk(data=bytes(view[i : i + chunk_bytes])) for i in range(0, view.nbytes, chunk_bytes)
    )
    return chunks


class EncodedPayload:
    """A message encoded once, served to every puller / pushed to every receiver.

    The header (with the CRC-32 of all tensor bytes) is built at once; each data frame — the
    Chunk's wire form written directly: tag, varint length, bytes, i.e. one copy of the tensor
    bytes — is built the first time any reader needs it and then kept. So the copy happens while
    the first stream is already flowing (as in a plain bytes stream) rather than up front, and
    only once however many neighbours read the payload. The source tensor must not change after
    publishing (the Node publishes a snapshot); if it did, the receivers' CRC check would refuse it.
    """

    def __init__(self, header: peer_pb2.Header, view: memoryview, chunk_bytes: int) -> None:
        self.header = header
        self.header_frame = peer_pb2.Chunk(header=header).SerializeToString()
        self.chunk_bytes = chunk_bytes
        self._view: memoryview | None = view
        self._frames: list[bytes | None] = [None] * -(-view.nbytes // chunk_bytes)
        self._missing = len(self._frames)
        self._lock = threading.Lock()
        self.wire_bytes = _frames_bytes(header, view.nbytes, chunk_bytes)
        """Serialized size of all chunks (the protobuf bytes gRPC carries, without its 5-byte framing)."""

    def __len__(self) -> int:
        """Number of frames, the header included."""
        return 1 + len(self._frames)

    def frame(self, i: int) -> bytes:
        """Serialized Chunk ``i`` (0 is the header)."""
        if i == 0:
            return self.header_frame
        f = self._frames[i - 1]
        if f is not None:
            return f
        with self._lock:
            f = self._frames[i - 1]
            if f is None:
                f = b"".join(self._data_parts(i))
                self._frames[i - 1] = f
                self._missing -= 1
                if not self._missing:
                    self._view = None  # every frame exists: let the source tensor go
            return f

    def frame_parts(self, i: int) -> tuple[bytes | memoryview, ...]:
        """Frame ``i`` as pieces whose concatenation is ``frame(i)``, without copying the tensor bytes:
        for a writer that copies them once, into its own buffer (the simulation's exchange step)."""
        if i == 0:
            return (self.header_frame,)
        f = self._frames[i - 1]
        return (f,) if f is not None else self._data_parts(i)

    def _data_parts(self, i: int) -> tuple[bytes, bytes, memoryview]:
        """Data frame ``i`` from the source tensor, as its tag, length and bytes (not joined)."""
        assert self._view is not None
        start = (i - 1) * self.chunk_bytes
        piece = self._view[start : start + self.chunk_bytes]
        return bytes((_TAG_DATA,)), _varint(piece.nbytes), piece

    def __iter__(self) -> Iterator[bytes]:
        for i in range(len(self)):
            yield self.frame(i)

    @property
    def frames(self) -> tuple[bytes, ...]:
        """All serialized Chunks, header first (builds the missing ones)."""
        return tuple(self)

    def chunks(self) -> list[peer_pb2.Chunk]:
        """The frames parsed back into Chunk messages (for generated stubs and tests)."""
        return [peer_pb2.Chunk.FromString(f) for f in self]


def encode_frames(msg: Payload, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> EncodedPayload:
    """``msg`` as serialized Chunks, byte-identical to serializing `encode`'s chunks (data frames lazily)."""
    _check_chunk_bytes(chunk_bytes)
    header, view = _payload_view(msg)
    return EncodedPayload(header, view, chunk_bytes)


class RawData(NamedTuple):
    """A data chunk read straight from its serialized form: a view of the bytes and the frame size."""

    data: memoryview
    wire_len: int


def parse_frame(buf: bytes) -> peer_pb2.Chunk | RawData:
    """Deserialize one Chunk; a pure data chunk comes back as a zero-copy `RawData` view.

    Used as gRPC's deserializer. The fast path applies only when the frame is exactly one
    length-delimited field 2 spanning the whole buffer (what every encoder writes); anything else
    goes through the regular protobuf parser, so the result is always what protobuf would give.
    """
    n = len(buf)
    if n >= 2 and buf[0] == _TAG_DATA:
        length = shift = 0
        pos = 1
        while pos < n and pos <= 10:
            b = buf[pos]
            pos += 1
            length |= (b & 0x7F) << shift
            if not b & 0x80:
                if pos + length == n:
                    return RawData(memoryview(buf)[pos:], n)
                break
            shift += 7
    return peer_pb2.Chunk.FromString(buf)


def _check_region(buf: memoryview, values: np.ndarray, start: int, end: int) -> tuple[int, bool | None]:
    """CRC-32 of ``buf[start:end]`` and whether its floats are all finite (None: not float-aligned)."""
    piece = buf[start:end]
    crc = crc32(piece)
    if start % 4 or end % 4:
        return crc, None
    return crc, all_finite(values[start // 4 : end // 4])


class Decoder:
    """Reassemble one payload chunk by chunk, checking as it goes; `finish` yields the Payload.

    The header is checked before the buffer is allocated (its size is then known and bounded), each
    data chunk is checked against the declared and maximal sizes before it is copied, and the
    checksum and finiteness are checked at the end. Nothing outside the decoder changes before
    `finish` returns, so a rejected payload leaves the receiver's state as it was.

    Each chunk is copied into place in the receiving thread (what any receiver does once); every
    completed region of ``CHECK_BYTES`` is then checksummed and scanned for NaN/Inf right away,
    while it is still in this core's cache, and the region CRCs are joined with `crc32_combine`.
    Profiled on ``bench/wire.py``: checking each 1 MiB chunk on the wire worker threads (the
    previous design) spent ~30% more CPU than the bare copy of a raw stream, mostly in hand-offs
    and cache misses, not in the checks. For payloads of at least ``parallel_min_bytes`` the
    region checks still go to the worker threads.
    """

    def __init__(self, expected: Expectation, *, parallel_min_bytes: int = PARALLEL_MIN_BYTES) -> None:
        self.expected = expected
        self.parallel_min_bytes = parallel_min_bytes
        self.header: peer_pb2.Header | None = None
        self.wire_bytes = 0
        self._specs: tuple[TensorSpec, ...] = ()
        self._buf: np.ndarray | None = None
        self._view: memoryview | None = None
        self._values: np.ndarray | None = None
        self._pos = 0
        self._checked = 0  # bytes [0, _checked) are in `_parts`
        self._parallel = False
        # per region: (length, CRC-32 and finiteness, or the future computing them)
        self._parts: list[tuple[int, tuple[int, bool | None] | futures.Future[tuple[int, bool | None]]]] = []

    @property
    def received(self) -> int:
        """Tensor bytes received so far."""
        return self._pos

    def feed(self, item: peer_pb2.Chunk | RawData) -> None:
        """Take the next chunk (a Chunk message or a `RawData` from `parse_frame`)."""
        if isinstance(item, RawData):
            self.wire_bytes += item.wire_len
            self._data(item.data)
            return
        self.wire_bytes += item.ByteSize()
        kind = item.WhichOneof("body")
        if kind == "header":
            self._header(item.header)
        elif kind == "data":
            self._data(item.data)
        else:
            raise WireError(Reason.EMPTY_CHUNK, "chunk carries neither a header nor data")

    def _header(self, header: peer_pb2.Header) -> None:
        if self.header is not None:
            raise WireError(Reason.DUPLICATE_HEADER, "a second header arrived in the same payload")
        self._specs = check_header(header, self.expected)
        self.header = header
        # np.empty: no zero-fill pass over a buffer every byte of which is about to be written.
        self._buf = np.empty(header.total_bytes, dtype=np.uint8)
        self._view = memoryview(self._buf)
        self._values = self._buf[: header.total_bytes - header.total_bytes % 4].view("<f4")
        self._parallel = header.total_bytes >= self.parallel_min_bytes

    def _data(self, data: bytes | memoryview) -> None:
        if self.header is None or self._view is None or self._values is None:
            raise WireError(Reason.MISSING_HEADER, "data arrived before the header (the first chunk must be the header)")
        n = len(data)
        end = self._pos + n
        total = self.header.total_bytes
        if end > total:
            if end > self.expected.max_bytes:
                raise WireError(
                    Reason.OVERSIZE,
                    f"stream exceeds the limit of {self.expected.max_bytes} bytes (at least {end} bytes sent)",
                )
            raise WireError(Reason.LENGTH, f"stream carries more than the {total} bytes its header declares")
        if not n:
            return
        self._view[self._pos : end] = data
        self._pos = end
        if end - self._checked >= CHECK_BYTES:
            self._check_to(end)

    def _check_to(self, end: int) -> None:
        """Queue (or run) the checks of the received bytes ``[_checked, end)``."""
        start, self._checked = self._checked, end
        if self._parallel:
            self._parts.append((end - start, wire_pool().submit(_check_region, self._view, self._values, start, end)))
        else:
            self._parts.append((end - start, _check_region(self._view, self._values, start, end)))

    def finish(self) -> Payload:
        """Check completeness, checksum and values; return the Payload (``flat`` owns the buffer)."""
        h = self.header
        if h is None or self._buf is None:
            raise WireError(Reason.MISSING_HEADER, "the payload has no header")
        if self._pos != h.total_bytes:
            raise WireError(Reason.TRUNCATED, f"stream ended after {self._pos} of {h.total_bytes} bytes")
        if self._checked < self._pos:
            self._check_to(self._pos)
        crc = scalars_crc(h.scalars)
        all_finite = True
        for n, part in self._parts:
            c, finite = part.result() if isinstance(part, futures.Future) else part
            crc = crc32_combine(crc, c, n)
            all_finite = all_finite and finite is True
        if crc != h.crc32:
            raise WireError(
                Reason.CHECKSUM,
                f"CRC-32 of the {self._pos} received bytes is {crc:#010x} (scalars included), "
                f"the header says {h.crc32:#010x}",
            )
        compression = h.compression or "none"
        indices = None
        if compression == "none" and all(s.dtype != BIT for s in self._specs):
            values = self._buf.view("<f4")
            if not all_finite:
                check_finite(values, self._specs)
            if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
                values = values.astype(np.float32)
        else:
            values, indices = _decoded(self._buf, self._specs, compression, int(h.count))
            check_finite(values, self._specs)
        return Payload(
            sender=h.sender,
            round=int(h.round),
            step=int(h.step),
            topology_hash=h.topology_hash,
            manifest=self._specs,
            flat=torch.from_numpy(values),
            scalars={k: float(h.scalars[k]) for k in sorted(h.scalars)},
            compression=compression,
            indices=indices,
        )


def _decoded(buf: np.ndarray, specs: tuple[TensorSpec, ...], compression: str,
             count: int) -> tuple[np.ndarray, torch.Tensor | None]:
    """Float32 values (and top-k indices) of checked, complete tensor bytes; refuses bad indices and pad bits."""
    numel = sum(s.numel for s in specs)
    if compression == "topk":
        idx = buf[: 4 * count].view("<i4").astype(np.int64)
        if count and (idx[0] < 0 or idx[-1] >= numel or (count > 1 and not bool((np.diff(idx) > 0).all()))):
            bad = int(np.flatnonzero(np.concatenate([[idx[0] < 0], np.diff(idx) <= 0, [idx[-1] >= numel]]))[0])
            raise WireError(Reason.INDICES, f"top-k indices must be strictly increasing in [0, {numel}) "
                                            f"(first offence at position {min(bad, count - 1)})")
        out = np.zeros(numel, dtype=np.float32)
        out[idx] = buf[4 * count :].view("<f4")
        return out, torch.from_numpy(idx)
    out = np.empty(numel, dtype=np.float32)
    pos = 0
    per = VALUE_BYTES[compression]
    for s in specs:
        if s.dtype == BIT:
            nb = -(-s.numel // 8)
            packed = buf[pos : pos + nb]
            if s.numel % 8 and int(packed[-1]) >> (s.numel % 8):
                raise WireError(Reason.MALFORMED, f"bit tensor {s.name!r} has non-zero padding bits")
            out[s.offset : s.offset + s.numel] = unpack_bits(packed, s.numel)
            pos += nb
            continue
        raw = buf[pos : pos + s.numel * per]
        if compression == "fp16":
            out[s.offset : s.offset + s.numel] = raw.view("<f2")
        elif compression == "bf16":
            out[s.offset : s.offset + s.numel] = (
                torch.from_numpy(raw.view("<i2").copy()).view(torch.bfloat16).float().numpy())
        else:
            out[s.offset : s.offset + s.numel] = raw.view("<f4")
        pos += s.numel * per
    return out, None


def decode(
    chunks: Iterable[peer_pb2.Chunk | RawData],
    expected: Expectation,
    *,
    parallel_min_bytes: int = PARALLEL_MIN_BYTES,
) -> Payload:
    """Reassemble and validate a payload; `WireError` names the first rule it breaks."""
    dec = Decoder(expected, parallel_min_bytes=parallel_min_bytes)
    for c in chunks:
        dec.feed(c)
    return dec.finish()
