"""Experiment configuration: one YAML file, dotted ``--set`` overrides, validation before anything runs.

A config names the topology, dataset, partition, model, algorithm (with its hyperparameters),
rounds, seed and device. Every command that takes a config accepts ``--set a.b=VALUE`` (VALUE is
parsed as YAML, so ``--set rounds=3`` is an int and ``--set algorithm.name=local`` a string).

The schema is typed (pydantic): one model per section below (``DataConfig``, ``NetworkConfig``,
``SimulationConfig``, ``CheckpointConfig``), each the single place that declares its keys, types,
ranges and defaults. To add a key, add a field to its section (with a ``Field`` range); it is then
parsed, range-checked, refused when misspelled (with a close match) and listed in errors. The
algorithm's hyperparameters have their own per-algorithm schema (``p2pfl.algorithms.hyperparameters``).

`load_config` validates the *whole* experiment before anything is written or started: the schema,
the algorithm's hyperparameters (types, ranges, cross-field rules), model, dataset, partition,
``data.root`` and the topology file. A bad config is refused with one `ConfigError` line
``FILE: KEY: problem; allowed: ...``.
"""

from __future__ import annotations

import copy
import functools
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

from p2pfl.badinput import BadInput, shorten, suggest
from p2pfl.schema import ConfigError, from_validation_error, yaml_number

if TYPE_CHECKING:
    from p2pfl.algorithms.registry import AlgorithmChoice

# ---- typed building blocks ---------------------------------------------------------------------

#: A finite float (ints accepted, ``1e-3`` strings read as numbers, bools refused).
Number = Annotated[float, BeforeValidator(yaml_number), Field(allow_inf_nan=False)]


