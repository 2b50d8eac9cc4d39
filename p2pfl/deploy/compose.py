"""``p2pfl compose``: write a docker-compose.yml with one service per peer of an experiment's topology.

Why generate instead of hand-writing: the compose file must agree with the topology (one service
per peer, and the address a peer dials is the service name its neighbour runs under), with the
certificates (each container gets its own key) and with the node's command line. Deriving it from
the config keeps the three in step, and a deterministic rendering lets a test check that the
committed example (``docker-compose.yml``) is current.

Decisions (the user-facing version is in ``docker/README.md``):

* **Addresses.** Containers find each other by compose service name. The topology file is mounted
  as it is (never rewritten: its hash covers the graph only, so it is the same hash as in simulate,
  launch and Kubernetes); where peers run comes from an address book. When the topology file's own
  addresses are all ``<service>:<port>`` with distinct DNS-label hosts (and the config names no
  address book), they are used as they are and each service is named after its peer's host.
  Otherwise (a graph-only topology, the ``127.0.0.1:5005x`` addresses ``p2pfl topology gen``
  writes, or the config's own ``network.addresses``) the generator writes an address book,
  ``<out stem>.addresses.yaml`` next to the compose file, with ``peer-<id>:<port>`` addresses
  (ports kept; 50051 for a graph-only topology), mounts it and points ``network.addresses`` at it.
* **No ``depends_on``.** A ring (like most topologies) has cycles, which compose refuses, and peers
  need no start order: a node serves at once and waits for its neighbours within the per-round
  deadline (``network.round_timeout_s``), so start-up skew costs nothing.
* **``restart: on-failure:N``** (bounded, ``--restarts``). A crashed or OOM-killed peer restarts and
  resumes from its checkpoint in the run folder; a peer that finished exits 0 and stays down
  (``unless-stopped`` would restart finished peers forever); a peer that crashes at every start stops
  after N tries instead of looping; ``docker compose stop`` is never undone by the policy.
* **Networks.** ``--network compose`` (default): the compose network, service names as addresses.
  ``--network host``: every container on the host's network (``network_mode: host``), the addresses
  as the config places them (its address book, else the topology's own, e.g. ``127.0.0.1:5005x``,
  distinct ports; a graph-only topology gets ``127.0.0.1:50050 + i``), for machines where containers
  may not route private address ranges, and for one-host benchmarks.
* **Resources.** Every service has CPU and memory limits (``--cpus``, ``--memory``) and a healthcheck on the peer's gRPC
  health service that imports neither torch nor Flower (``python -m p2pfl.health``). The first service
  has the build section (``docker compose build`` / ``up --build`` make the image from this checkout);
  the others run the same image by its tag, so compose builds it once, not once per peer.
* **GPUs** (``--gpus``): one device per peer, round-robin over the listed (or counted, or detected)
  devices, or an explicit ``peer=device`` mapping; ``all`` gives every peer every GPU.
* **Metrics.** Each peer serves Prometheus ``/metrics`` on its own port (``--metrics-port`` base +
  the peer's index in the topology; published on the host's loopback on the compose network), which
  ``p2pfl watch --compose FILE`` and Prometheus scrape.
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
from typing import TYPE_CHECKING, Any

from p2pfl.badinput import BadInput

if TYPE_CHECKING:
    from p2pfl.config import ExperimentConfig
    from p2pfl.topology import Topology

__all__ = [
    "ComposeError",
    "Deployment",
    "compose_topology",
    "gpu_assignment",
    "is_service_host",
    "render_compose",
    "service_name",
]

# The Compose Specification (no ``version:`` key, which Compose v2 calls obsolete): read by
# docker-compose 1.27+ (Debian's 1.29) and by Compose v2.
DEFAULT_IMAGE = "p2pfl:cpu"
DEFAULT_GPU_IMAGE = "p2pfl:cuda"
SERVICE_PREFIX = "peer-"
RESTART = "on-failure"
DEFAULT_RESTARTS = 3
DEFAULT_CPUS = 1.0
DEFAULT_MEMORY = "3g"
DEFAULT_METRICS_PORT = 9400
NETWORKS = ("compose", "host")
DOCKERFILE = "docker/Dockerfile"
#: Build arguments of the CUDA image (PyTorch's CUDA wheels; see docker/Dockerfile).
CUDA_BUILD_ARGS = {"TORCH_INDEX": "https://download.pytorch.org/whl/cu130", "TORCH_VERSION": "2.14.1"}
#: The healthcheck: the image's own (docker/entrypoint.sh --healthcheck), with compose's timings.
HEALTHCHECK = {"test": ["CMD", "p2pfl-entrypoint", "--healthcheck"], "interval": "10s", "timeout": "10s",
               "retries": 3, "start_period": "60s"}
#: The user the containers run as; compose interpolates it from the environment of `docker compose`.
USER = "${P2PFL_UID:-1000}:${P2PFL_GID:-1000}"
# Paths inside the container; they are also docker/entrypoint.sh's defaults.
IN_CONFIG = "/p2pfl/config.yaml"
IN_TOPOLOGY = "/p2pfl/topology.yaml"
IN_ADDRESSES = "/p2pfl/addresses.yaml"
#: The gRPC port of a peer placed by compose or Kubernetes when the topology gives none (graph only).
DEFAULT_GRPC_PORT = 50051
IN_CERTS = "/p2pfl/certs"
IN_DATA = "/p2pfl/data"
IN_RUN = "/p2pfl/run"
IN_APP = "/p2pfl/app"  # a ClientApp config's packages, on the container's PYTHONPATH
IN_APP_DIR = "/p2pfl/flower-app"  # a Flower App directory named by app: (the containers' app:)
#: The image variant with Flower, for configs that run a user's ClientApp (docker/Dockerfile's FLOWER=1).
FLOWER_BUILD_ARGS = {"FLOWER": "1"}
FLOWER_SUFFIX = "-flower"
CA_CERT = "ca.crt"  # same names as p2pfl.security.certs writes (not imported: it pulls in cryptography)

# A compose service name that resolves on the compose network: one lowercase DNS label.
_LABEL_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")


class ComposeError(BadInput):
    """The config cannot become a compose deployment; the message says why and what to do instead.

    A `BadInput`: the command line prints it on one line and exits 2, like every other bad input."""


@dataclass(frozen=True)
class Deployment:
    """What `render_compose` produces; `compose_command` writes it.

    ``topology`` is the graph placed where the containers run; ``address_book`` is where its
    addresses must be written (the containers read them there), or None when the topology file's
    own addresses are used as they are. The topology file itself is always mounted unchanged.
    """

    text: str
    services: dict[str, str]  # peer id -> service name, in topology order
    topology: Topology
    address_book: Path | None
    certs_dir: Path
    data_dir: Path
    run_dir: Path
    config: ExperimentConfig


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
    """The peers placed where the containers run, and whether the placement differs from ``topo``'s own.

    Kept as is when every host is a distinct service name; otherwise every address becomes
    ``peer-<id>:<port>`` (one rule for all peers; the port kept, `DEFAULT_GRPC_PORT` for a
    graph-only topology). Only addresses change: the graph, and so its hash, stay the same.
    """
    from p2pfl.topology.address import split_address  # lazily: see test_module_imports_lazily
    if topo.has_addresses:
        hosts = [split_address(p.address)[0] for p in topo.peers]  # type: ignore[arg-type]
        if all(is_service_host(h) for h in hosts) and len(set(hosts)) == len(hosts):
            return topo, False
    owner: dict[str, str] = {}
    addresses: dict[str, str] = {}
    for p in topo.peers:
        name = service_name(p.id)
        if name in owner:
            raise ComposeError(
                f"peers {owner[name]!r} and {p.id!r} would both run as service {name!r}; rename one of them "
                "or give every peer a distinct '<service>:<port>' address in the topology"
            )
        owner[name] = p.id
        port = DEFAULT_GRPC_PORT if p.address is None else split_address(p.address)[1]
        addresses[p.id] = f"{name}:{port}"
    return topo.with_addresses(addresses), True


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


def gpu_assignment(spec: str | None, peer_ids: Sequence[str]) -> dict[str, str | None] | None:
    """Which GPU each peer gets: peer id -> device id (None: every GPU), or None without ``spec``.

    ``spec``: ``all`` (every peer sees every GPU), ``auto`` (the devices ``nvidia-smi`` lists here),
    a count ``N`` (devices 0..N-1), a list ``0,2,3``, or a mapping ``p0=0,p1=1`` that names every
    peer. Counts, lists and detected devices are dealt round-robin in topology order, so with as many
    GPUs as peers each peer has its own; with fewer, peers share them evenly.
    """
    if spec is None:
        return None
    spec = spec.strip()
    if spec == "all":
        return {pid: None for pid in peer_ids}
    if "=" in spec:
        mapping: dict[str, str] = {}
        for item in spec.split(","):
            pid, sep, dev = (s.strip() for s in item.partition("="))
            if not sep or not pid or not dev.isdigit():
                raise ComposeError(f"--gpus {spec!r}: {item!r} is not PEER=DEVICE (e.g. p0=0,p1=1)")
            mapping[pid] = dev
        unknown = sorted(set(mapping) - set(peer_ids))
        missing = [pid for pid in peer_ids if pid not in mapping]
        if unknown or missing:
            raise ComposeError(f"--gpus {spec!r}: " + "; ".join(
                ([f"unknown peers {unknown}"] if unknown else []) + ([f"no device for {missing}"] if missing else [])))
        return {pid: mapping[pid] for pid in peer_ids}
    if spec == "auto":
        devices = _visible_gpus()
        if not devices:
            raise ComposeError("--gpus auto: nvidia-smi lists no GPU on this host; give a count or a list instead")
    elif spec.isdigit():
        if int(spec) < 1:
            raise ComposeError(f"--gpus {spec!r}: the GPU count must be at least 1")
        devices = [str(i) for i in range(int(spec))]
    else:
        devices = [d.strip() for d in spec.split(",")]
        if not all(d.isdigit() for d in devices) or len(set(devices)) != len(devices):
            raise ComposeError(f"--gpus {spec!r}: expected all, auto, a count, a list of distinct device "
                               "indices (0,1) or a mapping (p0=0,p1=1)")
    return {pid: devices[i % len(devices)] for i, pid in enumerate(peer_ids)}


def _visible_gpus() -> list[str]:
    """Indices of the GPUs ``nvidia-smi`` sees here (empty without the NVIDIA driver)."""
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        res = subprocess.run([exe, "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in res.stdout.splitlines() if line.strip().isdigit()]


def app_packages(cfg: ExperimentConfig) -> dict[str, Path]:
    """Top-level package (or module) name -> its host path, for the ``app``/``app_init`` of a ClientApp config.

    A container runs the image's p2pfl and Flower, but the user's app is the user's code: compose
    mounts each top-level package the config names (found as this Python finds it) read-only under
    ``IN_APP``, which is on the container's PYTHONPATH. Empty for a built-in algorithm's config.
    """
    import importlib.util

    from p2pfl.appdir import is_object_ref

    refs = [str(cfg.raw[k]) for k in ("app", "app_init") if cfg.raw.get(k) and is_object_ref(str(cfg.raw[k]))]
    root = app_directory(cfg)
    out: dict[str, Path] = {}
    for ref in refs:
        top = ref.partition(":")[0].split(".")[0]
        if top in out or top == "p2pfl":  # p2pfl's own modules are in the image
            continue
        if root is not None and ((root / top).is_dir() or (root / f"{top}.py").is_file()):
            continue  # the app directory's own package: mounted with it (IN_APP_DIR), imported from there
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not (spec.submodule_search_locations or spec.origin):
            raise ComposeError(f"app: cannot find {top!r} from {Path.cwd()}: run p2pfl compose where the app's "
                               "package is importable (as for p2pfl simulate)")
        if spec.submodule_search_locations:
            out[top] = Path(next(iter(spec.submodule_search_locations)))
        else:
            out[top] = Path(str(spec.origin))
    return out


def app_directory(cfg: ExperimentConfig) -> Path | None:
    """The Flower App directory a config's ``app:`` names (None for ``package.module:attr`` or no app).

    Compose mounts it read-only at ``IN_APP_DIR`` and tells the containers ``--set app=IN_APP_DIR``:
    the config's own path means nothing inside a container, and the directory is imported from
    wherever it is (``p2pfl.appdir``), so it needs no place on the PYTHONPATH.
    """
    from p2pfl.appdir import is_object_ref

    ref = str(cfg.raw.get("app") or "")
    return Path(ref).resolve() if ref and not is_object_ref(ref) else None


def default_context() -> Path | None:
    """The checkout this package runs from, if it has the Dockerfile (an installed wheel has none)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / DOCKERFILE).is_file() else None


