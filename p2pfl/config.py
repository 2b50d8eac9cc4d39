"""Experiment configuration: one YAML file, dotted ``--set`` overrides, validation before anything runs.

A config names the topology, dataset, partition, model, algorithm (with its hyperparameters),
rounds, seed and device. Every command that takes a config accepts ``--set a.b=VALUE`` (VALUE is
parsed as YAML, so ``--set rounds=3`` is an int and ``--set algorithm.name=local`` a string).
A bad config is refused with a message naming the key; nothing is started.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config file or override is malformed; the message names the key."""


TOP_KEYS = {
    "name", "seed", "rounds", "device", "topology", "data", "model", "algorithm",
    "network", "simulation", "eval_every", "checkpoint",
}
DATA_KEYS = {"dataset", "root", "partition", "batch_size", "params"}
NETWORK_KEYS = {"round_timeout_s", "quorum", "max_message_mb", "chunk_kb", "insecure",
                "certs"}
SIMULATION_KEYS = {"workers"}
CHECKPOINT_KEYS = {"enabled", "every"}


@dataclass(frozen=True)
class DataConfig:
    dataset: str
    partition: dict[str, Any]
    batch_size: int = 32
    root: str | None = None
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NetworkConfig:
    """How a peer talks to its neighbours over gRPC (ignored by the in-memory simulation)."""

    round_timeout_s: float = 60.0  # how long a peer waits for its neighbours' payloads each step
    quorum: float = 0.0  # fraction of in-neighbours that must arrive (0: self alone is enough)
    max_message_mb: int = 256
    chunk_kb: int = 1024
    insecure: bool = False
    certs: str | None = None  # folder made by `p2pfl certs`


@dataclass(frozen=True)
class ExperimentConfig:
    """A validated experiment. ``raw`` is the resolved dict, saved with every run."""

    name: str
    seed: int
    rounds: int
    device: str
    topology: str  # path to a topology file
    data: DataConfig
    model: dict[str, Any]
    algorithm: dict[str, Any]
    network: NetworkConfig
    workers: int
    eval_every: int
    checkpoint_every: int  # 0 disables checkpoints
    raw: dict[str, Any]

    @property
    def algorithm_name(self) -> str:
        return str(self.algorithm["name"])

    def hyperparameters(self) -> dict[str, Any]:
        """Algorithm hyperparameters (everything under ``algorithm`` but its name)."""
        return {k: v for k, v in self.algorithm.items() if k != "name"}


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set ``a.b.c`` in a nested dict, creating mappings on the way (what ``--set`` does)."""
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"key {key!r} has an empty part")
    node = data
    for p in parts[:-1]:
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"cannot set {key!r}: {p!r} is not a mapping")
        node = nxt
    node[parts[-1]] = copy.deepcopy(value)


def apply_overrides(data: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """Return a copy of ``data`` with ``KEY=VALUE`` overrides (dotted keys, YAML values) applied."""
    out = copy.deepcopy(data)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not KEY=VALUE")
        key, _, text = item.partition("=")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({exc})") from exc
        try:
            set_dotted(out, key, value)
        except ConfigError as exc:
            raise ConfigError(f"override {item!r}: {exc}") from None
    return out


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _mapping(d: dict[str, Any], key: str, allowed: set[str] | None = None) -> dict[str, Any]:
    val = d.get(key) or {}
    _need(isinstance(val, dict), f"config key {key!r} must be a mapping")
    if allowed is not None:
        unknown = set(val) - allowed
        _need(not unknown, f"unknown keys under {key!r}: {sorted(unknown)} (allowed: {sorted(allowed)})")
    return val


def resolve_path(path: str, base: Path | None) -> str:
    """A path in a config is relative to the working directory, else to the config's folder."""
    p = Path(path)
    if p.is_absolute() or p.exists() or base is None:
        return str(p)
    cand = base / p
    return str(cand) if cand.exists() else str(p)