class Section(BaseModel):
    """A config section: unknown keys refused, no silent coercion of strings to numbers, immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class DataConfig(Section):
    dataset: str
    partition: dict[str, Any] = Field(default_factory=lambda: {"kind": "iid"})
    batch_size: Annotated[int, Field(ge=1, le=1_000_000)] = 32
    root: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)


class NetworkConfig(Section):
    """How a peer talks to its neighbours over gRPC (ignored by the in-memory simulation)."""

    round_timeout_s: Annotated[Number, Field(gt=0, le=7 * 24 * 3600)] = 60.0  # wait per step for neighbours
    quorum: Annotated[Number, Field(ge=0, le=1)] = 0.0  # fraction of in-neighbours needed (0: self alone)
    max_message_mb: Annotated[int, Field(ge=1, le=65536)] = 256
    chunk_kb: Annotated[int, Field(ge=1, le=65536)] = 1024
    insecure: bool = False
    certs: str | None = None  # folder made by `p2pfl certs`
    # Address book (peer id -> host:port, p2pfl/topology/addressbook.py): where the peers run, kept
    # out of the topology so its hash covers the graph only. None: the topology file's own addresses.
    addresses: str | None = None
    # The round protocol (docs/protocol.md).
    mode: Literal["sync", "async"] = "sync"  # sync: round barrier; async: mix the freshest payloads held
    window: Annotated[int, Field(ge=1, le=64)] = 2  # past rounds a peer keeps serving (bounded skew)
    probe_s: Annotated[Number, Field(gt=0, le=3600)] = 2.0  # wait for a neighbour marked down (short probe)
    max_staleness: Annotated[int, Field(ge=0, le=1000)] = 4  # async: older payloads (in rounds) are dropped
    staleness_exp: Annotated[Number, Field(ge=0, le=16)] = 1.0  # async: weight ~ w_ij * (1 + s) ** -exp
    # A peer that every neighbour it calls refuses (TLS handshake, identity, topology or config hash)
    # this many rounds in a row stops with exit 1 and the causes (0: never; docs/protocol.md).
    refused_rounds: Annotated[int, Field(ge=0, le=1_000_000)] = 3
    # Experiments only: make a peer this many times slower (sleeps after training), e.g. {p3: 3.0}.
    slowdown: dict[str, Annotated[Number, Field(ge=1, le=1000)]] = Field(default_factory=dict)


class SimulationConfig(Section):
    # Ranks (processes) the peers are sharded over by a plain `p2pfl simulate` (one rank per core is
    # best); under torchrun the world size is the number of ranks and this is not used (docs/scale.md).
    workers: Annotated[int, Field(ge=1, le=4096)] = 2
    # exact: each peer runs the Node loop (bitwise equal to launch/compose); batched: all peers as
    # one stack of tensors, one vectorized step (p2pfl/engine/batched.py; equal up to float rounding).
    engine: Literal["exact", "batched"] = "exact"
    # Each worker process on a core of its own when the process may use exactly ``workers`` cores
    # (p2pfl/engine/exact.py, ``worker_cores``); false: the kernel places them.
    pin_cores: bool = True


class CheckpointConfig(Section):
    enabled: bool = True
    every: Annotated[int, Field(ge=1, le=1_000_000)] = 1
    # How long a failed write to the run folder (no space, read-only, I/O error) is retried, with
    # backoff, before the peer stops with one line and exit 74 (p2pfl/storage.py; 0: at once).
    storage_retry_s: Annotated[Number, Field(ge=0, le=7 * 24 * 3600)] = 60.0


class MixingConfig(Section):
    """How a peer combines what it received (docs/robust.md): plain weighted sum, or a robust rule."""

    robust: Literal["none", "median", "trimmed_mean", "clipped"] = "none"
    trim: Annotated[int, Field(ge=1, le=1000)] = 1  # trimmed_mean: inputs dropped at each end
    clip_radius: Annotated[Number, Field(gt=0, le=1e12)] = 1.0  # clipped: L2 radius around the own model


class ByzantineConfig(Section):
    """An attacker (experiments only): ``peer`` sends ``kind``-corrupted payloads (p2pfl/faults.py)."""

    peer: str
    kind: Literal["noise", "sign_flip", "scaled"]
    scale: Annotated[Number, Field(ge=-1e6, le=1e6)] = 1.0


class FaultsConfig(Section):
    byzantine: Annotated[list[ByzantineConfig], Field(max_length=4096)] = Field(default_factory=list)


class WireConfig(Section):
    """How payloads are encoded (p2pfl/wire/compress.py); every peer of a run must agree."""

    compression: Literal["none", "fp16", "bf16", "topk"] = "none"
    topk_ratio: Annotated[Number, Field(gt=0, le=1)] = 0.1  # topk: fraction of coordinates sent


class _Named(BaseModel):
    """``model`` / ``algorithm``: a name plus free parameters (checked against the named thing)."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: str


