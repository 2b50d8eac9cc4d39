"""What happens to a peer's payload between the algorithm and the transport, in every mode.

The Node hands its outgoing Payload to ``PayloadPipeline.send`` (experiment faults, then the wire
compression) and the received Messages to ``receive`` (top-k payloads made whole with the
receiver's own values), so the in-memory simulation and gRPC see the same values. The algorithm
still mixes its *own* uncompressed message as the self term: compression is only what crosses the
wire.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from p2pfl.faults import ByzantineFault, tamper
from p2pfl.payload import Payload
from p2pfl.wire.compress import BIT, WireFormat, compress_outgoing, densify


@dataclass(frozen=True)
class PayloadPipeline:
    """One peer's send/receive transforms: its fault (if it is an attacker) and the run's wire format."""

    wire: WireFormat = WireFormat()
    fault: ByzantineFault | None = None
    seed: int = 0

    @property
    def needed(self) -> bool:
        """Whether it changes anything (a Node without one skips it)."""
        return self.fault is not None or self.wire.compression != "none"

    def send(self, msg: Payload, extra: dict[str, torch.Tensor]) -> Payload:
        """The message as it goes on the wire (``extra``: the sender's state, for top-k's error feedback)."""
        if self.fault is not None:
            msg = tamper(msg, self.fault, self.seed)
        bits = tuple((s.offset, s.numel) for s in msg.manifest if s.dtype == BIT)
        return compress_outgoing(msg, self.wire, extra, bit_ranges=bits)

    def receive(self, received: dict[str, Payload], own: Payload) -> dict[str, Payload]:
        """The neighbours' messages as the algorithm mixes them (top-k: filled with ``own``'s values)."""
        if self.wire.compression != "topk":
            return received
        return {j: densify(m, own.flat) for j, m in received.items()}
