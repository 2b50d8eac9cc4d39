"""``p2pfl watch``: a live table of a run folder or a deployment (the snapshots are ``p2pfl.watch``)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer

from p2pfl.watch import PeerView, snapshot_compose, snapshot_run_dir


def watch_command(
    run_dir: Annotated[Path | None, typer.Argument(help="run folder (metrics-<peer>.jsonl or metrics.jsonl)")] = None,
    compose: Annotated[Path | None, typer.Option(
        "--compose", help="a compose file written by 'p2pfl compose': scrape its peers' /metrics")] = None,
    once: Annotated[bool, typer.Option("--once", help="print the state once and exit")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="with --once: one JSON object instead of a table")] = False,
    interval: Annotated[float, typer.Option(min=0.2, help="seconds between refreshes")] = 2.0,
) -> None:
    """Show each peer's round, accuracy and down links, live (or --once) for a run folder or a deployment."""
    if (run_dir is None) == (compose is None):
        typer.echo("error: give a run folder or --compose FILE (one of them)", err=True)
        raise typer.Exit(2)
    if run_dir is not None and not run_dir.is_dir():
        typer.echo(f"error: run folder {run_dir} not found", err=True)
        raise typer.Exit(2)

    def snap() -> list[PeerView]:
        return snapshot_compose(compose) if compose is not None else snapshot_run_dir(run_dir)

    title = f"p2pfl: {compose or run_dir}"
    try:
        views = snap()
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if once:
        if as_json:
            typer.echo(json.dumps({"peers": [asdict(v) for v in views]}, sort_keys=True))
        else:
            from rich.console import Console

            Console().print(_table(views, title))
        return
    from rich.live import Live

    with Live(_table(views, title), refresh_per_second=4, screen=False) as live:
        try:
            while not views or not all(v.state == "finished" for v in views):
                time.sleep(interval)
                views = snap()
                live.update(_table(views, title))
        except KeyboardInterrupt:
            pass


def _table(views: list[PeerView], title: str) -> Any:
    from rich.table import Table

    table = Table(title=title)
    for col, justify in (("peer", "left"), ("round", "right"), ("acc", "right"), ("loss", "right"),
                         ("MB sent", "right"), ("links down", "left"), ("state", "left")):
        table.add_column(col, justify=justify)
    colours = {"finished": "green", "running": "cyan", "down": "red", "waiting": "yellow"}
    for v in views:
        rnd = "-" if v.round is None else f"{v.round + 1}/{v.rounds}" if v.rounds else str(v.round + 1)
        state = v.state + (f" (resumed at {v.resumed_from})" if v.resumed_from is not None else "")
        table.add_row(v.peer, rnd, "-" if v.acc is None else f"{100 * v.acc:.2f}%",
                      "-" if v.loss is None else f"{v.loss:.4f}", f"{v.mb_sent:.2f}",
                      ", ".join(v.links_down) or "-", f"[{colours.get(v.state, 'white')}]{state}[/]")
    return table

