"""``p2pfl compose``: write a docker-compose.yml, one service per peer (the rendering is ``p2pfl.deploy.compose``)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer

from p2pfl.deploy.compose import (
    DEFAULT_CPUS,
    DEFAULT_GPU_IMAGE,
    DEFAULT_IMAGE,
    DEFAULT_MEMORY,
    DEFAULT_METRICS_PORT,
    DEFAULT_RESTARTS,
    missing_certs,
    render_compose,
)


def compose_command(
    config: Annotated[Path, typer.Option("--config", "-c", help="experiment config YAML")],
    out: Annotated[Path, typer.Option("--out", "-o",
                                      help="compose file to write; its folder is the deployment folder")]
    = Path("docker-compose.yml"),
    gpus: Annotated[str | None, typer.Option(
        "--gpus", help="NVIDIA GPUs, one per peer round-robin: a count (4), a list (0,1), auto (nvidia-smi), "
        "a mapping (p0=0,p1=1), or all (every peer sees every GPU)")] = None,
    set: Annotated[list[str] | None, typer.Option(
        "--set", help="override a config value: dotted.key=VALUE (repeatable; the containers get it too)")] = None,
    image: Annotated[str | None, typer.Option(
        help=f"image every peer runs (default {DEFAULT_IMAGE}, {DEFAULT_GPU_IMAGE} with --gpus)")] = None,
    certs: Annotated[Path | None, typer.Option(
        help="folder made by 'p2pfl certs' (default: certs/ next to the compose file)")] = None,
    data: Annotated[Path | None, typer.Option(
        help="data folder mounted read-only at /p2pfl/data (default: data/ next to the compose file)")] = None,
    runs: Annotated[Path | None, typer.Option(
        help="run folder for metrics and checkpoints (default: runs/<name>/ next to the compose file)")] = None,
    insecure: Annotated[bool, typer.Option(
        "--insecure", help="plaintext gRPC between the containers, no certificates (debugging only)")] = False,
    network: Annotated[str, typer.Option(
        help="compose: service names on the compose network; host: the host's network and the topology's "
        "own addresses (distinct ports)")] = "compose",
    cpus: Annotated[float, typer.Option(help="CPU limit per peer")] = DEFAULT_CPUS,
    memory: Annotated[str, typer.Option(help="memory limit per peer (e.g. 3g)")] = DEFAULT_MEMORY,
    restarts: Annotated[int, typer.Option(help="restarts of a crashed peer before compose gives up")]
    = DEFAULT_RESTARTS,
    metrics_port: Annotated[int, typer.Option(
        help="peers serve Prometheus /metrics on this port + their index in the topology")] = DEFAULT_METRICS_PORT,
    no_metrics: Annotated[bool, typer.Option("--no-metrics", help="no /metrics endpoints")] = False,
    context: Annotated[Path | None, typer.Option(
        help="build context: a checkout with docker/Dockerfile (default: this p2pfl checkout)")] = None,
) -> None:
    """Write a docker-compose.yml with one service per peer of CONFIG's topology (see docker/README.md)."""
    # Bad input (ComposeError, ConfigError, TopologyError: all BadInput) reaches the CLI's main(): one line, exit 2.
    dep = render_compose(config, out=out, gpus=gpus, sets=set, image=image, certs=certs, data=data,
                         runs=runs, insecure=insecure, network=network, cpus=cpus, memory=memory,
                         restarts=restarts, metrics_port=None if no_metrics else metrics_port, context=context)

    out.parent.mkdir(parents=True, exist_ok=True)
    if dep.address_book is not None:
        from p2pfl.topology.addressbook import AddressBook

        AddressBook.from_topology(dep.topology).dump(dep.address_book, dep.topology)
        typer.echo(f"wrote {dep.address_book}: where the peers run (the containers' network.addresses)")
    out.write_text(dep.text, encoding="utf-8")
    # Made here, by the user, so the docker daemon does not create them owned by root.
    dep.run_dir.mkdir(parents=True, exist_ok=True)
    dep.data_dir.mkdir(parents=True, exist_ok=True)
    svc = ", ".join(dep.services[p] for p in dep.services)
    typer.echo(f"wrote {out}: {len(dep.services)} services ({svc}); run folder {dep.run_dir}")
    if gpus and dep.config.device == "cpu":
        typer.echo("warning: --gpus reserves GPUs but the config says device: cpu; "
                   "use --set device=auto (or cuda) to train on them", err=True)
    if not insecure:
        missing = missing_certs(dep)
        if missing:
            sets = " ".join(f"--set {shlex.quote(s)}" for s in set or [])
            typer.echo(f"next: make the certificates ({len(missing)} files missing in {dep.certs_dir}):\n"
                       f"  p2pfl certs --config {shlex.quote(str(config))} --out {shlex.quote(str(dep.certs_dir))}"
                       + (f" {sets}" if sets else ""))
    typer.echo(f"then: docker compose -f {shlex.quote(str(out))} up -d   "
               f"(watch: p2pfl watch --compose {shlex.quote(str(out))})")

