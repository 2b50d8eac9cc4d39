"""Parameter sweeps: one base config, a grid of overrides (and named cases), one run folder per cell.

A sweep file::

    name: fmnist-pi                     # optional; default: the file's stem
    base: peers/demo.yaml               # relative to the working directory, else to the sweep file
    set: [rounds=100]                   # optional; applied to every cell
    cases:                              # optional; named override sets, crossed with the grid
      - {name: dfedavg, set: {algorithm: {name: dfedavg, preset: dfedavg-paper}}}
      - {name: deprl, set: [algorithm.name=deprl, algorithm.preset=deprl-paper]}
      - {name: fedrep, flower: fedrep, set: {algorithm: {name: deprl, preset: deprl-paper}}}
    grid:                               # dotted config key -> list of values
      data.partition.pi: [0.1, 0.3]
      seed: [1, 12, 123]
    order: cases                        # optional; cases (default): every grid point of a case, then
                                        # the next case; grid: every case at a grid point, then the next

``order: grid`` puts one seed of every method before the second seed of any, so a sweep cut off
half-way has something of each. The order changes no cell's name or config.

Every cell (base + ``set`` + its case + its grid values) is validated before anything runs, so a
typo in the last cell does not surface hours into the sweep. Each cell runs as its own
``p2pfl simulate`` subprocess, or ``p2pfl flower --baseline B`` for a case with ``flower: B``
(a parameter-server baseline on Flower's runtime, on the same partition) (a crash in one cell
cannot take the others down, and its output lands in ``<cell>/log.txt``). The sweep is resumable:
a cell whose ``summary.json`` exists and whose saved config matches the planned one is done; an
interrupted cell with the planned config and checkpoints continues from the last round every peer
checkpointed (``p2pfl simulate --resume`` or ``p2pfl flower --resume``, see ``p2pfl/resume.py``);
a finished simulation whose config differs from the plan's only in more ``rounds`` is extended from its
final checkpoints (the same ``--resume``: raise a sweep's ``rounds`` to run its curves further);
anything else in its folder (a failed or stale attempt) is deleted and rerun from scratch, so no
cell ever mixes two configs. ``sweep.json`` in the sweep folder lists every cell, its overrides and
its status.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import fnmatch
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from p2pfl.badinput import BadInput
from p2pfl.config import (
    ConfigError,
    apply_overrides,
    drop_dotted,
    parse_config,
    resolve_path,
    set_dotted,
)

#: Longest cell folder name before it is shortened with a hash suffix (filesystems allow 255).
MAX_CELL_NAME = 100
#: Config keys whose value cannot change a run's results (bitwise independent of the worker
#: count), so a finished cell still counts as finished when ``--jobs`` changes them.
RESULT_NEUTRAL_KEYS = ("simulation.workers",)
#: The orders a sweep's cells can run in (``order:``): case-major (the default) or grid-major.
SWEEP_ORDERS = ("cases", "grid")
#: How long an interrupted cell gets to stop cleanly (its own worker processes) before it is killed.
STOP_GRACE_S = 15.0


class SweepError(BadInput):
    """The sweep file or one of its cells is invalid (or its folder is held by another sweep); nothing
    was run. A `BadInput`: the command prints it on one line and exits 2, as for every bad input."""


@dataclass(frozen=True)
class Case:
    """A named set of overrides crossed with the grid (e.g. an algorithm with its own preset)."""

    name: str
    overrides: tuple[tuple[str, Any], ...]
    flower: str | None = None  # a parameter-server baseline (p2pfl.centralized.baselines) instead of simulate


@dataclass(frozen=True)
class SweepSpec:
    """A parsed sweep file. Overrides are ``(dotted key, value)`` pairs, applied in order."""

    name: str
    path: Path | None
    base: Path
    overrides: tuple[tuple[str, Any], ...]
    grid: tuple[tuple[str, tuple[Any, ...]], ...]
    cases: tuple[Case, ...]
    order: str = "cases"  # cases: case-major (every grid point of a case, then the next); grid: grid-major

    @property
    def folder(self) -> Path:
        return self.path.parent if self.path is not None else Path.cwd()


@dataclass(frozen=True)
class Cell:
    """One planned run: its folder name, what distinguishes it, and its validated config."""

    name: str
    case: str | None
    values: dict[str, Any]  # grid key -> value for this cell
    overrides: list[str]  # every override applied on top of the base, as KEY=VALUE (for people)
    config: dict[str, Any]  # resolved config (ExperimentConfig.raw), written to <cell>/config.yaml
    flower: str | None = None  # run by ``p2pfl flower --baseline`` (its case's ``flower``)


@dataclass
class CellResult:
    cell: Cell
    status: str  # finished (earlier) | done (now) | failed | interrupted | pending | planned | unselected
    error: str | None = None
    seconds: float | None = None
    found: str = "new"  # what was in its folder before: new | finished | interrupted | extendable | stale (cell_state)


@dataclass
class SweepResult:
    out: Path
    cells: list[CellResult] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(1 for c in self.cells if c.status == status)

    @property
    def failed(self) -> list[CellResult]:
        return [c for c in self.cells if c.status == "failed"]

    @property
    def ran(self) -> int:
        """Cells started by this invocation (done or failed)."""
        return self.count("done") + self.count("failed")


# --------------------------------------------------------------------------------------------
# sweep file


def _parse_overrides(value: Any, where: str) -> tuple[tuple[str, Any], ...]:
    """``set`` is a list of KEY=VALUE strings (as on the command line) or a mapping key -> value."""
    if value is None:
        return ()
    if isinstance(value, dict):
        pairs = []
        for key, val in value.items():
            if not isinstance(key, str) or not key:
                raise SweepError(f"{where}: keys must be dotted config keys, got {key!r}")
            pairs.append((key, val))
        return tuple(pairs)
    if isinstance(value, list):
        pairs = []
        for item in value:
            if not isinstance(item, str) or "=" not in item:
                raise SweepError(f"{where}: {item!r} is not KEY=VALUE")
            key, _, text = item.partition("=")
            # apply_overrides parses VALUE exactly as `--set` does; reuse it on an empty dict.
            try:
                parsed = apply_overrides({}, [f"v={text}"])["v"]
            except ConfigError as exc:
                raise SweepError(f"{where}: {exc}") from None
            pairs.append((key.strip(), parsed))
        return tuple(pairs)
    raise SweepError(f"{where}: must be a list of KEY=VALUE strings or a mapping")


def parse_sweep(data: Any, path: Path | None = None) -> SweepSpec:
    """Validate the structure of a sweep file (cells are validated later, by :func:`plan_cells`)."""
    where = str(path) if path is not None else "sweep"
    if not isinstance(data, dict):
        raise SweepError(f"{where}: a sweep file must be a YAML mapping")
    unknown = set(data) - {"name", "base", "set", "grid", "cases", "order"}
    if unknown:
        raise SweepError(f"{where}: unknown keys {sorted(unknown)} (allowed: base, cases, grid, name, order, set)")
    order = data.get("order", "cases")
    if order not in SWEEP_ORDERS:
        raise SweepError(f"{where}: 'order' must be one of {', '.join(SWEEP_ORDERS)}, got {_show(order)[:40]!r}")
    base = data.get("base")
    if not isinstance(base, str) or not base:
        raise SweepError(f"{where}: 'base' must be the path of an experiment config")
    folder = path.parent if path is not None else None
    base_path = Path(resolve_path(base, folder))
    if not base_path.is_file():
        raise SweepError(f"{where}: base config not found: {base} (looked in the working directory"
                         + (f" and {folder}" if folder is not None else "") + ")")
    name = data.get("name") or (path.stem if path is not None else "sweep")
    if not isinstance(name, str | int):
        raise SweepError(f"{where}: 'name' must be a string")

    grid_raw = data.get("grid") or {}
    if not isinstance(grid_raw, dict):
        raise SweepError(f"{where}: 'grid' must map dotted config keys to lists of values")
    grid = []
    for key, values in grid_raw.items():
        if not isinstance(key, str) or not key or not all(key.split(".")):
            raise SweepError(f"{where}: grid key {key!r} is not a dotted config key")
        if not isinstance(values, list) or not values:
            raise SweepError(f"{where}: grid key {key!r} needs a non-empty list of values")
        if len({_canon(v) for v in values}) != len(values):
            raise SweepError(f"{where}: grid key {key!r} lists a value twice")
        grid.append((key, tuple(values)))

    cases_raw = data.get("cases") or []
    if not isinstance(cases_raw, list):
        raise SweepError(f"{where}: 'cases' must be a list of {{name, set}} mappings")
    cases = []
    for i, case in enumerate(cases_raw):
        if not isinstance(case, dict) or not isinstance(case.get("name"), str | int) or \
                set(case) - {"name", "set", "flower"}:
            raise SweepError(f"{where}: case #{i + 1} must be a mapping with 'name', 'set' and optionally 'flower'")
        cname = str(case["name"])
        flower = case.get("flower")
        if flower is not None and not isinstance(flower, str):
            raise SweepError(f"{where}: case {cname!r}: 'flower' must name a baseline (fedavg, fedper, fedrep, ...)")
        cases.append(Case(cname, _parse_overrides(case.get("set"), f"{where}: case {cname!r}"), flower))
    names = [c.name for c in cases]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise SweepError(f"{where}: case names must be unique, repeated: {dup}")
    for case in cases:
        clash = {k for k, _ in case.overrides} & {k for k, _ in grid}
        if clash:
            raise SweepError(f"{where}: case {case.name!r} and the grid both set {sorted(clash)}; "
                             "set each key in one place")
    return SweepSpec(name=str(name), path=path, base=base_path,
                     overrides=_parse_overrides(data.get("set"), f"{where}: 'set'"), grid=tuple(grid),
                     cases=tuple(cases), order=order)


def load_sweep(path: str | Path) -> SweepSpec:
    p = Path(path)
    if not p.is_file():
        raise SweepError(f"sweep file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise SweepError(f"{p}: not valid YAML ({exc})") from None
    return parse_sweep(data, p)


# --------------------------------------------------------------------------------------------
# cells


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _get_dotted(data: dict[str, Any], key: str) -> Any:
    node: Any = data
    for p in key.split("."):
        if not isinstance(node, dict) or p not in node:
            return None
        node = node[p]
    return node


def _show(value: Any) -> str:
    """A value as the user would type it after ``--set KEY=``."""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, default=str)


def _slug(value: Any) -> str:
    """A short, filesystem-safe rendering of a value for a cell folder name."""
    if isinstance(value, str) and ("/" in value or value.endswith((".yaml", ".yml"))):
        text = Path(value).stem  # a file: its stem reads better than its path
    elif isinstance(value, bool) or value is None:
        text = json.dumps(value)
    elif isinstance(value, float):
        text = repr(value)
    elif isinstance(value, int | str):
        text = str(value)
    else:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    text = re.sub(r"[^A-Za-z0-9._+=-]+", "-", text).strip("-.")
    return text or "_"


def _digest(obj: Any, n: int = 8) -> str:
    return hashlib.sha1(_canon(obj).encode()).hexdigest()[:n]


def cell_name(case: str | None, values: dict[str, Any]) -> str:
    """Deterministic, readable folder name: ``case__key=value__key=value`` (hashed when too long)."""
    parts = ([_slug(case)] if case is not None else []) + [f"{_slug(k)}={_slug(v)}" for k, v in values.items()]
    name = "__".join(parts) or "base"
    if len(name) > MAX_CELL_NAME:
        name = name[: MAX_CELL_NAME - 10].rstrip("_-.") + "__" + _digest([case, values])
    return name


def _allowed_cores() -> list[int] | None:
    """The cores this process may run on, sorted; None off Linux."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return None


