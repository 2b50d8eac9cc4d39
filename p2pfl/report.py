"""Turn run folders into tables and plots: mean ± std over seeds, rounds to a target accuracy, bytes.

A run folder is any folder holding ``summary.json``, ``metrics.jsonl`` and ``config.yaml`` (what
``p2pfl simulate``, a sweep cell or a launched deployment writes). Runs whose configs differ only
in ``seed`` form one group (or, with ``by``, runs with equal values of those keys). Every figure is
recomputed from ``metrics.jsonl`` rather than read from ``summary.json``, so a report agrees with
the raw records by construction and works for runs whose summary predates a figure.

Definitions (the same in the table, the CSV and the plots):

- *accuracy at a round*: the mean over peers of their personalized test accuracy in that round;
- *final accuracy*: accuracy at the last evaluated round; *best*: the highest accuracy at any round;
- *rounds to target*: the number of rounds run (round index + 1) when accuracy first reaches the
  target; for a group, on the seed-averaged curve, with how many of its seeds reached it alone;
- *MB sent/peer*: total bytes a peer sent over the whole run, averaged over peers, in 10^6 bytes;
- *std*: the sample standard deviation over seeds (n - 1 in the denominator); blank for one seed.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from p2pfl.badinput import BadInput
from p2pfl.runfolder import read_metrics

RUN_FILES = ("summary.json", "metrics.jsonl", "config.yaml")
#: Keys that never define a group: the seed (that is what groups average over) and settings that
#: cannot change results (worker count, checkpointing, where the data files live).
NEUTRAL_PREFIXES = ("simulation.", "checkpoint.")
NEUTRAL_KEYS = {"seed", "data.root", "simulation", "checkpoint"}
DASH = "—"
_MISSING = "\0missing"  # a key absent from a run's config differs from any value, None included


class ReportError(BadInput):
    """Nothing to report on, a grouping key that no run has, or a run folder that cannot be rebuilt: a
    `BadInput` (one line, exit 2), like every input the user named that is wrong."""


@dataclass
class Run:
    """One run folder's figures, recomputed from its metrics."""

    path: Path
    config: dict[str, Any]  # flattened: dotted key -> value
    curve: list[tuple[int, float]]  # (round index, mean accuracy over peers), evaluated rounds only
    bytes_curve: list[float]  # cumulative bytes sent per peer at the end of each curve round
    bytes_sent_per_peer: float
    bytes_recv_per_peer: float
    peers: int
    rounds: int
    wall_seconds: float | None

    @property
    def seed(self) -> Any:
        return self.config.get("seed")

    @property
    def final_acc(self) -> float | None:
        return self.curve[-1][1] if self.curve else None

    @property
    def best(self) -> tuple[int, float] | None:
        return max(self.curve, key=lambda rc: rc[1]) if self.curve else None

    def rounds_to(self, target: float) -> int | None:
        return next((r + 1 for r, acc in self.curve if acc >= target), None)


@dataclass
class Group:
    key: tuple[tuple[str, Any], ...]  # the grouping keys' values, shared by every run in the group
    runs: list[Run] = field(default_factory=list)

    @property
    def values(self) -> dict[str, Any]:
        return dict(self.key)

    def curve(self) -> list[tuple[int, float, float | None, float]]:
        """(round index, mean over seeds, std over seeds, mean cumulative bytes/peer) per round."""
        accs: dict[int, list[float]] = {}
        sent: dict[int, list[float]] = {}
        for run in self.runs:
            for (r, acc), b in zip(run.curve, run.bytes_curve, strict=True):
                accs.setdefault(r, []).append(acc)
                sent.setdefault(r, []).append(b)
        return [(r, statistics.fmean(v), _std(v), statistics.fmean(sent[r])) for r, v in sorted(accs.items())]

    def final(self) -> tuple[float | None, float | None]:
        return _mean_std([r.final_acc for r in self.runs])

    def best(self) -> tuple[float | None, float | None]:
        return _mean_std([b[1] if b else None for b in (r.best for r in self.runs)])

    def rounds_to(self, target: float) -> tuple[int | None, int]:
        """(rounds for the seed-averaged curve to reach target, how many seeds reach it on their own)."""
        mean_round = next((r + 1 for r, acc, _, _ in self.curve() if acc >= target), None)
        return mean_round, sum(1 for run in self.runs if run.rounds_to(target) is not None)

    def bytes_sent(self) -> float:
        return statistics.fmean(r.bytes_sent_per_peer for r in self.runs)


