"""DePRL: personalized decentralized learning with a shared representation (spec 004).

Each round a worker takes tau SGD updates on its personal head theta_i (the final linear layer)
with the representation frozen, then exactly one SGD update on the representation phi_i with the
new head frozen, then gossips phi_i(k+1/2) only; heads are never sent nor averaged.
"""

from __future__ import annotations

from typing import Any, ClassVar

from p2pfl.algorithms.alternating import Phase, alternating_update, check_amount, check_unit
from p2pfl.algorithms.base import Algorithm, HyperparameterError, PeerState, TrainContext


class DePRL(Algorithm):
    """DePRL (spec 004 Algorithm 1, eqs. 3-7).

    Hyperparameters (defaults = the paper's appendix values, spec 004 §3.6):

    * ``lr_head`` (alpha) = 0.005 and ``lr_body`` (beta) = 0.01, both multiplied by ``lr_decay`` =
      0.96 after every round (checklist 7).
    * ``weight_decay`` = 1e-5, coupled L2 as in PyTorch SGD (§1.7 item 7: the form is unstated).
    * ``momentum`` = 0: eqs. (3)/(5) are plain SGD (§1.7 item 7); Remark 1 allows momentum. It
      applies to both phases, each with a momentum buffer that starts at zero (``ctx.train``: one
      buffer per phase call), so no optimizer state survives a round.
    * ``grad_clip`` = 0 (none; the paper states none): with ``grad_clip > 0`` each step's gradient
      of the trained block (head in the head phase, body in the body phase) is scaled to global L2
      norm at most ``grad_clip`` before weight decay and momentum (``rules.clip_grads``, the same
      rule in both engines). The authors' code clips at 10 (``deprl-authors``).
    * ``tau`` = 2 head updates, counted in ``tau_unit`` = ``steps`` by default. The text is
      ambiguous (§1.7 item 2: "epoch number" in the main text, "update steps" in the appendix and
      Fig. 8); steps is the default because eq. (3), Algorithm 1 and the whole analysis count tau
      minibatch SGD updates, and the appendix's hyperparameter list says steps. ``tau_unit:
      epochs`` gives the FedRep-code reading. All tau updates are kept: the paper's hand-off
      theta_i(k+1) = theta_i(k, tau-1) is an off-by-one (§1.7 item 1), the head after the last
      update theta_i(k, tau) is what the next phase and round use.
    * ``rep_steps`` = 1: exactly one representation SGD step per round on a fresh minibatch, as in
      Algorithm 1 and the theory (§1.7 item 3). Remark 1 allows more; the knob exists only for that
      generalization and defaults to the paper's one step. It is counted in ``rep_unit`` =
      ``steps`` by default; ``rep_unit: epochs`` (with ``tau_unit: epochs``) is the FedRep-code
      reading of the experiments, whose representation update count is unstated (§1.7 item 3).

    Other choices: head (tau) -> representation (1 step, gradient at the new head) -> gossip, each
    step on its own fresh minibatch (checklist 2); mixing with the topology's weights, self
    included, with a doubly-stochastic P (Metropolis on the static Ring / random / FC graphs,
    §1.6); one phi(0) on all workers (checklist 5, done by the Experiment); the evaluated model is
    the post-gossip (phi_i(k+1), theta_i(k+1)) (§1.7 item 5: "post-gossip is natural"). Models have
    no BatchNorm buffers in this code base, so item 6 does not arise.

    The authors' code mixes first, then trains (Main.py:127-142 of GYan58/AAAI24-DePRL; spec 004 §9).
    No option is needed for that order: every peer starts from the same phi(0), so its first mix is
    the identity (up to float rounding), and "mix, train, mix, train, ..." is this loop's "train,
    mix, train, mix, ..." without the last mix. The model the authors' order evaluates after round k's
    training is this loop's model before round k's gossip: ``eval_pre_gossip: true`` records it
    (``acc_pre_gossip``). The released code never calls its evaluation (``Logging``, Main.py:45-47), so
    when they evaluated is inferred, not read.
    """

    name = "deprl"
    shares = "shared"
    defaults: ClassVar[dict[str, Any]] = {
        "lr_head": 0.005, "lr_body": 0.01, "lr_decay": 0.96, "weight_decay": 1e-5, "momentum": 0.0,
        "tau": 2, "tau_unit": "steps", "rep_steps": 1, "rep_unit": "steps", "grad_clip": 0.0,
    }

    @classmethod
    def check(cls, hp: dict[str, Any]) -> None:
        super().check(hp)
        check_unit(cls.name, "tau_unit", hp["tau_unit"])
        check_amount(cls.name, "tau", hp["tau"], hp["tau_unit"])
        check_unit(cls.name, "rep_unit", hp["rep_unit"])
        check_amount(cls.name, "rep_steps", hp["rep_steps"], hp["rep_unit"])
        for key in ("momentum", "weight_decay", "grad_clip"):
            if not float(hp[key]) >= 0:
                raise HyperparameterError(f"{cls.name}: {key} must be >= 0")
        if not 0 < float(hp["lr_decay"]) <= 1:
            raise HyperparameterError(f"{cls.name}: lr_decay must be in (0, 1]")

    def phases(self, round: int) -> tuple[Phase, Phase]:
        common = {"momentum": float(self.hp["momentum"]), "weight_decay": float(self.hp["weight_decay"]),
                  "grad_clip": float(self.hp["grad_clip"])}
        head = Phase(lr=self.lr("lr_head", round), amount=float(self.hp["tau"]), unit=self.hp["tau_unit"], **common)
        body = Phase(lr=self.lr("lr_body", round), amount=float(self.hp["rep_steps"]),
                     unit=self.hp["rep_unit"], **common)
        return head, body

    def local_update(self, state: PeerState, ctx: TrainContext, round: int) -> dict[str, float]:
        head, body = self.phases(round)
        return alternating_update(ctx, head, body)