def render_compose(
    config: Path,
    *,
    out: Path = Path("docker-compose.yml"),
    gpus: str | None = None,
    sets: Sequence[str] | None = None,
    image: str | None = None,
    certs: Path | None = None,
    data: Path | None = None,
    runs: Path | None = None,
    insecure: bool = False,
    network: str = "compose",
    cpus: float = DEFAULT_CPUS,
    memory: str = DEFAULT_MEMORY,
    restarts: int = DEFAULT_RESTARTS,
    metrics_port: int | None = DEFAULT_METRICS_PORT,
    context: Path | None = None,
) -> Deployment:
    """Build the compose file for ``config`` without writing anything.

    ``out`` fixes the deployment folder (its parent): host paths in the file are relative to it, and
    ``certs``, ``data`` and ``runs`` default to ``certs/``, ``data/`` and ``runs/<name>/`` there.
    ``context``: the build context (a checkout with docker/Dockerfile; default: this package's own
    checkout, or no build section when installed from a wheel). ``metrics_port``: base port of the
    peers' ``/metrics`` (peer i serves base + i; None: off).
    Raises `ComposeError`, `p2pfl.config.ConfigError` or `p2pfl.topology.TopologyError`.
    """
    from p2pfl.config import load_config
    from p2pfl.topology.address import split_address  # lazily: see test_module_imports_lazily
    from p2pfl.topology.addressbook import placed_topology

    if network not in NETWORKS:
        raise ComposeError(f"--network {network!r}: expected one of {', '.join(NETWORKS)}")
    if not cpus > 0:
        raise ComposeError(f"--cpus {cpus}: must be > 0")
    if not re.fullmatch(r"[1-9][0-9]*[kmg]?", memory.lower()):
        raise ComposeError(f"--memory {memory!r}: expected a size such as 3g or 2048m")
    if restarts < 1:
        raise ComposeError(f"--restarts {restarts}: must be at least 1 (bounded restarts of a crashed peer)")
    sets = list(sets or [])
    cfg = load_config(config, sets)
    topo_file = Path(cfg.topology)
    # Where the peers run: the config's address book, else the topology file's own addresses.
    book = cfg.network.addresses
    placed = placed_topology(topo_file, book)
    if network == "host":
        topo, rewritten = placed, book is not None
        if not topo.has_addresses:
            topo, rewritten = topo.with_addresses({pid: f"127.0.0.1:{50050 + i}" for i, pid in enumerate(topo.ids)}), True
        ports = [split_address(p.address)[1] for p in topo.peers]
        if len(set(ports)) != len(ports):
            raise ComposeError("--network host: every peer shares the host's network, so the topology's peers "
                               "need distinct ports (e.g. 127.0.0.1:50050, 127.0.0.1:50051, ...)")
    else:
        topo, rewritten = compose_topology(placed)
        rewritten = rewritten or book is not None  # the book's host path is not in the containers
    if cfg.network.insecure and not insecure:
        raise ComposeError(
            "the config sets network.insecure, but a compose deployment uses mutual TLS: drop it "
            "(or --set network.insecure=false), or pass --insecure to p2pfl compose to deploy in plaintext on purpose"
        )
    ids = list(topo.ids)
    gpu_of = gpu_assignment(gpus, ids)
    if metrics_port is not None:
        taken = {split_address(p.address)[1] for p in topo.peers}
        mports = {pid: metrics_port + i for i, pid in enumerate(ids)}
        if not (0 < metrics_port and metrics_port + len(ids) - 1 <= 65535):
            raise ComposeError(f"--metrics-port {metrics_port}: peers would serve /metrics outside 1..65535")
        if set(mports.values()) & taken:
            raise ComposeError(f"--metrics-port {metrics_port}: the metrics ports {metrics_port}.."
                               f"{metrics_port + len(ids) - 1} collide with the peers' gRPC ports; choose another base")

    base = out.parent
    certs_dir = certs if certs is not None else base / "certs"
    data_dir = data if data is not None else base / "data"
    run_dir = runs if runs is not None else base / "runs" / cfg.name
    address_book = base / f"{out.stem}.addresses.yaml" if rewritten else None
    host_topology = topo_file
    apps = app_packages(cfg)
    app_dir = app_directory(cfg)
    flower = bool(apps) or app_dir is not None
    default_image = (DEFAULT_GPU_IMAGE if gpus else DEFAULT_IMAGE) + (FLOWER_SUFFIX if flower else "")
    image = image or default_image
    ctx = context if context is not None else default_context()

    # The containers see the config's own overrides, then the in-container topology path (last: it wins).
    args: list[str] = []
    ours = ("topology", "network.addresses") + (("app",) if app_dir is not None else ())
    for item in sets:
        if _override_key(item) not in ours:
            args += ["--set", _esc(item)]
    args += ["--set", f"topology={IN_TOPOLOGY}"]
    if app_dir is not None:
        args += ["--set", f"app={IN_APP_DIR}"]
    if address_book is not None:
        args += ["--set", f"network.addresses={IN_ADDRESSES}"]

    common_volumes = [
        f"{_esc(_rel(config, base))}:{IN_CONFIG}:ro",
        f"{_esc(_rel(host_topology, base))}:{IN_TOPOLOGY}:ro",
        f"{_esc(_rel(data_dir, base))}:{IN_DATA}:ro",
        f"{_esc(_rel(run_dir, base))}:{IN_RUN}",
    ]
    if address_book is not None:
        common_volumes.insert(2, f"{_esc(_rel(address_book, base))}:{IN_ADDRESSES}:ro")
    for top, path in apps.items():
        name = top if path.is_dir() else f"{top}.py"
        common_volumes.append(f"{_esc(_rel(path, base))}:{IN_APP}/{name}:ro")
    if app_dir is not None:
        common_volumes.append(f"{_esc(_rel(app_dir, base))}:{IN_APP_DIR}:ro")
    build: dict[str, Any] | None = None
    if ctx is not None:
        build = {"context": _esc(_rel(ctx, base)), "dockerfile": DOCKERFILE}
        if network == "host":
            build["network"] = "host"
        args_: dict[str, str] = {**(CUDA_BUILD_ARGS if gpus else {}), **(FLOWER_BUILD_ARGS if flower else {})}
        if args_:
            build["args"] = args_
    services: dict[str, dict[str, Any]] = {}
    names: dict[str, str] = {}
    metrics: dict[str, str] = {}
    for peer in topo.peers:
        host, port = split_address(peer.address)
        name = service_name(peer.id) if network == "host" else host
        names[peer.id] = name
        env = {
            "P2PFL_CERTS": IN_CERTS,
            "P2PFL_CONFIG": IN_CONFIG,
            "P2PFL_NO_DOWNLOAD": "1",
            "P2PFL_PEER": peer.id,
            "P2PFL_PORT": str(port),
            "P2PFL_RUN_DIR": IN_RUN,
        }
        if apps:
            env["PYTHONPATH"] = IN_APP
        volumes = list(common_volumes)
        if insecure:
            env["P2PFL_INSECURE"] = "1"
        else:
            for fname in (CA_CERT, f"{peer.id}.crt", f"{peer.id}.key"):
                volumes.append(f"{_esc(_rel(certs_dir / fname, base))}:{IN_CERTS}/{fname}:ro")
        svc: dict[str, Any] = {
            "command": list(args),
            "cpus": cpus,
            "environment": env,
            "healthcheck": dict(HEALTHCHECK),
            "image": _esc(image),
            "init": True,
            "mem_limit": memory.lower(),
            "restart": f"{RESTART}:{restarts}",
            "stop_grace_period": _stop_grace(cfg),
            "user": USER,
            "volumes": volumes,
        }
        if network == "host":
            svc["network_mode"] = "host"
        else:
            svc["expose"] = [str(port)]
        if metrics_port is not None:
            mport = mports[peer.id]
            env["P2PFL_METRICS_PORT"] = str(mport)
            if network == "host":
                env["P2PFL_METRICS_HOST"] = "127.0.0.1"
            else:  # inside its own network namespace; published on the host's loopback only
                env["P2PFL_METRICS_HOST"] = "0.0.0.0"
                svc["ports"] = [f"127.0.0.1:{mport}:{mport}"]
            metrics[peer.id] = f"127.0.0.1:{mport}"
        if gpu_of is not None:
            dev: dict[str, Any] = {"capabilities": ["gpu"], "driver": "nvidia"}
            if gpu_of[peer.id] is None:
                dev["count"] = "all"
            else:
                dev["device_ids"] = [gpu_of[peer.id]]
            svc["deploy"] = {"resources": {"reservations": {"devices": [dev]}}}
        services[name] = _sorted(svc)

    if build is not None:
        # One service builds the image all of them run: compose would otherwise build it once per
        # service (docker-compose 1.29 does), and with `up` the others find it by its tag.
        first = sorted(services)[0]
        services[first] = _sorted({**services[first], "build": build})

    options: list[str] = []
    if gpus:
        options += ["--gpus", gpus]
    if insecure:
        options.append("--insecure")
    if network != "compose":
        options += ["--network", network]
    if image != default_image:
        options += ["--image", image]
    for flag, value, default in (("--cpus", cpus, DEFAULT_CPUS), ("--memory", memory, DEFAULT_MEMORY),
                                 ("--restarts", restarts, DEFAULT_RESTARTS)):
        if value != default:
            options += [flag, str(value)]
    if metrics_port != DEFAULT_METRICS_PORT:
        options += ["--metrics-port", str(metrics_port)] if metrics_port is not None else ["--no-metrics"]
    for flag, given, default in (("--certs", certs_dir, base / "certs"), ("--data", data_dir, base / "data"),
                                 ("--runs", run_dir, base / "runs" / cfg.name)):
        if os.path.abspath(given) != os.path.abspath(default):
            options += [flag, _rel(given, base)]
    if ctx is not None and context is not None and os.path.abspath(ctx) != os.path.abspath(default_context() or ""):
        options += ["--context", _rel(ctx, base)]
    for item in sets:
        options += ["--set", item]

    config_rel = _rel(config, base)
    ext: dict[str, Any] = {
        "config": _esc(config_rel),
        "network": network,
        "peers": {pid: names[pid] for pid in sorted(names)},
        "run_dir": _esc(_rel(run_dir, base)),
        "topology": _esc(_rel(host_topology, base)),
        "topology_hash": topo.hash(),
    }
    if address_book is not None:
        ext["addresses"] = _esc(_rel(address_book, base))
    if metrics:
        ext["metrics"] = {pid: metrics[pid] for pid in sorted(metrics)}
    doc: dict[str, Any] = {
        "x-p2pfl": _sorted(ext),
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
    return Deployment(text=text, services=names, topology=topo, address_book=address_book,
                      certs_dir=certs_dir, data_dir=data_dir, run_dir=run_dir, config=cfg)


def missing_certs(deployment: Deployment) -> list[Path]:
    """The certificate files the deployment mounts that do not exist yet."""
    files = [deployment.certs_dir / CA_CERT]
    for pid in deployment.services:
        files += [deployment.certs_dir / f"{pid}.crt", deployment.certs_dir / f"{pid}.key"]
    return [f for f in files if not f.is_file()]