def _std(values: Sequence[float]) -> float | None:
    return statistics.stdev(values) if len(values) > 1 else None


def _mean_std(values: Iterable[float | None]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None]
    return (statistics.fmean(vals), _std(vals)) if vals else (None, None)


# --------------------------------------------------------------------------------------------
# loading


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings -> dotted keys (lists stay values: a shape or a list of classes is one value)."""
    if not isinstance(data, dict):
        return {prefix: data} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def find_runs(dirs: Iterable[str | Path]) -> list[Path]:
    """Every run folder at or under ``dirs`` (sorted, each once)."""
    found: set[Path] = set()
    for d in dirs:
        root = Path(d)
        if not root.exists():
            raise ReportError(f"no such folder: {root}")
        for summary in [root / "summary.json", *root.rglob("summary.json")]:
            folder = summary.parent
            if all((folder / f).is_file() for f in RUN_FILES):
                found.add(folder.resolve())
    return sorted(found)


def load_run(path: Path) -> Run:
    """Read one run folder; every figure comes from ``metrics.jsonl``."""
    config = yaml.safe_load((path / "config.yaml").read_text()) or {}
    summary = json.loads((path / "summary.json").read_text())
    recs = read_metrics(path / "metrics.jsonl")
    peers = sorted({str(r["peer"]) for r in recs})
    n = max(1, len(peers))
    by_round: dict[int, list[dict[str, Any]]] = {}
    for rec in recs:
        by_round.setdefault(int(rec["round"]), []).append(rec)
    curve: list[tuple[int, float]] = []
    bytes_curve: list[float] = []
    cum = 0.0
    for r in sorted(by_round):
        rows = by_round[r]
        cum += sum(float(x.get("bytes_sent") or 0) for x in rows) / n
        accs = [float(x["acc"]) for x in rows if x.get("acc") is not None]
        if accs:
            curve.append((r, statistics.fmean(accs)))
            bytes_curve.append(cum)
    sent = sum(float(r.get("bytes_sent") or 0) for r in recs) / n
    recv = sum(float(r.get("bytes_recv") or 0) for r in recs) / n
    return Run(path=path, config=flatten(config), curve=curve, bytes_curve=bytes_curve, bytes_sent_per_peer=sent,
               bytes_recv_per_peer=recv, peers=len(peers), rounds=(max(by_round) + 1) if by_round else 0,
               wall_seconds=summary.get("wall_seconds"))


# --------------------------------------------------------------------------------------------
# grouping


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _neutral(key: str) -> bool:
    return key in NEUTRAL_KEYS or key.startswith(NEUTRAL_PREFIXES)


def varying_keys(runs: Sequence[Run]) -> list[str]:
    """Config keys whose value (or presence) differs between runs, in first-seen order."""
    order: dict[str, None] = {}
    for run in runs:
        order.update(dict.fromkeys(run.config))
    return [k for k in order if len({_canon(run.config.get(k, _MISSING)) for run in runs}) > 1]


def group_runs(runs: Sequence[Run], by: Sequence[str] | None = None) -> tuple[list[Group], list[str]]:
    """Group runs; return the groups (sorted by their key values) and the grouping keys."""
    if by:
        known = {k for run in runs for k in run.config}
        unknown = [k for k in by if k not in known]
        if unknown:
            raise ReportError(f"no run has config key(s) {unknown}; keys that vary: {varying_keys(runs) or 'none'}")
        keys = list(by)
    else:
        keys = [k for k in varying_keys(runs) if not _neutral(k)]
    groups: dict[str, Group] = {}
    for run in runs:
        key = tuple((k, run.config.get(k)) for k in keys)
        groups.setdefault(_canon(key), Group(key)).runs.append(run)
    ordered = sorted(groups.values(), key=lambda g: [_sort_key(v) for _, v in g.key])
    for g in ordered:
        g.runs.sort(key=lambda run: (_sort_key(run.seed), str(run.path)))
    return ordered, keys


def _sort_key(value: Any) -> tuple[int, Any]:
    if value is None:
        return (2, "")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (0, float(value))
    return (1, _canon(value))


def table_keys(groups: Sequence[Group], keys: Sequence[str]) -> list[str]:
    """The grouping keys worth a column: those that differ between groups.

    An algorithm's hyperparameters (``algorithm.*``) get a column only when they vary for one
    algorithm: when they merely follow ``algorithm.name`` (each algorithm with its own preset),
    the name already says it, and the CSV keeps them all.
    """
    vals = [g.values for g in groups]
    cols = [k for k in keys if len({_canon(v.get(k)) for v in vals}) > 1]
    if "algorithm.name" in cols:
        def follows_name(k: str) -> bool:
            seen: dict[str, str] = {}
            return all(seen.setdefault(_canon(v.get("algorithm.name")), _canon(v.get(k))) == _canon(v.get(k))
                       for v in vals)
        cols = [k for k in cols if not (k.startswith("algorithm.") and k != "algorithm.name" and follows_name(k))]
    if not cols and groups:
        cols = [k for k in ("algorithm.name",) if k in groups[0].values] or list(keys[:1])
    return cols


# --------------------------------------------------------------------------------------------
# formatting


def show_value(value: Any) -> str:
    """A config value for a table cell: file paths by their name, other values as in YAML."""
    if value is None:
        return DASH
    if isinstance(value, str):
        return Path(value).name if "/" in value else value
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


def _pct(mean: float | None, std: float | None) -> str:
    if mean is None:
        return DASH
    return f"{100 * mean:.2f}" + (f" ± {100 * std:.2f}" if std is not None else "")


def _label(group: Group, cols: Sequence[str]) -> str:
    return ", ".join(f"{k}={show_value(group.values.get(k))}" for k in cols) or "all runs"


def markdown_table(groups: Sequence[Group], cols: Sequence[str], target: float | None, *,
                   count_header: str = "seeds") -> str:
    header = [*cols, "final acc (%)", "best acc (%)"]
    if target is not None:
        header.append(f"rounds to {100 * target:g}%")
    header += ["MB sent/peer", count_header]
    rows = []
    for g in groups:
        row = [show_value(g.values.get(k)) for k in cols]
        row += [_pct(*g.final()), _pct(*g.best())]
        if target is not None:
            r, reached = g.rounds_to(target)
            row.append(DASH if r is None else (f"{r}" if reached == len(g.runs) else f"{r} ({reached}/{len(g.runs)})"))
        row += [f"{g.bytes_sent() / 1e6:.2f}", str(len(g.runs))]
        rows.append(row)
    esc = [[c.replace("|", "\\|") for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in esc) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in esc]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# outputs


def write_csv(path: Path, groups: Sequence[Group], keys: Sequence[str], target: float | None) -> None:
    """One row per run, with every config key that varies anywhere, for people's own plots."""
    runs = [run for g in groups for run in g.runs]
    cfg_keys = [k for k in varying_keys(runs) if k != "seed"]
    for k in keys:
        if k not in cfg_keys:
            cfg_keys.append(k)
    fields = ["group", "run", "seed", *cfg_keys, "final_acc", "best_acc", "best_round"]
    if target is not None:
        fields.append("rounds_to_target")
    fields += ["rounds", "peers", "bytes_sent_per_peer", "bytes_recv_per_peer", "wall_seconds"]
    cols = table_keys(groups, keys)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields)
        for g in groups:
            for run in g.runs:
                best = run.best
                row: list[Any] = [_label(g, cols), str(run.path), run.seed]
                row += [_csv_value(run.config.get(k)) for k in cfg_keys]
                row += [run.final_acc, best[1] if best else None, best[0] + 1 if best else None]
                if target is not None:
                    row.append(run.rounds_to(target))
                row += [run.rounds, run.peers, run.bytes_sent_per_peer, run.bytes_recv_per_peer, run.wall_seconds]
                w.writerow(["" if v is None else v for v in row])


