"""Full-model baselines: Local (no communication) and DFedAvg (local SGD, then gossip)."""

from __future__ import annotations

from typing import ClassVar

from p2pfl.algorithms.base import Algorithm, PeerState, TrainContext
from p2pfl.algorithms.local_sgd import run_sgd


class Local(Algorithm):
    """Each peer trains its whole model on its own data and never communicates."""

    name = "local"
    shares = "all"
    defaults: ClassVar = {"lr": 0.1, "local_epochs": 1, "momentum": 0.0, "weight_decay": 5e-4, "lr_decay": 1.0}

    def gossip_steps(self) -> int:
        return 0

    def local_update(self, state: PeerState, ctx: TrainContext, round: int) -> dict[str, float]:
        loss = run_sgd(ctx, list(ctx.model.parameters()), lr=self.lr("lr", round), epochs=self.hp["local_epochs"],
                       momentum=self.hp["momentum"], weight_decay=self.hp["weight_decay"])
        return {"train_loss": loss}


class DFedAvg(Local):
    """DFedAvg: local SGD epochs on the whole model, then one gossip step of the whole model."""

    name = "dfedavg"

    def gossip_steps(self) -> int:
        return 1
