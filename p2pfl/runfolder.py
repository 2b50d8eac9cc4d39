"""The run folder every mode writes: resolved config, partition, topology, metrics, summary, plot.

    RUN/
      config.yaml        the resolved experiment config (overrides applied, presets expanded)
      topology.yaml      the topology used
      partition.json     every peer's train/test indices
      metrics.jsonl      one JSON object per peer per round
      summary.json       final mean/min/max personalized accuracy and totals
      accuracy.png       mean personalized accuracy per round, min-max and quartile bands over peers
      checkpoints/       one atomic checkpoint per peer
      config-changes.jsonl  config changes a resume accepted (--accept-config-change), if any

Every driver (``simulate`` with either engine, ``launch``, the Flower baselines, ``flwr run``)
goes through one `RunFolder`: created only after the experiment validated, it writes the
inputs, owns the metrics writer and the progress display, and at the end sorts the metrics and
writes the summary and the plot. ``p2pfl node`` (one peer of a launch or a compose deployment,
all sharing one folder) opens its part with `RunFolder.for_peer`: the same inputs (written once,
atomically, by whichever peer comes first), its own ``metrics-<peer>.jsonl`` (`peer_metrics_path`)
made consistent with its checkpoint on a restart (`keep_rounds`), and a progress line per round;
``launch`` merges the peers' files into ``metrics.jsonl`` and finishes the folder.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from p2pfl.display import figure, progress_bar
from p2pfl.storage import JsonlLog, append_line, atomic_write, read_jsonl
from p2pfl.storage import configure as configure_storage

if TYPE_CHECKING:
    from p2pfl.config import ExperimentConfig
    from p2pfl.topology import Topology

log = logging.getLogger(__name__)


def peer_metrics_path(run_dir: Path, peer_id: str) -> Path:
    """Where ``p2pfl node`` records peer ``peer_id``'s rounds (``p2pfl watch`` and docker/e2e.py read it)."""
    return Path(run_dir) / f"metrics-{peer_id}.jsonl"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file (a line torn by a kill is skipped: `p2pfl.storage.read_jsonl`)."""
    return read_jsonl(path)


def sort_metrics(path: Path, peer_order: list[str]) -> list[dict[str, Any]]:
    """Rewrite ``metrics.jsonl`` ordered by (round, peer index) so equal runs give equal files."""
    recs = read_metrics(path)
    rank = {p: i for i, p in enumerate(peer_order)}
    recs.sort(key=lambda r: (r["round"], rank.get(r["peer"], len(rank))))
    atomic_write(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in recs))
    return recs


def keep_rounds(path: Path, before: int, record: dict[str, Any] | None = None) -> int:
    """Make a metrics file hold exactly the rounds ``< before`` once per peer, for a resume at ``before``.

    Why: a peer writes its checkpoint (carrying the round's record) before the metrics line, so a
    kill can leave the file one record short (restored here from ``record``, the checkpoint's
    record of round ``before - 1``), ahead of the checkpoint (those rounds are redone: dropped),
    with a duplicate, or with a line torn by the kill (dropped). Rewritten atomically (temporary
    file + rename); returns the number of records kept. Serves a peer's ``metrics-<peer>.jsonl``
    and a simulation's ``metrics.jsonl`` (all peers) alike.
    """
    path = Path(path)
    recs: dict[tuple[str, int], str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
                key = (str(rec.get("peer")), int(rec["round"]))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a line torn by the kill
            if key[1] < before and key not in recs:
                recs[key] = json.dumps(rec, sort_keys=True)
    if record is not None and int(record.get("round", -1)) == before - 1:
        recs.setdefault((str(record.get("peer")), before - 1), json.dumps(record, sort_keys=True))
    order = sorted(recs, key=lambda k: (k[1], k[0]))
    atomic_write(path, "".join(recs[k] + "\n" for k in order))
    return len(recs)


#: One JSON line per accepted config change on a resume (``--accept-config-change``).
CONFIG_CHANGES = "config-changes.jsonl"


def config_change_entry(peers: list[str], round: int, old: dict[str, str], new: dict[str, str],
                        changed: list[str]) -> dict[str, Any]:
    """The record of a config change a resume accepted: who, at which round, the fingerprints before
    and after (`p2pfl.checkpoint.config_fingerprint`) and the keys that changed."""
    return {"time": time.time(), "peers": list(peers), "round": int(round), "old": dict(old), "new": dict(new),
            "changed": list(changed)}


def record_config_change(run_dir: Path, entry: dict[str, Any]) -> None:
    """Append ``entry`` to ``config-changes.jsonl``: the folder says its config changed mid-run, and how.

    Why a file of its own: ``config.yaml`` then holds the new config (what the run goes on with), and
    the records before the change were made under the old one; this line is the only trace of that.
    """
    append_line(Path(run_dir) / CONFIG_CHANGES, json.dumps(entry, sort_keys=True))


def write_inputs(run_dir: Path, raw_config: dict[str, Any], topology_dict: dict[str, Any], partition) -> None:
    """Several peers of one deployment may write the same input at once: each replaces it whole
    (`p2pfl.storage.atomic_write`)."""
    config = yaml.safe_dump(raw_config, sort_keys=False)
    # libyaml's emitter when PyYAML has it: the same text (a graph of ints and names), 3x faster
    # (1.3 s of CPU for the 10,000-peer graph of bench/scale.py in Python, issue 71)
    topology = yaml.dump(topology_dict, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False)
    atomic_write(run_dir / "config.yaml", config)
    atomic_write(run_dir / "topology.yaml", topology)
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
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))


def plot_accuracy(recs: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """Personalized accuracy per round over the peers: the mean, the min-max band and the quartile band.

    One band, whatever the number of peers (128 lines would be unreadable and slow to draw).
    """
    rounds = per_round(recs)
    if not rounds:
        return
    fig, ax = figure()
    _draw(ax, rounds, "C0", "mean personalized accuracy", quartiles=True)
    _save(fig, ax, path, title)


def plot_comparison(series: dict[str, list[dict[str, Any]]], path: Path, title: str = "") -> None:
    """Several runs on one plot (``p2pfl compare``): each run's mean accuracy per round and min-max band."""
    fig, ax = figure()
    drawn = 0
    for i, (label, recs) in enumerate(series.items()):
        rounds = per_round(recs)
        if rounds:
            _draw(ax, rounds, f"C{i % 10}", f"{label} (mean, min-max band)", quartiles=False)
            drawn += 1
    if drawn:
        _save(fig, ax, path, title)


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    atomic_write(run_dir / "summary.json", json.dumps(summary, indent=2, sort_keys=True))


class RunFolder:
    """One run's folder, from the first file written to the summary and plot (the lifecycle every
    driver shares, so each mode writes the same files the same way).

    ``record`` is the metrics sink a driver hands to its peers (thread-safe); it also reports
    progress: it advances the progress bar when one is shown, and for one peer's part of a
    deployment (`for_peer`) it logs the round's line. ``finish`` closes both and writes
    ``summary.json`` (the common fields name/algorithm/seed/mode/wall_seconds plus the driver's
    ``extra``) and ``accuracy.png``.
    """

    def __init__(self, path: Path, cfg: ExperimentConfig, mode: str, *, append: bool = False,
                 peer: str | None = None) -> None:
        self.path = Path(path)
        self.cfg = cfg
        self.mode = mode
        self.peer = peer
        metrics = peer_metrics_path(self.path, peer) if peer is not None else self.path / "metrics.jsonl"
        self.metrics = JsonlLog(metrics, truncate=not append)  # whole lines, storage faults retried
        self._bar: Any = None
        self._task: Any = None
        self._t0 = time.perf_counter()

    @classmethod
    def start(cls, path: str | Path, cfg: ExperimentConfig, topology: Topology, partition: Any, mode: str, *,
              append: bool = False) -> RunFolder:
        """Write config/topology/partition and open ``metrics.jsonl`` (after validation: bad input
        leaves nothing behind). ``append``: a resumed run keeps its earlier records. Storage faults
        are retried for ``checkpoint.storage_retry_s`` from here on (`p2pfl.storage`)."""
        configure_storage(cfg.checkpoint.storage_retry_s)
        write_inputs(Path(path), cfg.raw, topology.to_dict(), partition)
        return cls(Path(path), cfg, mode, append=append)

    @classmethod
    def for_peer(cls, path: str | Path, cfg: ExperimentConfig, topology: Topology, partition: Any, peer: str, *,
                 resume_at: int | None = None, checkpoint_record: dict[str, Any] | None = None,
                 config_changed: bool = False) -> RunFolder:
        """``p2pfl node``: peer ``peer``'s part of a run folder that the deployment's peers share.

        The inputs are written when the folder has none yet (``launch`` wrote them already; in a
        compose deployment the first peer does, atomically). ``resume_at``: the round the peer's
        checkpoint resumes at; its ``metrics-<peer>.jsonl`` is first made to hold exactly the rounds
        before it (`keep_rounds`, with ``checkpoint_record``), then appended to. Records carry the
        wall clock (``time``), so runs are compared after the same wall time. ``config_changed``: a
        resume accepted a changed config (``--accept-config-change``): the inputs are rewritten.
        """
        path = Path(path)
        if config_changed or not (path / "config.yaml").exists():  # changed: accepted on resume, recorded
            write_inputs(path, cfg.raw, topology.to_dict(), partition)
        if resume_at is not None:
            keep_rounds(peer_metrics_path(path, peer), resume_at, checkpoint_record)
        return cls(path, cfg, "node", append=resume_at is not None, peer=peer)

    def show_progress(self, total: int, label: str = "simulating", unit: str = "peer-rounds") -> None:
        """A progress bar over ``total`` records (one per ``record`` call) until ``finish``/``close``."""
        self._bar = progress_bar(label, unit)
        self._task = self._bar.add_task(label, total=total)

    def record(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Write one record (and report progress); returns the record as written."""
        if self.peer is not None:
            rec = {**rec, "time": time.time()}
        self.metrics(rec)
        if self._bar is not None:
            self._bar.advance(self._task)
        if self.peer is not None:
            log.info("%s round %d: acc=%s loss=%s sent=%s recv=%s missing=%s", self.peer, rec["round"],
                     rec.get("acc"), rec.get("loss"), rec.get("bytes_sent"), rec.get("bytes_recv"), rec.get("missing"))
        return rec

    def close(self) -> None:
        """Stop the progress bar and close the metrics file (idempotent; ``finish`` calls it)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        self.metrics.close()

    def merge_peer_files(self, peer_ids: list[str]) -> None:
        """``launch``: the peers wrote ``metrics-<peer>.jsonl``; make them this folder's ``metrics.jsonl``."""
        self.close()
        parts = [peer_metrics_path(self.path, pid) for pid in peer_ids]
        atomic_write(self.path / "metrics.jsonl",
                     "".join(json.dumps(r, sort_keys=True) + "\n" for p in parts if p.exists() for r in read_jsonl(p)))

    def finish(self, peer_ids: list[str], extra: dict[str, Any] | None = None, *, rounds_run: int | None = None,
               title: str | None = None) -> dict[str, Any]:
        """Sort the metrics, write ``summary.json`` and ``accuracy.png``; return the summary.

        ``rounds_run``: the rounds this invocation ran (a resumed run ran fewer) for s/round.
        """
        self.close()
        wall = time.perf_counter() - self._t0
        cfg = self.cfg
        recs = sort_metrics(self.path / "metrics.jsonl", peer_ids)
        summary = summarize(recs, {
            "name": cfg.name, "algorithm": cfg.algorithm_name, "seed": cfg.seed, "mode": self.mode,
            "wall_seconds": wall, "wall_seconds_per_round": wall / max(1, rounds_run or cfg.rounds), **(extra or {}),
        })
        write_summary(self.path, summary)
        plot_accuracy(recs, self.path / "accuracy.png", title or f"{cfg.name}: {cfg.algorithm_name}")
        return summary
