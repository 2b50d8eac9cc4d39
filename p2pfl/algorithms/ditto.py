"""Ditto (Li et al., ICML 2021) as a local rule for the Flower parameter-server baseline.

Why here: Ditto is one of the parameter-server baselines DePRL's Table 7 compares (spec 004 §2).
Its server is plain FedAvg over a global model w; what makes it Ditto is the client's *second*
model v_k, trained toward the global one with a proximal term. So it is a local rule
(``Algorithm.local_update``) run by ``p2pfl flower --baseline ditto``, whose server averages the
whole of w and whose evaluation uses each client's v_k (``Baseline.evaluate_extra``).

One round on client k, receiving the global w^t (Ditto's Algorithm 1, global update first):

1. global:   w_k  <- ``local_epochs`` epochs of SGD on F_k from w^t (FedAvg's own local rule;
   weight decay as coupled L2);  w_k is what the server averages;
2. personal: v_k  <- ``personal_epochs`` epochs of SGD on F_k(v) + (lam / 2) ||v - w^t||^2 from
   the client's previous v_k, i.e. per step ``v <- v - lr (grad F_k(v) + wd v + lam (v - w^t))``.

v_k starts as the initial model w^0 (every client's ``init_state``) and never leaves the client.
``lr`` (with the per-round ``lr_decay``) and ``weight_decay`` are shared by both updates, as in
Ditto's code. Under ``p2pfl simulate`` the peers' evaluated model would be w, not v_k, so the
reported metric there is not Ditto's: it is meant for the Flower baseline.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from p2pfl.algorithms.base import Algorithm, HyperparameterError, PeerState, TrainContext
from p2pfl.algorithms.local_sgd import Phase

PERSONAL = "ditto_personal"  # PeerState.extra key of v_k (flat, the model's layout order)


class Ditto(Algorithm):
    """Ditto's client: FedAvg's local update of w, then the proximal update of the personal v_k."""

    name = "ditto"
    shares = "all"
    defaults: ClassVar[dict[str, Any]] = {"lr": 0.1, "lr_decay": 0.998, "weight_decay": 5e-4, "local_epochs": 1,
                                          "personal_epochs": 1, "lam": 0.1}

    @classmethod
    def check(cls, hp: dict[str, Any]) -> None:
        super().check(hp)
        if not float(hp["personal_epochs"]) > 0:
            raise HyperparameterError(f"{cls.name}: personal_epochs must be > 0")

    def init_state(self, state: PeerState, generator: torch.Generator) -> None:
        state.extra[PERSONAL] = state.params.detach().clone()  # v_k^0 = w^0

    def local_update(self, state: PeerState, ctx: TrainContext, round: int) -> dict[str, Any]:
        lr, wd, lam = self.lr("lr", round), float(self.hp["weight_decay"]), float(self.hp["lam"])
        anchor = state.params.detach().clone()  # w^t, the global model received this round
        anchors = ctx.layout.views(anchor)
        loss = ctx.train("all", Phase(lr=lr, amount=float(self.hp["local_epochs"]), weight_decay=wd))
        global_k = state.params.detach().clone()
        with torch.no_grad():
            state.params.copy_(state.extra[PERSONAL])  # the bound model now holds v_k

        def prox(name: str, p: torch.Tensor) -> torch.Tensor:
            return (p - anchors[name]).mul_(lam)

        personal_loss = ctx.train("all", Phase(lr=lr, amount=float(self.hp["personal_epochs"]), weight_decay=wd),
                                  grad_term=prox)
        with torch.no_grad():
            state.extra[PERSONAL].copy_(state.params)
            state.params.copy_(global_k)  # the server gets w_k
        return {"train_loss": loss, "personal_train_loss": personal_loss}  # per peer in the batched engine


#: Ditto's own paper tunes lam per dataset; the DePRL spec gives none (spec 004 §2). "ditto-table1":
#: FedAvg's local rule of the Table 1 runs (D-PSGD's: 1 epoch, lr 0.1 x0.998, wd 5e-4), 1 personal epoch, lam 0.1.
PRESETS: dict[str, dict[str, Any]] = {"ditto-table1": dict(Ditto.defaults)}
