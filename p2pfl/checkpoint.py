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


def save_checkpoint(path: str | Path, state: PeerState, generator: torch.Generator, meta: dict | None = None) -> None:
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

    A node writes its checkpoint (carrying the round's record) before the metrics line, so a kill
    can leave the metrics one record short (restored here from ``record``) or, with checkpoints
    every k rounds, ahead of the checkpoint (those records are dropped: the rounds are redone).
    Duplicates are dropped too. Rewritten atomically (temporary file + rename); returns the
    number of records kept.
    """
    path = Path(path)
    recs: dict[int, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
                r = int(rec["round"])
            except (ValueError, KeyError, TypeError):
                continue  # a line torn by the kill
            if r < round and r not in recs:
                recs[r] = json.dumps(rec, sort_keys=True)
    if record is not None and int(record.get("round", -1)) == round - 1 and round - 1 not in recs:
        recs[round - 1] = json.dumps(record, sort_keys=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(recs[r] + "\n" for r in sorted(recs)))
    os.replace(tmp, path)
    return len(recs)
