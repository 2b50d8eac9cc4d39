"""``p2pfl k8s``: Kubernetes manifests for an experiment, one pod per peer, generated like the compose file.

Why this shape (the user-facing version is ``docs/deploy.md``):

* **One StatefulSet per peer** (replicas 1), all behind **one headless Service**. A peer is not an
  interchangeable replica: it has its own id, key and data split. A StatefulSet gives its pod a stable
  DNS name (``<statefulset>-0.<service>``, the address its neighbours dial), a persistent volume that
  survives restarts (the run folder: metrics and checkpoints, so a rescheduled pod resumes), and
  ordered, at-most-one-pod semantics (two copies of a peer never run at once). One StatefulSet for all
  peers would force every pod to mount every peer's key.
* **Addresses** come from an address book the ConfigMap carries (``addresses.yaml``: each peer at
  ``peer-<id>-0.<service>:<port>``, what ``network.addresses`` points at); the topology file goes
  into the ConfigMap byte for byte, so its hash (the graph's) is the same as in simulate, launch and
  compose. The certificates need no DNS names because peers verify each other by peer id
  (``grpc.ssl_target_name_override``), exactly as on loopback and in compose.
* **Certificates as Secrets**, one per peer (``p2pfl-certs-<id>``: ``ca.crt``, ``<id>.crt``,
  ``<id>.key``), written to a separate ``secrets.yaml`` (mode 0600, never to be committed) from a
  folder made by ``p2pfl certs``; without ``--certs`` the manifests reference them and the docs say
  how to create them with ``kubectl create secret``.
* **Health** uses the same probe as the container HEALTHCHECK (``p2pfl-entrypoint --healthcheck``,
  no torch import) for readiness and liveness; the headless Service publishes not-ready addresses,
  so peers find each other while starting (a peer waits for its neighbours within the round deadline).
* **GPUs**: ``--gpus N`` requests ``nvidia.com/gpu: N`` per pod: the scheduler gives each peer its own.
* **A Flower App directory** named by ``app:`` travels in a second ConfigMap (``p2pfl-app``), one key
  per file (keys cannot hold ``/``: the volume's ``items`` map each key back to its path), mounted
  read-only where compose mounts it (``IN_APP_DIR``) and named to every peer with ``--set app=``; the
  pods run the Flower image variant. ``__pycache__``, ``*.pyc`` and hidden files stay behind. A
  ConfigMap holds at most 1 MiB, so a directory over ``APP_MAX_BYTES`` is refused, and so is a file
  that is not UTF-8 text: an app directory is source code, and data belongs in the image or a volume
  (``binaryData`` could carry bytes, but would hide a data set in etcd).
* **Metrics**: each pod serves ``/metrics`` on the same port, annotated for Prometheus scraping.
* Deterministic output (sorted keys, no timestamps), like ``p2pfl compose``.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pfl.deploy.compose import (
    CA_CERT,
    DEFAULT_GPU_IMAGE,
    DEFAULT_IMAGE,
    FLOWER_SUFFIX,
    IN_ADDRESSES,
    IN_APP_DIR,
    IN_CERTS,
    IN_CONFIG,
    IN_RUN,
    IN_TOPOLOGY,
    ComposeError,
    _override_key,
    _sorted,
    app_directory,
    service_name,
)

__all__ = ["K8sError", "Manifests", "render_k8s"]

SERVICE = "p2pfl"
CONFIGMAP = "p2pfl-config"
APP_CONFIGMAP = "p2pfl-app"
#: The most bytes of a Flower App directory's files one ConfigMap carries (the API server's limit is 1 MiB).
APP_MAX_BYTES = 900 * 1024
GRPC_PORT = 50051
METRICS_PORT = 9400
APP_LABEL = "app.kubernetes.io/name"
PEER_LABEL = "p2pfl.dev/peer"
_QUANTITY_RE = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")
_KEY_RE = re.compile(r"[^-._a-zA-Z0-9]")


class K8sError(ComposeError):
    """The config cannot become Kubernetes manifests; the message says why."""


@dataclass(frozen=True)
class Manifests:
    """``documents``: every manifest but the Secrets; ``secrets``: the Secrets (None without ``certs``)."""

    documents: list[dict[str, Any]]
    secrets: list[dict[str, Any]] | None
    statefulsets: dict[str, str]  # peer id -> StatefulSet name


def secret_name(peer_id: str) -> str:
    return f"p2pfl-certs-{service_name(peer_id).removeprefix('peer-')}"


def pod_address(peer_id: str, service: str = SERVICE, port: int = GRPC_PORT) -> str:
    """The DNS name a peer's pod has inside the namespace (StatefulSet pod 0 behind the headless service)."""
    return f"{service_name(peer_id)}-0.{service}:{port}"


