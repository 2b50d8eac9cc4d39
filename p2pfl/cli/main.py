"""The ``p2pfl`` command line. Subcommands import what they need lazily so start-up stays fast."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import click
import typer
from typer.core import TyperGroup

from p2pfl.badinput import EXIT_BAD_INPUT, BadInput
from p2pfl.storage import StorageError


class _Refused(click.ClickException):
    """Bad input as click reports it: ``error: <one line>`` on stderr, exit status 2."""

    exit_code = EXIT_BAD_INPUT

    def show(self, file=None) -> None:  # noqa: ANN001 - click's signature
        typer.echo(f"error: {self.message}", err=True)


class _Group(TyperGroup):
    """Every command (and sub-app) of ``p2pfl``: a `BadInput` anywhere becomes one line and exit 2,
    with the traceback only under ``--debug`` / ``P2PFL_DEBUG=1``."""

    def invoke(self, ctx: click.Context):  # noqa: ANN201 - click's signature
        try:
            return super().invoke(ctx)
        except BadInput as exc:
            if os.environ.get("P2PFL_DEBUG") == "1":
                import traceback

                traceback.print_exc()
            raise _Refused(str(exc)) from None


app = typer.Typer(cls=_Group, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Peer-to-peer personalized federated learning: simulate, run peers, deploy. A peer runs "
                       "a built-in algorithm, or your own Flower App or ClientApp (Message API or NumPyClient): "
                       "name it in the config, app: path/to/your-flower-app (docs/flower.md).")

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="experiment config YAML")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="override a config value: dotted.key=VALUE (repeatable)")]
AcceptChangeOpt = Annotated[bool, typer.Option(
    "--accept-config-change", help="resume although the config differs from the one the checkpoints were "
    "written with (recorded in the run folder's config-changes.jsonl)")]
AddressesOpt = Annotated[Path | None, typer.Option(
    "--addresses", help="address book (peer id -> host:port) placing the topology's peers; "
    "same as --set network.addresses=FILE")]


def _with_addresses(sets: list[str] | None, addresses: Path | None) -> list[str] | None:
    """``--addresses FILE`` as the override it stands for (so `launch` hands it on to its nodes)."""
    return sets if addresses is None else [*(sets or []), f"network.addresses={addresses}"]


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _load(config: Path, sets: list[str] | None, rounds: int | None = None):
    """Load and validate the whole experiment (a BadInput reaches main(): one line, exit 2)."""
    from p2pfl.config import load_config

    extra = list(sets or [])
    if rounds is not None:
        extra.append(f"rounds={rounds}")
    cfg = load_config(config, extra)
    for note in cfg.notes:
        typer.echo(f"note: {note}", err=True)
    return cfg


@contextmanager
def _no_leftovers(folder: Path, *, empty_only: bool = False):
    """Remove ``folder`` if this command created it and then failed on bad input (or left it empty).

    Only a folder that did not exist before the command is ever removed, so a resumed or user-made
    run folder is never touched.
    """
    from p2pfl.badinput import BadInput

    existed = folder.exists()
    try:
        yield
    except BaseException as exc:
        if not existed and folder.is_dir():
            if isinstance(exc, BadInput) and not empty_only:
                shutil.rmtree(folder, ignore_errors=True)
            elif not any(folder.iterdir()):
                folder.rmdir()
        raise


def _locate(exc: BadInput, config: Path) -> BadInput:
    """A refusal raised while the experiment is assembled (e.g. a partition that cannot be made
    from this dataset) names the config file and key like every other."""
    from p2pfl.data.partition import PartitionError

    if isinstance(exc, PartitionError) and not exc.key:
        exc.key = "data.partition"
    return exc.located(str(config))


@contextmanager
def _making(folder: Path, config: Path):
    """A command that makes a run folder from CONFIG: a refusal found while the experiment is
    assembled names the config (and leaves no folder behind, as any bad input); a run that fails
    (ValueError, RuntimeError) is one line on stderr and exit 1."""
    try:
        with _no_leftovers(folder):
            yield
    except BadInput as exc:
        _locate(exc, config)
        raise
    except typer.Exit:
        raise
    except StorageError as exc:  # a write to the run folder failed for checkpoint.storage_retry_s
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(exc.exit_code) from None
    except (ValueError, RuntimeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


def _check_peer(cfg, peer: str, certs: Path | None, insecure: bool) -> None:
    """`p2pfl node`: the peer is in the topology and its certificate files exist (before anything starts)."""
    from p2pfl.badinput import BadInput, suggest
    from p2pfl.topology import load_topology

    ids = load_topology(cfg.topology).ids
    if peer not in ids:
        close = suggest(peer, ids)
        raise BadInput(f"peer {peer!r} is not in topology {cfg.topology}", source="--peer",
                       allowed=ids if len(ids) <= 20 else f"{ids[0]} ... {ids[-1]} ({len(ids)} peers)",
                       hint=f"did you mean {close!r}?" if close else None)
    if insecure or cfg.network.insecure:
        return
    folder = certs if certs is not None else (Path(cfg.network.certs) if cfg.network.certs else None)
    if folder is None:
        raise BadInput("no certificates: pass --certs DIR (made by `p2pfl certs`) or --insecure for plaintext",
                       source="--certs")
    missing = [n for n in ("ca.crt", f"{peer}.crt", f"{peer}.key") if not (folder / n).is_file()]
    if missing:
        raise BadInput(f"{', '.join(missing)} not found in {folder}", source="--certs",
                       hint=f"make them with `p2pfl certs -c CONFIG --out {folder}`")
    from p2pfl.security.certs import TLSConfig, check_own_certificate

    check_own_certificate(TLSConfig.load(folder, peer))  # another CA's, expired, another id's: refused here


def default_run_dir(name: str, algorithm: str) -> Path:
    return Path("runs") / f"{name}-{algorithm}-{time.strftime('%Y%m%d-%H%M%S')}"


@app.command()
def simulate(config: ConfigOpt, rounds: Annotated[int | None, typer.Option(help="override rounds")] = None,
             out: Annotated[Path | None, typer.Option(help="run folder")] = None, set: SetOpt = None,
             quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar")] = False,
             resume: Annotated[bool, typer.Option("--resume", help="continue an interrupted run in --out from "
                                                  "the last round every peer checkpointed, or extend a finished "
                                                  "one to more rounds")] = False,
             verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
             accept_config_change: AcceptChangeOpt = False) -> None:
    """Run every peer of CONFIG (in-memory transport, peers sharded over `simulation.workers` ranks) and
    write a run folder. Under torchrun each process is a rank: `torchrun --nproc-per-node K $(which p2pfl)
    simulate -c CONFIG --out RUN` (docs/scale.md)."""
    _setup_logging(verbose)
    cfg = _load(config, set, rounds)
    from p2pfl.engine.exact import one_malloc_arena
    from p2pfl.procgroup import end_launched_rank, launched
    from p2pfl.simulation import simulate as run_sim

    if launched() and out is None:  # every rank must name the same folder: torchrun's run id, not the time
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        if run_id == "none" or not run_id.replace("-", "").replace("_", "").isalnum():
            from p2pfl.badinput import BadInput

            raise BadInput("under torchrun without a run id (--rdzv-id) every rank must be given the run folder",
                           source="--out", hint="pass --out RUN (on a filesystem every host sees)")
        out = Path("runs") / f"{cfg.name}-{cfg.algorithm_name}-{run_id}"
    one_malloc_arena()  # before the progress bar's thread, so the forked ranks inherit one arena
    run_dir = out or default_run_dir(cfg.name, cfg.algorithm_name)
    with _making(run_dir, config):
        summary = run_sim(cfg, run_dir, progress=not quiet, resume=resume, accept_config_change=accept_config_change)
    if summary:  # rank 0 (the other ranks of a torchrun launch return nothing)
        print_summary(summary, run_dir)
    elif launched():  # a torchrun rank other than 0, its part done: end as a forked rank ends
        end_launched_rank()


@app.command()
def node(config: ConfigOpt, peer: Annotated[str, typer.Option("--peer", help="this peer's id in the topology")],
         out: Annotated[Path, typer.Option(help="run folder (metrics-<peer>.jsonl, checkpoints/)")] = Path("runs/node"),
         certs: Annotated[Path | None, typer.Option(help="folder made by 'p2pfl certs' (mutual TLS)")] = None,
         insecure: Annotated[bool, typer.Option("--insecure", help="plaintext gRPC (explicit opt-in)")] = False,
         threads: Annotated[int, typer.Option(help="torch CPU threads (1 = bitwise equal to simulate)")] = 1,
         metrics_port: Annotated[int | None, typer.Option(
             "--metrics-port", min=0, max=65535, help="serve Prometheus /metrics on this port (off by default)")] = None,
         metrics_host: Annotated[str, typer.Option(
             "--metrics-host", help="address /metrics listens on (0.0.0.0 for a scraper on another host)")]
         = "127.0.0.1",
         set: SetOpt = None, verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
         addresses: AddressesOpt = None, accept_config_change: AcceptChangeOpt = False) -> None:
    """Run one peer: serve its gRPC peer service and run its rounds (resumes from its checkpoint)."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format=f"%(asctime)s %(levelname)s [{peer}] %(name)s: %(message)s")
    set = _with_addresses(set, addresses)
    cfg = _load(config, set)
    _check_peer(cfg, peer, certs, insecure)
    from p2pfl.node_process import node_main

    try:
        with _no_leftovers(out, empty_only=True):
            code = node_main(cfg, peer, out, certs, insecure, threads, metrics_port, metrics_host,
                             accept_config_change=accept_config_change)
    except BadInput:
        raise
    except StorageError as exc:  # a write to the run folder failed for checkpoint.storage_retry_s
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(exc.exit_code) from None
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    raise typer.Exit(code)