class ConfigFile(Section):
    """The whole file. Sections with defaults may be left out."""

    name: str = "experiment"
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] = 0
    rounds: Annotated[int, Field(ge=1, le=10_000_000)] = 10
    device: str = "cpu"
    # On CUDA, let convolutions and float32 matrix products round their inputs to TF32 (10-bit
    # mantissa): faster on Ampere and later, but a GPU run then no longer equals the CPU's up to float
    # reassociation. Off by default (IEEE float32, as on a CPU); no effect on a CPU.
    tf32: bool = False
    topology: str
    data: DataConfig
    model: _Named
    algorithm: _Named
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    simulation: SimulationConfig = Field(default_factory=SimulationConfig)
    eval_every: Annotated[int, Field(ge=1, le=10_000_000)] = 1
    # Also evaluate each peer's model right after local training, before it mixes (records
    # ``acc_pre_gossip``, ``loss_pre_gossip`` on the evaluated rounds). The round's accuracy (``acc``) is
    # the post-gossip model's; DePRL's spec (004 §1.7 item 5) leaves which one the paper reports open and
    # asks for both. Off by default: one more evaluation per evaluated round.
    eval_pre_gossip: bool = False
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    mixing: MixingConfig = Field(default_factory=MixingConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    wire: WireConfig = Field(default_factory=WireConfig)

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v in {"cpu", "cuda", "auto"} or re.fullmatch(r"cuda:\d{1,3}", v):
            return v
        raise ValueError("device: allowed: cpu, cuda, cuda:N, auto")


class SharingConfig(Section):
    """What of a ClientApp's state never leaves the peer (everything else is gossiped; p2pfl/flower/appstate.py)."""

    # State-dict key prefixes (strings), or positions in the app's state order (integers; negative
    # from the end), for a legacy app whose model is an unnamed list (NumPyClient.get_parameters).
    personal: list[StrictStr | StrictInt] = Field(default_factory=list)
    # BatchNorm-style running statistics: averaged like any shared float (as Flower's FedAvg does) or
    # kept by each peer (FedBN's choice). Integer buffers (num_batches_tracked) are never mixed.
    running_stats: Literal["shared", "personal"] = "shared"


class AppConfigFile(ConfigFile):
    """A config whose peers run a Flower ClientApp (``app``) instead of a built-in model and algorithm.

    The app brings its model, data and local rule, so ``model`` and ``algorithm`` are refused
    and ``data`` is optional (unused by p2pfl); see ``p2pfl.flower.clientapp``.
    """

    app: str  # "package.module:attr" of a flwr.clientapp.ClientApp, or a Flower App directory
    # "package.module:attr": the initial model (nn.Module factory, state dict or ArrayRecord); for a
    # Flower App directory it overrides the model its ServerApp starts from.
    app_init: str | None = None
    app_config: dict[str, Any] = Field(default_factory=dict)  # given to the app as context.run_config
    app_train_config: dict[str, Any] = Field(default_factory=dict)  # set in every train message's config
    sharing: SharingConfig = Field(default_factory=SharingConfig)
    data: DataConfig | None = None  # type: ignore[assignment]
    model: None = None  # type: ignore[assignment]
    algorithm: None = None  # type: ignore[assignment]


#: Top-level keys (derived from the schema; kept for callers that list them).
TOP_KEYS = set(ConfigFile.model_fields)


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
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    notes: tuple[str, ...] = ()  # one-line notices for the user (e.g. hyperparameters dropped by --set)
    mixing: MixingConfig = field(default_factory=MixingConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    tf32: bool = False  # CUDA convolutions and matrix products in TF32 (see ConfigFile.tf32)
    eval_pre_gossip: bool = False  # also evaluate before mixing (see ConfigFile.eval_pre_gossip)
    #: the algorithm resolved once (class + typed hyperparameters); None for a ClientApp config
    choice: AlgorithmChoice | None = None

    @property
    def algorithm_name(self) -> str:
        return str(self.algorithm["name"])

    def hyperparameters(self) -> dict[str, Any]:
        """Algorithm hyperparameters (everything under ``algorithm`` but its name)."""
        return {k: v for k, v in self.algorithm.items() if k != "name"}


# ---- overrides ---------------------------------------------------------------------------------


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set ``a.b.c`` in a nested dict, creating mappings on the way (what ``--set`` does)."""
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError("a key part is empty", key=shorten(key))
    node = data
    for p in parts[:-1]:
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"cannot set it: {p!r} is not a mapping", key=shorten(key))
        node = nxt
    node[parts[-1]] = copy.deepcopy(value)


def drop_dotted(data: dict[str, Any], keys: Iterable[str]) -> None:
    """Remove each dotted ``key`` (``a.b.c``) from ``data`` in place, where it is present."""
    for key in keys:
        *parents, leaf = key.split(".")
        node: Any = data
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)


def parse_override(item: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (key, YAML-parsed value)."""
    if "=" not in item:
        raise ConfigError(f"{shorten(item)!r} is not KEY=VALUE", source="--set")
    key, _, text = item.partition("=")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"value {shorten(text)!r} is not valid YAML ({problem})", source="--set",
                          key=shorten(key)) from None
    return key.strip(), value


def apply_overrides(data: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """Return a copy of ``data`` with ``KEY=VALUE`` overrides (dotted keys, YAML values) applied."""
    out = copy.deepcopy(data)
    for item in overrides or []:
        key, value = parse_override(item)
        try:
            set_dotted(out, key, value)
        except ConfigError as exc:
            raise exc.located("--set") from None
    return out


def switch_algorithm(data: dict[str, Any], overrides: list[str] | None) -> tuple[dict[str, Any], list[str]]:
    """Apply overrides; when they change ``algorithm.name``, drop the file's hyperparameters the new one lacks.

    The file's hyperparameters were written for the file's algorithm: ``--set algorithm.name=X``
    runs X with its own defaults, keeping only the file's values X also has (and everything set
    on the command line). Returns (config, notes) where notes say which keys were dropped.
    """
    out = apply_overrides(data, overrides)
    file_algo = data.get("algorithm") if isinstance(data.get("algorithm"), dict) else {}
    new_algo = out.get("algorithm")
    if not isinstance(new_algo, dict) or new_algo.get("name") == file_algo.get("name"):
        return out, []
    from p2pfl.algorithms.registry import hyperparameter_names

    try:
        allowed = set(hyperparameter_names(str(new_algo.get("name"))))
    except BadInput:
        return out, []  # an unknown name: refused with the list of algorithms by parse_config
    from_cli = {parse_override(s)[0].split(".", 1)[1] for s in overrides or [] if s.strip().startswith("algorithm.")}
    dropped = [k for k in list(new_algo) if k not in ("name", *from_cli) and (k not in allowed or k == "preset")
               and k in file_algo]
    for k in dropped:
        new_algo.pop(k)
    notes = []
    if dropped:
        from p2pfl.algorithms.presets import presets_for

        presets = presets_for(str(new_algo["name"]))
        notes.append(f"algorithm.name={new_algo['name']} (--set): dropped {file_algo.get('name')}'s "
                     f"{', '.join(dropped)} from the file; {new_algo['name']} uses its own defaults"
                     + (f" (its papers' presets: algorithm.preset={' | '.join(presets)})" if presets else ""))
    return out, notes


# ---- validation ----------------------------------------------------------------------------------

def resolve_path(path: str, base: Path | None) -> str:
    """A path in a config is relative to the working directory, else to the config's folder."""
    p = Path(path)
    if p.is_absolute() or p.exists() or base is None:
        return str(p)
    cand = base / p
    return str(cand) if cand.exists() else str(p)


def parse_config(data: dict[str, Any], base: Path | None = None, *, check_files: bool = True) -> ExperimentConfig:
    """Validate a config dict (overrides already applied), resolve presets, check the whole experiment.

    ``check_files=False`` skips what needs files on disk (topology, data.root), e.g. for a config
    generated before its topology.
    """
    if not isinstance(data, dict):
        raise ConfigError("a config must be a YAML mapping of keys to values")
    if "app" in data:
        return _parse_app_config(data, base, check_files)
    try:
        parsed = ConfigFile.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc, ConfigFile) from None

    from p2pfl.algorithms.registry import resolve

    algo = resolve_preset(dict(parsed.algorithm.model_dump()))
    given = {k: yaml_number(v) for k, v in algo.items() if k != "name"}
    choice = resolve(algo["name"], given)  # the one lookup and check; the peers build from it
    algo = {"name": algo["name"], **given}
    _check_model(parsed.model.model_dump())
    _check_data(parsed.data, base, check_files)

    raw = copy.deepcopy(data)
    raw["algorithm"] = algo
    raw["topology"] = resolve_path(parsed.topology, base)
    if check_files:
        _check_topology(raw["topology"])
    parsed = _resolve_addresses(parsed, raw, base, check_files)
    _check_robust_and_wire(parsed, algo, raw["topology"], check_files)
    ck = parsed.checkpoint
    return ExperimentConfig(
        name=parsed.name, seed=parsed.seed, rounds=parsed.rounds, device=parsed.device,
        topology=raw["topology"], data=parsed.data, model=dict(parsed.model.model_dump()), algorithm=algo,
        network=parsed.network, workers=parsed.simulation.workers, eval_every=parsed.eval_every,
        checkpoint_every=ck.every if ck.enabled else 0, raw=raw, simulation=parsed.simulation, checkpoint=ck,
        mixing=parsed.mixing, faults=parsed.faults, wire=parsed.wire, tf32=parsed.tf32,
        eval_pre_gossip=parsed.eval_pre_gossip, choice=choice,
    )


def _parse_app_config(data: dict[str, Any], base: Path | None, check_files: bool) -> ExperimentConfig:
    """A ClientApp config: the common keys as usual; the app's own (model, data, rule) are the app's business."""
    try:
        parsed = AppConfigFile.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc, AppConfigFile) from None
    raw = copy.deepcopy(data)
    _check_app_keys(parsed, raw, base, check_files)
    raw["topology"] = resolve_path(parsed.topology, base)
    if check_files:
        _check_topology(raw["topology"])
    parsed = _resolve_addresses(parsed, raw, base, check_files)
    _check_robust_and_wire(parsed, {"name": "clientapp"}, raw["topology"], check_files)
    ck = parsed.checkpoint
    return ExperimentConfig(
        name=parsed.name, seed=parsed.seed, rounds=parsed.rounds, device=parsed.device,
        topology=raw["topology"], data=parsed.data, model={}, algorithm={"name": "clientapp"},  # type: ignore[arg-type]
        network=parsed.network, workers=parsed.simulation.workers, eval_every=parsed.eval_every,
        checkpoint_every=ck.every if ck.enabled else 0, raw=raw, simulation=parsed.simulation, checkpoint=ck,
        mixing=parsed.mixing, faults=parsed.faults, wire=parsed.wire, tf32=parsed.tf32,
        eval_pre_gossip=parsed.eval_pre_gossip,
    )


