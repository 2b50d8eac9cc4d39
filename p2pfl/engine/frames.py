"""What one rank sends another at an exchange step: a byte buffer of typed entries.

Both engines speak it (`p2pfl.engine.exact` sends payloads, records and failures at every step;
`p2pfl.engine.batched` records and failures at each round's end), so it is defined once, here.
An entry is its kind (1 byte), its body's length (8 bytes, little-endian) and the body:

* ``PAYLOAD``: one payload for some of the receiving rank's peers -- round, step, wire size,
  local readers, the sender's id and the wire codec's own frames (what gRPC would carry; the
  receiver parses and validates them as a deployed peer does);
* ``RECORDS``: metrics records for rank 0, JSON lines;
* ``ERROR``: a rank's failure, its text (a traceback) -- raised on rank 0 as `SimulationError`;
* ``STORAGE``: a failed write, ``[path, problem]`` -- raised on rank 0 as the one-line
  `StorageError` that `p2pfl node` would print (exit 74).
"""

from __future__ import annotations

import json
import struct
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

from p2pfl.payload import Payload
from p2pfl.storage import StorageError

PAYLOAD, RECORDS, ERROR, STORAGE = b"P", b"R", b"E", b"S"
_ENTRY = struct.Struct("<cQ")
# A payload's body: round, step, wire size, local readers, sender id length, frame count; then the
# sender id, the frame lengths (8 bytes each) and the frames (what `encode_frames` made).
_PAYLOAD_HEAD = struct.Struct("<qqqqII")


class SimulationError(RuntimeError):
    """A simulation stopped: a peer or a rank failed, or no message can ever come (a deadlock)."""


def pack(buf: bytearray, kind: bytes, body: bytes | bytearray) -> None:
    """Append one entry of ``kind`` to ``buf``."""
    buf += _ENTRY.pack(kind, len(body))
    buf += body


def entries(buf: memoryview) -> Iterator[tuple[bytes, memoryview]]:
    """The entries of a received buffer, in order: (kind, body), the body a view into ``buf``."""
    at = 0
    while at < len(buf):
        kind, n = _ENTRY.unpack_from(buf, at)
        at += _ENTRY.size
        yield kind, buf[at : at + n]
        at += n


def pack_payload(buf: bytearray, msg: Payload, size: int, count: int,
                 frames: Sequence[bytes | tuple[bytes | memoryview, ...]]) -> None:
    """Append a payload entry; a frame is its bytes or the pieces they join (`EncodedPayload.frame_parts`),
    copied here straight into ``buf`` (one copy of the tensor bytes)."""
    sender = msg.sender.encode()
    parts = [f if isinstance(f, tuple) else (f,) for f in frames]
    lengths = [sum(memoryview(p).nbytes for p in f) for f in parts]
    head = _PAYLOAD_HEAD.pack(msg.round, msg.step, size, count, len(sender), len(frames))
    buf += _ENTRY.pack(PAYLOAD, len(head) + len(sender) + 8 * len(frames) + sum(lengths))
    buf += head
    buf += sender
    buf += struct.pack(f"<{len(frames)}Q", *lengths)
    for f in parts:
        for p in f:
            buf += p


def unpack_payload(body: memoryview) -> tuple[str, int, int, int, int, list[memoryview]]:
    """A payload entry's (sender, round, step, wire size, local readers, frames)."""
    r, step, size, count, n_sender, n_frames = _PAYLOAD_HEAD.unpack_from(body, 0)
    at = _PAYLOAD_HEAD.size
    sender = bytes(body[at : at + n_sender]).decode()
    at += n_sender
    lengths = struct.unpack_from(f"<{n_frames}Q", body, at)
    at += 8 * n_frames
    frames = []
    for n in lengths:
        frames.append(body[at : at + n])
        at += n
    return sender, r, step, size, count, frames


def pack_records(buf: bytearray, records: Sequence[dict[str, Any]]) -> None:
    """Append metrics records (for rank 0) as one entry of JSON lines."""
    pack(buf, RECORDS, "".join(json.dumps(rec) + "\n" for rec in records).encode())


def read_records(body: memoryview) -> list[dict[str, Any]]:
    """The records of a ``RECORDS`` entry."""
    return [json.loads(line) for line in bytes(body).decode().splitlines()]


def failure(error: BaseException, who: str) -> BaseException:
    """What rank 0 raises for ``error`` (``who``: "peer p3", "rank 2"): a failed write as the one-line
    `StorageError` that `p2pfl node` prints (exit 74), anything else as a `SimulationError` with its traceback."""
    if isinstance(error, StorageError):
        return StorageError(error.path, error.problem)
    return SimulationError(f"{who} failed: " + "".join(traceback.format_exception(error)))


def pack_failure(buf: bytearray, error: BaseException, who: str) -> BaseException:
    """Append ``error`` as the entry rank 0 raises (`failure`); returns that exception."""
    raised = failure(error, who)
    if isinstance(raised, StorageError):
        pack(buf, STORAGE, json.dumps([raised.path, raised.problem]).encode())
    else:
        pack(buf, ERROR, str(raised).encode())
    return raised


def read_failure(kind: bytes, body: memoryview) -> BaseException | None:
    """What rank 0 raises for an ``ERROR`` or ``STORAGE`` entry; None for any other kind."""
    if kind == ERROR:
        return SimulationError(bytes(body).decode(errors="replace"))
    if kind == STORAGE:
        path, problem = json.loads(bytes(body).decode())
        return StorageError(path, problem)
    return None
