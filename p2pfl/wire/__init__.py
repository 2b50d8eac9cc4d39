"""The wire codec: tensors <-> header + raw chunks, and the checks a receiver runs (no pickle)."""

from p2pfl.wire.codec import (
    DEFAULT_CHUNK_BYTES,
    Decoder,
    EncodedPayload,
    RawData,
    decode,
    encode,
    encode_frames,
    parse_frame,
)
from p2pfl.wire.validate import DTYPE, Expectation, Reason, WireError, check_finite, check_header

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DTYPE",
    "Decoder",
    "EncodedPayload",
    "Expectation",
    "RawData",
    "Reason",
    "WireError",
    "check_finite",
    "check_header",
    "decode",
    "encode",
    "encode_frames",
    "parse_frame",
]