def _check_app_keys(parsed: AppConfigFile, raw: dict[str, Any], base: Path | None, check_files: bool) -> None:
    """``app`` (an object or a Flower App directory, resolved like ``topology``) and ``app_init``;
    with ``check_files``, the directory's pyproject and the ``app_config`` keys it declares
    (p2pfl/appdir.py). Importing the app is left to the experiment (before any peer starts)."""
    from p2pfl.appdir import is_object_ref

    for key in ("app", "app_init"):
        ref = getattr(parsed, key)
        if ref is None or (key == "app" and not is_object_ref(ref)):
            continue
        module, sep, attr = ref.partition(":")
        if not (module and sep and attr):
            raise ConfigError(f"{shorten(ref)!r} is not 'package.module:attr'", key=key)
    if is_object_ref(parsed.app):
        if not parsed.app_init:
            raise ConfigError("missing: name the initial model ('package.module:Net'), or name a Flower App "
                              "directory as app (its ServerApp gives the model)", key="app_init")
        return
    raw["app"] = resolve_path(parsed.app, base)
    if check_files:
        from p2pfl.appdir import read_app_dir, run_config

        run_config(read_app_dir(raw["app"]), parsed.app_config)


def _check_robust_and_wire(parsed: ConfigFile, algo: dict[str, Any], topology_path: str, check_files: bool) -> None:
    """``mixing``, ``faults`` and ``wire`` against the algorithm, the engine and the topology (docs/robust.md)."""
    name = str(algo["name"])
    mode = "push" if algo.get("mix_mode") == "push" else "pull"
    if parsed.simulation.engine == "batched":
        if parsed.faults.byzantine:
            raise ConfigError("simulation.engine batched does not model the wire; use engine exact",
                              key="faults.byzantine")
        if parsed.wire.compression != "none":
            raise ConfigError("simulation.engine batched does not model the wire; use engine exact",
                              key="wire.compression")
        from p2pfl.algorithms import ALGORITHMS, algorithm_class

        if name in ALGORITHMS and not algorithm_class(name).batched:
            raise ConfigError(f"simulation.engine batched does not run {name} (its local rule has its own loss, "
                              "written for one peer); use engine exact", key="simulation.engine")
    if parsed.wire.compression == "topk" and (mode == "push" or name == "dispfl"):
        why = ("push-sum must deliver its whole mass" if mode == "push"
               else "dispfl's masks are bit tensors, and its masked averaging needs every held coordinate")
        raise ConfigError(f"topk cannot be used with {name}{' (mix_mode: push)' if mode == 'push' else ''}: {why}",
                          key="wire.compression", allowed="none, fp16, bf16")
    peers = [b.peer for b in parsed.faults.byzantine]
    dup = sorted({p for p in peers if peers.count(p) > 1})
    if dup:
        raise ConfigError(f"peer {shorten(dup[0])!r} is listed twice", key="faults.byzantine")
    if not check_files:
        return
    from p2pfl.algorithms.robust import MixingRule, check_supported
    from p2pfl.topology import load_topology

    topology = load_topology(topology_path)
    for i, p in enumerate(peers):
        if p not in topology.ids:
            close = suggest(p, topology.ids)
            raise ConfigError(f"peer {shorten(p)!r} is not in topology {topology.name!r}",
                              key=f"faults.byzantine[{i}].peer", hint=f"did you mean {close!r}?" if close else None)
    m = parsed.mixing
    check_supported(MixingRule(m.robust, m.trim, float(m.clip_radius)), topology, algorithm=name, mode=mode)


