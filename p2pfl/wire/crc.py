"""CRC-32 of payloads, in pieces: the wire checksum and the joining of piece checksums.

The payload checksum is CRC-32 (zlib's polynomial) of the header's scalars, canonically encoded
(`scalars_crc`), followed by all tensor bytes. Receivers check it region by region as chunks
arrive and join the regions' CRCs with `crc32_combine`, so it lives apart from the codec that
frames the bytes. ``wire_pool`` is the process's wire worker threads, which the decoder also uses
for region checks of very large payloads.
"""

from __future__ import annotations

import functools
import os
import struct
import threading
import zlib
from collections.abc import Mapping, Sequence
from concurrent import futures

__all__ = ["crc32", "crc32_combine", "scalars_crc", "wire_pool"]

_CRC_PIECE = 4 << 20

# ---- CRC-32 in pieces ---------------------------------------------------------------------------
# zlib.crc32 releases the GIL, so pieces of a large buffer can be checksummed on worker threads,
# overlapping with the network, if the pieces' CRCs can be joined: crc32_combine (zlib's algorithm,
# which Python does not expose) does that from a 32x32 GF(2) operator per piece length, cached.

_POLY = 0xEDB88320


def _gf2_times(mat: Sequence[int], vec: int) -> int:
    s = 0
    i = 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _gf2_square(mat: Sequence[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


@functools.lru_cache(maxsize=64)
def _zeros_operator(nbytes: int) -> tuple[int, ...]:
    """The GF(2) matrix that advances a CRC-32 register over ``nbytes`` zero bytes."""
    op = [1 << i for i in range(32)]
    odd = [_POLY] + [1 << (n - 1) for n in range(1, 32)]  # one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    n = nbytes
    while True:
        even = _gf2_square(odd)
        if n & 1:
            op = [_gf2_times(even, c) for c in op]
        n >>= 1
        if not n:
            break
        odd = _gf2_square(even)
        if n & 1:
            op = [_gf2_times(odd, c) for c in op]
        n >>= 1
        if not n:
            break
    return tuple(op)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``."""
    if len2 <= 0:
        return crc1
    return _gf2_times(_zeros_operator(len2), crc1) ^ crc2


_POOL: futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def wire_pool() -> futures.ThreadPoolExecutor:
    """The wire worker threads (shared by every encoder/decoder of the process; created on first use)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = futures.ThreadPoolExecutor(
                max_workers=max(2, min(4, os.cpu_count() or 1)), thread_name_prefix="p2pfl-wire"
            )
        return _POOL


try:  # ISA-L's CRC-32: the same values as zlib.crc32, about 5x faster (SIMD carry-less multiply)
    from isal.isal_zlib import crc32 as _isal_crc32
except ImportError:  # pragma: no cover - isal is a dependency; keep working without it
    _isal_crc32 = None


def crc32(view: memoryview, piece: int = _CRC_PIECE) -> int:
    """zlib.crc32 of ``view``: ISA-L when installed, else zlib split over the wire worker threads."""
    if _isal_crc32 is not None:
        return _isal_crc32(view)
    if view.nbytes < 2 * piece:
        return zlib.crc32(view)
    pieces = [view[i : i + piece] for i in range(0, view.nbytes, piece)]
    crcs = list(wire_pool().map(zlib.crc32, pieces))
    out = crcs[0]
    for p, c in zip(pieces[1:], crcs[1:], strict=True):
        out = crc32_combine(out, c, p.nbytes)
    return out


def scalars_crc(scalars: Mapping[str, float]) -> int:
    """CRC-32 of the scalars' canonical bytes, the start of the payload checksum.

    Per key in sorted order: the uint32 little-endian length of its UTF-8 bytes, those bytes, the
    float64 little-endian value. No scalars: 0, so the checksum is then the tensor bytes' alone.
    """
    if not scalars:
        return 0
    parts = []
    for k in sorted(scalars):
        b = k.encode("utf-8")
        parts.append(struct.pack("<I", len(b)) + b + struct.pack("<d", float(scalars[k])))
    return zlib.crc32(b"".join(parts))
