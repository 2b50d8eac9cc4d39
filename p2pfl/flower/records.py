"""Conversions at the Flower boundary: named tensors <-> records, messages, and a Context's state.

Everything that arrives in a record is checked before it is used (names, shapes, dtype,
finiteness), so a refused record changes nothing. A ``Context.state`` is turned into tensors
plus one JSON document (never pickle) so it fits a peer checkpoint. A legacy (``client_fn``)
ClientApp's FitIns / EvaluateIns and FitRes / EvaluateRes go through Flower's own converters
(``flwr.compat.common.recorddict_compat``), so its layout is exactly what Flower's server sends.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.common.typing import Scalar

from p2pfl.models.layout import TensorSpec

ARRAYS_KEY = "arrays"  # what Flower's strategies send and quickstart apps read
CONFIG_KEY = "config"
SERVER_ROUND = "server-round"  # the round number Flower's strategies put in every config they send
METRICS_KEY = "metrics"
# Where a reply's metrics fill the run folder's ``acc``/``loss`` columns (first match wins).
ACC_NAMES = ("acc", "accuracy", "eval_acc", "eval_accuracy", "eval-acc", "eval-accuracy")
LOSS_NAMES = ("loss", "eval_loss", "eval-loss")
TTL_S = 43_200.0  # Flower's default message time-to-live (12 h); a peer's own messages never wait that long

_R = TypeVar("_R", ArrayRecord, ConfigRecord, MetricRecord)


def array_record(tensors: Mapping[str, torch.Tensor], dtypes: Mapping[str, torch.dtype] | None = None) -> ArrayRecord:
    """Named tensors as an ArrayRecord (Flower serializes each one as .npy bytes, no pickle).

    ``dtypes`` casts a tensor back to the dtype its owner declared (flat buffers are float32).
    """
    rec = ArrayRecord()
    for name, t in tensors.items():
        t = t.detach().cpu()
        if dtypes is not None and name in dtypes and t.dtype != dtypes[name]:
            t = t.to(dtypes[name])
        rec[name] = Array(t.contiguous().numpy())
    return rec


def tensor_of(arr: Array) -> torch.Tensor:
    """An Array's values as a (writable) tensor."""
    return torch.from_numpy(np.array(arr.numpy(), copy=True))


def record_of(content: RecordDict, key: str, kind: type[_R]) -> _R:
    """``content[key]``, refused unless it is a ``kind`` record (a message is never trusted)."""
    rec = content.get(key)
    if not isinstance(rec, kind):
        raise ValueError(f"message has no {kind.__name__} {key!r}")
    return rec


def number(rec: ConfigRecord | MetricRecord, key: str) -> float:
    """A scalar value of a record, refused unless it is a number."""
    value = rec.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"record value {key!r} is not a number: {value!r}")
    return float(value)


def scalar_metrics(rec: MetricRecord) -> dict[str, float]:
    """The scalar entries of a MetricRecord (lists are skipped: a metrics line holds scalars)."""
    return {k: float(v) for k, v in rec.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def message_metrics(msg: Message) -> dict[str, float]:
    """Every scalar metric of a reply, over all its MetricRecords."""
    out: dict[str, float] = {}
    for rec in msg.content.metric_records.values():
        out.update(scalar_metrics(rec))
    return out


def with_acc_loss(metrics: dict[str, float]) -> dict[str, float | None]:
    """``metrics`` plus the run folder's ``acc``/``loss`` columns, taken from the first usual name found.

    Apps name them differently (``accuracy``, ``eval_acc``, ...); summaries and plots read ``acc``.
    """
    out: dict[str, float | None] = dict(metrics)
    out["acc"] = next((metrics[k] for k in ACC_NAMES if k in metrics), None)
    out["loss"] = next((metrics[k] for k in LOSS_NAMES if k in metrics), None)
    return out


def train_columns(metrics: dict[str, float]) -> dict[str, float]:
    """Train metrics as recorded: Flower's ``num-examples`` is in both replies, the train one is renamed."""
    return {("train-num-examples" if k == "num-examples" else k): v for k, v in metrics.items()}


def load_arrays(specs: Sequence[TensorSpec], record: ArrayRecord, flat: torch.Tensor, what: str) -> None:
    """Copy ``record``'s tensors into ``flat`` at ``specs``' places; refuse anything but exactly ``specs``.

    Names, shapes, a floating-point dtype and finiteness are checked for every tensor before
    anything is written, so a refused record leaves ``flat`` as it was.
    """
    want = [s.name for s in specs]
    got = list(record.keys())
    if sorted(got) != sorted(want):
        extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
        raise ValueError(f"{what} has wrong names (unexpected {extra}, missing {missing})")
    decoded: list[tuple[int, int, np.ndarray]] = []
    for s in specs:
        arr = record[s.name]
        if tuple(arr.shape) != s.shape:
            raise ValueError(f"{what}: tensor {s.name!r} has shape {tuple(arr.shape)}, expected {s.shape}")
        value = arr.numpy()
        if value.dtype.kind != "f":
            raise ValueError(f"{what}: tensor {s.name!r} has dtype {value.dtype}, not floating point")
        if not np.isfinite(value).all():
            raise ValueError(f"{what}: tensor {s.name!r} contains NaN or Inf")
        decoded.append((s.offset, s.numel, value))
    for offset, numel, value in decoded:
        src = torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32).reshape(-1))
        flat[offset : offset + numel].copy_(src)