def _check_model(model: dict[str, Any]) -> None:
    from p2pfl.models import model_names
    from p2pfl.models.registry import model_parameters, model_value_problem

    name = model["name"]
    if name not in model_names():
        close = suggest(name, model_names())
        raise ConfigError(f"unknown model {shorten(name)!r}", key="model.name", allowed=model_names(),
                          hint=f"did you mean {close!r}?" if close else None)
    accepted = model_parameters(name)
    for k in model:
        if k != "name" and k not in accepted:
            close = suggest(k, accepted)
            raise ConfigError(f"not a parameter of model {name}", key=f"model.{k}", allowed=accepted or "none",
                              hint=f"did you mean {close!r}?" if close else None)
        problem = model_value_problem(name, k, model[k]) if k != "name" else None
        if problem is not None:
            raise ConfigError(problem, key=f"model.{k}")


def _check_data(d: DataConfig, base: Path | None, check_files: bool) -> None:
    from p2pfl.data.datasets import KNOWN_DATASETS, dataset_parameters
    from p2pfl.data.partition import BOOL_PARAMETERS, partition_parameters

    try:
        allowed_params = dataset_parameters(d.dataset)
    except KeyError:
        close = suggest(d.dataset, KNOWN_DATASETS)
        raise ConfigError(f"unknown dataset {shorten(d.dataset)!r}", key="data.dataset", allowed=KNOWN_DATASETS,
                          hint=f"did you mean {close!r}?" if close else None) from None
    for k in d.params:
        if k not in allowed_params:
            raise ConfigError(f"not a parameter of dataset {d.dataset}", key=f"data.params.{k}",
                              allowed=sorted(allowed_params) or "none")
    kind = d.partition.get("kind", "iid")
    try:
        allowed, required = partition_parameters(kind)
    except KeyError:
        from p2pfl.data.partition import PARTITION_KINDS

        close = suggest(kind, PARTITION_KINDS)
        raise ConfigError(f"unknown partition kind {shorten(repr(kind))}", key="data.partition.kind",
                          allowed=PARTITION_KINDS, hint=f"did you mean {close!r}?" if close else None) from None
    for k, v in d.partition.items():
        if k == "kind":
            continue
        if k not in allowed:
            close = suggest(k, allowed)
            raise ConfigError(f"not a parameter of the {kind} partition", key=f"data.partition.{k}",
                              allowed=sorted(allowed), hint=f"did you mean {close!r}?" if close else None)
        if k in BOOL_PARAMETERS:
            if v is not None and not isinstance(v, bool):
                raise ConfigError(f"must be true or false, got {shorten(repr(v), 60)}", key=f"data.partition.{k}")
        elif v is not None and (isinstance(v, bool) or not isinstance(v, int | float)
                                or isinstance(v, float) and not math.isfinite(v)):
            raise ConfigError(f"must be a finite number, got {shorten(repr(v), 60)}", key=f"data.partition.{k}")
    if required and d.partition.get(required) is None:
        raise ConfigError(f"the {kind} partition needs {required}", key=f"data.partition.{required}")
    if d.root is not None and check_files:
        root = Path(d.root)  # the loader reads it as given (relative to the working directory)
        if not root.is_dir():
            raise ConfigError(f"folder {shorten(d.root)!r} does not exist" if not root.exists()
                              else f"{shorten(d.root)!r} is not a folder", key="data.root")