def _quantity(value: str, what: str) -> str:
    if not _QUANTITY_RE.match(value):
        raise K8sError(f"--{what} {value!r}: not a Kubernetes quantity (e.g. 1, 500m, 3Gi)")
    return value


def app_files(root: Path, where: str) -> dict[str, tuple[str, str]]:
    """A Flower App directory's files as ConfigMap entries: key -> (path inside the directory, text).

    Keys are the paths with ``/`` spelled ``__`` (a ConfigMap key is ``[-._a-zA-Z0-9]+``), made unique
    by a numeric suffix; ``__pycache__``, ``*.pyc`` and hidden files or folders are left out. `K8sError`
    (``where``: ``FILE: KEY``) for a directory without files, over ``APP_MAX_BYTES``, or a file that
    is not UTF-8 text.
    """
    if not root.is_dir():
        raise K8sError(f"{where}: {root} is not a directory")
    out: dict[str, tuple[str, str]] = {}
    total = 0
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part.startswith(".") or part == "__pycache__" for part in rel.parts) or path.suffix == ".pyc":
            continue
        if not path.is_file():
            continue
        raw = path.read_bytes()
        total += len(raw)
        if total > APP_MAX_BYTES:
            raise K8sError(f"{where}: the Flower App directory {root} holds more than {APP_MAX_BYTES // 1024} KiB "
                           "of files, more than a ConfigMap carries; build an image with the app in it instead")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise K8sError(f"{where}: {rel.as_posix()} in the Flower App directory {root} is not UTF-8 text; a "
                           "ConfigMap carries the app's source only: move data into the image or a volume") from None
        key = base = _KEY_RE.sub("_", rel.as_posix().replace("/", "__"))[:240]
        n = 1
        while key in out:
            n += 1
            key = f"{base}-{n}"
        out[key] = (rel.as_posix(), text)
    if not out:
        raise K8sError(f"{where}: the Flower App directory {root} has no files to ship")
    return out


