"""The built-in peer app: one peer's model factory, data and evaluation.

The library's own counterpart of a Flower ``ClientApp`` for the built-in algorithms: the Node
(decentralized) and the Flower baselines (``p2pfl.flower``) both measure a peer through it, so
a peer is evaluated the same way whoever drives it. A user's own ClientApp takes its place
through ``p2pfl.flower.clientapp`` (config key ``app``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from p2pfl.data.loader import PeerData


@dataclass
class PeerApp:
    peer_id: str
    model_fn: Callable[[], nn.Module]
    data: PeerData
    device: torch.device

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Personalized accuracy and loss on this peer's own test split."""
        model.eval()
        loss_sum, correct, n = 0.0, 0, 0
        for x, y in self.data.test_batches():
            out = model(x)
            loss_sum += float(F.cross_entropy(out, y, reduction="sum"))
            correct += int((out.argmax(1) == y).sum())
            n += int(y.numel())
        return {"loss": loss_sum / max(n, 1), "acc": correct / max(n, 1), "num_examples": float(n)}