def _resolve_addresses(parsed: Any, raw: dict[str, Any], base: Path | None, check_files: bool) -> Any:
    """``network.addresses`` resolved like ``topology`` (relative to the working directory, else the
    config's folder) and, with ``check_files``, checked against the topology's peers."""
    book = parsed.network.addresses
    if book is None:
        return parsed
    path = resolve_path(book, base)
    raw["network"] = {**raw.get("network", {}), "addresses": path}
    if check_files:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"address book {shorten(book)!r} not found", key="network.addresses")
        from p2pfl.topology.addressbook import placed_topology

        placed_topology(raw["topology"], path)  # AddressBookError names the book file and key
    return parsed.model_copy(update={"network": parsed.network.model_copy(update={"addresses": path})})


def _check_topology(path: str) -> None:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"topology file {shorten(path)!r} not found", key="topology")
    st = p.stat()
    _topology_ok(path, str(p.resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=64)
def _topology_ok(path: str, resolved: str, mtime_ns: int, size: int) -> bool:
    """Load once per file version (a sweep checks the same topology for every cell)."""
    from p2pfl.topology import load_topology

    load_topology(path)  # TopologyError names the topology file itself (errors are not cached)
    return True


def resolve_preset(algo: dict[str, Any]) -> dict[str, Any]:
    """Expand ``preset: NAME`` into its hyperparameters; keys given in the config win."""
    algo = dict(algo)
    preset = algo.pop("preset", None)
    if preset is None:
        return algo
    from p2pfl.algorithms.presets import all_presets, presets_for

    presets = all_presets()
    if preset not in presets:
        close = suggest(preset, presets)
        raise ConfigError(f"unknown preset {shorten(repr(preset))}", key="algorithm.preset",
                          allowed=presets_for(str(algo.get("name"))) or sorted(presets),
                          hint=f"did you mean {close!r}?" if close else None)
    fitting = presets_for(str(algo.get("name")))
    if fitting and preset not in fitting:
        raise ConfigError(f"preset {preset!r} is not for algorithm {algo.get('name')}", key="algorithm.preset",
                          allowed=fitting)
    merged = {**presets[preset], **algo}
    merged["preset"] = preset
    return merged


def load_config(path: str | Path, overrides: list[str] | None = None, *, check_files: bool = True,
                ) -> ExperimentConfig:
    """Read a YAML config (bounded loader), apply ``--set`` overrides and validate the whole experiment.

    Every refusal is a `ConfigError` naming this file (or ``--set``) and the key.
    """
    from p2pfl.yamlsafe import YamlLimits, load_yaml_file

    p = Path(path)
    data = load_yaml_file(p, "config file", YamlLimits(max_bytes=1 << 20, max_nodes=100_000))
    if not isinstance(data, dict):
        raise ConfigError("a config must be a YAML mapping of keys to values", source=str(p))
    from_cli = {parse_override(s)[0] for s in overrides or [] if "=" in s}
    merged, notes = switch_algorithm(data, overrides)
    try:
        cfg = parse_config(merged, base=p.parent, check_files=check_files)
    except BadInput as exc:
        if exc.key and exc.key in from_cli:
            exc.source = exc.source or "--set"
        raise exc.located(str(p)) from None
    if notes:
        cfg = ExperimentConfig(**{**cfg.__dict__, "notes": tuple(notes)})
    return cfg