@app.command()
def launch(config: ConfigOpt, out: Annotated[Path | None, typer.Option(help="run folder")] = None,
           insecure: Annotated[bool, typer.Option("--insecure", help="plaintext gRPC (explicit opt-in)")] = False,
           timeout: Annotated[float | None, typer.Option(help="kill peers still running after this many seconds")] = None,
           set: SetOpt = None, verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
           addresses: AddressesOpt = None) -> None:
    """Start one `p2pfl node` process per peer on loopback (mutual TLS with generated certs)."""
    _setup_logging(verbose)
    set = _with_addresses(set, addresses)
    cfg = _load(config, set)
    from p2pfl.launch import launch as run_launch

    run_dir = out or default_run_dir(cfg.name, cfg.algorithm_name + "-launch")
    with _making(run_dir, config):
        summary = run_launch(config, cfg, run_dir, list(set or []), insecure=insecure, timeout_s=timeout,
                             verbose=verbose)
    print_summary(summary, run_dir)
    if summary["failed_peers"]:
        typer.echo(f"error: peers failed: {summary['failed_peers']}", err=True)
        raise typer.Exit(1)


@app.command()
def compare(config: ConfigOpt,
            algorithms: Annotated[str, typer.Option(help="comma-separated NAME or NAME:PRESET, e.g. "
                                                    "local,dfedavg,dfedmdc:dfedmdc-demo")],
            out: Annotated[Path | None, typer.Option(help="folder: one run folder per algorithm + comparison.png")]
            = None,
            rounds: Annotated[int | None, typer.Option(help="override rounds")] = None, set: SetOpt = None,
            quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar")] = False,
            verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    """Simulate several algorithms on CONFIG's experiment (same topology, split, model, seed); one plot."""
    _setup_logging(verbose)
    from p2pfl.compare import compare as run_compare
    from p2pfl.compare import parse_algorithms, summary_line

    entries = parse_algorithms(algorithms)
    sets = [*(set or []), *([f"rounds={rounds}"] if rounds is not None else [])]
    cfg = _load(config, sets)
    run_dir = out or default_run_dir(cfg.name, "compare")
    width = max(len(e.label) for e in entries)
    with _making(run_dir, config):
        run_compare(config, entries, run_dir, sets=sets, progress=not quiet,
                    on_result=lambda row: typer.echo(summary_line(row, width)))
    typer.echo(f"plot: {run_dir / 'comparison.png'}  (one run folder per algorithm in {run_dir})")


@app.command()
def certs(config: ConfigOpt, out: Annotated[Path, typer.Option(help="folder for ca.crt and <peer>.crt/.key")],
          host: Annotated[list[str] | None, typer.Option(help="extra SAN host/IP for every peer (repeatable)")] = None,
          ca_key_dir: Annotated[Path | None, typer.Option(
              help="keep the CA's private key here (made 0700) instead of in --out, which peers read")] = None,
          set: SetOpt = None) -> None:
    """Make a CA and one certificate per peer id of CONFIG's topology (mutual TLS)."""
    cfg = _load(config, set)
    from p2pfl.security.certs import make_certs
    from p2pfl.topology.address import split_address
    from p2pfl.topology.addressbook import placed_topology

    # Peer ids were checked with the config (no 'ca', no odd names); a graph-only topology adds no host.
    topo = placed_topology(cfg.topology, cfg.network.addresses)
    placed = {pid: [split_address(topo.address(pid))[0]] for pid in topo.ids} if topo.has_addresses \
        else {pid: [] for pid in topo.ids}
    hosts = {pid: [*placed[pid], *(host or [])] for pid in topo.ids}
    try:
        with _no_leftovers(out):
            make_certs(list(topo.ids), out, hosts=hosts, ca_key_dir=ca_key_dir)
    except ValueError as exc:
        raise BadInput(str(exc), source=str(config)) from None
    from p2pfl.security.certs import CA_CERT, certificate_expiry

    expiry = min(certificate_expiry(out / f"{pid}.crt") for pid in topo.ids)
    ca_expiry = certificate_expiry(out / CA_CERT)
    typer.echo(f"wrote CA and {len(topo.ids)} peer certificates to {out}; they expire on "
               f"{expiry:%Y-%m-%d %H:%M} UTC (the CA on {ca_expiry:%Y-%m-%d}): renew before then with the same CA")


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


@app.command()
def algorithms(name: Annotated[str | None, typer.Argument(help="one algorithm (default: all)")] = None) -> None:
    """List the algorithms with their hyperparameters, defaults, accepted values and paper presets."""
    from p2pfl.badinput import shorten, suggest
    from p2pfl.catalog import load

    rows = load()["algorithms"]  # no torch: the catalog is derived from the implementations
    if name is not None:
        names = [r["name"] for r in rows]
        if name not in names:
            close = suggest(name, names)
            raise BadInput(f"unknown algorithm {shorten(repr(name))}", key="algorithm.name", allowed=sorted(names),
                           hint=f"did you mean {close!r}?" if close else None)
        rows = [r for r in rows if r["name"] == name]
    for row in rows:
        typer.echo(f"{row['name']}  (shares: {row['shares']}) {row['doc']}")
        for key, default, accepted in row["hyperparameters"]:
            typer.echo(f"    {key:<18} default {default:<12} {accepted}")
        typer.echo(f"    presets: {', '.join(row['presets']) if row['presets'] else '-'}")


@app.command()
def models() -> None:
    """List the models (config key model.name) and the extra parameters each accepts."""
    from p2pfl.catalog import load

    for row in load()["models"]:
        params = ", ".join(f"{p}={default}" for p, default in row["params"]) or "-"
        typer.echo(f"{row['name']:<10} params: {params}")


@app.command()
def datasets() -> None:
    """List the datasets (config key data.dataset), their parameters and the partition kinds."""
    from p2pfl.catalog import load

    catalog = load()
    for row in catalog["datasets"]:
        params = ", ".join(f"{k}={v}" for k, v in row["params"]) or "-"
        typer.echo(f"{row['name']:<14} params: {params}")
    typer.echo("partitions (data.partition.kind):")
    for row in catalog["partitions"]:
        required = row["required"]
        typer.echo(f"    {row['kind']:<20} {', '.join(row['keys'])}" + (f"  (required: {required})" if required else ""))


def print_summary(summary: dict, run_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    # a Flower baseline is named by its baseline (its algorithm is only the local rule), a P2P run by its algorithm
    method = f"{summary['baseline']} (centralized)" if summary.get("baseline") else summary.get("algorithm")
    table = Table(title=f"{summary.get('name')} / {method}: personalized accuracy")
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
#: Packages a lazy command may need that an install can leave out (the peer image has no Flower).
OPTIONAL_STACKS = frozenset({"flwr", "torchvision", "matplotlib"})
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "flower": ("p2pfl.cli.flower", "flower_command"),
    "compose": ("p2pfl.cli.compose", "compose_command"),
    "k8s": ("p2pfl.cli.k8s", "k8s_command"),
    "watch": ("p2pfl.cli.watch", "watch_command"),
    "sweep": ("p2pfl.cli.sweep", "sweep_command"),
    "report": ("p2pfl.cli.sweep", "report_command"),
}


def _mount(argv: list[str] | None = None) -> None:
    import importlib

    args = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
    # typer leaves CommandInfo.name unset for @app.command(); the command is then the function's name
    have = {c.name or (c.callback.__name__.replace("_", "-") if c.callback else None) for c in app.registered_commands}
    if not args or args[0] not in have:  # the topology sub-app imports numpy, pydantic and networkx
        from p2pfl.cli.topology import app as topology_app

        if not any(g.name == "topology" for g in app.registered_groups):
            app.add_typer(topology_app, name="topology", help="generate, check and draw topology files")
    if args and (args[0] in have or args[0] == "topology"):
        return  # an eager command (e.g. health) needs none of the lazy ones (nor the topology sub-app)
    wanted = [args[0]] if args and args[0] in LAZY_COMMANDS else list(LAZY_COMMANDS)
    for name in wanted:
        if name not in have:
            module, func = LAZY_COMMANDS[name]
            try:
                mod = importlib.import_module(module)
            except ModuleNotFoundError as exc:
                # The peer image has no Flower (docker/peer_requirements.py): `p2pfl --help` lists the rest.
                if (args and args[0] == name) or (exc.name or "").split(".")[0] not in OPTIONAL_STACKS:
                    raise
                continue
            app.command(name)(getattr(mod, func))


def main(argv: list[str] | None = None) -> None:
    """Entry point. Bad input anywhere (config, topology, options) is one line on stderr and exit 2;
    ``--debug`` (anywhere on the line, or ``P2PFL_DEBUG=1``) adds the traceback."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("P2PFL_DEBUG") == "1"
    args = [a for a in args if a != "--debug"]
    if debug:
        os.environ["P2PFL_DEBUG"] = "1"  # child `p2pfl node` processes of launch inherit it
    _mount(args)
    if not args:
        app(args=args, prog_name="p2pfl")  # no arguments: the help text
        return
    try:
        code = app(args=args, prog_name="p2pfl", standalone_mode=False)
    except BadInput as exc:  # raised outside a command's invocation (e.g. while mounting)
        if debug:
            import traceback

            traceback.print_exc()
        typer.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except click.exceptions.UsageError as exc:
        cmd = exc.ctx.command_path if exc.ctx is not None else "p2pfl"
        typer.echo(f"error: {cmd}: {exc.format_message()} (see {cmd} --help)", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except click.ClickException as exc:  # _Refused: bad input inside a command
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        sys.exit(130)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
