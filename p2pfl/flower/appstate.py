"""A Flower App's model state (its ``state_dict``) split into what is mixed and what is only carried.

Flower's strategies ship every ``state_dict`` entry (parameters *and* buffers) in the ``"arrays"``
record, so an app's state holds more than float parameters: BatchNorm's running statistics (float
buffers), its ``num_batches_tracked`` counter (int64, 0-dim), any integer or boolean buffer. Each
entry lands in one of three places:

* **shared** float entries: the gossiped prefix of the peer's flat ``[shared | personal]`` buffer;
* **personal** float entries (a ``sharing.personal`` prefix or index, or a running statistic under
  ``sharing.running_stats: personal``): the flat buffer's personal part, checkpointed, never sent;
* **held** entries, the ones that cannot be averaged (integer, boolean, complex): never mixed,
  whatever ``sharing`` says; each peer keeps its own copy in ``PeerState.extra`` (so checkpoints
  and resumes carry them) and hands it to its app with the rest of the state.

Why ``running_stats`` is an option: averaging BatchNorm statistics across peers whose data differ
mixes feature distributions that do not match any one peer; FedBN (Li et al., ICLR 2021) keeps
normalization local for that reason. ``shared`` (the default) is what Flower's FedAvg does with the
same app; ``personal`` keeps each peer's statistics. FedBN proper also keeps the layer's affine
weights local: list the normalization layers' prefixes in ``sharing.personal`` for that.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from p2pfl.badinput import BadInput
from p2pfl.flower.records import array_record, load_arrays, tensor_of
from p2pfl.models.layout import ParamLayout

RunningStats = Literal["shared", "personal"]
RUNNING_STATS = ("shared", "personal")
#: ``state_dict`` suffixes of torch's normalization buffers (``_NormBase``: BatchNorm*, InstanceNorm*, SyncBatchNorm).
RUNNING_STAT_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")
#: Where a held entry lives in ``PeerState.extra`` (checkpointed with the peer).
HELD_PREFIX = "app-held/"


class AppStateError(BadInput):
    """An app's model state cannot be run peer to peer; the message names the entry and the config key."""


def is_running_stat(name: str) -> bool:
    """A normalization layer's running statistic (or its batch counter), by its ``state_dict`` name."""
    return name.rpartition(".")[2] in RUNNING_STAT_SUFFIXES


def mixable(t: torch.Tensor) -> bool:
    """Whether a weighted average of such tensors means something: real floating point only."""
    return t.is_floating_point()


