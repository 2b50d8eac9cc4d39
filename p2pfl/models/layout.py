"""Flat parameter layout: one contiguous buffer per peer, the model's parameters as views into it.

Why: mixing, encoding and checkpointing all want the shared part as one contiguous vector (one
weighted sum per peer, one socket write), and the simulation wants one model object per worker
with each peer's tensors swapped in. Ordering the buffer as ``[shared | personal]`` makes the
shared part a zero-copy slice, and binding a module's parameters as views of a peer's buffer
swaps a peer in without copying.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and place of one tensor inside a flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    #: How the tensor crosses the wire: ``float32`` (the default), or ``bit`` for 0/1 tensors sent bit-packed.
    dtype: str = "float32"


@dataclass(frozen=True)
class ParamLayout:
    """Where each named parameter of a model lives in the flat ``[shared | personal]`` buffer."""

    specs: tuple[TensorSpec, ...]
    num_shared: int  # number of *elements* in the shared prefix
    shared_names: tuple[str, ...]
    personal_names: tuple[str, ...]

    @classmethod
    def from_model(cls, model: nn.Module, shared: Sequence[str], personal: Sequence[str]) -> ParamLayout:
        params = dict(model.named_parameters())
        if set(shared) & set(personal):
            raise ValueError(f"parameters both shared and personal: {sorted(set(shared) & set(personal))}")
        if set(shared) | set(personal) != set(params):
            missing = sorted(set(params) - set(shared) - set(personal))
            raise ValueError(f"parameters neither shared nor personal: {missing}")
        if any(True for _ in model.buffers()):
            raise ValueError("models with buffers (e.g. BatchNorm running stats) are not supported")
        return cls.from_shapes({n: tuple(p.shape) for n, p in params.items()}, shared, personal)

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, tuple[int, ...]], shared: Sequence[str],
                    personal: Sequence[str]) -> ParamLayout:
        """The layout of named tensors of these shapes: ``shared`` first, then ``personal``, each in the given order."""
        specs: list[TensorSpec] = []
        offset = 0
        for name in [*shared, *personal]:
            numel = math.prod(shapes[name])
            specs.append(TensorSpec(name, tuple(shapes[name]), offset, numel))
            offset += numel
        num_shared = sum(s.numel for s in specs[: len(shared)])
        return cls(tuple(specs), num_shared, tuple(shared), tuple(personal))

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.specs)

    @property
    def num_personal(self) -> int:
        return self.numel - self.num_shared

    def shared_specs(self) -> tuple[TensorSpec, ...]:
        return self.specs[: len(self.shared_names)]

    def personal_specs(self) -> tuple[TensorSpec, ...]:
        return self.specs[len(self.shared_names) :]

    def flatten(self, model: nn.Module, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy the model's parameters into a (new) flat float32 buffer in layout order."""
        params = dict(model.named_parameters())
        first = next(iter(params.values()))
        if out is None:
            out = torch.empty(self.numel, dtype=torch.float32, device=first.device)
        for s in self.specs:
            out[s.offset : s.offset + s.numel].copy_(params[s.name].detach().reshape(-1))
        return out

    def bind(self, model: nn.Module, flat: torch.Tensor) -> None:
        """Make the model's parameters views of ``flat``: training then updates ``flat`` in place."""
        if flat.dim() != 1 or flat.numel() != self.numel or not flat.is_contiguous():
            raise ValueError(f"flat buffer must be contiguous 1-D with {self.numel} elements")
        params = dict(model.named_parameters())
        for s in self.specs:
            p = params[s.name]
            p.data = flat[s.offset : s.offset + s.numel].view(s.shape)
            p.grad = None

    def views(self, flat: torch.Tensor, part: str = "all") -> dict[str, torch.Tensor]:
        """Named views into ``flat`` (``part``: all | shared | personal).

        ``flat`` may carry leading dimensions (``[peers, numel]`` in the batched engine): each
        view is then ``[peers, *shape]``, still sharing ``flat``'s storage.
        """
        specs = {"all": self.specs, "shared": self.shared_specs(), "personal": self.personal_specs()}[part]
        lead = tuple(flat.shape[:-1])
        # One shape tuple, not unpacked arguments: a 0-dim tensor (a scalar parameter or buffer) has
        # shape (), and ``view()`` with no argument at all is a TypeError.
        return {s.name: flat[..., s.offset : s.offset + s.numel].view((*lead, *s.shape)) for s in specs}

    def shared_params(self, model: nn.Module) -> list[nn.Parameter]:
        params = dict(model.named_parameters())
        return [params[n] for n in self.shared_names]

    def personal_params(self, model: nn.Module) -> list[nn.Parameter]:
        params = dict(model.named_parameters())
        return [params[n] for n in self.personal_names]