def render_k8s(
    config: Path,
    *,
    sets: Sequence[str] | None = None,
    image: str | None = None,
    gpus: int = 0,
    certs: Path | None = None,
    namespace: str | None = None,
    cpu: str = "1",
    memory: str = "3Gi",
    storage: str = "1Gi",
    insecure: bool = False,
) -> Manifests:
    """Build the manifests for ``config`` without writing anything (`K8sError`, ConfigError, TopologyError)."""
    from p2pfl.config import load_config
    from p2pfl.topology import load_topology
    from p2pfl.topology.addressbook import AddressBook

    sets = list(sets or [])
    cfg = load_config(config, sets)
    if cfg.network.insecure and not insecure:
        raise K8sError("the config sets network.insecure, but the manifests use mutual TLS: drop it, "
                       "or pass --insecure to p2pfl k8s to deploy in plaintext on purpose")
    if gpus < 0:
        raise K8sError(f"--gpus {gpus}: must be >= 0")
    for value, what in ((cpu, "cpu"), (memory, "memory"), (storage, "storage")):
        _quantity(value, what)
    if namespace is not None and not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", namespace):
        raise K8sError(f"--namespace {namespace!r}: not a DNS label")
    topo = load_topology(cfg.topology)
    names = {p.id: service_name(p.id) for p in topo.peers}
    if len(set(names.values())) != len(names):
        raise K8sError("two peer ids map to the same StatefulSet name; rename one of them")
    # Where the pods run: the headless service's DNS names (whatever the config's own book says).
    book = AddressBook(tuple((pid, pod_address(pid)) for pid in topo.ids))
    app_dir = app_directory(cfg)
    app = app_files(app_dir, f"{config}: app") if app_dir is not None else None
    image = image or (DEFAULT_GPU_IMAGE if gpus else DEFAULT_IMAGE) + (FLOWER_SUFFIX if app is not None else "")
    meta_ns = {"namespace": namespace} if namespace else {}
    common = {APP_LABEL: "p2pfl", "app.kubernetes.io/part-of": cfg.name[:63]}

    # The pods see the config's own overrides, then the in-pod paths (last: they win; a host path is dropped).
    args: list[str] = []
    ours = ("topology", "network.addresses") + (("app",) if app is not None else ())
    for item in sets:
        if _override_key(item) not in ours:
            args += ["--set", item]
    args += ["--set", f"topology={IN_TOPOLOGY}", "--set", f"network.addresses={IN_ADDRESSES}"]
    if app is not None:
        args += ["--set", f"app={IN_APP_DIR}"]

    docs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": {"name": CONFIGMAP, "labels": dict(common), **meta_ns},
         "data": {"config.yaml": Path(config).read_text(encoding="utf-8"),
                  "topology.yaml": Path(cfg.topology).read_text(encoding="utf-8"),
                  "addresses.yaml": book.to_yaml(topo)}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": SERVICE, "labels": dict(common), **meta_ns},
         "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {APP_LABEL: "p2pfl"},
                  "ports": [{"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc"},
                            {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"}]}},
    ]
    if app is not None:
        docs.insert(1, {"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": APP_CONFIGMAP, "labels": dict(common), **meta_ns},
                        "data": {key: text for key, (_, text) in app.items()}})
    probe = {"exec": {"command": ["p2pfl-entrypoint", "--healthcheck"]}, "periodSeconds": 15, "timeoutSeconds": 10,
             "failureThreshold": 3}
    for peer in topo.peers:
        name = names[peer.id]
        labels = {**common, PEER_LABEL: peer.id}
        env = {"P2PFL_PEER": peer.id, "P2PFL_PORT": str(GRPC_PORT), "P2PFL_CONFIG": IN_CONFIG,
               "P2PFL_CERTS": IN_CERTS, "P2PFL_RUN_DIR": IN_RUN, "P2PFL_NO_DOWNLOAD": "1",
               "P2PFL_METRICS_PORT": str(METRICS_PORT), "P2PFL_METRICS_HOST": "0.0.0.0"}
        if insecure:
            env["P2PFL_INSECURE"] = "1"
        limits: dict[str, Any] = {"cpu": cpu, "memory": memory}
        if gpus:
            limits["nvidia.com/gpu"] = gpus
        mounts = [{"name": "config", "mountPath": IN_CONFIG, "subPath": "config.yaml", "readOnly": True},
                  {"name": "config", "mountPath": IN_TOPOLOGY, "subPath": "topology.yaml", "readOnly": True},
                  {"name": "config", "mountPath": IN_ADDRESSES, "subPath": "addresses.yaml", "readOnly": True},
                  {"name": "run", "mountPath": IN_RUN}]
        volumes: list[dict[str, Any]] = [{"name": "config", "configMap": {"name": CONFIGMAP}}]
        if app is not None:  # the directory rebuilt from the keys, read-only where compose mounts it
            mounts.append({"name": "flower-app", "mountPath": IN_APP_DIR, "readOnly": True})
            volumes.append({"name": "flower-app", "configMap": {
                "name": APP_CONFIGMAP, "items": [{"key": key, "path": rel} for key, (rel, _) in app.items()]}})
        if not insecure:
            mounts.append({"name": "certs", "mountPath": IN_CERTS, "readOnly": True})
            volumes.append({"name": "certs", "secret": {"secretName": secret_name(peer.id), "defaultMode": 0o400}})
        container = {
            "name": "peer", "image": image, "imagePullPolicy": "IfNotPresent", "args": list(args),
            "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
            "ports": [{"name": "grpc", "containerPort": GRPC_PORT}, {"name": "metrics", "containerPort": METRICS_PORT}],
            "resources": {"requests": dict(limits), "limits": dict(limits)},
            "readinessProbe": {**probe, "initialDelaySeconds": 5},
            "livenessProbe": {**probe, "initialDelaySeconds": 60},
            "volumeMounts": mounts,
        }
        pod_spec: dict[str, Any] = {
            "securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000, "runAsNonRoot": True},
            "terminationGracePeriodSeconds": int(float(cfg.network.round_timeout_s)) + 60,
            "containers": [container],
            "volumes": volumes,
        }
        docs.append({
            "apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": name, "labels": labels, **meta_ns},
            "spec": {
                "serviceName": SERVICE, "replicas": 1, "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": {APP_LABEL: "p2pfl", PEER_LABEL: peer.id}},
                "template": {"metadata": {"labels": labels, "annotations": {
                    "prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT),
                    "prometheus.io/path": "/metrics"}}, "spec": pod_spec},
                "volumeClaimTemplates": [{"metadata": {"name": "run"}, "spec": {
                    "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": storage}}}}],
            },
        })

    secrets = None
    if certs is not None and not insecure:
        secrets = []
        for peer in topo.peers:
            files = [CA_CERT, f"{peer.id}.crt", f"{peer.id}.key"]
            missing = [f for f in files if not (certs / f).is_file()]
            if missing:
                raise K8sError(f"--certs {certs}: {', '.join(missing)} not found; make them with "
                               f"`p2pfl certs --config {config} --out {certs}`")
            secrets.append({
                "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": secret_name(peer.id), "labels": {**common, PEER_LABEL: peer.id}, **meta_ns},
                "data": {f: base64.b64encode((certs / f).read_bytes()).decode("ascii") for f in files},
            })
    return Manifests(documents=[_sorted(d) for d in docs],
                     secrets=None if secrets is None else [_sorted(s) for s in secrets],
                     statefulsets=names)


def dump_all(documents: list[dict[str, Any]], header: str) -> str:
    import yaml

    return header + "".join("---\n" + yaml.safe_dump(d, sort_keys=False, width=120) for d in documents)