def _csv_value(value: Any) -> Any:
    return json.dumps(value, separators=(",", ":")) if isinstance(value, list | dict) else value


def plot_groups(groups: Sequence[Group], cols: Sequence[str], out: Path) -> list[Path]:
    """``accuracy_vs_round.png`` and ``accuracy_vs_bytes.png``: the seed mean per group, ± std band."""
    from matplotlib.ticker import MaxNLocator

    from p2pfl.display import figure

    paths = []
    for name, xlabel in (("accuracy_vs_round.png", "round"), ("accuracy_vs_bytes.png", "MB sent per peer")):
        fig, ax = figure((7, 4.5))
        for g in groups:
            pts = g.curve()
            if not pts:
                continue
            xs = [r + 1 for r, *_ in pts] if xlabel == "round" else [b / 1e6 for *_, b in pts]
            ys = [m for _, m, _, _ in pts]
            line, = ax.plot(xs, ys, marker="o", markersize=3, label=f"{_label(g, cols)} (n={len(g.runs)})")
            if len(g.runs) > 1:
                sd = [s or 0.0 for _, _, s, _ in pts]
                ax.fill_between(xs, [y - s for y, s in zip(ys, sd, strict=True)],
                                [y + s for y, s in zip(ys, sd, strict=True)], color=line.get_color(), alpha=0.15)
        ax.set_xlabel(xlabel)
        if xlabel == "round":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("mean personalized accuracy")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths


