"""The ``p2pfl`` command line. Subcommands import what they need lazily so start-up stays fast."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
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
             resume: Annotated[bool, typer.Option("--resume", help="continue an interrupted run in --out from "
                                                  "the last round every peer checkpointed")] = False,
             verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    """Run every peer of CONFIG in one process (in-memory transport) and write a run folder."""
    _setup_logging(verbose)
    cfg = _load(config, set, rounds)
    from p2pfl.simulation import simulate as run_sim

    run_dir = out or default_run_dir(cfg.name, cfg.algorithm_name)
    try:
        summary = run_sim(cfg, run_dir, progress=not quiet, resume=resume)
    except (ValueError, RuntimeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    print_summary(summary, run_dir)


@app.command()
def node(config: ConfigOpt, peer: Annotated[str, typer.Option("--peer", help="this peer's id in the topology")],
         out: Annotated[Path, typer.Option(help="run folder (metrics-<peer>.jsonl, checkpoints/)")] = Path("runs/node"),
         certs: Annotated[Path | None, typer.Option(help="folder made by `p2pfl certs` (mutual TLS)")] = None,
         insecure: Annotated[bool, typer.Option("--insecure", help="plaintext gRPC (explicit opt-in)")] = False,
         threads: Annotated[int, typer.Option(help="torch CPU threads (1 = bitwise equal to simulate)")] = 1,
         set: SetOpt = None, verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    """Run one peer: serve its gRPC peer service and run its rounds (resumes from its checkpoint)."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format=f"%(asctime)s %(levelname)s [{peer}] %(name)s: %(message)s")
    cfg = _load(config, set)
    from p2pfl.standalone import node_main

    try:
        code = node_main(cfg, peer, out, certs, insecure, threads)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    raise typer.Exit(code)


@app.command()
def launch(config: ConfigOpt, out: Annotated[Path | None, typer.Option(help="run folder")] = None,
           insecure: Annotated[bool, typer.Option("--insecure", help="plaintext gRPC (explicit opt-in)")] = False,
           timeout: Annotated[float | None, typer.Option(help="kill peers still running after this many seconds")] = None,
           set: SetOpt = None, verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    """Start one `p2pfl node` process per peer on loopback (mutual TLS with generated certs)."""
    _setup_logging(verbose)
    cfg = _load(config, set)
    from p2pfl.standalone import launch as run_launch

    run_dir = out or default_run_dir(cfg.name, cfg.algorithm_name + "-launch")
    try:
        summary = run_launch(config, cfg, run_dir, list(set or []), insecure=insecure, timeout_s=timeout, verbose=verbose)
    except (ValueError, RuntimeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    print_summary(summary, run_dir)
    if summary["failed_peers"]:
        typer.echo(f"error: peers failed: {summary['failed_peers']}", err=True)
        raise typer.Exit(1)


@app.command()
def certs(config: ConfigOpt, out: Annotated[Path, typer.Option(help="folder for ca.crt and <peer>.crt/.key")],
          host: Annotated[list[str] | None, typer.Option(help="extra SAN host/IP for every peer (repeatable)")] = None,
          set: SetOpt = None) -> None:
    """Make a CA and one certificate per peer id of CONFIG's topology (mutual TLS)."""
    cfg = _load(config, set)
    from p2pfl.security.certs import make_certs
    from p2pfl.topology import TopologyError, load_topology

    try:
        topo = load_topology(cfg.topology)
    except TopologyError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    hosts = {pid: [topo.address(pid).rpartition(":")[0], *(host or [])] for pid in topo.ids}
    make_certs(list(topo.ids), out, hosts=hosts)
    typer.echo(f"wrote CA and {len(topo.ids)} peer certificates to {out}")


@app.command()
def health(address: Annotated[str, typer.Argument(help="host:port of a peer")],
           certs: Annotated[Path | None, typer.Option(help="certificate folder")] = None,
           peer: Annotated[str | None, typer.Option(help="our own peer id (client certificate)")] = None,
           target: Annotated[str | None, typer.Option(help="the checked peer's id (default: --peer)")] = None,
           insecure: Annotated[bool, typer.Option("--insecure")] = False) -> None:
    """Exit 0 if the peer at ADDRESS reports SERVING on the gRPC health service."""
    from p2pfl.health import check_health

    try:
        ok = check_health(address, certs=certs, peer=peer, target=target, insecure=insecure)
    except (ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo("SERVING" if ok else "NOT SERVING")
    raise typer.Exit(0 if ok else 1)


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


# Commands whose modules are heavy (flwr, grpc) are registered only when invoked (or for --help),
# so `p2pfl simulate` does not pay for importing Flower. name -> (module, function)
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "flower": ("peers.flower", "flower_command"),
    "compose": ("p2pfl.deploy.compose", "compose_command"),
    "sweep": ("p2pfl.sweep_cli", "sweep_command"),
    "report": ("p2pfl.sweep_cli", "report_command"),
}


def _mount(argv: list[str] | None = None) -> None:
    import importlib

    from p2pfl.topology.cli import app as topology_app

    if not any(g.name == "topology" for g in app.registered_groups):
        app.add_typer(topology_app, name="topology", help="generate, check and draw topology files")
    args = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
    # typer leaves CommandInfo.name unset for @app.command(); the command is then the function's name
    have = {c.name or (c.callback.__name__.replace("_", "-") if c.callback else None) for c in app.registered_commands}
    if args and (args[0] in have or args[0] == "topology"):
        return  # an eager command (e.g. simulate) needs none of the lazy ones: no flwr, no grpc
    wanted = [args[0]] if args and args[0] in LAZY_COMMANDS else list(LAZY_COMMANDS)
    for name in wanted:
        if name not in have:
            module, func = LAZY_COMMANDS[name]
            app.command(name)(getattr(importlib.import_module(module), func))


def main() -> None:
    _mount()
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
