"""FedRoD (Chen & Chao, ICLR 2022) as a local rule for the Flower parameter-server baseline.

Why here: FedRoD is the fourth parameter-server baseline of DePRL's Table 7 (spec 004 §2). Its
server is plain FedAvg over the body and a *generic* head; each client also keeps a *personal*
head. So, like Ditto (``p2pfl.algorithms.ditto``), it is a local rule run by
``p2pfl flower --baseline fedrod``.

The model's one declared head (``PersonalModel.HEAD``, a ``nn.Linear``) is the generic head g. The
personal head p is a second linear layer of the same shape, kept in ``PeerState.extra`` (layout
order of the head: weight, then bias). FedRoD predicts with the sum of the two heads' logits,
``g(z) + p(z) = (W_g + W_p) z + (b_g + b_p)``: a model whose head is g + p, which is how the
baseline evaluates a client (the received global body and generic head, plus its own p).

One round on client k, receiving the global body and generic head, for ``local_epochs`` epochs;
per minibatch (x, y), with z = body(x):

1. body and generic head: one SGD step on the balanced-softmax loss
   ``CE(g(z) + log n_k, y)``, n_k the client's training label counts (classes it has no sample of
   get ``log 0 = -inf``: they drop out of the normalizer, as in the balanced softmax);
2. personal head: one SGD step on ``CE(g(z) + p(z), y)`` with z and g(z) held fixed (the
   gradient reaches p only), computed from the same forward pass as step 1.

Both steps use the shared ``rules.sgd_step_`` with the round's ``lr`` and ``weight_decay``. Our
choices where the DePRL spec is silent (its baselines' hyperparameters are not given): FedAvg's
local rule of the Table 1 runs (1 epoch, lr 0.1 x0.998, wd 5e-4), p starting at zero (the first
personalized model is the generic one), the same lr for p. Under ``p2pfl simulate`` a peer would
be evaluated with g alone, so the reported metric there is not FedRoD's.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from p2pfl.algorithms.base import Algorithm, PeerState, TrainContext
from p2pfl.badinput import BadInput

PERSONAL_HEAD = "fedrod_head"  # PeerState.extra key of p (flat, the head's layout order)


class FedRoD(Algorithm):
    """FedRoD's client: balanced-softmax update of body + generic head, CE update of the personal head."""

    name = "fedrod"
    shares = "all"
    defaults: ClassVar[dict[str, Any]] = {"lr": 0.1, "lr_decay": 0.998, "weight_decay": 5e-4, "local_epochs": 1}
    batched = False  # its own losses through ``run_sgd``: the exact engine (and the Flower baseline) only

    def init_state(self, state: PeerState, generator: torch.Generator) -> None:
        if len(self.layout.personal_names) != 2:  # p is "a second linear layer of the same shape"
            raise BadInput("fedrod needs a one-layer head (weight and bias); this model's has "
                           f"{len(self.layout.personal_names)} tensors", key="model.head_layers", allowed="1")
        numel = self.layout.numel - self.layout.num_shared  # the head's size
        state.extra[PERSONAL_HEAD] = torch.zeros(numel, dtype=state.params.dtype, device=state.params.device)

    def local_update(self, state: PeerState, ctx: TrainContext, round: int) -> dict[str, Any]:
        from p2pfl.algorithms.local_sgd import run_sgd
        from p2pfl.algorithms.rules import sgd_step_

        lr, wd = self.lr("lr", round), float(self.hp["weight_decay"])
        model, layout = ctx.model, ctx.layout
        named = dict(model.named_parameters())
        params = [named[s.name] for s in layout.specs]
        head = model.head()  # type: ignore[operator]
        # p as (weight, bias) views of the extra flat, in the head's layout order
        n0 = layout.num_shared
        p_flat = state.extra[PERSONAL_HEAD]
        p_views = {s.name: p_flat[s.offset - n0 : s.offset - n0 + s.numel].view(s.shape) for s in layout.personal_specs()}
        head_name = model.HEAD  # type: ignore[union-attr]
        p_w, p_b = p_views[f"{head_name}.weight"], p_views[f"{head_name}.bias"]
        log_prior = torch.log(ctx.data.train_label_counts().to(p_flat.dtype))  # -inf for absent classes
        p_bufs: list[torch.Tensor | None] = [None, None]
        personal_losses: list[float] = []

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            z = model.represent(x)  # type: ignore[operator]
            g = head(z)
            loss = F.cross_entropy(g + log_prior, y)  # balanced softmax: body + generic head
            loss.backward()
            w = p_w.detach().requires_grad_(True)
            b = p_b.detach().requires_grad_(True)
            personal = F.cross_entropy(g.detach() + F.linear(z.detach(), w, b), y)
            grads = torch.autograd.grad(personal, (w, b))
            with torch.no_grad():
                sgd_step_([p_w, p_b], list(grads), p_bufs, lr=lr, weight_decay=wd)
            personal_losses.append(float(personal.detach()))
            return loss

        loss = run_sgd(ctx, params, lr=lr, weight_decay=wd, epochs=float(self.hp["local_epochs"]), step_fn=step)
        return {"train_loss": loss,
                "personal_train_loss": sum(personal_losses) / max(len(personal_losses), 1)}


#: "fedrod-table1": FedAvg's local rule of the Table 1 runs (D-PSGD's: 1 epoch, lr 0.1 x0.998, wd 5e-4).
PRESETS: dict[str, dict[str, Any]] = {"fedrod-table1": dict(FedRoD.defaults)}
