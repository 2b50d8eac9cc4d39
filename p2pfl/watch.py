"""``p2pfl watch``: the state of every peer of a run, live in the terminal, or once.

Two sources, one table (peer, round, accuracy, loss, MB sent, which links are down, state):

* a **run folder** (``p2pfl watch RUN_DIR``): the per-peer ``metrics-<peer>.jsonl`` that running
  ``p2pfl node``/``launch`` peers append to, or the merged ``metrics.jsonl`` of a finished run
  (simulate, launch, sweep). Links are down where a peer's last round lists missing neighbours;
* a **compose deployment** (``p2pfl watch --compose docker-compose.yml``): each peer's Prometheus
  ``/metrics`` (addresses from the file's ``x-p2pfl.metrics``), which also tells which links the
  peer's probes find down right now; a peer whose endpoint does not answer is shown ``down`` with
  its last record from the run folder.

Refreshes until every peer finished (or Ctrl-C); ``--once`` prints one table (``--json``: one JSON
object) and exits, which is what a finished run and scripts want. Reads only: never changes a run.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PeerView", "snapshot_compose", "snapshot_run_dir"]


@dataclass
class PeerView:
    """What the table shows of one peer."""

    peer: str
    round: int | None = None  # index of the last completed round
    rounds: int | None = None
    acc: float | None = None
    loss: float | None = None
    mb_sent: float = 0.0
    links_down: list[str] = field(default_factory=list)
    state: str = "waiting"  # waiting | running | finished | down
    resumed_from: int | None = None


def _records(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Per-peer records: the per-peer files when there are any (a run in progress), else metrics.jsonl."""
    files = sorted(run_dir.glob("metrics-*.jsonl"))
    if not files and (run_dir / "metrics.jsonl").is_file():
        files = [run_dir / "metrics.jsonl"]
    out: dict[str, list[dict[str, Any]]] = {}
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError:
            continue
        for line in text.splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written, or cut by a crash
            if isinstance(rec, dict) and isinstance(rec.get("peer"), str) and isinstance(rec.get("round"), int):
                out.setdefault(rec["peer"], []).append(rec)
    return out


def _config_rounds(run_dir: Path) -> int | None:
    import yaml

    for name in ("config.yaml",):
        try:
            data = yaml.safe_load((run_dir / name).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(data, dict) and isinstance(data.get("rounds"), int):
            return data["rounds"]
    return None


def _from_records(peer: str, recs: list[dict[str, Any]], rounds: int | None) -> PeerView:
    view = PeerView(peer=peer, rounds=rounds)
    if not recs:
        return view
    last = max(recs, key=lambda r: r["round"])
    view.round = last["round"]
    for rec in sorted(recs, key=lambda r: r["round"]):
        if isinstance(rec.get("acc"), int | float):
            view.acc, view.loss = rec["acc"], rec.get("loss")
    view.mb_sent = sum(int(r.get("bytes_sent") or 0) for r in recs) / 1e6
    view.links_down = sorted(str(m) for m in last.get("missing") or [])
    view.state = "finished" if rounds is not None and view.round + 1 >= rounds else "running"
    return view


def snapshot_run_dir(run_dir: Path, peers: list[str] | None = None, rounds: int | None = None) -> list[PeerView]:
    """One `PeerView` per peer of the run folder (``peers``: also list those with no record yet)."""
    recs = _records(run_dir)
    rounds = rounds if rounds is not None else _config_rounds(run_dir)
    names = list(peers) if peers else sorted(recs)
    return [_from_records(p, recs.get(p, []), rounds) for p in names]


def _scrape(address: str, timeout_s: float = 3.0) -> dict[str, dict[tuple[tuple[str, str], ...], float]] | None:
    from p2pfl.node_metrics import parse_exposition

    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as resp:
            return parse_exposition(resp.read().decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None


def _value(m: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str) -> float | None:
    vals = list(m.get(name, {}).values())
    return vals[0] if vals and vals[0] == vals[0] else None  # NaN -> None


def snapshot_compose(compose_file: Path) -> list[PeerView]:
    """One `PeerView` per service of a compose file written by ``p2pfl compose``."""
    import yaml

    try:
        doc = yaml.safe_load(compose_file.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{compose_file}: cannot read the compose file ({exc})") from None
    ext = doc.get("x-p2pfl") if isinstance(doc, dict) else None
    if not isinstance(ext, dict) or not isinstance(ext.get("peers"), dict):
        raise ValueError(f"{compose_file}: no x-p2pfl section: not written by `p2pfl compose`")
    base = compose_file.parent
    run_dir = base / str(ext.get("run_dir", "")).replace("$$", "$") if ext.get("run_dir") else None
    peers = sorted(ext["peers"])
    from_files = {v.peer: v for v in snapshot_run_dir(run_dir, peers)} if run_dir else {}
    metrics = ext.get("metrics") or {}
    views = []
    for pid in peers:
        view = from_files.get(pid, PeerView(peer=pid))
        m = _scrape(metrics[pid]) if pid in metrics else None
        if m is None:
            if pid in metrics and view.state != "finished":
                view.state = "down"
            views.append(view)
            continue
        rnd = _value(m, "p2pfl_round")
        view.round = int(rnd) if rnd is not None and rnd >= 0 else view.round
        total = _value(m, "p2pfl_rounds_total")
        view.rounds = int(total) if total is not None else view.rounds
        view.acc = _value(m, "p2pfl_accuracy") if _value(m, "p2pfl_accuracy") is not None else view.acc
        view.loss = _value(m, "p2pfl_loss") if _value(m, "p2pfl_loss") is not None else view.loss
        resumed = _value(m, "p2pfl_resumed_from_round")
        view.resumed_from = int(resumed) if resumed is not None and resumed >= 0 else None
        down = {dict(k)["neighbour"] for k, v in m.get("p2pfl_neighbour_up", {}).items() if v == 0}
        down |= {dict(k)["neighbour"] for k, v in m.get("p2pfl_neighbour_missing", {}).items() if v == 1}
        view.links_down = sorted(down)
        view.state = "finished" if _value(m, "p2pfl_finished") == 1 else "running"
        views.append(view)
    return views