def round_content(template: RecordDict, arrays: ArrayRecord, server_round: int) -> RecordDict:
    """A message content for one round: ``template``'s records, its ArrayRecord replaced by ``arrays``
    and ``server-round`` set in each ConfigRecord that has it (records copied: the template is reused).

    ``template`` is what a Flower strategy sent in round 1 (its own record keys), so an app reads
    this round's content where and as it would under that strategy.
    """
    out = RecordDict()
    placed = False
    for key, rec in template.items():
        if isinstance(rec, ArrayRecord) and not placed:
            out[key], placed = arrays, True
        elif isinstance(rec, ConfigRecord):
            values = dict(rec)
            if SERVER_ROUND in values:
                values[SERVER_ROUND] = server_round
            out[key] = ConfigRecord(values)
        elif isinstance(rec, MetricRecord):
            out[key] = MetricRecord(dict(rec))
        else:
            out[key] = rec
    if not placed:
        out[ARRAYS_KEY] = arrays
    return out


def record_bytes(content: RecordDict) -> int:
    """Bytes of the tensors a message carries, as Flower counts them (``ArrayRecord.count_bytes``)."""
    return sum(rec.count_bytes() for rec in content.array_records.values())


def instruction(content: RecordDict, message_type: str, *, run_id: int, src_node_id: int, dst_node_id: int,
                message_id: str, group_id: str = "") -> Message:
    """An instruction Message built with Flower's public ``Metadata`` (no process-wide identity needed).

    Flower's runtimes give every message an id when they route it; a peer that hands its own
    ClientApp a message plays that part, so the id is given here.
    """
    metadata = Metadata(run_id=run_id, message_id=message_id, src_node_id=src_node_id, dst_node_id=dst_node_id,
                        reply_to_message_id="", group_id=group_id, created_at=time.time(), ttl=TTL_S,
                        message_type=message_type)
    return Message(content, metadata=metadata)


# -- Context.state <-> checkpointable tensors ----------------------------------------------------------
STATE_JSON = "flwr-state.json"  # key of the JSON document (uint8 tensor) among the tensors
_ARRAY_PREFIX = "flwr-state/"


def state_to_tensors(state: RecordDict) -> dict[str, torch.Tensor]:
    """A Context's state as named tensors: ArrayRecords' arrays as they are, the rest as one JSON.

    ConfigRecord/MetricRecord values are scalars, strings, bytes or lists of them; bytes become
    hex strings tagged in the JSON so they round-trip exactly.
    """
    out: dict[str, torch.Tensor] = {}
    doc: dict[str, dict] = {"arrays": {}, "config": {}, "metrics": {}}
    for key, rec in state.items():
        if isinstance(rec, ArrayRecord):
            names = []
            for i, (name, arr) in enumerate(rec.items()):
                out[f"{_ARRAY_PREFIX}{key}/{i}"] = tensor_of(arr)
                names.append(name)
            doc["arrays"][key] = names
        elif isinstance(rec, ConfigRecord):
            doc["config"][key] = {k: _jsonable(v) for k, v in rec.items()}
        elif isinstance(rec, MetricRecord):
            doc["metrics"][key] = dict(rec.items())
        else:  # pragma: no cover - a RecordDict holds only these three
            raise TypeError(f"unknown record type {type(rec).__name__}")
    out[STATE_JSON] = torch.frombuffer(bytearray(json.dumps(doc, sort_keys=True).encode()), dtype=torch.uint8)
    return out


def tensors_to_state(tensors: Mapping[str, torch.Tensor]) -> RecordDict:
    """The inverse of ``state_to_tensors`` (order of records and of arrays kept)."""
    if STATE_JSON not in tensors:
        return RecordDict()
    doc = json.loads(bytes(tensors[STATE_JSON].cpu().numpy().tobytes()).decode())
    state = RecordDict()
    for key, names in doc["arrays"].items():
        rec = ArrayRecord()
        for i, name in enumerate(names):
            rec[name] = Array(tensors[f"{_ARRAY_PREFIX}{key}/{i}"].cpu().contiguous().numpy())
        state[key] = rec
    for key, values in doc["config"].items():
        state[key] = ConfigRecord({k: _from_jsonable(v) for k, v in values.items()})
    for key, values in doc["metrics"].items():
        state[key] = MetricRecord(values)
    return state