def parse_config(data: dict[str, Any], base: Path | None = None) -> ExperimentConfig:
    """Validate a config dict (overrides already applied) and resolve presets."""
    _need(isinstance(data, dict), "config must be a YAML mapping")
    unknown = set(data) - TOP_KEYS
    _need(not unknown, f"unknown top-level config keys: {sorted(unknown)} (allowed: {sorted(TOP_KEYS)})")
    for key in ("topology", "data", "model", "algorithm"):
        _need(key in data and data[key] is not None, f"config is missing {key!r}")
    seed = data.get("seed", 0)
    rounds = data.get("rounds", 10)
    _need(isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0, "'seed' must be an integer >= 0")
    _need(isinstance(rounds, int) and not isinstance(rounds, bool) and rounds >= 1, "'rounds' must be an integer >= 1")
    device = str(data.get("device", "cpu"))
    _need(device in {"cpu", "cuda", "auto"} or device.startswith("cuda:"), f"'device' must be cpu, cuda or auto, not {device!r}")
    topo = data["topology"]
    _need(isinstance(topo, str), "'topology' must be the path of a topology file")

    d = _mapping(data, "data", DATA_KEYS)
    _need(isinstance(d.get("dataset"), str), "'data.dataset' must name a dataset")
    part = d.get("partition", {"kind": "iid"})
    _need(isinstance(part, dict) and isinstance(part.get("kind"), str), "'data.partition' must be a mapping with 'kind'")
    bs = d.get("batch_size", 32)
    _need(isinstance(bs, int) and bs >= 1, "'data.batch_size' must be an integer >= 1")
    params = d.get("params") or {}
    _need(isinstance(params, dict), "'data.params' must be a mapping")
    data_cfg = DataConfig(dataset=d["dataset"], partition=dict(part), batch_size=bs, root=d.get("root"), params=dict(params))

    model = _mapping(data, "model")
    _need(isinstance(model.get("name"), str), "'model.name' must name a model")
    algo = _mapping(data, "algorithm")
    _need(isinstance(algo.get("name"), str), "'algorithm.name' must name an algorithm")
    algo = resolve_preset(algo)

    net = _mapping(data, "network", NETWORK_KEYS)
    try:
        network = NetworkConfig(**net)
    except TypeError as exc:  # pragma: no cover - keys are checked above
        raise ConfigError(f"network: {exc}") from exc
    _need(float(network.round_timeout_s) > 0, "'network.round_timeout_s' must be > 0")
    _need(0.0 <= float(network.quorum) <= 1.0, "'network.quorum' must be in [0, 1]")

    sim = _mapping(data, "simulation", SIMULATION_KEYS)
    workers = sim.get("workers", 2)
    _need(isinstance(workers, int) and workers >= 1, "'simulation.workers' must be an integer >= 1")
    ev = data.get("eval_every", 1)
    _need(isinstance(ev, int) and ev >= 1, "'eval_every' must be an integer >= 1")
    ck = _mapping(data, "checkpoint", CHECKPOINT_KEYS)
    ck_every = int(ck.get("every", 1)) if ck.get("enabled", True) else 0

    raw = copy.deepcopy(data)
    raw["algorithm"] = algo
    raw["topology"] = resolve_path(topo, base)
    return ExperimentConfig(
        name=str(data.get("name", "experiment")), seed=seed, rounds=rounds, device=device,
        topology=raw["topology"], data=data_cfg, model=dict(model), algorithm=algo, network=network,
        workers=workers, eval_every=ev, checkpoint_every=ck_every, raw=raw,
    )


def resolve_preset(algo: dict[str, Any]) -> dict[str, Any]:
    """Expand ``preset: NAME`` into its hyperparameters; keys given in the config win."""
    algo = dict(algo)
    preset = algo.pop("preset", None)
    if preset is None:
        return algo
    from p2pfl.algorithms.presets import all_presets

    PRESETS = all_presets()  # noqa: N806
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r} (known: {sorted(PRESETS)})")
    merged = {**PRESETS[preset], **algo}
    merged["preset"] = preset
    return merged


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read a YAML config, apply ``--set`` overrides and validate."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: config must be a YAML mapping")
    return parse_config(apply_overrides(data, overrides), base=p.parent)