@dataclass(frozen=True)
class AppLayout:
    """Where every entry of an app's state lives (see the module docstring).

    ``order``: the ``state_dict``'s own key order (what the app gets back); ``dtypes``: every entry's
    dtype (the flat buffer is float32; an entry is cast back before the app sees it); ``held``: the
    initial value of each held entry (every peer starts from the same one).
    """

    layout: ParamLayout
    order: tuple[str, ...]
    dtypes: dict[str, torch.dtype]
    held: dict[str, torch.Tensor]

    def init_extra(self, extra: MutableMapping[str, torch.Tensor]) -> None:
        """Give a new peer its own copy of the held entries (a resumed peer's come from its checkpoint)."""
        for name, value in self.held.items():
            extra[HELD_PREFIX + name] = value.clone()

    def tensors(self, mixed: Mapping[str, torch.Tensor], extra: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The app's whole state in ``state_dict`` order: ``mixed`` (views of the flat buffer) plus the held entries."""
        return {k: mixed[k] if k in mixed else extra[HELD_PREFIX + k] for k in self.order}

    def record(self, mixed: Mapping[str, torch.Tensor], extra: Mapping[str, torch.Tensor]) -> ArrayRecord:
        """The ``"arrays"`` record an app gets: every entry, each in its own dtype."""
        return array_record(self.tensors(mixed, extra), self.dtypes)

    def arrays(self, mixed: Mapping[str, torch.Tensor], extra: Mapping[str, torch.Tensor]) -> list[np.ndarray]:
        """The app's whole state as the unnamed list a legacy app (NumPyClient) gets: ``order``, own dtypes."""
        return [t.detach().cpu().to(self.dtypes[k]).contiguous().numpy() for k, t in self.tensors(mixed, extra).items()]

    def load_arrays(self, arrays: Sequence[np.ndarray], flat: torch.Tensor, extra: MutableMapping[str, torch.Tensor],
                    what: str) -> None:
        """``load`` for a legacy app's reply: the list is named by position (``order``), then checked as a record."""
        if len(arrays) != len(self.order):
            raise ValueError(f"{what} holds {len(arrays)} arrays, expected {len(self.order)} (the initial model's)")
        self.load(ArrayRecord({k: Array(np.asarray(a)) for k, a in zip(self.order, arrays, strict=True)}), flat,
                  extra, what)

    def load(self, record: ArrayRecord, flat: torch.Tensor, extra: MutableMapping[str, torch.Tensor],
             what: str) -> None:
        """Copy an app's reply into the peer's flat buffer and held entries; all checked before any is written.

        A held entry must come back with its shape and its kind of dtype (an integer stays an integer).
        """
        got = list(record.keys())
        if sorted(got) != sorted(self.order):
            extra_names, missing = sorted(set(got) - set(self.order)), sorted(set(self.order) - set(got))
            raise ValueError(f"{what} has wrong names (unexpected {extra_names}, missing {missing})")
        values: dict[str, torch.Tensor] = {}
        for name, want in self.held.items():
            arr = record[name]
            if tuple(arr.shape) != tuple(want.shape):
                raise ValueError(f"{what}: tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(want.shape)}")
            value = tensor_of(arr)
            if _kind(value.dtype) != _kind(want.dtype):
                raise ValueError(f"{what}: tensor {name!r} has dtype {value.dtype}, expected {want.dtype}")
            values[name] = value.to(want.dtype)
        mixed = ArrayRecord()
        for name in self.layout.shared_names + self.layout.personal_names:
            mixed[name] = record[name]
        load_arrays(self.layout.specs, mixed, flat, what)  # checks the mixed part before writing any of it
        for name, value in values.items():
            extra[HELD_PREFIX + name] = value.to(extra[HELD_PREFIX + name].device)


def _kind(dtype: torch.dtype) -> str:
    """``bool``, ``int`` or ``float``: what a held entry must keep when an app hands it back."""
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "int"


def app_layout(state: Mapping[str, torch.Tensor], personal: Sequence[str | int],
               running_stats: RunningStats = "shared") -> tuple[AppLayout, torch.Tensor]:
    """Split an app's initial state: the layout (shared keys first, each part in state order) and the flat buffer.

    A float entry is personal when it starts with a ``sharing.personal`` prefix (a string), sits at a
    ``sharing.personal`` index (an integer: its position in the state's order, which is the order of
    the list a NumPyClient's ``get_parameters`` returns; negative counts from the end), or is a running
    statistic under ``running_stats="personal"``; a non-float entry is held (module docstring).
    """
    names = list(state)
    prefixes: list[str] = []
    exact: set[str] = set()
    for p in personal:
        if isinstance(p, int) and not isinstance(p, bool):
            if not -len(names) <= p < len(names):
                raise AppStateError(f"index {p} is out of range: the app's state has {len(names)} arrays "
                                    f"(0..{len(names) - 1}, or -{len(names)}..-1 from the end)", key="sharing.personal")
            exact.add(names[p])
        elif not any(k.startswith(p) for k in state):
            raise AppStateError(f"prefix {p!r} matches no key of the app's state "
                                f"({', '.join(names[:8])}{', ...' if len(names) > 8 else ''})",
                                key="sharing.personal")
        else:
            prefixes.append(p)
    if running_stats not in RUNNING_STATS:
        raise AppStateError(f"not an allowed value: {running_stats!r}", key="sharing.running_stats",
                            allowed=RUNNING_STATS)
    for k, v in state.items():
        if v.layout != torch.strided or v.is_quantized:
            raise AppStateError(f"state entry {k!r} is a {v.layout} / quantized tensor: only dense tensors "
                                "can be carried", key="app")
        if v.is_complex():
            raise AppStateError(f"state entry {k!r} has dtype {v.dtype}: complex tensors are not supported",
                                key="app")
    mixed = [k for k, v in state.items() if mixable(v)]
    held = {k: v.detach().cpu().clone() for k, v in state.items() if not mixable(v)}

    def is_personal(k: str) -> bool:
        return k in exact or any(k.startswith(p) for p in prefixes) or (running_stats == "personal"
                                                                        and is_running_stat(k))

    shared = [k for k in mixed if not is_personal(k)]
    own = [k for k in mixed if is_personal(k)]
    if not shared:
        raise AppStateError("every floating-point tensor is personal; nothing would be gossiped",
                            key="sharing.personal")
    layout = ParamLayout.from_shapes({k: tuple(state[k].shape) for k in mixed}, shared, own)
    flat = torch.cat([state[s.name].detach().reshape(-1).to(torch.float32) for s in layout.specs])
    if not torch.isfinite(flat).all():
        bad = next(s.name for s in layout.specs if not torch.isfinite(state[s.name]).all())
        raise AppStateError(f"initial state entry {bad!r} contains NaN or Inf", key="app")
    dtypes = {k: v.dtype for k, v in state.items()}
    return AppLayout(layout, tuple(state), dtypes, held), flat


def as_state(made: object, what: str) -> dict[str, torch.Tensor]:
    """An initial model as a state dict of tensors: an ``nn.Module``, an ``ArrayRecord`` or a mapping."""
    if isinstance(made, torch.nn.Module):
        raw: Mapping[str, object] = made.state_dict()
    elif isinstance(made, ArrayRecord):
        raw = {k: tensor_of(v) for k, v in made.items()}
    elif isinstance(made, Mapping):
        raw = made
    else:
        raise AppStateError(f"{what} is a {type(made).__name__}, not an nn.Module, a state dict or an ArrayRecord",
                            key="app_init")
    out: dict[str, torch.Tensor] = {}
    for k, v in raw.items():
        if isinstance(v, torch.Tensor):
            out[str(k)] = v.detach().clone()
        elif isinstance(v, np.ndarray | np.generic | int | float | bool):
            out[str(k)] = torch.as_tensor(np.array(v, copy=True))
        else:
            raise AppStateError(f"state entry {k!r} of {what} is a {type(v).__name__}, not a tensor "
                                "(extra state that is not a tensor cannot be carried)", key="app_init")
    return out
