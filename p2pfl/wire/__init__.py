"""The wire codec: tensors <-> header + raw chunks, and the checks a receiver runs (no pickle)."""

from p2pfl.wire.codec import (
    DEFAULT_CHUNK_BYTES,
    PARALLEL_MIN_BYTES,
    Decoder,
    EncodedPayload,
    RawData,
    decode,
    encode,
    encode_frames,
    parse_frame,
)
from p2pfl.wire.crc import crc32, crc32_combine, scalars_crc
from p2pfl.wire.validate import (
    DTYPE,
    WIRE_VERSION,
    Expectation,
    Reason,
    WireError,
    all_finite,
    check_finite,
    check_header,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DTYPE",
    "PARALLEL_MIN_BYTES",
    "Decoder",
    "EncodedPayload",
    "Expectation",
    "RawData",
    "Reason",
    "WIRE_VERSION",
    "WireError",
    "all_finite",
    "check_finite",
    "check_header",
    "crc32",
    "crc32_combine",
    "decode",
    "encode",
    "encode_frames",
    "parse_frame",
    "scalars_crc",
]
