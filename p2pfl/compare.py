"""Several algorithms on one experiment: the same topology, data split, model and seed, one plot.

``p2pfl compare -c peers/demo.yaml --algorithms local,dfedavg,dfedmdc:dfedmdc-demo --out runs/demo``
simulates each algorithm in its own run folder under ``--out`` (``runs/demo/local/`` ...), then
writes ``comparison.json`` (one row per algorithm) and ``comparison.png`` (mean personalized
accuracy per round of every algorithm, with its min-max band over peers) at the top.

Why a command and not a loop in a Makefile: the runs share one loaded dataset and one partition
object (so "the same split" holds by construction, not by luck), an algorithm name or preset is
checked for every entry before the first run starts, and the comparison is one library call a
notebook or a test can make.

An entry is ``NAME`` or ``NAME:PRESET``. ``NAME`` runs like ``--set algorithm.name=NAME``: the
file's hyperparameters that NAME also has are kept (``local`` and ``dfedavg`` get the demo's lr).
``NAME:PRESET`` runs the preset, and the file's hyperparameters for another algorithm do not
override it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pfl.badinput import BadInput, suggest

__all__ = ["Entry", "compare", "parse_algorithms", "summary_line"]

_MAX_ENTRIES = 12


@dataclass(frozen=True)
class Entry:
    """One algorithm of a comparison: its name, an optional preset, and the folder label."""

    name: str
    preset: str | None = None

    @property
    def label(self) -> str:
        return self.name if self.preset is None else f"{self.name}-{self.preset.removeprefix(self.name + '-')}"


def parse_algorithms(spec: str, source: str = "--algorithms") -> list[Entry]:
    """``"local,dfedavg,dfedmdc:dfedmdc-demo"`` -> entries; unknown names/presets are bad input."""
    from p2pfl.algorithms import ALGORITHMS
    from p2pfl.algorithms.presets import presets_for

    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        raise BadInput("no algorithm given", source=source, hint="e.g. --algorithms local,dfedavg,dfedmdc")
    if len(items) > _MAX_ENTRIES:
        raise BadInput(f"{len(items)} algorithms; at most {_MAX_ENTRIES} in one comparison", source=source)
    entries = []
    for item in items:
        name, _, preset = item.partition(":")
        if name not in ALGORITHMS:
            close = suggest(name, ALGORITHMS)
            raise BadInput(f"unknown algorithm {name[:40]!r}", source=source, allowed=sorted(ALGORITHMS),
                           hint=f"did you mean {close!r}?" if close else None)
        if preset and preset not in presets_for(name):
            raise BadInput(f"{preset[:40]!r} is not a preset of {name}", source=source,
                           allowed=presets_for(name) or "(none)")
        entries.append(Entry(name, preset or None))
    labels = [e.label for e in entries]
    dup = next((lab for lab in labels if labels.count(lab) > 1), None)
    if dup:
        raise BadInput(f"{dup!r} appears twice", source=source)
    return entries


def _overrides(entry: Entry, sets: list[str]) -> list[str]:
    out = [*sets, f"algorithm.name={entry.name}"]
    if entry.preset:
        out.append(f"algorithm.preset={entry.preset}")
    return out


def _configs(config: Path, entries: list[Entry], sets: list[str]) -> list[Any]:
    """Every entry's validated config, before any run starts (a bad entry refuses the whole comparison)."""
    from p2pfl.algorithms.presets import all_presets
    from p2pfl.config import load_config, parse_override

    from_cli = {parse_override(s)[0] for s in sets if "=" in s}
    cfgs = []
    for e in entries:
        extra = []
        if e.preset:  # the preset rules over the file's values (the command line still wins)
            extra = [f"algorithm.{k}={json.dumps(v)}" for k, v in all_presets()[e.preset].items()
                     if f"algorithm.{k}" not in from_cli]
        cfgs.append(load_config(config, _overrides(e, sets) + extra))
    return cfgs


def compare(config: str | Path, entries: list[Entry], out_dir: str | Path, *, sets: list[str] | None = None,
            progress: bool = True, on_result=None) -> list[dict[str, Any]]:
    """Simulate every entry on CONFIG's experiment; write ``comparison.json``/``.png``; return the rows.

    ``on_result(row)`` is called after each algorithm finishes (the CLI prints its line then).
    """
    from p2pfl.experiment import Experiment
    from p2pfl.runfolder import plot_comparison, read_metrics
    from p2pfl.simulation import simulate

    config = Path(config)
    out = Path(out_dir)
    cfgs = _configs(config, entries, list(sets or []))
    if any(c.raw.get("app") for c in cfgs):
        raise BadInput("compare runs built-in algorithms; this config names a ClientApp (app:)", source=str(config),
                       key="app")
    rows: list[dict[str, Any]] = []
    series: dict[str, list[dict[str, Any]]] = {}
    shared: Experiment | None = None
    for entry, cfg in zip(entries, cfgs, strict=True):
        exp = Experiment.from_config(cfg)
        if shared is not None:  # one dataset in memory and one split for every algorithm
            exp.__dict__["dataset"] = shared.dataset
            exp.__dict__["partition"] = shared.partition
            exp.__dict__["topology"] = shared.topology
        shared = shared or exp
        run_dir = out / entry.label
        summary = simulate(cfg, run_dir, progress=progress, experiment=exp)
        series[entry.label] = read_metrics(run_dir / "metrics.jsonl")
        row = {"algorithm": entry.label, "name": entry.name, "preset": entry.preset, "run_dir": str(run_dir),
               **{k: summary.get(k) for k in ("rounds", "peers", "final_acc_mean", "final_acc_min", "final_acc_max",
                                              "bytes_sent_per_peer", "wall_seconds")}}
        rows.append(row)
        if on_result is not None:
            on_result(row)
    first = cfgs[0]
    (out / "comparison.json").write_text(json.dumps(
        {"name": first.name, "config": str(config), "topology": str(first.topology),
         "partition": dict(first.data.partition), "seed": first.seed, "algorithms": rows}, indent=2, sort_keys=True))
    plot_comparison(series, out / "comparison.png",
                    f"{first.name}: {len(shared.topology.ids) if shared else 0} peers, personalized accuracy")
    return rows


def summary_line(row: dict[str, Any], width: int = 14) -> str:
    """One line per algorithm: final mean personalized accuracy (min-max over peers), traffic, time."""

    def pct(v: float | None) -> str:
        return "   -  " if v is None else f"{100 * v:5.1f}%"

    return (f"{row['algorithm']:<{width}} final accuracy {pct(row['final_acc_mean'])} "
            f"(peers {pct(row['final_acc_min']).strip()}-{pct(row['final_acc_max']).strip()}) "
            f"after {row['rounds']} rounds, {row['bytes_sent_per_peer'] / 1e6:.1f} MB sent/peer, "
            f"{row['wall_seconds'] or 0:.0f} s")
