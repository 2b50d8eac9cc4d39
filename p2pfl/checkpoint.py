"""Atomic per-peer checkpoints of tensors and scalars, without pickle.

Format: one ``.npz`` (numpy, loaded with ``allow_pickle=False``) holding the flat parameters,
the algorithm's extra tensors, the peer's RNG state, and a JSON metadata entry (round, scalars).
Written to a temporary file and renamed, so a crash never leaves a torn checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from p2pfl.algorithms.base import PeerState

FORMAT = 1


def save_checkpoint(path: str | Path, state: PeerState, generator: torch.Generator, meta: dict | None = None,
                    durable: bool = True) -> None:
    """Write atomically (temporary file + rename); ``durable`` also fsyncs it before the rename, so
    that it survives a power loss, not only a kill of the process."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {
        "params": state.params.detach().cpu().numpy(),
        "rng": generator.get_state().numpy(),
    }
    for k, v in state.extra.items():
        arrays[f"extra/{k}"] = v.detach().cpu().numpy()
    info = {"format": FORMAT, "peer": state.peer_id, "round": state.round, "scalars": state.scalars, **(meta or {})}
    arrays["meta"] = np.frombuffer(json.dumps(info).encode(), dtype=np.uint8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        if durable:
            os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: str | Path, device: torch.device | str = "cpu") -> tuple[PeerState, torch.Tensor, dict]:
    """Return (state, rng_state, meta). Raises ValueError on a malformed file."""
    with np.load(Path(path), allow_pickle=False) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: unsupported checkpoint format {meta.get('format')}")
        params = torch.from_numpy(z["params"].copy()).to(device)
        extra = {k[len("extra/"):]: torch.from_numpy(z[k].copy()).to(device) for k in z.files if k.startswith("extra/")}
        rng = torch.from_numpy(z["rng"].copy())
    state = PeerState(peer_id=meta["peer"], params=params, extra=extra,
                      scalars={k: float(v) for k, v in meta["scalars"].items()}, round=int(meta["round"]))
    return state, rng, meta


def checkpoint_info(path: str | Path) -> tuple[int, dict | None]:
    """(round it resumes at, last record stored with it); (0, None) when there is none. No tensors loaded."""
    path = Path(path)
    if not path.exists():
        return 0, None
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(bytes(z["meta"]).decode())
    rec = meta.get("record")
    return int(meta["round"]), (rec if isinstance(rec, dict) else None)


def reconcile_metrics(path: str | Path, round: int, record: dict | None) -> int:
    """Make a peer's ``metrics.jsonl`` hold exactly rounds ``< round`` once each, for a resume at ``round``.

    The checkpoint carries the round's record because it is written before the metrics line; the
    repair itself is the run folder's (`p2pfl.runfolder.keep_rounds`, the one definition).
    """
    from p2pfl.runfolder import keep_rounds

    return keep_rounds(Path(path), round, record)
