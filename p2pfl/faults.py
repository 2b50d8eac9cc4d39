"""Fault injection for experiments (``faults.byzantine``): a peer that sends well-formed garbage.

Why here and not in a transport: the attack is applied to the named peer's *outgoing message* by
the Node (``p2pfl.wire.pipeline``), before compression and encoding, so ``p2pfl simulate`` and
``p2pfl node`` (gRPC) send the very same bad values, and the robust mixing rules are measured in
both. The attacker keeps training its own model honestly; only what it sends is corrupted.

Kinds (``scale`` = s):

* ``noise``: ``x + s * N(0, 1)`` per coordinate, drawn from a generator seeded by (experiment seed,
  sender, round, step), so every mode draws the same noise;
* ``sign_flip``: ``-s * x``;
* ``scaled``: ``s * x``.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from typing import Literal

import torch

from p2pfl.payload import Payload

FAULT_KINDS: tuple[str, ...] = ("noise", "sign_flip", "scaled")


@dataclass(frozen=True)
class ByzantineFault:
    """One attacker: which peer, what it does to its payload, how strongly."""

    peer: str
    kind: Literal["noise", "sign_flip", "scaled"]
    scale: float = 1.0


def tamper(msg: Payload, fault: ByzantineFault, seed: int) -> Payload:
    """``msg`` with ``fault`` applied to its tensor values (scalars such as mu are left alone)."""
    flat = msg.flat.detach()
    if fault.kind == "sign_flip":
        bad = flat * (-float(fault.scale))
    elif fault.kind == "scaled":
        bad = flat * float(fault.scale)
    elif fault.kind == "noise":
        gen = torch.Generator(device="cpu")
        gen.manual_seed((int(seed) * 1_000_003 + zlib.crc32(msg.sender.encode()) * 7919
                         + msg.round * 101 + msg.step) % (2**63 - 1))
        noise = torch.randn(flat.shape, generator=gen, dtype=torch.float32)
        bad = flat + noise.to(flat.device) * float(fault.scale)
    else:  # pragma: no cover - the config schema admits only FAULT_KINDS
        raise ValueError(f"unknown fault kind {fault.kind!r}")
    return dataclasses.replace(msg, flat=bad)