def is_state_tensor(name: str) -> bool:
    return name == STATE_JSON or name.startswith(_ARRAY_PREFIX)


def _jsonable(v):
    if isinstance(v, bytes):
        return {"bytes": v.hex()}
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    return v


def _from_jsonable(v):
    if isinstance(v, dict):
        return bytes.fromhex(v["bytes"])
    if isinstance(v, list):
        return [_from_jsonable(x) for x in v]
    return v


# -- Flower's legacy message layout (a ClientApp built from client_fn: NumPyClient / Client) -----------
#: What the legacy strategies call a client's reply size; recorded like the Message API's ``num-examples``.
NUM_EXAMPLES = "num-examples"


@dataclass(frozen=True)
class LegacyReply:
    """A FitRes / EvaluateRes read back from a reply: the arrays (train only) and the scalar metrics.

    ``metrics`` holds the client's own scalar metrics, ``num-examples`` and, for evaluate, ``loss``
    (EvaluateRes carries the loss beside its metrics).
    """

    arrays: list[np.ndarray]
    metrics: dict[str, float]


def legacy_content(message_type: str, arrays: Sequence[np.ndarray], config: Mapping[str, Scalar]) -> RecordDict:
    """The content Flower's legacy server sends a ``client_fn`` ClientApp: FitIns / EvaluateIns as records.

    Built with Flower's own converters (``fitins_to_recorddict``), so the app's
    ``handle_legacy_message_from_msgtype`` reads exactly what a Flower server would send it: the
    arrays as ``Parameters`` (each one .npy bytes, unnamed, in order) and the config.
    """
    from flwr.common import EvaluateIns, FitIns, ndarrays_to_parameters
    from flwr.compat.common.recorddict_compat import evaluateins_to_recorddict, fitins_to_recorddict

    params = ndarrays_to_parameters(list(arrays))
    if message_type == MessageType.TRAIN:
        return fitins_to_recorddict(FitIns(params, dict(config)), keep_input=True)
    if message_type == MessageType.EVALUATE:
        return evaluateins_to_recorddict(EvaluateIns(params, dict(config)), keep_input=True)
    raise ValueError(f"no legacy layout for message type {message_type!r}")


def get_parameters_content() -> RecordDict:
    """A legacy ``get_parameters`` request (GetParametersIns, empty config), what Flower's server sends one
    client when its strategy has no initial parameters."""
    from flwr.common import GetParametersIns
    from flwr.compat.common.recorddict_compat import getparametersins_to_recorddict

    return getparametersins_to_recorddict(GetParametersIns(config={}))


def legacy_reply(message_type: str, content: RecordDict) -> LegacyReply:
    """Read a legacy reply (FitRes, EvaluateRes or GetParametersRes) with Flower's own converters.

    Refused (ValueError, one line) when the content is not that layout or its status is not OK;
    the arrays are decoded by Flower's ``parameters_to_ndarrays`` (``np.load`` without pickle).
    """
    from flwr.common import Code, parameters_to_ndarrays
    from flwr.compat.common.recorddict_compat import (
        recorddict_to_evaluateres,
        recorddict_to_fitres,
        recorddict_to_getparametersres,
    )

    name = {MessageType.TRAIN: "FitRes", MessageType.EVALUATE: "EvaluateRes"}.get(message_type, "GetParametersRes")
    try:
        if message_type == MessageType.TRAIN:
            res = recorddict_to_fitres(content, keep_input=True)
            metrics = {**_scalars(res.metrics), NUM_EXAMPLES: float(res.num_examples)}
            params = res.parameters
        elif message_type == MessageType.EVALUATE:
            res = recorddict_to_evaluateres(content)
            metrics = {**_scalars(res.metrics), NUM_EXAMPLES: float(res.num_examples), "loss": float(res.loss)}
            params = None
        else:
            res = recorddict_to_getparametersres(content, keep_input=True)
            metrics, params = {}, res.parameters
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"the reply is not a {name} ({type(exc).__name__}: {exc})") from None
    if res.status.code != Code.OK:
        raise ValueError(f"the {name} status is {res.status.code.name}: {res.status.message}")
    try:
        arrays = [] if params is None else parameters_to_ndarrays(params)
    except ValueError as exc:
        raise ValueError(f"the {name} parameters are not .npy arrays ({exc})") from None
    return LegacyReply(arrays, metrics)


def _scalars(values: Mapping[str, Scalar]) -> dict[str, float]:
    """The numeric entries of a legacy metrics dict (strings and bytes are not metrics columns)."""
    return {k: float(v) for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}
