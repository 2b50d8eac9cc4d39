"""Payload compression (``wire.compression``): what a sender puts on the wire, and how a receiver reads it.

Why the lossy step happens *before* the transport: the sender turns its outgoing Payload into the
values the receiver will see (``compress_outgoing``: float16/bfloat16 rounding, or top-k selection),
and the codec then encodes those values losslessly (``p2pfl.wire.codec``). So the in-memory
simulation (which hands Messages over as they are) and gRPC (which encodes them) deliver bitwise the
same numbers, and the bytes the simulation accounts are computed by the codec's own size function.

Modes:

* ``none``: float32, as before.
* ``fp16`` / ``bf16``: every float tensor as 2-byte floats (round to nearest even). A value out of
  float16's range becomes Inf, which receivers refuse like any non-finite payload.
* ``topk``: the ``k = ceil(topk_ratio * m)`` coordinates of the ``m``-element payload whose value
  changed most since that coordinate was last sent, as ``k`` int32 indices (strictly increasing)
  followed by their ``k`` float32 values. **Error feedback**: the sender keeps, per coordinate, the
  value it last sent (``state.extra["wire/topk_ref"]``, checkpointed with the peer); the residual
  ``x - ref`` accumulates what was not sent until it is large enough to be. A receiver fills the
  coordinates it was not sent with *its own* value of that coordinate (``densify``): an unsent
  coordinate gives its weight back to the receiver instead of pulling it towards zero, and needs no
  per-neighbour history (so missed rounds, restarts and time-varying graphs stay safe).

Tensors a manifest declares as ``bit`` (DisPFL's 0/1 masks) are always bit-packed (``pack_bits``),
whatever the compression: 32x smaller than float32.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from p2pfl.payload import Payload

__all__ = [
    "BIT",
    "COMPRESSIONS",
    "TOPK_REF",
    "WireFormat",
    "compress_outgoing",
    "densify",
    "pack_bits",
    "topk_count",
    "unpack_bits",
]

Compression = Literal["none", "fp16", "bf16", "topk"]
COMPRESSIONS: tuple[str, ...] = ("none", "fp16", "bf16", "topk")
#: Manifest dtype of a 0/1 tensor sent bit-packed (eight values per byte, little bit order).
BIT = "bit"
#: ``PeerState.extra`` key of the top-k error-feedback reference (the values last sent).
TOPK_REF = "wire/topk_ref"
#: Value bytes per element of each float encoding.
VALUE_BYTES = {"none": 4, "fp16": 2, "bf16": 2, "topk": 4}


@dataclass(frozen=True)
class WireFormat:
    """What every payload of a run looks like on the wire (``wire.*``); senders and receivers agree on it."""

    compression: Compression = "none"
    topk_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")
        if not (0.0 < float(self.topk_ratio) <= 1.0):
            raise ValueError(f"topk_ratio must be in (0, 1], got {self.topk_ratio!r}")


def topk_count(numel: int, ratio: float) -> int:
    """How many coordinates a top-k payload of ``numel`` elements carries (at least one when non-empty)."""
    if numel <= 0:
        return 0
    return min(numel, max(1, math.ceil(float(ratio) * numel - 1e-9)))


def pack_bits(values: np.ndarray) -> np.ndarray:
    """0/1 float32 values -> bytes, eight per byte (little bit order); refuses anything but 0 and 1."""
    ones = values == 1.0
    if not bool((ones | (values == 0.0)).all()):
        raise ValueError("a bit tensor holds a value other than 0 and 1")
    return np.packbits(ones, bitorder="little")


def unpack_bits(packed: np.ndarray, numel: int) -> np.ndarray:
    """``pack_bits`` reversed: ``numel`` float32 0/1 values (trailing pad bits must be zero: checked by the caller)."""
    return np.unpackbits(packed, count=numel, bitorder="little").astype(np.float32)


def _round_to(flat: torch.Tensor, compression: str) -> torch.Tensor:
    dtype = torch.float16 if compression == "fp16" else torch.bfloat16
    return flat.to(dtype).to(torch.float32)


def compress_outgoing(msg: Payload, fmt: WireFormat, extra: dict[str, torch.Tensor],
                      bit_ranges: tuple[tuple[int, int], ...] = ()) -> Payload:
    """The Payload as the receivers will see it, under ``fmt`` (``msg`` itself when nothing changes).

    ``extra`` is the sender's ``PeerState.extra``: top-k keeps its error-feedback reference there.
    ``bit_ranges`` are the (offset, numel) of bit tensors, which float rounding must not touch
    (their 0/1 values are exact in every encoding anyway).
    """
    if fmt.compression == "none":
        return msg
    flat = msg.flat.detach()
    if fmt.compression in ("fp16", "bf16"):
        out = _round_to(flat, fmt.compression)
        for off, n in bit_ranges:
            out[off : off + n] = flat[off : off + n]
        return dataclasses.replace(msg, flat=out, compression=fmt.compression)
    if bit_ranges:
        raise ValueError("top-k compression cannot carry bit tensors")
    ref = extra.get(TOPK_REF)
    if ref is None or ref.shape != flat.shape:
        ref = torch.zeros_like(flat)
    k = topk_count(flat.numel(), fmt.topk_ratio)
    resid = (flat - ref).abs()
    # ties broken by the lowest index (stable sort), so the choice is a pure function of the values
    idx = torch.sort(torch.argsort(resid, descending=True, stable=True)[:k]).values
    sent = torch.zeros_like(flat)
    sent[idx] = flat[idx]
    new_ref = ref.clone()
    new_ref[idx] = flat[idx]
    extra[TOPK_REF] = new_ref
    return dataclasses.replace(msg, flat=sent, compression="topk", indices=idx.to(torch.int64))


def densify(msg: Payload, own: torch.Tensor) -> Payload:
    """A top-k payload made whole: the coordinates it did not carry take the receiver's own values."""
    if msg.indices is None:
        return msg
    full = own.detach().to(msg.flat.device).clone()
    full[msg.indices] = msg.flat[msg.indices]
    return dataclasses.replace(msg, flat=full, indices=None)
