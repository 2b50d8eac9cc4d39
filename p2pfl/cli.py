"""The ``p2pfl`` command line. Subcommands import what they need lazily so start-up stays fast."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Peer-to-peer personalized federated learning: simulate, run peers, deploy.")

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="experiment config YAML")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="override a config value: dotted.key=VALUE (repeatable)")]


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _load(config: Path, sets: list[str] | None, rounds: int | None = None):
    from p2pfl.config import ConfigError, load_config

    extra = list(sets or [])
    if rounds is not None:
        extra.append(f"rounds={rounds}")
    try:
        return load_config(config, extra)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


def default_run_dir(name: str, algorithm: str) -> Path:
    return Path("runs") / f"{name}-{algorithm}-{time.strftime('%Y%m%d-%H%M%S')}"


@app.command()
def simulate(config: ConfigOpt, rounds: Annotated[int | None, typer.Option(help="override rounds")] = None,
             out: Annotated[Path | None, typer.Option(help="run folder")] = None, set: SetOpt = None,
             quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar")] = False,
             verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    """Run every peer of CONFIG in one process (in-memory transport) and write a run folder."""
    _setup_logging(verbose)
    cfg = _load(config, set, rounds)
    from p2pfl.simulation import simulate as run_sim

    run_dir = out or default_run_dir(cfg.name, cfg.algorithm_name)
    try:
        summary = run_sim(cfg, run_dir, progress=not quiet)
    except (ValueError, RuntimeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    print_summary(summary, run_dir)


def print_summary(summary: dict, run_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{summary.get('name')} / {summary.get('algorithm')}: personalized accuracy")
    for col in ("rounds", "peers", "mean", "min", "max", "s/round", "MB sent/peer"):
        table.add_column(col, justify="right")

    def pct(v):
        return "-" if v is None else f"{100 * v:.2f}%"

    table.add_row(str(summary["rounds"]), str(summary["peers"]), pct(summary["final_acc_mean"]),
                  pct(summary["final_acc_min"]), pct(summary["final_acc_max"]),
                  f"{summary.get('wall_seconds_per_round') or 0:.2f}", f"{summary['bytes_sent_per_peer'] / 1e6:.2f}")
    console = Console()
    console.print(table)
    console.print(f"run folder: {run_dir}")


def _mount() -> None:
    from p2pfl.topology.cli import app as topology_app

    app.add_typer(topology_app, name="topology", help="generate, check and draw topology files")


def main() -> None:
    _mount()
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