PRESETS: dict[str, dict[str, Any]] = {
    # Appendix hyperparameters (spec 004 §3.6); the batch size (128 CIFAR-100, 16 otherwise) is a
    # data setting, not an algorithm one. Spelled out (not ``DePRL.defaults``) so that a key added
    # to the class later does not change the configs of the runs made with this preset.
    "deprl-paper": {"lr_head": 0.005, "lr_body": 0.01, "lr_decay": 0.96, "weight_decay": 1e-5, "momentum": 0.0,
                    "tau": 2, "tau_unit": "steps", "rep_steps": 1, "rep_unit": "steps"},
    # What the authors' public code runs (GYan58/AAAI24-DePRL, spec 004 §9; file:line of its 2023-12
    # commit 341e890): SGD momentum 0.9 with a new optimizer every round (Sims.py:33, 138-140), one lr
    # 0.01 for head and body (Main.py:185) x0.96 per round (Sims.py:398-399, 434-436: the server's
    # StepLR, handed to the clients by updateLR), weight decay 1e-5 (Main.py:198), gradient norm
    # clipped at 10 (Sims.py:217, 235), 3 head epochs then 1 body epoch (Main.py:184; Sims.py:210,
    # 228: ``way2``, DePRL's local rule, Utils.py:837-842). Batch 16 (Main.py:197) and 200 rounds
    # (Main.py:186) are data and run settings; the personal part (the whole classifier,
    # Utils.py:747-753) is the model's (``model.head_layers``, ``alexnet_fmnist``).
    # Two differences remain (docs/results.md): their optimizer spans both phases of a round, so the
    # body phase starts with the momentum the head phase built from body gradients it then discarded
    # (here each phase starts from zero); and they clip the whole model's gradient norm, the frozen
    # block's gradient included (here the trained block's, the only one computed).
    "deprl-authors": {"lr_head": 0.01, "lr_body": 0.01, "lr_decay": 0.96, "weight_decay": 1e-5, "momentum": 0.9,
                      "tau": 3, "tau_unit": "epochs", "rep_steps": 1, "rep_unit": "epochs", "grad_clip": 10.0},
}
