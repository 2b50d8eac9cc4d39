"""Sweeps (plan, validate, run in parallel subprocesses, resume, record failures) and reports.

One tiny sweep (``local`` and ``dfedavg`` x seeds 1 and 2, 2 rounds) runs once per module and is
shared: the resume, report and CLI tests read or rerun parts of it. Each cell is a real
``p2pfl simulate`` subprocess, which is what makes a sweep robust, so the cost here is mostly
interpreter start-up (a few seconds a cell).
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from p2pfl.cli.sweep import register
from p2pfl.report import find_runs, make_report
from p2pfl.runfolder import read_metrics
from p2pfl.sweep import SweepError, available_cores, cell_name, load_sweep, parse_sweep, plan_cells, run_sweep
from tests.conftest import tiny_config

CELLS = ["local__seed=1", "local__seed=2", "dfedavg__seed=1", "dfedavg__seed=2"]


def _app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def _write_sweep(folder: Path, **body: object) -> Path:
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "tiny-sweep", "base": "config.yaml", **body}, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """Run the shared sweep once through the CLI; return (sweep file, sweep folder, CLI output)."""
    folder = tmp_path_factory.mktemp("sweep")
    tiny_config(folder, rounds=2)
    sweep = _write_sweep(folder, set=["rounds=2"],
                         cases=[{"name": "local", "set": ["algorithm.name=local"]},
                                {"name": "dfedavg", "set": {"algorithm.name": "dfedavg"}}],
                         grid={"seed": [1, 2]})
    out = folder / "out"
    res = CliRunner().invoke(_app(), ["sweep", str(sweep), "--out", str(out), "--jobs", "2", "-q"])
    assert res.exit_code == 0, res.output
    return sweep, out, res.output


@pytest.mark.timeout(300)
def test_sweep_runs_every_cell(swept: tuple[Path, Path, str]) -> None:
    _, out, output = swept
    assert "4 run now" in output
    for name in CELLS:
        cell = out / name
        for f in ("summary.json", "metrics.jsonl", "config.yaml", "log.txt"):
            assert (cell / f).is_file(), (name, f)
        cfg = yaml.safe_load((cell / "config.yaml").read_text())
        algo, seed = name.split("__seed=")
        assert cfg["algorithm"]["name"] == algo and cfg["seed"] == int(seed) and cfg["rounds"] == 2
        # two jobs share the cores: each cell's workers were lowered to fit
        assert cfg["simulation"]["workers"] <= max(1, available_cores() // 2)
        assert Path(cfg["topology"]).is_absolute()
    index = json.loads((out / "sweep.json").read_text())
    assert [c["name"] for c in index["cells"]] == CELLS
    assert {c["status"] for c in index["cells"]} == {"done"}
    assert index["cells"][0]["overrides"] == ["rounds=2", "algorithm.name=local", "seed=1"]


@pytest.mark.timeout(300)
def test_rerun_runs_nothing(swept: tuple[Path, Path, str]) -> None:
    sweep, out, _ = swept
    before = {n: (out / n / "summary.json").stat().st_mtime_ns for n in CELLS}
    # another --jobs changes simulation.workers, which cannot change results: still finished
    result = run_sweep(load_sweep(sweep), out, jobs=1, progress=False)
    assert result.ran == 0 and result.count("finished") == 4
    assert {n: (out / n / "summary.json").stat().st_mtime_ns for n in CELLS} == before


def _results(cell: Path) -> list[tuple]:
    """What a run computed (timings aside) per record."""
    return [(r["round"], r["peer"], r["acc"], r["loss"], r["bytes_sent"], r["consensus_dist"])
            for r in read_metrics(cell / "metrics.jsonl")]


@pytest.mark.timeout(300)
def test_interrupted_cell_is_rerun_cleanly(swept: tuple[Path, Path, str]) -> None:
    sweep, out, _ = swept
    cell = out / "dfedavg__seed=2"
    metrics = _results(cell)
    untouched = (out / "local__seed=1" / "summary.json").stat().st_mtime_ns
    (cell / "summary.json").unlink()
    (cell / "junk.txt").write_text("left by a killed run")
    (cell / "metrics.jsonl").write_text('{"round": 0, "peer": "p0", "acc": 0.0}\n')  # half-written
    result = run_sweep(load_sweep(sweep), out, jobs=2, progress=False)
    assert [r.cell.name for r in result.cells if r.status == "done"] == ["dfedavg__seed=2"]
    assert result.ran == 1 and not result.failed
    assert not (cell / "junk.txt").exists() and (cell / "summary.json").is_file()
    assert _results(cell) == metrics  # same seed, same results
    assert (out / "local__seed=1" / "summary.json").stat().st_mtime_ns == untouched


@pytest.mark.timeout(300)
def test_failing_cell_is_reported_and_others_finish(tmp_path: Path) -> None:
    tiny_config(tmp_path, rounds=2)
    # noise < 0 passes config validation and fails only when the dataset is built, in the cell
    sweep = _write_sweep(tmp_path, cases=[{"name": "ok", "set": []},
                                          {"name": "broken", "set": ["data.params.noise=-1"]}])
    out = tmp_path / "out"
    res = CliRunner().invoke(_app(), ["sweep", str(sweep), "--out", str(out), "-j", "2", "-q"])
    assert res.exit_code == 1, res.output
    assert "broken" in res.output and "noise" in res.output
    assert (out / "ok" / "summary.json").is_file()
    assert not (out / "broken" / "summary.json").exists()
    assert "noise must be >= 0" in (out / "broken" / "error.txt").read_text()
    assert "noise" in (out / "broken" / "log.txt").read_text()
    status = {c["name"]: (c["status"], c["error"]) for c in json.loads((out / "sweep.json").read_text())["cells"]}
    assert status["ok"] == ("done", None)
    assert status["broken"][0] == "failed" and "noise" in status["broken"][1]


@pytest.mark.parametrize(("grid", "cases", "message"), [
    ({"data.partitoin.pi": [0.1]}, None, "data.partitoin: unknown key"),
    ({"rounds": [2, 0]}, None, "cell rounds=0: rounds: must be >= 1"),
    ({"algorithm.name": ["local", "nosuch"]}, None, "unknown algorithm 'nosuch'"),
    ({"algorithm.lrr": [0.1]}, None, "algorithm.lrr: not a hyperparameter of"),
    ({"topology": ["missing.yaml"]}, None, "not found"),
    ({"seed": [1]}, [{"name": "a", "set": ["seed=2"]}], "both set ['seed']"),
    ({"seed": 1}, None, "non-empty list"),
])
def test_bad_sweep_is_refused_before_running(tmp_path: Path, grid: dict, cases: list | None, message: str) -> None:
    tiny_config(tmp_path, rounds=2)
    body: dict[str, object] = {"grid": grid}
    if cases:
        body["cases"] = cases
    sweep = _write_sweep(tmp_path, **body)
    out = tmp_path / "out"
    res = CliRunner().invoke(_app(), ["sweep", str(sweep), "--out", str(out)])
    assert res.exit_code == 2 and message in res.output, res.output  # 2: bad input
    assert not out.exists()  # nothing ran, not even a folder


def test_dry_run_lists_cells_and_runs_nothing(tmp_path: Path) -> None:
    tiny_config(tmp_path, rounds=2)
    sweep = _write_sweep(tmp_path, grid={"data.partition.alpha": [0.1, 1.0], "seed": [1, 2, 3]})
    out = tmp_path / "out"
    res = CliRunner().invoke(_app(), ["sweep", str(sweep), "--out", str(out), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "6 cells, 0 already finished, 6 to run" in res.output and not out.exists()
    cells = plan_cells(load_sweep(sweep), jobs=1, cores=2)
    assert cells[0].name == "data.partition.alpha=0.1__seed=1"
    assert cells[0].config["data"]["partition"] == {"kind": "dirichlet", "alpha": 0.1}


def test_cell_names_are_safe_and_deterministic() -> None:
    assert cell_name(None, {"topology": "topology/ring-8.yaml", "lr": 0.01}) == "topology=ring-8__lr=0.01"
    assert cell_name("deprl", {"data.partition": {"kind": "iid"}}) == 'deprl__data.partition=kind-iid'
    long = cell_name(None, {"x" * 80: "y" * 80})
    assert len(long) <= 100 and long == cell_name(None, {"x" * 80: "y" * 80})
    assert long != cell_name(None, {"x" * 80: "y" * 79 + "z"})
    assert "/" not in cell_name("a/b", {"k": "a b:c"})


def test_sweep_file_structure_errors(tmp_path: Path) -> None:
    with pytest.raises(SweepError, match="base config not found"):
        parse_sweep({"base": "nope.yaml"}, tmp_path / "s.yaml")
    tiny_config(tmp_path)
    with pytest.raises(SweepError, match="unknown keys"):
        parse_sweep({"base": "config.yaml", "grd": {}}, tmp_path / "s.yaml")
    with pytest.raises(SweepError, match="case names must be unique"):
        parse_sweep({"base": "config.yaml", "cases": [{"name": "a"}, {"name": "a"}]}, tmp_path / "s.yaml")
    with pytest.raises(SweepError, match="'order' must be one of cases, grid, got 'seeds'"):
        parse_sweep({"base": "config.yaml", "order": "seeds"}, tmp_path / "s.yaml")


def test_grid_order_runs_one_seed_of_every_case_first(tmp_path: Path) -> None:
    """``order: grid`` changes when a cell runs (a FIFO in plan order), never its name or config."""
    tiny_config(tmp_path, rounds=2)
    body = {"cases": [{"name": "local", "set": ["algorithm.name=local"]},
                      {"name": "dfedavg", "set": ["algorithm.name=dfedavg"]}], "grid": {"seed": [1, 2]}}
    by_case = plan_cells(load_sweep(_write_sweep(tmp_path, **body)), jobs=1, cores=2)
    by_grid = plan_cells(load_sweep(_write_sweep(tmp_path, order="grid", **body)), jobs=1, cores=2)
    assert [c.name for c in by_case] == ["local__seed=1", "local__seed=2", "dfedavg__seed=1", "dfedavg__seed=2"]
    assert [c.name for c in by_grid] == ["local__seed=1", "dfedavg__seed=1", "local__seed=2", "dfedavg__seed=2"]
    assert {c.name: c.config for c in by_grid} == {c.name: c.config for c in by_case}


def _expected(out: Path, algo: str) -> tuple[list[float], list[list[float]]]:
    """Straight from metrics.jsonl: per seed, the final mean accuracy and the per-round means."""
    finals, curves = [], []
    for seed in (1, 2):
        recs = read_metrics(out / f"{algo}__seed={seed}" / "metrics.jsonl")
        rounds = sorted({r["round"] for r in recs})
        curve = [statistics.fmean(r["acc"] for r in recs if r["round"] == k) for k in rounds]
        finals.append(curve[-1])
        curves.append(curve)
    return finals, curves


@pytest.mark.timeout(300)
def test_report_groups_seeds(swept: tuple[Path, Path, str], tmp_path: Path) -> None:
    _, out, _ = swept
    finals, curves = _expected(out, "dfedavg")
    mean_curve = [statistics.fmean(c) for c in zip(*curves, strict=True)]
    target = mean_curve[1]  # the seed-mean reaches this exactly at round 2, not before
    assert mean_curve[0] < target
    rep = make_report([out], tmp_path / "rep", target=target)
    assert len(find_runs([out])) == 4
    assert rep.columns == ["algorithm.name"]
    groups = {g.values["algorithm.name"]: g for g in rep.groups}
    assert set(groups) == {"local", "dfedavg"}
    g = groups["dfedavg"]
    mean, std = g.final()
    assert mean == pytest.approx(statistics.fmean(finals)) and std == pytest.approx(statistics.stdev(finals))
    assert g.rounds_to(target)[0] == 2
    assert g.best()[0] == pytest.approx(statistics.fmean(max(c) for c in curves))
    local_finals, _ = _expected(out, "local")
    assert groups["local"].final()[0] == pytest.approx(statistics.fmean(local_finals))
    assert groups["local"].bytes_sent() == 0 and g.bytes_sent() > 0
    row = next(line for line in rep.markdown.splitlines() if line.startswith("| dfedavg"))
    assert f"{100 * statistics.fmean(finals):.2f} ± {100 * statistics.stdev(finals):.2f}" in row
    assert "| 2 " in row  # rounds to target; and the seed count

    unreachable = make_report([out], tmp_path / "rep2", target=1.01 * max(max(c) for c in curves), plots=False)
    assert all("—" in line for line in unreachable.markdown.splitlines()[2:] if line.startswith("| dfedavg"))

    with open(tmp_path / "rep" / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and {r["algorithm.name"] for r in rows} == {"local", "dfedavg"}
    by_run = {Path(r["run"]).name: r for r in rows}
    assert float(by_run["dfedavg__seed=1"]["final_acc"]) == pytest.approx(finals[0])
    assert by_run["dfedavg__seed=2"]["seed"] == "2"
    for name in ("report.md", "accuracy_vs_round.png", "accuracy_vs_bytes.png"):
        assert (tmp_path / "rep" / name).stat().st_size > 0
    assert "sample std" in (tmp_path / "rep" / "report.md").read_text()


@pytest.mark.timeout(300)
def test_report_cli_by_key_and_errors(swept: tuple[Path, Path, str], tmp_path: Path) -> None:
    _, out, _ = swept
    res = CliRunner().invoke(_app(), ["report", str(out), "--out", str(tmp_path), "--by", "seed", "--target", "50"])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("| ")]
    assert lines[0].split("|")[1].strip() == "seed" and "runs" in lines[0] and "rounds to 50%" in lines[0]
    assert len(lines) == 3  # header + seeds 1 and 2, each grouping both algorithms
    res = CliRunner().invoke(_app(), ["report", str(out), "--by", "no.such.key"])
    assert res.exit_code == 2 and "no.such.key" in res.output  # bad input: one line, exit 2
    res = CliRunner().invoke(_app(), ["report", str(tmp_path / "empty")])
    assert res.exit_code == 2 and res.output.count("error: ") == 1


def test_a_finished_cell_whose_topology_path_is_gone_is_judged_by_its_run_folders_copy(tmp_path: Path) -> None:
    """run.sh runs cells from code snapshots under runs/ (``code-<sha>/``), which a fresh checkout lacks:
    such a cell still counts as finished if the topology copy its run folder holds has the planned graph
    (addresses, kept apart from the graph, may differ), and not otherwise."""
    from p2pfl import sweep
    from p2pfl.config import parse_config
    from p2pfl.topology import generate

    planned_cfg = tiny_config(tmp_path)  # its own ring-4 topology file
    planned = sweep._normalize(parse_config(yaml.safe_load(planned_cfg.read_text())).raw)
    cell = tmp_path / "runs" / "cell"
    cell.mkdir(parents=True)
    (cell / "summary.json").write_text("{}")
    (cell / "metrics.jsonl").write_text("")
    saved = {**yaml.safe_load(planned_cfg.read_text()),
             "topology": "/elsewhere/runs/reproduce/code-0123456789ab/topology/ring-4.yaml"}
    (cell / "config.yaml").write_text(yaml.safe_dump(saved))
    assert sweep.cell_state(cell, planned) == "interrupted"  # no copy: nothing shows the graph it ran on
    for topo, state in ((generate("ring", 4, base_port=60000), "finished"), (generate("ring", 5), "interrupted")):
        topo.dump(cell / sweep.RUN_TOPOLOGY)
        assert (cell / sweep.RUN_TOPOLOGY).read_bytes() != Path(planned["topology"]).read_bytes()
        assert sweep.cell_state(cell, planned) == state, topo.name
    # a changed hyperparameter is still a changed cell
    generate("ring", 4, base_port=60000).dump(cell / sweep.RUN_TOPOLOGY)
    (cell / "config.yaml").write_text(yaml.safe_dump({**saved, "seed": 99}))
    assert sweep.cell_state(cell, planned) == "stale"


def test_a_cell_run_with_a_default_spelled_out_is_the_planned_cell(tmp_path: Path) -> None:
    """A cell run by hand with ``--set simulation.engine=exact`` (the default) counts as the sweep's
    finished cell; one run with the batched engine does not (its numbers differ by float rounding)."""
    from p2pfl import sweep
    from p2pfl.config import parse_config

    planned_cfg = tiny_config(tmp_path)
    raw = yaml.safe_load(planned_cfg.read_text())
    planned = sweep._normalize(parse_config(raw).raw)
    assert "engine" not in planned.get("simulation", {})
    cell = tmp_path / "runs" / "cell"
    cell.mkdir(parents=True)
    (cell / "summary.json").write_text("{}")
    (cell / "metrics.jsonl").write_text("")
    for engine, state in (("exact", "finished"), ("batched", "stale")):
        saved = {**raw, "simulation": {**raw.get("simulation", {}), "engine": engine}}
        (cell / "config.yaml").write_text(yaml.safe_dump(saved))
        assert sweep.cell_state(cell, planned) == state, engine
    for tf32, state in ((False, "finished"), (True, "stale")):  # tf32 (GPU precision): false is the default
        (cell / "config.yaml").write_text(yaml.safe_dump({**raw, "tf32": tf32}))
        assert sweep.cell_state(cell, planned) == state, tf32


def test_a_second_sweep_into_the_same_folder_is_refused_before_it_runs(tmp_path: Path) -> None:
    """Two sweeps into one folder would run the same pending cell into one cell folder: while one
    holds the folder, another is refused in one line, and nothing of it is written."""
    import fcntl

    from p2pfl.sweep import SweepError, parse_sweep, run_sweep

    cfg = tiny_config(tmp_path, rounds=1)
    spec = parse_sweep({"name": "locked", "base": str(cfg), "grid": {"seed": [1, 2]}}, tmp_path / "s.yaml")
    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".sweep.lock", "a") as held:  # what a running sweep holds
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SweepError, match="another p2pfl sweep is running into this folder"):
            run_sweep(spec, out, progress=False)
        assert sorted(p.name for p in out.iterdir()) == [".sweep.lock"]
        assert run_sweep(spec, out, dry_run=True, progress=False).cells  # a dry run only reads


@pytest.mark.timeout(300)
def test_only_runs_the_selected_cells_and_leaves_the_others_alone(tmp_path: Path) -> None:
    """``--only`` runs one cell of a sweep into its folder (a seed cut off elsewhere, say); the other
    cells, even an interrupted one, are not touched, and a later full run counts the cell finished."""
    tiny_config(tmp_path, rounds=2)
    sweep = _write_sweep(tmp_path, set=["rounds=2"], cases=[{"name": "local", "set": ["algorithm.name=local"]},
                                                            {"name": "dfedavg", "set": ["algorithm.name=dfedavg"]}],
                         grid={"seed": [1, 2]})
    out = tmp_path / "out"
    (out / "local__seed=2").mkdir(parents=True)
    (out / "local__seed=2" / "junk.txt").write_text("an interrupted attempt")
    res = CliRunner().invoke(_app(), ["sweep", str(sweep), "--out", str(out), "-q", "--only", "dfedavg__seed=1"])
    assert res.exit_code == 0, res.output
    assert "1 run now" in res.output and "3 not selected by --only" in res.output
    assert (out / "dfedavg__seed=1" / "summary.json").is_file()
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["dfedavg__seed=1", "local__seed=2"]
    assert (out / "local__seed=2" / "junk.txt").is_file()  # unselected: not cleaned, not rerun
    index = {c["name"]: c["status"] for c in json.loads((out / "sweep.json").read_text())["cells"]}
    assert index == {"local__seed=1": "unselected", "local__seed=2": "unselected",
                     "dfedavg__seed=1": "done", "dfedavg__seed=2": "unselected"}
    # two globs select their union; the finished cell stays finished
    dry = run_sweep(load_sweep(sweep), out, dry_run=True, only=["dfedavg__*", "*seed=1"])
    assert {r.cell.name: r.status for r in dry.cells} == {
        "local__seed=1": "planned", "local__seed=2": "unselected", "dfedavg__seed=1": "finished",
        "dfedavg__seed=2": "planned"}
    # a glob that matches nothing is a typo: refused (exit 2), nothing written
    before = (out / "sweep.json").read_text()
    bad = CliRunner().invoke(_app(), ["sweep", str(sweep), "--out", str(out), "-q", "--only", "dpsgd__*"])
    assert bad.exit_code == 2 and "--only 'dpsgd__*': matches none of the sweep's 4 cells" in bad.output
    assert (out / "sweep.json").read_text() == before
