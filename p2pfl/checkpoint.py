"""Atomic per-peer checkpoints of tensors and scalars, without pickle, verified before use.

Format: one ``.npz`` (numpy, loaded with ``allow_pickle=False``) holding the flat parameters,
the algorithm's extra tensors, the peer's RNG state, and a JSON metadata entry (round, scalars,
the run's fingerprint, and a CRC-32 of every array). Written to a temporary file and renamed, so
a crash never leaves a torn checkpoint; anything else that damages one (a copy cut short, a flipped
bit, a file of another peer or of another model put in its place) is found by `verify_checkpoint`
before a resumed peer touches its run folder (docs/bad-input.md, "Checkpoints").
"""

from __future__ import annotations

import hashlib
import json
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from p2pfl.algorithms.base import PeerState
from p2pfl.badinput import BadInput, shorten
from p2pfl.storage import atomic_write

__all__ = ["FORMAT", "CheckpointError", "Verified", "changed_keys", "checkpoint_info", "config_fingerprint",
           "load_checkpoint", "reconcile_metrics", "save_checkpoint", "verify_checkpoint"]

#: 2: a CRC-32 of the arrays (``crc32``) and the run's fingerprint (``run``) in the metadata.
FORMAT = 2
#: Checkpoints written before the checksum (format 1) are still read: numpy's zip reader checks each
#: member's own CRC-32, so a flipped bit or a cut file is still refused; only the owner and shape
#: checks (and no config check: they carry no fingerprint) apply to them.
_READABLE = (1, FORMAT)

#: Config keys that say where, how long and how a run is carried out, not what it computes: a resume
#: may change them freely (more rounds, other addresses or timeouts, another device or data folder).
#: ``topology`` is a path; the graph itself is compared by its hash.
OPERATIONAL_KEYS = ("name", "rounds", "topology", "device", "network", "simulation", "checkpoint", "data.root")


class CheckpointError(BadInput):
    """A checkpoint that cannot be resumed from: ``FILE: problem`` (one line, exit 2, nothing touched)."""


def _crc(arrays: Mapping[str, np.ndarray]) -> int:
    """CRC-32 of every array (name, dtype, shape, bytes) in name order: damage anywhere changes it."""
    crc = 0
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        crc = zlib.crc32(f"{name}|{a.dtype.str}|{a.shape}|".encode(), crc)
        crc = zlib.crc32(a.reshape(-1).view(np.uint8), crc)
    return crc