@dataclass
class Report:
    markdown: str  # the table alone
    groups: list[Group]
    columns: list[str]
    files: list[Path]
    warnings: list[str]


def make_report(dirs: Sequence[str | Path], out: str | Path, *, target: float | None = None,
                by: Sequence[str] | None = None, plots: bool = True) -> Report:
    """Find runs under ``dirs``, group them and write report.md, report.csv and the two plots to ``out``.

    ``target`` is an accuracy in [0, 1] (a value above 1 is read as a percentage).
    """
    if target is not None:
        if not math.isfinite(target) or target < 0 or target > 100:
            raise ReportError(f"--target must be an accuracy in [0, 1] or a percentage, not {target}")
        target = target / 100 if target > 1 else target
    paths = find_runs(dirs)
    if not paths:
        raise ReportError(f"no run folders (with {', '.join(RUN_FILES)}) under {', '.join(map(str, dirs))}")
    runs = [load_run(p) for p in paths]
    groups, keys = group_runs(runs, by)
    cols = table_keys(groups, keys)
    warnings = []
    if not by:
        for g in groups:
            seeds = [_canon(r.seed) for r in g.runs]
            if len(set(seeds)) < len(seeds):
                warnings.append(f"group {_label(g, cols)} has runs with the same seed: "
                                + ", ".join(str(r.path) for r in g.runs))
    table = markdown_table(groups, cols, target, count_header="runs" if by else "seeds")

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    md = ["# Results", "",
          f"{len(runs)} runs in {len(groups)} groups"
          + (f" (grouped by {', '.join(keys)})" if by else " (runs that differ only in seed form a group)") + ". "
          "Accuracy: mean personalized test accuracy over peers, in %, as mean ± sample std over seeds; "
          "final = last evaluated round, best = best round"
          + (f"; rounds to {100 * target:g}%: first round where the seed-averaged accuracy reaches it "
             "(k/n: seeds that reach it on their own)" if target is not None else "")
          + "; MB sent/peer: total over the run (10^6 bytes).", "", table, "", "## Runs", ""]
    for g in groups:
        md.append(f"- **{_label(g, cols)}**: " + ", ".join(f"`{r.path}`" for r in g.runs))
    if warnings:
        md += ["", "## Warnings", "", *[f"- {w}" for w in warnings]]
    files = [out / "report.md", out / "report.csv"]
    files[0].write_text("\n".join(md) + "\n")
    write_csv(files[1], groups, keys, target)
    if plots:
        files += plot_groups(groups, cols, out)
    return Report(markdown=table, groups=groups, columns=cols, files=files, warnings=warnings)