def available_cores() -> int:
    allowed = _allowed_cores()
    return len(allowed) if allowed is not None else (os.cpu_count() or 1)


def plan_cells(spec: SweepSpec, *, jobs: int = 1, cores: int | None = None) -> list[Cell]:
    """Expand the sweep into cells and validate every one; raise SweepError naming each bad cell.

    Unless the sweep itself sets ``simulation.workers``, each cell gets
    ``min(its config's workers, cores // jobs)`` so that parallel cells do not oversubscribe the
    machine (a simulation's results do not depend on its worker count).
    """
    try:
        base = yaml.safe_load(spec.base.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SweepError(f"cannot read base config {spec.base}: {exc}") from None
    if not isinstance(base, dict):
        raise SweepError(f"base config {spec.base} must be a YAML mapping")
    per_job = max(1, (cores or available_cores()) // max(1, jobs))
    combos: list[dict[str, Any]] = [{}]
    for key, values in spec.grid:
        combos = [{**c, key: v} for c in combos for v in values]
    cases: list[Case | None] = list(spec.cases) or [None]

    if spec.order == "grid":
        planned = [(case, values) for values in combos for case in cases]
    else:
        planned = [(case, values) for case in cases for values in combos]

    cells: list[Cell] = []
    errors: list[str] = []
    for case, values in planned:
        pairs = list(spec.overrides) + list(case.overrides if case else ()) + list(values.items())
        name = cell_name(case.name if case else None, values)
        try:
            data = copy.deepcopy(base)
            for key, val in pairs:
                set_dotted(data, key, val)
            swept = {k for k, _ in pairs}
            if "topology" in swept and isinstance(data.get("topology"), str):
                # a topology named by the sweep is relative to the cwd, else to the sweep file
                data["topology"] = resolve_path(data["topology"], spec.folder)
            if "simulation.workers" not in swept and "simulation" not in swept:
                sim = data.get("simulation") if isinstance(data.get("simulation"), dict) else {}
                workers = sim.get("workers", 2)
                if isinstance(workers, int) and not isinstance(workers, bool):
                    data["simulation"] = {**sim, "workers": max(1, min(workers, per_job))}
            cfg = parse_config(data, base=spec.base.parent)  # the whole experiment, topology file included
            if case is not None and case.flower is not None:
                from p2pfl.centralized.baselines import baseline_of

                baseline_of(case.flower, cfg.algorithm_name)  # an unknown baseline or a wrong local rule
        except Exception as exc:  # noqa: BLE001 - e.g. a preset's module fails to import: refuse, say why
            errors.append(f"cell {name}: {exc}")
            continue
        raw = copy.deepcopy(cfg.raw)
        if Path(raw["topology"]).exists():  # absolute: the cell's config works from any directory
            raw["topology"] = str(Path(raw["topology"]).resolve())
        cells.append(Cell(name=name, case=case.name if case else None, values=values,
                          overrides=[f"{k}={_show(v)}" for k, v in pairs], config=_normalize(raw),
                          flower=case.flower if case else None))
    if errors:
        more = f"\n  ... and {len(errors) - 10} more" if len(errors) > 10 else ""
        raise SweepError(f"sweep {spec.name!r}: {len(errors)} of {len(cases) * len(combos)} cells are invalid, "
                         "nothing was run:\n  " + "\n  ".join(errors[:10]) + more)
    _disambiguate(cells)
    return cells


def _disambiguate(cells: list[Cell]) -> None:
    """Two cells can slug to one name (files with one stem in two folders): suffix a hash."""
    seen: dict[str, int] = {}
    for c in cells:
        seen[c.name] = seen.get(c.name, 0) + 1
    for i, c in enumerate(cells):
        if seen[c.name] > 1:
            cells[i] = Cell(name=f"{c.name}__{_digest([c.case, c.values])}", case=c.case, values=c.values,
                            overrides=c.overrides, config=c.config, flower=c.flower)


def _normalize(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config as it reads back from YAML (tuples become lists), so saved and planned compare equal."""
    return yaml.safe_load(yaml.safe_dump(cfg, sort_keys=True))


#: The copy of its topology file that every run folder holds (p2pfl.runfolder): what a finished cell ran
#: on, when the path its config names is gone (it ran from a code snapshot of another checkout).
RUN_TOPOLOGY = "topology.yaml"


def _topology_key(path: str | Path) -> str | None:
    """What of a topology file decides results: its graph (``Topology.hash``, which leaves out the
    addresses, kept apart since the address book), else its bytes; None when the file is not at hand."""
    try:
        content = Path(path).read_bytes()
    except OSError:
        return None
    try:
        from p2pfl.topology import parse_topology
        from p2pfl.yamlsafe import load_yaml_text

        return "graph:" + parse_topology(load_yaml_text(content.decode("utf-8"), str(path)), str(path)).hash()
    except (ValueError, UnicodeDecodeError):  # BadInput/TopologyError are ValueErrors
        return "sha1:" + hashlib.sha1(content).hexdigest()


def _with_local_topology(saved: Any, planned: dict[str, Any], cell_dir: Path) -> Any:
    """A saved config whose topology file is gone (its code snapshot was on another checkout): when the
    run folder's own copy (``RUN_TOPOLOGY``) has the planned graph, the planned path instead, so it parses."""
    if not (isinstance(saved, dict) and isinstance(saved.get("topology"), str)
            and isinstance(planned.get("topology"), str)) or Path(saved["topology"]).is_file():
        return saved
    mine, theirs = _topology_key(cell_dir / RUN_TOPOLOGY), _topology_key(planned["topology"])
    if mine is None or mine != theirs:
        return saved
    return {**saved, "topology": planned["topology"]}


def _comparable(cfg: dict[str, Any]) -> dict[str, Any]:
    """What decides a cell's results: the config less result-neutral keys, with the topology file
    named by its content (a checkout or snapshot elsewhere holds the same file at another path) and
    the ``simulation`` section's defaults and ``tf32``'s filled in (``engine: exact`` spelled out is the default)."""
    out = copy.deepcopy(cfg)
    sim = out.get("simulation")
    if sim is None or isinstance(sim, dict):  # a key spelled at its default is the key left out
        from p2pfl.config import SimulationConfig

        out["simulation"] = {**SimulationConfig().model_dump(), **(sim or {})}
    out.setdefault("tf32", False)
    topo = out.get("topology")
    if isinstance(topo, str):
        key = _topology_key(topo)
        if key is not None:
            out["topology"] = key
    drop_dotted(out, RESULT_NEUTRAL_KEYS)
    return out


def cell_state(cell_dir: Path, config: dict[str, Any]) -> str:
    """``new`` (no folder), ``finished`` (summary + matching config), ``extendable`` (a finished
    simulation whose config differs from the plan's in more ``rounds`` only, with the final checkpoints
    to continue from: ``p2pfl simulate --resume`` extends it), ``stale`` (finished with another
    config: the sweep changed), or ``interrupted`` (a folder without a summary of its config's rounds)."""
    if not cell_dir.exists():
        return "new"
    summary, saved = cell_dir / "summary.json", cell_dir / "config.yaml"
    if not (summary.is_file() and saved.is_file() and (cell_dir / "metrics.jsonl").is_file()):
        return "interrupted"
    try:
        ran = json.loads(summary.read_text()).get("rounds")
        done = parse_config(_with_local_topology(yaml.safe_load(saved.read_text()), config, cell_dir)).raw
    except (OSError, ValueError, yaml.YAMLError, TypeError, AttributeError):
        return "interrupted"
    if ran is not None and ran != done.get("rounds"):
        return "interrupted"  # an extension stopped before it took the summary away
    done = _normalize(done)
    if _comparable(done) == _comparable(config):
        return "finished"
    if (_comparable({**done, "rounds": 0}) == _comparable({**config, "rounds": 0})
            and isinstance(done.get("rounds"), int) and isinstance(config.get("rounds"), int)
            and done["rounds"] < config["rounds"]):
        from p2pfl.resume import finished_round

        if finished_round(cell_dir) == done["rounds"]:
            return "extendable"
    return "stale"


# --------------------------------------------------------------------------------------------
# running


def default_out(spec: SweepSpec) -> Path:
    return Path("runs") / "sweeps" / _slug(spec.name)


def simulate_command(cell_dir: Path, resume: bool = False, flower: str | None = None) -> list[str]:
    """How one cell runs: the ordinary CLI in a fresh interpreter (isolated, logged, killable)."""
    if flower is not None:
        return [sys.executable, "-m", "p2pfl.cli", "flower", "--config", str(cell_dir / "config.yaml"),
                "--out", str(cell_dir), "--baseline", flower, "--quiet"] + (["--resume"] if resume else [])
    return [sys.executable, "-m", "p2pfl.cli", "simulate", "--config", str(cell_dir / "config.yaml"),
            "--out", str(cell_dir), "--quiet"] + (["--resume"] if resume else [])


def can_resume(cell_dir: Path, config: dict[str, Any]) -> bool:
    """An interrupted cell continues from its checkpoints when its saved config is the planned one."""
    from p2pfl.resume import resumable

    try:
        saved = _normalize(yaml.safe_load((cell_dir / "config.yaml").read_text()))
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(saved, dict) and _comparable(saved) == _comparable(config) and resumable(cell_dir)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    tmp.replace(path)


def write_index(out: Path, spec: SweepSpec, results: list[CellResult], jobs: int) -> None:
    """``sweep.json``: the cells, their overrides and status; rewritten as cells finish."""
    _write_json(out / "sweep.json", {
        "name": spec.name,
        "sweep_file": str(spec.path.resolve()) if spec.path else None,
        "base": str(spec.base.resolve()),
        "jobs": jobs,
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "counts": {s: sum(1 for r in results if r.status == s) for s in sorted({r.status for r in results})},
        "cells": [{"name": r.cell.name, "case": r.cell.case, "values": r.cell.values, "overrides": r.cell.overrides,
                   **({"flower": r.cell.flower} if r.cell.flower else {}), "status": r.status, "error": r.error, "seconds": r.seconds} for r in results],
    })


def _tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _reason(log_text: str, rc: int) -> str:
    """One line for the summary: the CLI's ``error: ...`` line, else the last line of a traceback."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("error:"):
            return ln[len("error:"):].strip()
    return lines[-1] if lines else f"exit code {rc}"


@dataclass
class _Running:
    result: CellResult
    proc: subprocess.Popen[bytes]
    log: IO[bytes]
    started: float
    slot: int = 0


def select_cells(cells: list[Cell], only: Sequence[str] | None) -> set[str]:
    """The names of the cells to run: those matching any ``only`` glob (``fnmatch`` on the cell's
    folder name, e.g. ``dpsgd__*`` or ``*seed=1``), every cell when ``only`` is empty. A pattern that
    matches no cell is a typo, refused before anything runs (it would otherwise run nothing, quietly)."""
    if not only:
        return {c.name for c in cells}
    chosen: set[str] = set()
    for pattern in only:
        hits = {c.name for c in cells if fnmatch.fnmatchcase(c.name, pattern)}
        if not hits:
            shown = pattern if len(pattern) <= 80 else pattern[:77] + "..."
            raise SweepError(f"--only {shown!r}: matches none of the sweep's {len(cells)} cells "
                             f"(e.g. {cells[0].name})" if cells else f"--only {shown!r}: the sweep has no cells")
        chosen |= hits
    return chosen


def run_sweep(spec: SweepSpec, out: Path | None = None, *, jobs: int = 1, dry_run: bool = False,
              progress: bool = True, cores: int | None = None, only: Sequence[str] | None = None) -> SweepResult:
    """Plan, validate and run (or resume) a sweep; see the module docstring.

    ``only``: globs on cell names; the other cells are neither run nor touched (status ``unselected``
    unless already finished), so one cell of a sweep (a seed cut off on a lent GPU, say) can be run
    alone into the sweep's folder, where a later full run counts it as finished.
    Returns every cell's status; the caller decides the exit code (any failed cell: 1).
    KeyboardInterrupt stops the running cells (their folders stay without a summary, so the next
    invocation reruns them), records them as interrupted and propagates.
    """
    jobs = max(1, int(jobs))
    cells = plan_cells(spec, jobs=jobs, cores=cores)
    chosen = select_cells(cells, only)
    out = Path(out) if out is not None else default_out(spec)
    with contextlib.ExitStack() as held:
        if not dry_run:
            out.mkdir(parents=True, exist_ok=True)
            held.enter_context(_folder_lock(out))  # before reading the cells' states: they decide what runs
        return _run_cells(spec, cells, out, jobs=jobs, dry_run=dry_run, progress=progress, chosen=chosen)


@contextlib.contextmanager
def _folder_lock(out: Path) -> Iterator[None]:
    """One sweep at a time per folder: two would run the same pending cell into one cell folder."""
    path = out / ".sweep.lock"
    with open(path, "a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SweepError(f"{out}: another p2pfl sweep is running into this folder ({path.name} is held); "
                             "wait for it or give another --out") from None
        yield


def _run_cells(spec: SweepSpec, cells: list[Cell], out: Path, *, jobs: int, dry_run: bool,
               progress: bool, chosen: set[str]) -> SweepResult:
    result = SweepResult(out=out)
    states = {c.name: cell_state(out / c.name, c.config) for c in cells}
    for c in cells:
        if states[c.name] == "finished":
            status = "finished"
        elif c.name not in chosen:
            status = "unselected"
        else:
            status = "planned" if dry_run else "pending"
        result.cells.append(CellResult(c, status, found=states[c.name]))
    if dry_run:
        return result

    write_index(out, spec, result.cells, jobs)
    todo = deque(r for r in result.cells if r.status == "pending")
    total = sum(1 for r in result.cells if r.status != "unselected")
    bar, task = _progress(progress, total, total - len(todo))
    running: list[_Running] = []
    slots = core_slots(jobs)
    try:
        while todo or running:
            while todo and len(running) < jobs:
                slot = min(set(range(jobs)) - {r.slot for r in running})
                running.append(_start(out, todo.popleft(), slot, slots[slot] if slots else None))
            time.sleep(0.05)
            for run in [r for r in running if r.proc.poll() is not None]:
                running.remove(run)
                _finish(out, run)
                write_index(out, spec, result.cells, jobs)
                if bar is not None:
                    bar.update(task, advance=1, failed=result.count("failed"))
                    if run.result.status == "failed":
                        bar.console.print(f"[red]failed[/red] {run.result.cell.name}: {run.result.error}")
    except BaseException:
        _stop(running)
        for run in running:
            run.result.status, run.result.error = "interrupted", "interrupted (rerun the sweep to resume)"
        write_index(out, spec, result.cells, jobs)
        raise
    finally:
        if bar is not None:
            bar.stop()
    return result


def _progress(enabled: bool, total: int, done: int) -> tuple[Any, Any]:
    if not enabled:
        return None, None
    from rich.progress import TextColumn

    from p2pfl.display import progress_bar

    bar = progress_bar("sweep", "cells", TextColumn("[red]{task.fields[failed]} failed"), stderr=True)
    task = bar.add_task("cells", total=total, completed=done, failed=0)
    return bar, task


def core_slots(jobs: int) -> list[list[int]] | None:
    """For ``jobs`` > 1 cells side by side: a disjoint slice of this process's cores for each (a
    cell's simulation then pins its workers inside its slice, p2pfl.engine.exact.worker_cores);
    None for one job, off Linux, or with fewer cores than jobs."""
    allowed = _allowed_cores()
    if allowed is None:
        return None
    per = len(allowed) // max(1, jobs)
    if jobs < 2 or per < 1:
        return None
    return [allowed[k * per:(k + 1) * per] for k in range(jobs)]


def _start(out: Path, res: CellResult, slot: int = 0, cores: list[int] | None = None) -> _Running:
    cell_dir = out / res.cell.name
    resume = (res.found == "interrupted" and can_resume(cell_dir, res.cell.config)) or res.found == "extendable"
    if cell_dir.exists() and not resume:  # a failed or stale attempt, or one without checkpoints: start clean
        shutil.rmtree(cell_dir)
    cell_dir.mkdir(parents=True, exist_ok=True)
    (cell_dir / "error.txt").unlink(missing_ok=True)
    (cell_dir / "config.yaml").write_text(yaml.safe_dump(res.cell.config, sort_keys=False))
    command = simulate_command(cell_dir, resume=resume, flower=res.cell.flower)
    log = open(cell_dir / "log.txt", "ab" if resume else "wb")  # closed in _finish / _stop
    log.write(("$ " + " ".join(command) + "\n").encode())
    log.flush()
    proc = spawn_cell(command, log, cores)
    res.status = "running"
    return _Running(res, proc, log, time.perf_counter(), slot)


def spawn_cell(command: list[str], log: IO[bytes], cores: list[int] | None = None) -> subprocess.Popen[bytes]:
    """Start one cell's process in its own session (a Ctrl-C in the terminal reaches only the sweep,
    which then stops each cell once: a second SIGINT during a cell's cleanup would leave its workers
    behind), pinned to ``cores`` when given.

    No ``preexec_fn``: with one, Popen forks instead of vforking, so the fork handlers of a gRPC
    runtime already running in this process (a test session, a notebook that ran a peer) run in the
    child and can abort it before exec (an event-engine poller on a closed descriptor: SIGABRT in
    about 1 start in 10). A child inherits the affinity of the thread that starts it, so this thread
    takes the cell's cores for the moment of the start. SIGINT: exec resets a handled signal to its
    default; the sweep CLI handles SIGINT (``stoppable``) before any cell starts, so a sweep started
    in the background, with SIGINT ignored, still gets cells that stop on it (a caller that leaves
    SIGINT ignored gets cells that ``_stop`` kills after its grace instead; they resume all the same).
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    before = os.sched_getaffinity(0) if cores is not None else None
    try:
        if cores is not None:
            os.sched_setaffinity(0, cores)  # this thread only (Linux): the sweep's other threads keep theirs
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    finally:
        if before is not None:
            os.sched_setaffinity(0, before)


def stoppable() -> None:
    """Make SIGTERM and SIGINT stop the sweep like Ctrl-C (cells stopped, folders left to resume),
    also when it was started in the background with SIGINT ignored. Main thread only."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _finish(out: Path, run: _Running) -> None:
    run.log.close()
    res, cell_dir = run.result, out / run.result.cell.name
    res.seconds = round(time.perf_counter() - run.started, 3)
    rc = run.proc.returncode
    if rc == 0 and (cell_dir / "summary.json").is_file():
        res.status, res.error = "done", None
        return
    tail = _tail(cell_dir / "log.txt")
    res.status = "failed"
    res.error = _reason(tail, rc) if rc != 0 else "finished without writing summary.json"
    (cell_dir / "error.txt").write_text(f"{res.error}\n\nexit code {rc}; last lines of log.txt:\n\n{tail}\n")


def _stop(running: list[_Running]) -> None:
    """Ask each running cell to stop (SIGINT: it cleans up its workers), then kill what remains."""
    for run in running:
        if run.proc.poll() is None:
            run.proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + STOP_GRACE_S
    for run in running:
        try:
            run.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(run.proc.pid, signal.SIGKILL)  # the cell's own session: it and its workers
            except ProcessLookupError:
                pass
            run.proc.wait()
        run.log.close()


__all__ = ["Case", "Cell", "CellResult", "SweepError", "SweepResult", "SweepSpec", "available_cores", "cell_name",
           "cell_state", "default_out", "load_sweep", "parse_sweep", "plan_cells", "run_sweep", "simulate_command",
           "spawn_cell", "stoppable", "write_index"]
