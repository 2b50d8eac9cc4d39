"""``p2pfl sweep`` and ``p2pfl report``: typer commands, importing their work only when run.

Wire them into the main app with :func:`register` (or ``app.command("sweep")(sweep_command)`` and
``app.command("report")(report_command)``). This module imports nothing heavy at import time so
that ``p2pfl --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from p2pfl.badinput import EXIT_BAD_INPUT

if TYPE_CHECKING:
    from p2pfl.sweep import SweepResult


def sweep_command(
    sweep_file: Annotated[Path, typer.Argument(help="sweep YAML: base, set, grid, cases, name")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="sweep folder (default runs/sweeps/<name>)")] = None,
    jobs: Annotated[int, typer.Option("--jobs", "-j", min=1, help="cells run in parallel (one process each)")] = 1,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="validate and list the cells; run nothing")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar")] = False,
    only: Annotated[list[str] | None, typer.Option(
        "--only", help="run only the cells whose name matches this glob (repeatable), e.g. 'dpsgd__seed=1'")] = None,
) -> None:
    """Run every cell of SWEEP_FILE (base config x cases x grid), resuming what is already done."""
    from p2pfl.sweep import SweepError, default_out, load_sweep, run_sweep, stoppable

    stoppable()  # kill -TERM (or -INT, even in the background) stops the cells cleanly, resumable
    try:
        spec = load_sweep(sweep_file)
        result = run_sweep(spec, out, jobs=jobs, dry_run=dry_run, progress=not quiet, only=only)
    except SweepError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None  # bad input: nothing ran
    except KeyboardInterrupt:
        typer.echo("interrupted: rerun the same command to resume", err=True)
        raise typer.Exit(130) from None
    folder = out or default_out(spec)
    stale = [r.cell.name for r in result.cells if r.found == "stale" and r.status != "unselected"]
    extended = [r.cell.name for r in result.cells if r.found == "extendable" and r.status != "unselected"]
    if dry_run:
        _print_cells(result, len(spec.overrides))
        todo = sum(1 for r in result.cells if r.status == "planned")
        finished, left = result.count("finished"), result.count("unselected")
        typer.echo(f"{len(result.cells)} cells, {finished} already finished, {todo} to run "
                   f"into {folder}" + (f" ({len(stale)} finished with another config would be rerun)" if stale else "")
                   + (f" ({len(extended)} finished with fewer rounds would be extended)" if extended else "")
                   + (f", {left} not selected by --only" if left else ""))
        return
    if stale:
        typer.echo(f"note: reran {len(stale)} cells whose saved config differed from the sweep: {', '.join(stale)}",
                   err=True)
    if extended:
        typer.echo(f"note: extended {len(extended)} finished cells to the sweep's rounds: {', '.join(extended)}",
                   err=True)
    left = result.count("unselected")
    typer.echo(f"{len(result.cells)} cells: {result.count('done')} run now, {result.count('finished')} already "
               f"finished, {len(result.failed)} failed" + (f", {left} not selected by --only" if left else "")
               + f"; folder {folder} (index: sweep.json)")
    if result.failed:
        for r in result.failed:
            typer.echo(f"failed: {r.cell.name}: {r.error} (see {folder / r.cell.name / 'error.txt'})", err=True)
        raise typer.Exit(1)


def _print_cells(result: SweepResult, n_common: int) -> None:
    """The cells and what is particular to each (the sweep-wide ``set`` is the same for all)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="sweep cells")
    table.add_column("cell", overflow="fold")
    table.add_column("status")
    table.add_column("its overrides", overflow="fold")
    for r in result.cells:
        table.add_row(r.cell.name, r.status, " ".join(r.cell.overrides[n_common:]))
    Console().print(table)


def report_command(
    dirs: Annotated[list[Path], typer.Argument(help="run folders, or folders holding them (searched recursively)")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="where report.md/.csv and plots go "
                                              "(default: the folder given, or ./report for several)")] = None,
    target: Annotated[float | None, typer.Option("--target", help="target accuracy for rounds-to-target, "
                                                 "0-1 or a percentage")] = None,
    by: Annotated[list[str] | None, typer.Option("--by", help="group by these config keys instead of "
                                                 "'all but seed' (repeatable or comma-separated)")] = None,
) -> None:
    """Tabulate and plot runs: mean ± std over seeds, rounds to a target accuracy, bytes per peer."""
    from p2pfl.report import ReportError, make_report

    keys = [k.strip() for item in by or [] for k in item.split(",") if k.strip()]
    folder = out or (dirs[0] if len(dirs) == 1 else Path("report"))
    try:
        rep = make_report(dirs, folder, target=target, by=keys or None)
    except ReportError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    typer.echo(rep.markdown)
    for w in rep.warnings:
        typer.echo(f"warning: {w}", err=True)
    typer.echo(f"\nwrote {', '.join(str(p) for p in rep.files)}")


def register(app: typer.Typer) -> None:
    """Add ``sweep`` and ``report`` to a typer app (the main ``p2pfl`` app)."""
    app.command("sweep")(sweep_command)
    app.command("report")(report_command)


__all__ = ["register", "report_command", "sweep_command"]
