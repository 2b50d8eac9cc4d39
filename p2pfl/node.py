"""The round loop every peer runs, in every mode: train -> gossip step(s) -> evaluate -> record -> checkpoint.

The simulation runs one Node per peer (threads, in-memory transport); ``p2pfl node`` runs one
Node in its own process with the gRPC transport. Same code, same seeds, same results.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from p2pfl.algorithms.base import Algorithm, PeerState, TrainContext
from p2pfl.algorithms.dfedpgp import MU
from p2pfl.checkpoint import load_checkpoint, save_checkpoint
from p2pfl.modelpool import ModelPool
from p2pfl.models.layout import ParamLayout
from p2pfl.payload import Payload
from p2pfl.peerapp import PeerApp
from p2pfl.topology import MixingPlan, Topology
from p2pfl.transport.base import Transport
from p2pfl.transport.progress import catch_up_target
from p2pfl.transport.pushsum import MU_FLOOR, debit, withholds
from p2pfl.wire.pipeline import PayloadPipeline

log = logging.getLogger(__name__)

Recorder = Callable[[dict[str, Any]], None]


@dataclasses.dataclass(frozen=True)
class Protocol:
    """The round protocol's knobs a node needs (from ``network.*``; docs/protocol.md)."""

    asynchronous: bool = False  # network.mode == "async"
    window: int = 2
    probe_s: float = 2.0
    max_staleness: int = 4
    staleness_exp: float = 1.0
    slowdown: float = 1.0  # experiments only


def staleness_plan(plan: MixingPlan, staleness: dict[str, int], exp: float) -> MixingPlan:
    """Asynchronous mixing weights: ``w_ij * (1 + s_j) ** -exp`` for a payload ``s_j`` rounds old.

    A payload from a neighbour ahead (s < 0) counts as fresh (s = 0). The algorithm's pull-mode
    mixing renormalizes over self + what arrived, so the weights still sum to one.
    """
    if not staleness or exp == 0:
        return plan
    weights = {j: w * (1.0 + max(0, staleness[j])) ** -exp if j in staleness else w
               for j, w in plan.in_weights.items()}
    return dataclasses.replace(plan, in_weights=weights)


def _shares_storage(t: torch.Tensor, params: torch.Tensor) -> bool:
    """Whether ``t`` is a view of ``params``' memory (the Node then publishes it without a copy)."""
    return t.device == params.device and t.untyped_storage().data_ptr() == params.untyped_storage().data_ptr()


