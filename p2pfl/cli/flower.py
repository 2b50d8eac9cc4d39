"""``p2pfl flower``: a centralized baseline (FedAvg, FedPer, FedRep, Ditto) of a config, on Flower's runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="experiment config YAML")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="override a config value: dotted.key=VALUE (repeatable)")]


def flower_command(config: ConfigOpt, rounds: Annotated[int | None, typer.Option(help="override rounds")] = None,
                   out: Annotated[Path | None, typer.Option(help="run folder")] = None, set: SetOpt = None,
                   baseline: Annotated[str, typer.Option(
                       help="fedavg (whole model averaged) | fedper (body averaged, joint local rule) | "
                            "fedrep (body averaged, head-then-body local rule) | "
                            "ditto (global model averaged; each node's personal model evaluated) | "
                            "fedrod (body + generic head averaged; generic + personal head evaluated)")] = "fedper",
                   runtime: Annotated[str, typer.Option(
                       help="auto (Ray when installed) | ray (Flower's Simulation Runtime: this project's Flower App "
                            "under `flwr run`, on a SuperLink started for the run) | in-process")] = "auto",
                   resume: Annotated[bool, typer.Option("--resume", help="continue an interrupted run in --out from "
                                                        "the last round the server and every node checkpointed")] = False,
                   quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no summary table")] = False,
                   verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    """Centralized baseline: CONFIG's peers as Flower nodes under Flower's FedAvg (same data, models, local rule)."""
    from p2pfl.badinput import BadInput
    from p2pfl.centralized.baselines import run_baseline
    from p2pfl.cli.main import _load, _setup_logging, default_run_dir, print_summary

    _setup_logging(verbose)
    cfg = _load(config, set, rounds)
    run_dir = out or default_run_dir(cfg.name, f"flower-{baseline}-{cfg.algorithm_name}")
    try:
        summary = run_baseline(cfg, run_dir, baseline, runtime=runtime, verbose=verbose, resume=resume)
    except BadInput:
        raise  # one line, exit 2 (p2pfl.cli.main.main)
    except (ValueError, RuntimeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if not quiet:
        print_summary(summary, run_dir)
    typer.echo(f"runtime: {summary['runtime']}")
