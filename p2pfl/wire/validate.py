"""What a receiver checks before a payload may touch its state.

Nothing from a peer is trusted: the header is checked against what this peer expects for the
(round, step) — topology, sender, manifest, scalars, sizes — before any buffer is allocated, the
running byte count is checked while the stream arrives (so an oversize stream is refused before
it is buffered), and the checksum and finiteness are checked on the reassembled bytes. Every
failure is a `WireError` whose ``code`` says which rule broke (the gRPC service maps it to a
status code) and whose message names the first offending item.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from p2pfl.models.layout import TensorSpec
from p2pfl.proto import peer_pb2
from p2pfl.wire.compress import BIT, VALUE_BYTES, WireFormat, topk_count

__all__ = [
    "DTYPE",
    "WIRE_VERSION",
    "Expectation",
    "Reason",
    "WireError",
    "all_finite",
    "check_finite",
    "check_header",
    "encoded_nbytes",
    "excerpt",
]

#: The only tensor dtype on the wire (the flat parameter buffers are float32).
DTYPE = "float32"
_ITEMSIZE = 4
#: ``Header.wire_version`` this code writes and accepts. 2: the CRC-32 also covers the scalars.
WIRE_VERSION = 2
#: Longest excerpt of a peer-supplied string quoted in an error message.
_SHOW = 64


class Reason(StrEnum):
    """Which rule a payload broke."""

    MISSING_HEADER = "missing_header"
    DUPLICATE_HEADER = "duplicate_header"
    EMPTY_CHUNK = "empty_chunk"
    MALFORMED = "malformed"
    MANIFEST = "manifest"
    DTYPE = "dtype"
    SCALARS = "scalars"
    LENGTH = "length"
    OVERSIZE = "oversize"
    CHECKSUM = "checksum"
    TRUNCATED = "truncated"
    NON_FINITE = "non_finite"
    ROUND = "round"
    VERSION = "version"
    STEP = "step"
    TOPOLOGY = "topology"
    SENDER = "sender"
    COMPRESSION = "compression"
    INDICES = "indices"


class WireError(ValueError):
    """A payload was rejected; ``code`` is the broken rule, the message says precisely what was wrong."""

    def __init__(self, code: Reason, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Expectation:
    """What a receiver expects of one payload.

    ``senders`` are the peers allowed to send it at this (round, step) (for a pull: the peer
    asked; for a push: the plan's in-neighbours). ``max_bytes`` bounds the tensor bytes.
    """

    specs: tuple[TensorSpec, ...]
    round: int
    step: int
    topology_hash: str
    senders: frozenset[str]
    scalar_keys: frozenset[str] = field(default_factory=frozenset)
    max_bytes: int = 256 << 20
    wire: WireFormat = field(default_factory=WireFormat)  # ``wire.*``: how the tensor bytes are encoded

    def __post_init__(self) -> None:
        object.__setattr__(self, "specs", tuple(self.specs))
        object.__setattr__(self, "senders", frozenset(self.senders))
        object.__setattr__(self, "scalar_keys", frozenset(self.scalar_keys))

    @property
    def nbytes(self) -> int:
        """Tensor bytes a conforming payload carries."""
        return encoded_nbytes(self.specs, self.wire.compression, self.count)

    @property
    def count(self) -> int:
        """Top-k: the number of coordinates every payload carries (0 in the other modes)."""
        if self.wire.compression != "topk":
            return 0
        return topk_count(sum(s.numel for s in self.specs), self.wire.topk_ratio)


def encoded_nbytes(specs: Iterable[TensorSpec], compression: str, count: int = 0) -> int:
    """Tensor bytes of a payload: per tensor its values (4 or 2 bytes each) or its packed bits; top-k:
    ``count`` int32 indices and ``count`` float32 values."""
    if compression == "topk":
        return count * (4 + VALUE_BYTES["topk"])
    per = VALUE_BYTES[compression]
    return sum(-(-s.numel // 8) if s.dtype == BIT else s.numel * per for s in specs)


def _fmt_ids(ids: Iterable[str]) -> str:
    ids = sorted(ids)
    return ", ".join(ids) if ids else "none"


def excerpt(text: str) -> str:
    """``repr`` of a peer-supplied string, cut to a bounded excerpt: error messages end up in logs."""
    if len(text) <= _SHOW:
        return repr(text)
    return f"{text[:_SHOW]!r}... ({len(text)} chars)"


def _show_keys(keys: Iterable[str], limit: int = 8) -> str:
    keys = sorted(keys)
    shown = ", ".join(excerpt(k) for k in keys[:limit])
    return f"[{shown}{f', ... ({len(keys)} keys)' if len(keys) > limit else ''}]"


def _shape(shape: Iterable[int]) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ")"


def check_header(h: peer_pb2.Header, exp: Expectation) -> tuple[TensorSpec, ...]:
    """Check a payload header against ``exp``; return the manifest as TensorSpecs (offsets computed).

    Order: wire version, topology, sender, round, step (a payload from another run or round says
    nothing else worth reading), declared size (before anything is buffered), manifest, scalars,
    compression (and the top-k count), length. Peer-supplied strings are quoted as bounded excerpts.
    """
    if h.wire_version != WIRE_VERSION:
        raise WireError(
            Reason.VERSION,
            f"payload has wire version {h.wire_version}, this peer reads version {WIRE_VERSION} "
            "(the peers run different p2pfl versions)",
        )
    if h.topology_hash != exp.topology_hash:
        raise WireError(
            Reason.TOPOLOGY,
            f"topology hash {excerpt(h.topology_hash)} differs from this peer's {exp.topology_hash!r} "
            "(the peers run different topology files)",
        )
    if h.sender not in exp.senders:
        raise WireError(
            Reason.SENDER,
            f"sender {excerpt(h.sender)} is not an allowed in-neighbour at round {exp.round} step {exp.step} "
            f"(allowed: {_fmt_ids(exp.senders)})",
        )
    if h.round != exp.round:
        raise WireError(Reason.ROUND, f"payload is for round {h.round}, expected round {exp.round}")
    if h.step != exp.step:
        raise WireError(Reason.STEP, f"payload is for step {h.step} of round {h.round}, expected step {exp.step}")
    if h.total_bytes > exp.max_bytes:
        raise WireError(
            Reason.OVERSIZE,
            f"payload declares {h.total_bytes} bytes, more than the limit of {exp.max_bytes} bytes",
        )

    entries = h.manifest
    specs: list[TensorSpec] = []
    offset = 0
    for i, (e, want) in enumerate(zip(entries, exp.specs, strict=False)):
        if e.name != want.name:
            raise WireError(
                Reason.MANIFEST, f"manifest entry {i} is tensor {excerpt(e.name)}, expected {want.name!r}"
            )
        if e.dtype != want.dtype:
            raise WireError(
                Reason.DTYPE, f"tensor {e.name!r} has dtype {excerpt(e.dtype)}; only {want.dtype} is accepted"
            )
        shape = tuple(int(d) for d in e.shape)
        if shape != tuple(want.shape):
            got = _shape(shape) if len(shape) <= 8 else f"of {len(shape)} dimensions"
            raise WireError(
                Reason.MANIFEST,
                f"tensor {e.name!r} has shape {got}, expected {_shape(want.shape)}",
            )
        numel = math.prod(shape)
        specs.append(TensorSpec(e.name, shape, offset, numel, want.dtype))
        offset += numel
    if len(entries) > len(exp.specs):
        raise WireError(
            Reason.MANIFEST,
            f"manifest has {len(entries)} tensors, expected {len(exp.specs)}: "
            f"unexpected tensor {excerpt(entries[len(exp.specs)].name)}",
        )
    if len(entries) < len(exp.specs):
        raise WireError(
            Reason.MANIFEST,
            f"manifest has {len(entries)} tensors, expected {len(exp.specs)}: "
            f"tensor {exp.specs[len(entries)].name!r} is missing",
        )

    keys = set(h.scalars)
    extra, missing = keys - exp.scalar_keys, exp.scalar_keys - keys
    if extra:
        raise WireError(Reason.SCALARS, f"unexpected scalar keys {_show_keys(extra)} (expected {sorted(exp.scalar_keys)})")
    if missing:
        raise WireError(Reason.SCALARS, f"missing scalar keys {sorted(missing)}")
    for k in sorted(keys):
        v = h.scalars[k]
        if not math.isfinite(v):
            raise WireError(Reason.NON_FINITE, f"scalar {k!r} is {v!r}")

    compression = h.compression or "none"
    if compression != exp.wire.compression:
        raise WireError(
            Reason.COMPRESSION,
            f"payload compression is {excerpt(compression)}, this peer's config says {exp.wire.compression!r} "
            "(the peers run different wire.compression settings)",
        )
    if h.count != exp.count:
        raise WireError(
            Reason.COMPRESSION,
            f"payload carries {h.count} top-k coordinates, expected {exp.count}"
            + (" (the peers run different wire.topk_ratio settings)" if compression == "topk" else ""),
        )
    need = encoded_nbytes(specs, compression, exp.count)
    if h.total_bytes != need:
        raise WireError(
            Reason.LENGTH, f"header declares {h.total_bytes} bytes but the manifest needs {need} bytes"
        )
    return tuple(specs)


def all_finite(values: np.ndarray) -> bool:
    """Whether every float32 in ``values`` is finite.

    Fast path: ``dot(v, v)`` (one BLAS pass, no temporary, GIL released) is finite only if every
    element is — NaN and Inf propagate. Squares of huge finite values can overflow it, so a
    non-finite result is confirmed by the exact elementwise scan.
    """
    if values.size == 0:
        return True
    with np.errstate(over="ignore", invalid="ignore"):
        if math.isfinite(float(np.dot(values, values))):
            return True
    return bool(np.isfinite(values).all())


def check_finite(values: np.ndarray, specs: Iterable[TensorSpec]) -> None:
    """Refuse NaN/Inf anywhere in ``values`` (float32), naming the first tensor that has one.

    One vectorized pass over the whole buffer; the per-tensor scan that names the culprit runs
    only on failure.
    """
    if all_finite(values):
        return
    for s in specs:
        part = values[s.offset : s.offset + s.numel]
        bad = int(part.size - np.count_nonzero(np.isfinite(part)))
        if bad:
            n_nan = int(np.count_nonzero(np.isnan(part)))
            raise WireError(
                Reason.NON_FINITE,
                f"tensor {s.name!r} contains {bad} non-finite value(s) ({n_nan} NaN, {bad - n_nan} Inf)",
            )
    raise WireError(Reason.NON_FINITE, "payload contains non-finite values")  # pragma: no cover