class Node:
    def __init__(self, *, peer_id: str, topology: Topology, algorithm: Algorithm, app: PeerApp,
                 transport: Transport, models: ModelPool, layout: ParamLayout, state: PeerState,
                 generator: torch.Generator, seed: int, rounds: int, deadline_s: float,
                 record: Recorder, eval_every: int = 1, checkpoint_path: Path | None = None,
                 checkpoint_every: int = 1, stop: threading.Event | None = None,
                 on_round: Callable[[int], None] | None = None, quorum: float = 0.0,
                 protocol: Protocol | None = None, pipeline: PayloadPipeline | None = None,
                 eval_pre_gossip: bool = False) -> None:
        self.peer_id = peer_id
        self.topology = topology
        self.topology_hash = topology.hash()
        self.algorithm = algorithm
        self.app = app
        self.transport = transport
        self.models = models
        self.layout = layout
        self.state = state
        self.generator = generator
        self.seed = seed
        self.rounds = rounds
        if transport is not None:  # the batched engine drives the node's state without one
            transport.final_round = rounds - 1  # push-sum settles in full there (no later push)
        self.deadline_s = deadline_s
        self.record = record
        self.eval_every = eval_every
        self.eval_pre_gossip = eval_pre_gossip
        self.checkpoint_path = checkpoint_path
        self.checkpoint_every = checkpoint_every
        self.stop = stop or threading.Event()
        self.on_round = on_round
        self.quorum = quorum
        self.protocol = protocol or Protocol()
        self.pipeline = pipeline if pipeline is not None and pipeline.needed else None  # faults, compression
        self.resumed_record: dict[str, Any] | None = None  # the last record stored with the checkpoint
        # fsync each checkpoint (survives a power loss); `simulate` turns it off (docs/protocol.md)
        self.durable_checkpoints = True
        # more metadata stored with every checkpoint: the run's fingerprint (Experiment.make_node),
        # which a resume compares with the config it is started with (p2pfl.resume.check_config)
        self.checkpoint_meta: dict[str, Any] = {}
        self._fast_forward_from: int | None = None
        self._resumed_at = -1
        self._replay_through = -1  # after a restart: rounds replayed before any catch-up (`resume`)
        self._short = False  # push-sum: some in-neighbour's share did not arrive in the last step
        # Catch-up (docs/protocol.md): in-neighbours to ask for evidence of their progress at the start
        # of the next round -- those whose payload did not arrive in the last one, or all after a restart.
        self._probe: set[str] = set()
        self._probe_all = False

    # -- resume ------------------------------------------------------------------------------
    def resume(self) -> bool:
        """Load the last checkpoint if there is one; return whether it did."""
        if self.checkpoint_path is None or not self.checkpoint_path.exists():
            return False
        state, rng, meta = load_checkpoint(self.checkpoint_path, self.state.params.device)
        if state.peer_id != self.peer_id or state.params.shape != self.state.params.shape:
            raise ValueError(f"checkpoint {self.checkpoint_path} does not belong to peer {self.peer_id}")
        self.state = state
        self.generator.set_state(rng)
        rec = meta.get("record")
        self.resumed_record = rec if isinstance(rec, dict) else None
        self.transport.restore_ledger(meta.get("ledger"))  # push-sum running totals of this very state
        self._short = bool(meta.get("short", False))  # push-sum: withholds as its uninterrupted self would
        self._resumed_at = state.round
        self._replay_through = self.published_through(state.round)
        log.info("%s: resumed from checkpoint at round %d", self.peer_id, state.round)
        return True

    def published_through(self, resumed: int) -> int:
        """The last round this peer may have published before the kill that a resume at ``resumed``
        follows: the round that ends the checkpoint interval starting there (``resumed`` itself when
        it checkpoints every round). Those rounds are replayed and recorded before any catch-up, so
        that a round whose payload the neighbours mixed is never skipped unrecorded (docs/protocol.md,
        "Metrics and checkpoint")."""
        every = max(1, self.checkpoint_every or 1)
        return min(resumed + (every - 1 - resumed) % every, self.rounds - 1)

    def rejoin(self) -> None:
        """After a restart: the first round asks every in-neighbour for evidence of where it is.

        It does not believe their Status answers (a claim): the catch-up pulls the payload of the
        round a neighbour names and moves only on what passed validation (`catch_up`). Pull mode
        replays from the checkpoint while its in-neighbours are within ``window`` rounds (they still
        serve what it needs); push-sum replays its resumed round first (recovery) in any case.
        """
        self._probe_all = True

    def catch_up(self) -> None:
        """Fast-forward to where the in-neighbours proved to be, if this peer fell behind them.

        Evidence only (``p2pfl/transport/progress.py``): the rounds of payloads from in-neighbours
        that passed validation -- pushes taken into the inbox, pulled payloads -- never a round a
        request or a Status answer claims. A strict majority of the round's in-neighbours must have
        proved a later round (``majority_round``); push mode moves on any such proof (an in-neighbour
        finishes round r only after this peer's round r decided its push, or after a fault), pull mode
        only beyond ``window`` (closer in-neighbours still serve this peer's rounds). Without a fault
        it never fires, and it asks nobody: only in-neighbours whose payload did not arrive in the
        last round (or all of them after a restart) are asked for evidence, within ``probe_s``.
        """
        r = self.state.round
        push = self.algorithm.mode == "push"
        if r <= self._replay_through:
            return  # the rounds it may have published before a restart are replayed and recorded first
        if push and r == self.transport.resumed_round():
            return  # push-sum replays its resumed round first: it may recover a push lost in the restart
        plan = self.topology.plan(self.peer_id, r, 0, seed=self.seed, mode=self.algorithm.mode)
        ins = sorted(plan.in_weights)
        probe = ins if self._probe_all else sorted(self._probe & set(ins))
        self._probe_all, self._probe = False, set()
        proven = self.transport.proven_rounds(ins, probe, self.protocol.probe_s)
        target = catch_up_target(r, proven, ins, push=push, window=self.protocol.window, rounds=self.rounds)
        if target is not None:
            log.warning("%s: in-neighbours proved round %d (%s); fast-forwarding from round %d", self.peer_id,
                        target, ",".join(f"{p}={proven[p]}" for p in ins if p in proven), r)
            if self._fast_forward_from is None:
                self._fast_forward_from = r
            self.state.round = target

    def _withhold(self, plan: MixingPlan) -> bool:
        """Push-sum weight floor: keep the whole share this step (docs/protocol.md, "Weight floor").

        A peer whose in-neighbour is down gives a share every step and receives none, so its mu
        would halve each round (on a directed ring) and DFedPGP's z = u / mu and lr / mu blow up.
        Below ``MU_FLOOR``, a peer that was short of an in-neighbour's share in its last step keeps
        everything (mass is conserved: nobody absorbs what it keeps). Never fires without a fault,
        so fault-free runs are bitwise the simulation's.
        """
        return (plan.mode == "push" and self.transport.can_withhold and MU in self.state.scalars
                and withholds(float(self.state.scalars[MU]), self._short))

    def _settle(self, amount: float, self_weight: float, last: bool) -> float:
        """Add a ledger settlement to mu (mu only: the de-biased model z = u / mu stays as it is, so the
        weight comes back or goes without a jolt to the model); returns what was applied.

        A debit goes only down to ``self_weight * MU_FLOOR`` (`pushsum.debit`): the rest is handed back
        to the transport, owed by this peer alone and applied with a later settlement, so no fault
        interleaving can drive a weight to zero (DFedPGP's body step is lr / mu)."""
        mu = float(self.state.scalars[MU])
        applied, deferred = debit(mu, amount, self_weight * MU_FLOOR, last=last)
        if deferred:
            self.transport.defer_settlement(deferred)
            log.warning("%s: %.6g of push-sum weight owed; deferred to keep mu above the floor", self.peer_id,
                        -deferred)
        self.state.scalars[MU] = mu + applied
        return applied

    def _evaluated(self, r: int) -> bool:
        """Whether round ``r`` is evaluated: every ``eval_every`` rounds and the last."""
        return (r + 1) % self.eval_every == 0 or r + 1 == self.rounds

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> PeerState:
        while self.state.round < self.rounds and not self.stop.is_set():
            if not self.protocol.asynchronous or self._probe_all:  # async: only where a restart left it
                self.catch_up()
            self.run_round(self.state.round)
        if self.state.round >= self.rounds:
            self.transport.linger(self.protocol.probe_s if self.protocol.asynchronous else self.deadline_s)
        return self.state

    def run_round(self, r: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        with self.models.borrow((r, 0, self.topology.index(self.peer_id))) as model:
            t_start = time.perf_counter()  # compute time excludes waiting for a free worker
            self.layout.bind(model, self.state.params)
            ctx = TrainContext(model, self.layout, self.app.data, self.generator, self.state.params.device)
            train_metrics = self.algorithm.local_update(self.state, ctx, r)
            t_train = time.perf_counter() - t_start
            pre_gossip: dict[str, float] = {}
            if self.eval_pre_gossip and self._evaluated(r):  # the model as trained, before it mixes
                self.layout.bind(model, self.state.params)
                ev = self.app.evaluate(model)
                pre_gossip = {f"{k}_pre_gossip": ev[k] for k in ("acc", "loss") if k in ev}
        if self.protocol.slowdown > 1.0:  # experiments only: a peer made this many times slower
            self.transport.sleep((self.protocol.slowdown - 1.0) * t_train)

        sent = recv = 0
        missing: set[str] = set()
        undelivered: set[str] = set()
        settled = 0.0
        withheld = False
        consensus = 0.0
        for step in range(self.algorithm.gossip_steps()):
            plan = self.topology.plan(self.peer_id, r, step, seed=self.seed, mode=self.algorithm.mode)
            flat, scalars = self.algorithm.outgoing(self.state, r, step)
            # The published payload must not change when this peer mixes. A view of the parameters is
            # published as it is (no copy while the peer waits for its neighbours: at 10,000 peers
            # nearly all of a worker's peers wait at once), and the parameters move to a copy of
            # their own just before mixing (copy on write); anything else is published as a snapshot.
            aliased = _shares_storage(flat, self.state.params)
            msg = Payload(self.peer_id, r, step, self.topology_hash, self.algorithm.wire_specs(),
                          flat.detach() if aliased else flat.detach().clone(), dict(scalars))
            # What crosses the wire (an attacker's fault, compression); `msg` stays the self term.
            wire_msg = self.pipeline.send(msg, self.state.extra) if self.pipeline else msg
            if self.protocol.asynchronous:
                res = self.transport.exchange_latest(wire_msg, plan, self.protocol.max_staleness,
                                                     self.protocol.probe_s)
                plan = staleness_plan(plan, {j: r - m.round for j, m in res.received.items()},
                                      self.protocol.staleness_exp)
            elif self._withhold(plan):
                withheld = True
                res = self.transport.exchange(wire_msg, plan, self.deadline_s, withhold=True)  # type: ignore[call-arg]
            else:
                res = self.transport.exchange(wire_msg, plan, self.deadline_s)
            if self.pipeline:
                res.received = self.pipeline.receive(res.received, msg)
            if res.undelivered and plan.mode == "push":
                # Push-sum: a share the receiver did not mix stays with the sender (no mass is lost).
                kept = sum(plan.out_weights[k] for k in res.undelivered)
                plan = dataclasses.replace(plan, self_weight=plan.self_weight + kept)
                undelivered.update(res.undelivered)
            if res.missing:
                log.warning("%s round %d step %d: no payload from %s", self.peer_id, r, step, ",".join(res.missing))
            need = math.ceil(self.quorum * len(plan.in_weights) - 1e-9)
            if len(res.received) < need and plan.mode == "pull":
                # Below quorum: do not let a few neighbours drag the model; keep our own this step.
                # (Push-sum mixes anyway: its weight already accounts for lost mass.)
                log.error("%s round %d step %d: quorum not met (%d of %d needed); keeping own model",
                          self.peer_id, r, step, len(res.received), need)
                res.received = {}
            if step == 0 and res.received:
                # Distance of our shared part to the mean of the neighbours' (same round, before mixing).
                # k * (mean - own) = sum - k * own: one temporary written k times (once for k = 1), a norm
                n = min(self.layout.num_shared, msg.flat.numel())
                k = len(res.received)
                # in plan order, as mixing: arrival order (the dict's) differs between transports and runs
                rank = {j: i for i, j in enumerate(plan.in_weights)}
                order = sorted(res.received, key=lambda j: (rank.get(j, len(rank)), j))
                flats = [res.received[j].flat[:n].to(msg.flat.device, non_blocking=True) for j in order]
                if k == 1:
                    gap = torch.sub(flats[0], msg.flat[:n])
                else:
                    gap = torch.add(flats[0], flats[1])
                    for f in flats[2:]:
                        gap.add_(f)
                    gap.sub_(msg.flat[:n], alpha=k)
                consensus = float(torch.linalg.vector_norm(gap)) / k
            if aliased:  # copy on write: the published payload keeps the old buffer
                self.state.params = self.state.params.clone()
            self.algorithm.combine(self.state, r, step, msg, res.received, plan)
            if plan.mode == "push":
                self._short = bool(res.missing or res.withheld)
                if res.mu_settle:  # the ledger's repair of a restart (docs/protocol.md)
                    settled += self._settle(res.mu_settle, plan.self_weight, r + 1 == self.rounds)
            sent += res.bytes_sent
            recv += res.bytes_recv
            missing.update(res.missing)
        self._probe = set(missing)  # whom the next round's catch-up asks for evidence of progress

        self.state.round = r + 1
        rec: dict[str, Any] = {"round": r, "peer": self.peer_id}
        if self._evaluated(r):
            with self.models.borrow((r, 1, self.topology.index(self.peer_id))) as model:
                self.layout.bind(model, self.state.params)
                ev = self.app.evaluate(model)
            rec.update({k: v for k, v in ev.items() if k != "num_examples"})  # acc, loss (+ a ClientApp's own)
            rec.update(pre_gossip)
        rec.update({k: v for k, v in train_metrics.items() if isinstance(v, int | float)})
        rec.update(bytes_sent=sent, bytes_recv=recv,
                   consensus_dist=consensus, missing=sorted(missing), train_seconds=t_train,
                   seconds=time.perf_counter() - t0)
        if MU in self.state.scalars and self.algorithm.mode == "push":
            rec["mu"] = float(self.state.scalars[MU])  # push-sum weight: sum over peers stays n
        if undelivered:
            rec["undelivered"] = sorted(undelivered)
        if settled:
            rec["mu_settled"] = settled
        if withheld:
            rec["withheld"] = True
        if self._fast_forward_from is not None:
            rec["fast_forward_from"], self._fast_forward_from = self._fast_forward_from, None
        # Checkpoint (atomic rename, carrying this record) first, then the metrics line: a kill in
        # between is repaired on resume from the record in the checkpoint (reconcile_metrics), so
        # no round is ever lost or recorded twice.
        if self.checkpoint_path is not None and self.checkpoint_every and (
            (r + 1) % self.checkpoint_every == 0 or r + 1 == self.rounds
        ):
            late = self.transport.late_settlement() if self.algorithm.mode == "push" else 0.0
            if late:  # e.g. a push mixed here whose OK could not be sent: its share goes back (mu only)
                sw = self.topology.plan(self.peer_id, r, 0, seed=self.seed, mode="push").self_weight
                rec["mu_settled"] = rec.get("mu_settled", 0.0) + self._settle(late, sw, r + 1 == self.rounds)
                rec["mu"] = float(self.state.scalars[MU])
            ledger = self.transport.ledger_state()  # push-sum running totals, consistent with this state
            extra = {"ledger": ledger, "short": self._short} if ledger is not None else {}
            save_checkpoint(self.checkpoint_path, self.state, self.generator,
                            meta={"record": rec, **extra, **self.checkpoint_meta},
                            durable=self.durable_checkpoints)
        self.record(rec)
        if self.on_round is not None:
            self.on_round(r)
        return rec
