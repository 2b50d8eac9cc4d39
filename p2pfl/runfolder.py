"""The run folder every mode writes: resolved config, partition, topology, metrics, summary, plot.

    RUN/
      config.yaml        the resolved experiment config (overrides applied, presets expanded)
      topology.yaml      the topology used
      partition.json     every peer's train/test indices
      metrics.jsonl      one JSON object per peer per round
      summary.json       final mean/min/max personalized accuracy and totals
      accuracy.png       mean personalized accuracy per round, min-max and quartile bands over peers
      checkpoints/       one atomic checkpoint per peer
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import yaml


class MetricsWriter:
    """Thread-safe append of metric records to ``metrics.jsonl`` (one line each, flushed)."""

    def __init__(self, path: Path, truncate: bool = True) -> None:
        self.path = path
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "w" if truncate else "a", buffering=1)

    def __call__(self, rec: dict[str, Any]) -> None:
        line = json.dumps(rec, sort_keys=True)
        with self._lock:
            self._f.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._f.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def sort_metrics(path: Path, peer_order: list[str]) -> list[dict[str, Any]]:
    """Rewrite ``metrics.jsonl`` ordered by (round, peer index) so equal runs give equal files."""
    recs = read_metrics(path)
    rank = {p: i for i, p in enumerate(peer_order)}
    recs.sort(key=lambda r: (r["round"], rank.get(r["peer"], len(rank))))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in recs))
    tmp.replace(path)
    return recs


def write_inputs(run_dir: Path, raw_config: dict[str, Any], topology_dict: dict[str, Any], partition) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(raw_config, sort_keys=False))
    (run_dir / "topology.yaml").write_text(yaml.safe_dump(topology_dict, sort_keys=False))
    if partition is not None:  # None: a ClientApp partitions its own data
        partition.save(run_dir / "partition.json")


def per_round(recs: list[dict[str, Any]]) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for r in recs:
        if r.get("acc") is not None:
            out.setdefault(int(r["round"]), []).append(float(r["acc"]))
    return dict(sorted(out.items()))


def summarize(recs: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    rounds = per_round(recs)
    last_round = max(rounds) if rounds else None
    final = rounds.get(last_round, []) if last_round is not None else []
    peers = sorted({r["peer"] for r in recs})
    sent = {p: 0 for p in peers}
    for r in recs:
        sent[r["peer"]] += int(r.get("bytes_sent", 0))
    summary = {
        "rounds": (last_round + 1) if last_round is not None else 0,
        "peers": len(peers),
        "final_acc_mean": sum(final) / len(final) if final else None,
        "final_acc_min": min(final) if final else None,
        "final_acc_max": max(final) if final else None,
        "acc_mean_per_round": {str(k): sum(v) / len(v) for k, v in rounds.items()},
        "bytes_sent_per_peer": (sum(sent.values()) / len(sent)) if sent else 0,
        "wall_seconds_per_round": None,
    }
    summary.update(extra or {})
    return summary


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted list."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _figure():  # noqa: ANN202 - matplotlib types stay a lazy import
    """A figure on the Agg canvas (no pyplot state, safe in threads) and its one axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _draw(ax, rounds: dict[int, list[float]], color: str, label: str, quartiles: bool) -> None:  # noqa: ANN001
    """One series: the mean over peers per round, its min-max band and (optionally) its quartile band."""
    xs = [k + 1 for k in rounds]
    cols = [sorted(v) for v in rounds.values()]
    ax.fill_between(xs, [v[0] for v in cols], [v[-1] for v in cols], alpha=0.15, color=color, linewidth=0,
                    label="min-max over peers" if quartiles else None)
    if quartiles and max(len(v) for v in cols) >= 4:
        ax.fill_between(xs, [_quantile(v, 0.25) for v in cols], [_quantile(v, 0.75) for v in cols], alpha=0.3,
                        color=color, linewidth=0, label="25-75% of peers")
    ax.plot(xs, [sum(v) / len(v) for v in cols], color=color, marker="o" if len(xs) <= 30 else None,
            markersize=3, label=label)


def _save(fig, ax, path: Path, title: str) -> None:  # noqa: ANN001
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    # fixed margins: ``tight_layout`` renders the figure once more just to measure it
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.12, top=0.92)
    fig.savefig(path, dpi=110)


def plot_accuracy(recs: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """Personalized accuracy per round over the peers: the mean, the min-max band and the quartile band.

    One band, whatever the number of peers (128 lines would be unreadable and slow to draw).
    """
    rounds = per_round(recs)
    if not rounds:
        return
    fig, ax = _figure()
    _draw(ax, rounds, "C0", "mean personalized accuracy", quartiles=True)
    _save(fig, ax, path, title)


def plot_comparison(series: dict[str, list[dict[str, Any]]], path: Path, title: str = "") -> None:
    """Several runs on one plot (``p2pfl compare``): each run's mean accuracy per round and min-max band."""
    fig, ax = _figure()
    drawn = 0
    for i, (label, recs) in enumerate(series.items()):
        rounds = per_round(recs)
        if rounds:
            _draw(ax, rounds, f"C{i % 10}", f"{label} (mean, min-max band)", quartiles=False)
            drawn += 1
    if drawn:
        _save(fig, ax, path, title)


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
