"""``p2pfl compose``: write a docker-compose.yml with one service per peer of an experiment's topology.

Why generate instead of hand-writing: the compose file must agree with the topology (one service
per peer, and the address a peer dials is the service name its neighbour runs under), with the
certificates (each container gets its own key) and with the node's command line. Deriving it from
the config keeps the three in step, and a deterministic rendering lets a test check that the
committed example (``docker-compose.yml``) is current.

Decisions (the user-facing version is in ``docker/README.md``):

* **Addresses.** Containers find each other by compose service name. When every topology address
  is ``<service>:<port>`` with distinct DNS-label hosts, the topology is used as is and each service
  is named after its peer's host. Otherwise (e.g. the ``127.0.0.1:5005x`` addresses that
  ``p2pfl topology gen`` writes) the generator writes a copy, ``<out stem>.topology.yaml`` next to
  the compose file, with ``peer-<id>:<port>`` addresses (ports kept) and mounts that copy instead.
  Rewriting rather than refusing lets any config deploy unchanged; the copy's topology hash differs
  from the original's, which is harmless because every container mounts the same copy.
* **No ``depends_on``.** A ring (like most topologies) has cycles, which compose refuses, and peers
  need no start order: a node serves at once and waits for its neighbours within the per-round
  deadline (``network.round_timeout_s``), so start-up skew costs nothing.
* **``restart: on-failure``.** A crashed or OOM-killed peer restarts and resumes from its checkpoint
  in the run folder; a peer that finished exits 0 and stays down (``unless-stopped`` would restart
  finished peers forever), and ``docker compose stop`` is never undone by the policy.
* **Certificates** are host files made by ``p2pfl certs``, mounted read-only file by file: each
  container sees the CA certificate and its own certificate and key, never another peer's key.
* **Data** is mounted read-only with downloads off (``P2PFL_NO_DOWNLOAD=1``), so the containers
  never race to download into one folder; Fashion-MNIST ships in the image.
* **Run folder**: one shared bind mount; each node writes ``metrics-<peer>.jsonl`` and
  ``checkpoints/<peer>.npz`` there, so results and checkpoints stay on the host across restarts.
* **User**: containers run as ``${P2PFL_UID:-1000}:${P2PFL_GID:-1000}`` because the key files are
  mode 0600 and the run folder belongs to whoever made them; the image's own user is uid 1000.
* **Deterministic output**: services sorted by name, keys sorted, no timestamps, host paths relative
  to the compose file's folder (compose resolves them from there).

Heavy modules (the config loader, the topology package with numpy and networkx) are imported inside
the functions, so registering this command does not slow down other ``p2pfl`` commands.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from p2pfl.config import ExperimentConfig
    from p2pfl.topology import Topology

__all__ = [
    "COMPOSE_VERSION",
    "ComposeError",
    "Deployment",
    "compose_command",
    "compose_topology",
    "is_service_host",
    "render_compose",
    "service_name",
]

#: Compose file format: accepted by docker-compose 1.25+ (Debian's 1.29) and by Compose v2.
COMPOSE_VERSION = "3.8"
DEFAULT_IMAGE = "p2pfl:cpu"
DEFAULT_GPU_IMAGE = "p2pfl:cuda"
SERVICE_PREFIX = "peer-"
RESTART = "on-failure"
#: The user the containers run as; compose interpolates it from the environment of `docker compose`.
USER = "${P2PFL_UID:-1000}:${P2PFL_GID:-1000}"
# Paths inside the container; they are also docker/entrypoint.sh's defaults.
IN_CONFIG = "/p2pfl/config.yaml"
IN_TOPOLOGY = "/p2pfl/topology.yaml"
IN_CERTS = "/p2pfl/certs"
IN_DATA = "/p2pfl/data"
IN_RUN = "/p2pfl/run"
CA_CERT = "ca.crt"  # same names as p2pfl.security.certs writes (not imported: it pulls in cryptography)

# A compose service name that resolves on the compose network: one lowercase DNS label.
_LABEL_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")


class ComposeError(ValueError):
    """The config cannot become a compose deployment; the message says why and what to do instead."""


@dataclass(frozen=True)
class Deployment:
    """What `render_compose` produces; `compose_command` writes it.

    ``topology_copy`` is where the rewritten topology (``topology``) must be written, or None when
    the config's own topology file already uses service names and is mounted as is.
    """

    text: str
    services: dict[str, str]  # peer id -> service name, in topology order
    topology: Topology
    topology_copy: Path | None
    certs_dir: Path
    data_dir: Path
    run_dir: Path
    config: ExperimentConfig


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); the topology has already validated the form."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def is_service_host(host: str) -> bool:
    """Whether ``host`` can serve as a compose service name: a lowercase DNS label, not an IP or localhost."""
    if host == "localhost" or not _LABEL_RE.match(host):
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return True
    return False


def service_name(peer_id: str) -> str:
    """The service name given to a peer whose address is not one already: ``peer-<id>`` as a DNS label."""
    slug = re.sub(r"[^a-z0-9-]+", "-", peer_id.lower()).strip("-")
    name = SERVICE_PREFIX + slug
    if not slug or not _LABEL_RE.match(name):
        raise ComposeError(
            f"peer id {peer_id!r} does not make a valid service name ({name!r} is not a DNS label of at most "
            "63 characters); use a shorter id, or give the peer an address '<service>:<port>' in the topology"
        )
    return name


def compose_topology(topo: Topology) -> tuple[Topology, bool]:
    """The topology the containers use, and whether it had to be rewritten to service-name addresses.

    Kept as is when every host is a distinct service name; otherwise every address becomes
    ``peer-<id>:<port>`` (one rule for all peers, so a half-converted file is never produced).
    """
    from dataclasses import replace

    from p2pfl.topology import Peer

    hosts = [split_address(p.address)[0] for p in topo.peers]
    if all(is_service_host(h) for h in hosts) and len(set(hosts)) == len(hosts):
        return topo, False
    owner: dict[str, str] = {}
    peers = []
    for p in topo.peers:
        name = service_name(p.id)
        if name in owner:
            raise ComposeError(
                f"peers {owner[name]!r} and {p.id!r} would both run as service {name!r}; rename one of them "
                "or give every peer a distinct '<service>:<port>' address in the topology"
            )
        owner[name] = p.id
        peers.append(Peer(id=p.id, address=f"{name}:{split_address(p.address)[1]}"))
    return replace(topo, peers=tuple(peers)), True


def _rel(path: Path, base: Path) -> str:
    """``path`` relative to ``base`` in POSIX form, starting with ``./`` or ``../`` as compose wants."""
    rel = Path(os.path.relpath(os.path.abspath(path), os.path.abspath(base))).as_posix()
    if rel == ".":
        return "."
    return rel if rel == ".." or rel.startswith("../") else f"./{rel}"


def _esc(text: str) -> str:
    """Escape ``$`` so compose does not treat a path or argument as a variable to interpolate."""
    return text.replace("$", "$$")


def _override_key(item: str) -> str:
    return item.partition("=")[0].strip()


def _stop_grace(cfg: ExperimentConfig) -> str:
    """How long compose waits after SIGTERM: a node stops between rounds, and a round in progress may
    wait a full deadline for a neighbour that already stopped, so allow the deadline plus a minute."""
    return f"{math.ceil(float(cfg.network.round_timeout_s)) + 60}s"


def _sorted(value: Any) -> Any:
    """Mappings with their keys sorted, recursively (lists keep their order): stable output."""
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


def _regen_command(config: str, out: Path, options: Sequence[str]) -> str:
    parts = ["p2pfl", "compose", "--config", config.removeprefix("./"), "--out", out.name, *options]
    return " ".join(shlex.quote(p) for p in parts)


def render_compose(
    config: Path,
    *,
    out: Path = Path("docker-compose.yml"),
    gpus: bool = False,
    sets: Sequence[str] | None = None,
    image: str | None = None,
    certs: Path | None = None,
    data: Path | None = None,
    runs: Path | None = None,
    insecure: bool = False,
) -> Deployment:
    """Build the compose file for ``config`` without writing anything.

    ``out`` fixes the deployment folder (its parent): host paths in the file are relative to it, and
    ``certs``, ``data`` and ``runs`` default to ``certs/``, ``data/`` and ``runs/<name>/`` there.
    Raises `ComposeError`, `p2pfl.config.ConfigError` or `p2pfl.topology.TopologyError`.
    """
    from p2pfl.config import load_config
    from p2pfl.topology import load_topology

    sets = list(sets or [])
    cfg = load_config(config, sets)
    topo_file = Path(cfg.topology)
    topo, rewritten = compose_topology(load_topology(topo_file))
    if cfg.network.insecure and not insecure:
        raise ComposeError(
            "the config sets network.insecure, but a compose deployment uses mutual TLS: drop it "
            "(or --set network.insecure=false), or pass --insecure to p2pfl compose to deploy in plaintext on purpose"
        )

    base = out.parent
    certs_dir = certs if certs is not None else base / "certs"
    data_dir = data if data is not None else base / "data"
    run_dir = runs if runs is not None else base / "runs" / cfg.name
    topology_copy = base / f"{out.stem}.topology.yaml" if rewritten else None
    host_topology = topology_copy if topology_copy is not None else topo_file
    image = image or (DEFAULT_GPU_IMAGE if gpus else DEFAULT_IMAGE)

    # The containers see the config's own overrides, then the in-container topology path (last: it wins).
    args: list[str] = []
    for item in sets:
        if _override_key(item) != "topology":
            args += ["--set", _esc(item)]
    args += ["--set", f"topology={IN_TOPOLOGY}"]

    common_volumes = [
        f"{_esc(_rel(config, base))}:{IN_CONFIG}:ro",
        f"{_esc(_rel(host_topology, base))}:{IN_TOPOLOGY}:ro",
        f"{_esc(_rel(data_dir, base))}:{IN_DATA}:ro",
        f"{_esc(_rel(run_dir, base))}:{IN_RUN}",
    ]
    services: dict[str, dict[str, Any]] = {}
    names: dict[str, str] = {}
    for peer in topo.peers:
        host, port = split_address(peer.address)
        names[peer.id] = host
        env = {
            "P2PFL_CERTS": IN_CERTS,
            "P2PFL_CONFIG": IN_CONFIG,
            "P2PFL_NO_DOWNLOAD": "1",
            "P2PFL_PEER": peer.id,
            "P2PFL_PORT": str(port),
            "P2PFL_RUN_DIR": IN_RUN,
        }
        volumes = list(common_volumes)
        if insecure:
            env["P2PFL_INSECURE"] = "1"
        else:
            for name in (CA_CERT, f"{peer.id}.crt", f"{peer.id}.key"):
                volumes.append(f"{_esc(_rel(certs_dir / name, base))}:{IN_CERTS}/{name}:ro")
        svc: dict[str, Any] = {
            "command": list(args),
            "environment": env,
            "expose": [str(port)],
            "image": _esc(image),
            "init": True,
            "restart": RESTART,
            "stop_grace_period": _stop_grace(cfg),
            "user": USER,
            "volumes": volumes,
        }
        if gpus:
            svc["deploy"] = {"resources": {"reservations": {"devices": [
                {"capabilities": ["gpu"], "count": "all", "driver": "nvidia"},
            ]}}}
        services[host] = _sorted(svc)

    options: list[str] = []
    if gpus:
        options.append("--gpus")
    if insecure:
        options.append("--insecure")
    if image != (DEFAULT_GPU_IMAGE if gpus else DEFAULT_IMAGE):
        options += ["--image", image]
    for flag, given, default in (("--certs", certs_dir, base / "certs"), ("--data", data_dir, base / "data"),
                                 ("--runs", run_dir, base / "runs" / cfg.name)):
        if os.path.abspath(given) != os.path.abspath(default):
            options += [flag, _rel(given, base)]
    for item in sets:
        options += ["--set", item]

    config_rel = _rel(config, base)
    doc: dict[str, Any] = {
        "version": COMPOSE_VERSION,
        "x-p2pfl": {
            "config": _esc(config_rel),
            "peers": {pid: names[pid] for pid in sorted(names)},
            "topology": _esc(_rel(host_topology, base)),
            "topology_hash": topo.hash(),
        },
        "services": {name: services[name] for name in sorted(services)},
    }
    import yaml

    header = (
        f"# Generated by `p2pfl compose` from {config_rel}: do not edit; regenerate from this folder with\n"
        f"#   {_regen_command(config_rel, out, options)}\n"
        f"# One service per peer of topology {topo.name!r} (hash {topo.hash()}). Before `docker compose up`:\n"
        "# build the image and make the certificates (docker/README.md).\n"
    )
    text = header + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=120)
    return Deployment(text=text, services=names, topology=topo, topology_copy=topology_copy,
                      certs_dir=certs_dir, data_dir=data_dir, run_dir=run_dir, config=cfg)


def missing_certs(deployment: Deployment) -> list[Path]:
    """The certificate files the deployment mounts that do not exist yet."""
    files = [deployment.certs_dir / CA_CERT]
    for pid in deployment.services:
        files += [deployment.certs_dir / f"{pid}.crt", deployment.certs_dir / f"{pid}.key"]
    return [f for f in files if not f.is_file()]


def compose_command(
    config: Annotated[Path, typer.Option("--config", "-c", help="experiment config YAML")],
    out: Annotated[Path, typer.Option("--out", "-o",
                                      help="compose file to write; its folder is the deployment folder")]
    = Path("docker-compose.yml"),
    gpus: Annotated[bool, typer.Option("--gpus", help="reserve the host's GPUs for every peer (NVIDIA)")] = False,
    set: Annotated[list[str] | None, typer.Option(
        "--set", help="override a config value: dotted.key=VALUE (repeatable; the containers get it too)")] = None,
    image: Annotated[str | None, typer.Option(
        help=f"image every peer runs (default {DEFAULT_IMAGE}, {DEFAULT_GPU_IMAGE} with --gpus)")] = None,
    certs: Annotated[Path | None, typer.Option(
        help="folder made by `p2pfl certs` (default: certs/ next to the compose file)")] = None,
    data: Annotated[Path | None, typer.Option(
        help="data folder mounted read-only at /p2pfl/data (default: data/ next to the compose file)")] = None,
    runs: Annotated[Path | None, typer.Option(
        help="run folder for metrics and checkpoints (default: runs/<name>/ next to the compose file)")] = None,
    insecure: Annotated[bool, typer.Option(
        "--insecure", help="plaintext gRPC between the containers, no certificates (debugging only)")] = False,
) -> None:
    """Write a docker-compose.yml with one service per peer of CONFIG's topology (see docker/README.md)."""
    from p2pfl.config import ConfigError
    from p2pfl.topology import TopologyError

    try:
        dep = render_compose(config, out=out, gpus=gpus, sets=set, image=image, certs=certs, data=data,
                             runs=runs, insecure=insecure)
    except (ComposeError, ConfigError, TopologyError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None

    out.parent.mkdir(parents=True, exist_ok=True)
    if dep.topology_copy is not None:
        dep.topology.dump(dep.topology_copy)
        typer.echo(f"wrote {dep.topology_copy}: the topology with service-name addresses (the containers use it)")
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
    typer.echo(f"then: docker compose -f {shlex.quote(str(out))} up -d   (watch: docker compose logs -f)")