def averaged_model_accuracy(run_dir: str | Path, batch_size: int = 1000) -> dict[str, Any]:
    """The DFedADMM / DFedSAM papers' metric: the average x̄ of all peers' final models, evaluated on
    the dataset's whole (global) test set.

    Every other figure here is personalized (each peer's own model on its own test split, the
    metric of DePRL, DFedMDC and DFedPGP); the DFedADMM and DFedSAM tables report this one instead
    (spec 002 §5, spec 003 §4). x̄ is the plain mean over peers of the full flat parameter vector in
    ``checkpoints/<peer>.npz`` (the run's last checkpoint; every peer's must be of the same round).
    For algorithms with personal heads the mean of the heads is part of x̄: the number is
    computable but is not what those papers report. Reads only the run's own checkpoint files
    (numpy, no pickle). Raises :class:`ReportError` when the run has no complete set of checkpoints.

    A peer whose parameters are not finite (it diverged) makes x̄ non-finite, and x̄ then scores
    chance: that is the paper's metric, reported as it is. So the result also names those peers
    (``nonfinite_peers``) and, when there are any, scores the mean of the *other* peers' models
    (``acc_finite_peers``, ``loss_finite_peers``): a diagnostic that says what the run's healthy
    peers reached, never a substitute for ``acc``. A non-finite loss is written as ``None`` (JSON
    has no NaN).
    """
    import torch
    import torch.nn.functional as F

    from p2pfl.checkpoint import load_checkpoint
    from p2pfl.config import load_config
    from p2pfl.experiment import Experiment

    run = Path(run_dir)
    try:
        exp = Experiment(load_config(run / "config.yaml"), torch.device("cpu"))
    except (OSError, ValueError) as exc:
        raise ReportError(f"{run}: cannot rebuild the experiment from config.yaml: {exc}") from None
    peers = list(exp.topology.ids)
    paths = [run / "checkpoints" / f"{pid}.npz" for pid in peers]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ReportError(f"{run}: no final checkpoint for {len(missing)} peers (e.g. {missing[0]})")
    total: torch.Tensor | None = None
    finite_total: torch.Tensor | None = None
    rounds, nonfinite = set(), []
    for pid, path in zip(peers, paths, strict=True):
        state, _, _ = load_checkpoint(path)
        rounds.add(state.round)
        params = state.params.double()
        total = params if total is None else total + params
        if not bool(torch.isfinite(params).all()):
            nonfinite.append(pid)
        else:
            finite_total = params if finite_total is None else finite_total + params
    if len(rounds) != 1:
        raise ReportError(f"{run}: peers' checkpoints are of different rounds {sorted(rounds)}")
    assert total is not None
    model = exp.build_model()
    data = exp.dataset

    def score(mean: torch.Tensor) -> tuple[float, float | None]:
        exp.layout.bind(model, mean.float())
        model.eval()
        correct, loss_sum = 0, 0.0
        with torch.no_grad():
            for i in range(0, data.num_test, batch_size):
                x, y = data.test_x[i:i + batch_size], data.test_y[i:i + batch_size]
                out = model(x)
                loss_sum += float(F.cross_entropy(out, y, reduction="sum"))
                correct += int((out.argmax(1) == y).sum())
        loss = loss_sum / data.num_test
        return correct / data.num_test, (loss if math.isfinite(loss) else None)

    acc, loss = score(total / len(paths))
    result: dict[str, Any] = {"metric": "averaged model on the global test set", "acc": acc, "loss": loss,
                              "peers": len(paths), "round": rounds.pop(), "test_examples": data.num_test,
                              "nonfinite_peers": nonfinite}
    if nonfinite and finite_total is not None:
        result["acc_finite_peers"], result["loss_finite_peers"] = score(finite_total / (len(paths) - len(nonfinite)))
    return result


__all__ = ["Group", "Report", "ReportError", "Run", "averaged_model_accuracy", "find_runs", "flatten",
           "group_runs", "load_run", "make_report", "markdown_table", "table_keys", "varying_keys"]
