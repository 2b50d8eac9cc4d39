"""The round loop every peer runs, in every mode: train -> gossip step(s) -> evaluate -> record -> checkpoint.

The simulation runs one Node per peer (threads, in-memory transport); ``p2pfl node`` runs one
Node in its own process with the gRPC transport. Same code, same seeds, same results.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from p2pfl.algorithms.base import Algorithm, PeerState, TrainContext
from p2pfl.checkpoint import load_checkpoint, save_checkpoint
from p2pfl.messages import Message
from p2pfl.modelpool import ModelPool
from p2pfl.models.layout import ParamLayout
from p2pfl.peerapp import PeerApp
from p2pfl.topology import Topology
from p2pfl.transport.base import Transport

log = logging.getLogger(__name__)

Recorder = Callable[[dict[str, Any]], None]


class Node:
    def __init__(self, *, peer_id: str, topology: Topology, algorithm: Algorithm, app: PeerApp,
                 transport: Transport, models: ModelPool, layout: ParamLayout, state: PeerState,
                 generator: torch.Generator, seed: int, rounds: int, deadline_s: float,
                 record: Recorder, eval_every: int = 1, checkpoint_path: Path | None = None,
                 checkpoint_every: int = 1, stop: threading.Event | None = None,
                 on_round: Callable[[int], None] | None = None, quorum: float = 0.0) -> None:
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
        self.deadline_s = deadline_s
        self.record = record
        self.eval_every = eval_every
        self.checkpoint_path = checkpoint_path
        self.checkpoint_every = checkpoint_every
        self.stop = stop or threading.Event()
        self.on_round = on_round
        self.quorum = quorum

    # -- resume ------------------------------------------------------------------------------
    def resume(self) -> bool:
        """Load the last checkpoint if there is one; return whether it did."""
        if self.checkpoint_path is None or not self.checkpoint_path.exists():
            return False
        state, rng, _ = load_checkpoint(self.checkpoint_path, self.state.params.device)
        if state.peer_id != self.peer_id or state.params.shape != self.state.params.shape:
            raise ValueError(f"checkpoint {self.checkpoint_path} does not belong to peer {self.peer_id}")
        self.state = state
        self.generator.set_state(rng)
        log.info("%s: resumed from checkpoint at round %d", self.peer_id, state.round)
        return True

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> PeerState:
        while self.state.round < self.rounds and not self.stop.is_set():
            self.run_round(self.state.round)
        if self.state.round >= self.rounds:
            self.transport.linger(self.deadline_s)
        return self.state

    def run_round(self, r: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        with self.models.borrow((r, 0, self.topology.index(self.peer_id))) as model:
            t_start = time.perf_counter()  # compute time excludes waiting for a free worker
            self.layout.bind(model, self.state.params)
            ctx = TrainContext(model, self.layout, self.app.data, self.generator, self.state.params.device)
            train_metrics = self.algorithm.local_update(self.state, ctx, r)
            t_train = time.perf_counter() - t_start

        sent = recv = 0
        missing: set[str] = set()
        consensus = 0.0
        for step in range(self.algorithm.gossip_steps()):
            plan = self.topology.plan(self.peer_id, r, step, seed=self.seed, mode=self.algorithm.mode)
            flat, scalars = self.algorithm.outgoing(self.state, r, step)
            # A snapshot: the published payload must not change when this peer mixes.
            msg = Message(self.peer_id, r, step, self.topology_hash, self.algorithm.wire_specs(),
                          flat.detach().clone(), dict(scalars))
            res = self.transport.exchange(msg, plan, self.deadline_s)
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
                n = min(self.layout.num_shared, msg.flat.numel())
                mean = torch.stack([m.flat[:n] for m in res.received.values()]).mean(0)
                consensus = float(torch.linalg.vector_norm(msg.flat[:n] - mean))
            self.algorithm.combine(self.state, r, step, msg, res.received, plan)
            sent += res.bytes_sent
            recv += res.bytes_recv
            missing.update(res.missing)

        self.state.round = r + 1
        rec: dict[str, Any] = {"round": r, "peer": self.peer_id}
        if (r + 1) % self.eval_every == 0 or r + 1 == self.rounds:
            with self.models.borrow((r, 1, self.topology.index(self.peer_id))) as model:
                self.layout.bind(model, self.state.params)
                ev = self.app.evaluate(model)
            rec.update({k: v for k, v in ev.items() if k != "num_examples"})  # acc, loss (+ a ClientApp's own)
        rec.update({k: v for k, v in train_metrics.items() if isinstance(v, int | float)})
        rec.update(bytes_sent=sent, bytes_recv=recv,
                   consensus_dist=consensus, missing=sorted(missing), train_seconds=t_train,
                   seconds=time.perf_counter() - t0)
        self.record(rec)
        if self.checkpoint_path is not None and self.checkpoint_every and (
            (r + 1) % self.checkpoint_every == 0 or r + 1 == self.rounds
        ):
            save_checkpoint(self.checkpoint_path, self.state, self.generator)
        if self.on_round is not None:
            self.on_round(r)
        return rec
