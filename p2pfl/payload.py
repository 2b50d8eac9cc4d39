"""The wire-neutral payload a peer publishes for (round, step).

The in-memory transport hands these objects over as they are; the gRPC transport encodes
them with the wire codec (header + manifest + raw bytes) and decodes them back bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from p2pfl.models.layout import TensorSpec


@dataclass(frozen=True)
class Payload:
    """A peer's payload for one gossip exchange.

    ``flat`` is one contiguous float32 vector holding the tensors named by ``manifest`` (in
    order); ``scalars`` carries values such as the push-sum weight.
    """

    sender: str
    round: int
    step: int
    topology_hash: str
    manifest: tuple[TensorSpec, ...]
    flat: torch.Tensor
    scalars: dict[str, float] = field(default_factory=dict)
    #: How the codec encodes ``flat`` (``p2pfl.wire.compress``): the values are already what receivers see.
    compression: str = "none"
    #: Top-k only: the sorted int64 indices carried (``flat`` is zero elsewhere until ``densify``).
    indices: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Size of the uncompressed float32 tensor data (``p2pfl.wire.codec.wire_size``: what the wire carries)."""
        return self.flat.numel() * self.flat.element_size()

    def tensors(self) -> dict[str, torch.Tensor]:
        """Named views into ``flat``."""
        return {s.name: self.flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.manifest}