def _comparable(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` without the operational keys (a deep copy through JSON: plain data only)."""
    from p2pfl.config import drop_dotted

    out = json.loads(json.dumps(raw, default=str))
    drop_dotted(out, OPERATIONAL_KEYS)
    return out


def config_fingerprint(raw: Mapping[str, Any], topology_hash: str) -> dict[str, str]:
    """What a checkpoint records of its run: a hash of the config (less `OPERATIONAL_KEYS`) and the
    topology's graph hash. A resume compares it with the config it is started with."""
    text = json.dumps(_comparable(raw), sort_keys=True, separators=(",", ":"))
    return {"config": hashlib.sha256(text.encode()).hexdigest()[:16], "topology": str(topology_hash)}


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict) or not d:
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def changed_keys(old_raw: Mapping[str, Any], new_raw: Mapping[str, Any]) -> list[str]:
    """The dotted keys (not operational) whose values differ between two configs, sorted."""
    a, b = _flatten(_comparable(old_raw)), _flatten(_comparable(new_raw))
    return sorted(k for k in set(a) | set(b) if a.get(k, ...) != b.get(k, ...))


def save_checkpoint(path: str | Path, state: PeerState, generator: torch.Generator, meta: dict | None = None,
                    durable: bool = True) -> None:
    """Write atomically (`p2pfl.storage.atomic_write`: temporary file + rename; a storage fault is
    retried, then `StorageError`); ``durable`` also fsyncs it before the rename, so that it survives
    a power loss, not only a kill of the process."""
    arrays: dict[str, np.ndarray] = {
        "params": state.params.detach().cpu().numpy(),
        "rng": generator.get_state().numpy(),
    }
    for k, v in state.extra.items():
        arrays[f"extra/{k}"] = v.detach().cpu().numpy()
    info = {"format": FORMAT, "peer": state.peer_id, "round": state.round, "scalars": state.scalars, **(meta or {}),
            "crc32": _crc(arrays)}
    arrays["meta"] = np.frombuffer(json.dumps(info).encode(), dtype=np.uint8)
    atomic_write(path, lambda f: np.savez(f, **arrays), durable=durable)


def _refuse(path: Path, problem: str, hint: str | None = None) -> CheckpointError:
    return CheckpointError(problem, source=shorten(str(path), 200), hint=hint)


def _read(path: Path, arrays: bool = True) -> tuple[dict, dict[str, np.ndarray]]:
    """(metadata, arrays) of a readable, intact checkpoint; `CheckpointError` otherwise.

    Why every error is caught here: a damaged zip fails in many ways (BadZipFile, EOFError, a
    ValueError from numpy, a KeyError for a missing member, a UnicodeDecodeError in the metadata);
    each is the same fact for the user, one line naming the file.
    """
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise _refuse(path, f"cannot be read ({exc.strerror or exc})") from None
    if size == 0:
        raise _refuse(path, "is empty (0 bytes): not a checkpoint", hint="restore it, or remove it to start over")
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            data = {k: z[k] for k in z.files if k != "meta"} if arrays else {}
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError, UnicodeDecodeError) as exc:
        raise _refuse(path, f"is not a readable checkpoint (truncated or corrupted: {shorten(str(exc), 80)})",
                      hint="restore it, or remove it to start over") from None
    if not isinstance(meta, dict):
        raise _refuse(path, "is not a readable checkpoint (its metadata is not a JSON object)")
    if meta.get("format") not in _READABLE:
        raise _refuse(path, f"unsupported checkpoint format {shorten(repr(meta.get('format')), 20)}",
                      hint=f"this version reads formats {', '.join(map(str, _READABLE))}")
    for key, kind in (("peer", str), ("round", int), ("scalars", dict)):
        if not isinstance(meta.get(key), kind):
            raise _refuse(path, f"is not a readable checkpoint (metadata {key!r} missing or malformed)")
    if arrays:
        if "params" not in data or "rng" not in data:
            raise _refuse(path, "is not a readable checkpoint (params or rng missing)")
        if meta["format"] >= 2 and meta.get("crc32") != _crc(data):
            raise _refuse(path, "checksum mismatch: the file is corrupted", hint="restore it, or remove it to start over")
    return meta, data


def load_checkpoint(path: str | Path, device: torch.device | str = "cpu") -> tuple[PeerState, torch.Tensor, dict]:
    """Return (state, rng_state, meta); `CheckpointError` (a ValueError) for a damaged file."""
    meta, data = _read(Path(path))
    params = torch.from_numpy(data["params"].copy()).to(device)
    extra = {k[len("extra/"):]: torch.from_numpy(v.copy()).to(device) for k, v in data.items() if k.startswith("extra/")}
    rng = torch.from_numpy(data["rng"].copy())
    state = PeerState(peer_id=meta["peer"], params=params, extra=extra,
                      scalars={k: float(v) for k, v in meta["scalars"].items()}, round=int(meta["round"]))
    return state, rng, meta


def checkpoint_info(path: str | Path) -> tuple[int, dict | None]:
    """(round it resumes at, last record stored with it); (0, None) when there is none. No tensors loaded."""
    path = Path(path)
    if not path.exists():
        return 0, None
    meta, _ = _read(path, arrays=False)
    rec = meta.get("record")
    return int(meta["round"]), (rec if isinstance(rec, dict) else None)


@dataclass(frozen=True)
class Verified:
    """A checkpoint found fit to resume from: its round, last record and the run it was written by
    (None: a format-1 checkpoint, written before fingerprints)."""

    round: int
    record: dict | None
    run: dict | None


def verify_checkpoint(path: str | Path, *, peer_id: str, shapes: Mapping[str, tuple[int, ...]]) -> Verified:
    """Everything a resume needs to know about ``path`` before it touches a file, else `CheckpointError`:

    intact (readable, its CRC-32), this peer's, and tensors of the shapes of this config's model and
    algorithm (``shapes``: ``params`` and ``extra/<name>`` of a fresh state; an extra tensor the
    algorithm creates later is not in it and not compared). The config check is the caller's
    (`p2pfl.resume.check_config`): whether a change is accepted is a command-line choice.
    """
    path = Path(path)
    meta, data = _read(path)
    if meta["peer"] != peer_id:
        raise _refuse(path, f"is the checkpoint of peer {shorten(repr(meta['peer']), 70)}, not of {peer_id!r}",
                      hint="each peer resumes from its own checkpoints/<peer>.npz")
    for key, want in shapes.items():
        have = data.get(key)
        if have is not None and tuple(have.shape) != tuple(want):
            what = "the model's parameters" if key == "params" else f"algorithm state {key.removeprefix('extra/')!r}"
            raise _refuse(path, f"{what} have shape {tuple(have.shape)} in it but {tuple(want)} under this config "
                          "(another model or model parameter?)", hint="resume with the config it was written with")
    rec, run = meta.get("record"), meta.get("run")
    return Verified(int(meta["round"]), rec if isinstance(rec, dict) else None, run if isinstance(run, dict) else None)


def reconcile_metrics(path: str | Path, round: int, record: dict | None) -> int:
    """Make a peer's ``metrics.jsonl`` hold exactly rounds ``< round`` once each, for a resume at ``round``.

    The checkpoint carries the round's record because it is written before the metrics line; the
    repair itself is the run folder's (`p2pfl.runfolder.keep_rounds`, the one definition).
    """
    from p2pfl.runfolder import keep_rounds

    return keep_rounds(Path(path), round, record)
