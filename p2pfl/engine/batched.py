"""The batched simulation engine (``simulation.engine: batched``): all peers as one stack.

What the Node loop does per peer (train -> gossip step(s) -> evaluate -> record -> checkpoint),
done here for every peer at once:

* **state**: the peers are built by ``Experiment.make_node`` (same initial model, generators,
  algorithm state as every other mode), then stacked: ``params [peers, numel]``, each extra tensor
  ``[peers, ...]``, each scalar a ``[peers]`` float64 tensor;
* **train**: the algorithm's own ``local_update`` on a ``BatchedContext`` (one vectorized step for
  all peers, the shared update rules);
* **gossip**: per step, the plans of all peers become one weight matrix and the algorithm's
  ``combine_stacked`` mixes with one matrix product;
* **evaluate, record, checkpoint**: batched evaluation; one metrics record per peer per round with
  the exact engine's keys; the same per-peer checkpoint files.

Not bitwise equal to the exact engine (sums run in another order): equal within float
reassociation, which ``tests/test_batched.py`` checks for every algorithm. Everything arrives in a
simulation, so the network knobs (quorum, deadlines, asynchronous mode) play no part here. The
per-peer timings in the records are the batch's times divided by the number of peers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from p2pfl.algorithms.base import Algorithm, PeerState
from p2pfl.algorithms.dfedpgp import MU
from p2pfl.checkpoint import load_checkpoint, save_checkpoint
from p2pfl.config import ExperimentConfig
from p2pfl.data.loader import PeerData
from p2pfl.engine.context import BatchedContext
from p2pfl.engine.mixing import consensus_distances, step_mixing
from p2pfl.experiment import Experiment
from p2pfl.payload import Payload
from p2pfl.resume import drop_generations, keep_generations, prepare_resume
from p2pfl.runfolder import RunFolder
from p2pfl.wire.codec import wire_size

log = logging.getLogger(__name__)

Record = Callable[[dict[str, Any]], None]


#: Most bytes of peer state one checkpoint copy takes off the device at a time.
CHECKPOINT_CHUNK_BYTES = 256 << 20


class BatchedEngineError(RuntimeError):
    """The batched engine cannot run this experiment (the message says why)."""


def stack_states(states: list[PeerState]) -> PeerState:
    """One PeerState whose tensors are the peers' stacked along a new first dimension."""
    first = states[0]
    return PeerState(
        peer_id="*",
        params=torch.stack([s.params for s in states]).contiguous(),
        extra={k: torch.stack([s.extra[k] for s in states]).contiguous() for k in first.extra},
        scalars={k: torch.tensor([float(s.scalars[k]) for s in states], dtype=torch.float64,
                                 device=first.params.device) for k in first.scalars},
        round=first.round,
    )


def rows_on(stacked: PeerState, rows: slice, device: torch.device) -> PeerState:
    """Peers ``rows`` of the stacked state, every tensor on ``device`` (views where they are there already)."""
    return PeerState(peer_id=stacked.peer_id, params=stacked.params[rows].to(device),
                     extra={k: v[rows].to(device) for k, v in stacked.extra.items()},
                     scalars={k: v[rows].to(device) for k, v in stacked.scalars.items()}, round=stacked.round)


def peer_state(stacked: PeerState, i: int, peer_id: str) -> PeerState:
    """Peer ``i``'s own PeerState (copies), as the exact engine would hold it."""
    return PeerState(peer_id=peer_id, params=stacked.params[i].clone(),
                     extra={k: v[i].clone() for k, v in stacked.extra.items()},
                     scalars={k: float(v[i]) for k, v in stacked.scalars.items()}, round=stacked.round)


def payload_size_keys(sender_bytes: list[int], scalars: dict[str, torch.Tensor]) -> list[tuple]:
    """For each row, what its payload's wire size depends on beyond the step (round, topology, specs:
    the same for every row): the sender id's length in bytes and, for each scalar, whether it is
    +0.0, -0.0 or neither. The header is protobuf: a double takes its fixed 8 bytes whatever its
    value, and only a zero may be left out (so +0.0 and -0.0 are told apart too); rows with equal
    keys have payloads of equal size (`p2pfl.wire.codec.wire_size`), so one probe per key serves all.
    """
    classes = [torch.where(v == 0, torch.where(torch.signbit(v), 2, 1), 0).tolist() for v in scalars.values()]
    return [(n, *(c[k] for c in classes)) for k, n in enumerate(sender_bytes)]


class BatchedSimulation:
    """Every peer of an experiment on one device, stepped together."""

    def __init__(self, exp: Experiment, run_dir: Path | None, record: Record) -> None:
        if getattr(exp, "app_spec", None) is not None:
            raise BatchedEngineError("simulation.engine 'batched' runs the built-in algorithms only, not a ClientApp "
                                     "('app:'); use engine 'exact'")
        self.exp = exp
        self.cfg = exp.cfg
        self.run_dir = run_dir
        self.record = record
        self.topology = exp.topology
        self.ids = list(self.topology.ids)
        self.index = {pid: i for i, pid in enumerate(self.ids)}
        self.sender_bytes = [len(pid.encode("utf-8")) for pid in self.ids]
        nodes = [exp.make_node(pid, transport=None, models=None, record=record,  # type: ignore[arg-type]
                               run_dir=None) for pid in self.ids]
        if any(n.pipeline is not None for n in nodes):
            raise BatchedEngineError("simulation.engine 'batched' applies neither wire.compression nor "
                                     "faults.byzantine; use engine 'exact'")
        self.algorithm: Algorithm = nodes[0].algorithm
        if not type(self.algorithm).batched:
            raise BatchedEngineError(f"simulation.engine 'batched' does not run {self.algorithm.name!r} (its local rule "
                                     "has its own loss, written for one peer); use engine 'exact'")
        self.topology_hash = self.topology.hash()
        self.chunk_bytes = int(self.cfg.network.chunk_kb) * 1024
        self.generators = [n.generator for n in nodes]
        self.state = stack_states([n.state for n in nodes])
        part = exp.partition
        datas = [PeerData(exp.dataset, part.train[i], part.test[i], self.cfg.data.batch_size, "cpu")
                 for i in range(len(self.ids))]
        self.ctx = BatchedContext(exp.build_model(), exp.layout, exp.dataset, datas, self.generators,
                                  self.state.params, exp.device)
        self.ckpt_dir = (run_dir / "checkpoints") if (run_dir is not None and self.cfg.checkpoint_every) else None

    # -- the loop -------------------------------------------------------------------------------
    def run(self, rounds: int | None = None) -> None:
        for r in range(self.state.round, rounds or self.cfg.rounds):
            self.run_round(r)

    def run_round(self, r: int) -> list[dict[str, Any]]:
        t0 = time.perf_counter()
        train = self.algorithm.local_update(self.state, self.ctx, r)
        self._sync()
        t_train = time.perf_counter() - t0
        total_rounds = self.cfg.rounds
        evaluated = (r + 1) % self.cfg.eval_every == 0 or r + 1 == total_rounds
        # the models as trained, before they mix (Node.run_round's eval_pre_gossip)
        pre = self.ctx.evaluate() if evaluated and self.cfg.eval_pre_gossip else None
        traffic = self.gossip(r)
        self.state.round = r + 1
        loss, acc = self.ctx.evaluate() if evaluated else (None, None)
        seconds = time.perf_counter() - t0
        recs = []
        P = len(self.ids)  # noqa: N806
        # one device-to-host copy per metric, not one per peer
        per_peer: dict[str, list[float]] = {}
        if evaluated:
            per_peer.update(acc=acc.tolist(), loss=loss.tolist())
        if pre is not None:
            per_peer.update(acc_pre_gossip=pre[1].tolist(), loss_pre_gossip=pre[0].tolist())
        for k, v in train.items():
            if isinstance(v, torch.Tensor):
                per_peer[k] = v.tolist() if v.dim() else [float(v)] * P
            elif isinstance(v, int | float):
                per_peer[k] = [v] * P
        if MU in self.state.scalars and self.algorithm.mode == "push":
            per_peer["mu"] = self.state.scalars[MU].tolist()  # push-sum weight, as the Node records it
        for i, pid in enumerate(self.ids):
            rec: dict[str, Any] = {"round": r, "peer": pid}
            rec.update({k: v[i] for k, v in per_peer.items()})
            rec.update(bytes_sent=traffic["sent"][i], bytes_recv=traffic["recv"][i],
                       consensus_dist=traffic["consensus"][i], missing=traffic["missing"][i],
                       train_seconds=t_train / P, seconds=seconds / P)
            recs.append(rec)
            self.record(rec)
        every = self.cfg.checkpoint_every
        if self.ckpt_dir is not None and every and ((r + 1) % every == 0 or r + 1 == total_rounds):
            self._checkpoint()
            keep_generations(self.ckpt_dir, self.ids, r + 1)  # what a resume restarts from (p2pfl/resume.py)
        return recs

    def restore(self, start: int) -> None:
        """Continue at round ``start`` from every peer's checkpoint file (as ``prepare_resume`` put them
        back): parameters, algorithm state and each peer's RNG, so the run goes on as if it had not stopped."""
        assert self.ckpt_dir is not None
        device = self.state.params.device
        states = []
        for i, pid in enumerate(self.ids):
            state, rng, _ = load_checkpoint(self.ckpt_dir / f"{pid}.npz", device)
            if state.peer_id != pid or state.params.shape != self.state.params[i].shape:
                raise BatchedEngineError(f"checkpoint {self.ckpt_dir / f'{pid}.npz'} does not belong to peer {pid}")
            if state.round != start:
                raise BatchedEngineError(f"checkpoint {self.ckpt_dir / f'{pid}.npz'} is of round {state.round}, "
                                         f"not {start}")
            self.generators[i].set_state(rng)
            states.append(state)
        stacked = stack_states(states)
        self.state.params.copy_(stacked.params)  # in place: the context trains these very rows
        self.state.extra, self.state.scalars, self.state.round = stacked.extra, stacked.scalars, stacked.round

    def _checkpoint(self) -> None:
        """Every peer's checkpoint file, as the exact engine's simulate writes them (not fsynced,
        docs/protocol.md). Off a GPU in a few copies of many peers each, not one copy per peer
        (a synchronization each) nor one of the whole stack (measured: 13.7 GB of host memory for
        128 AlexNet peers)."""
        assert self.ckpt_dir is not None
        per_peer = self.state.params[0].nbytes + sum(v[0].nbytes for v in self.state.extra.values())
        chunk = max(1, CHECKPOINT_CHUNK_BYTES // max(1, per_peer))
        for start in range(0, len(self.ids), chunk):
            host = rows_on(self.state, slice(start, start + chunk), torch.device("cpu"))
            for k, pid in enumerate(self.ids[start : start + chunk]):
                save_checkpoint(self.ckpt_dir / f"{pid}.npz", peer_state(host, k, pid), self.generators[start + k],
                                meta={"run": self.exp.fingerprint}, durable=False)

    # -- gossip ---------------------------------------------------------------------------------
    def gossip(self, r: int) -> dict[str, list]:
        """Every gossip step of round ``r`` for all peers: one sparse weight matrix, one product each."""
        P = len(self.ids)  # noqa: N806
        algo = self.algorithm
        sent, recv = [0] * P, [0] * P
        missing: list[set[str]] = [set() for _ in range(P)]
        consensus = [0.0] * P
        device = self.state.params.device
        for step in range(algo.gossip_steps()):
            plans = [self.topology.plan(pid, r, step, seed=self.cfg.seed, mode=algo.mode) for pid in self.ids]
            flat, scalars = algo.outgoing(self.state, r, step)
            own = flat.detach().clone()  # the snapshot every peer mixes (Jacobi, as the exact engine)
            scal = {k: (v.detach().clone().to(torch.float64) if isinstance(v, torch.Tensor)
                        else torch.full((P,), float(v), dtype=torch.float64, device=device))
                    for k, v in scalars.items()}
            ok = torch.isfinite(own).all(dim=1)  # a non-finite payload is refused by its receivers, as on the wire
            for v in scal.values():
                ok &= torch.isfinite(v)
            size = self._wire_sizes(r, step, own, scal, list(range(P)))
            mixing = step_mixing(plans, self.index, ok.cpu(), torch.tensor(size, dtype=torch.int64), P, device)
            for i, plan in enumerate(plans):
                sent[i] += size[i] * len(plan.out_weights)
            for i, got in enumerate(mixing.recv.tolist()):
                recv[i] += got
            for i, j in mixing.refused:
                missing[i].add(j)
            if step == 0:
                consensus = consensus_distances(mixing.arrived, own[:, : min(self.exp.layout.num_shared, own.shape[1])])
            algo.combine_stacked(self.state, r, step, own, scal, mixing.weights)
        return {"sent": sent, "recv": recv, "consensus": consensus, "missing": [sorted(m) for m in missing]}

    def _wire_sizes(self, r: int, step: int, own: torch.Tensor, scalars: dict[str, torch.Tensor],
                    peers: list[int]) -> list[int]:
        """Each row's payload size as the gRPC codec would put it on the wire (what the exact engine
        counts); row ``k`` is the payload of peer ``peers[k]``. One ``wire_size`` per distinct header
        shape, not per peer: see `payload_size_key`."""
        specs = self.algorithm.wire_specs()
        keys = payload_size_keys([self.sender_bytes[g] for g in peers], scalars)
        sizes: dict[tuple, int] = {}
        out = []
        for k, key in enumerate(keys):
            if key not in sizes:
                pid = self.ids[peers[k]]
                sizes[key] = wire_size(Payload(pid, r, step, self.topology_hash, specs, own[k],
                                               {n: float(v[k]) for n, v in scalars.items()}), self.chunk_bytes)
            out.append(sizes[key])
        return out

    def _sync(self) -> None:
        if self.state.params.device.type == "cuda":
            torch.cuda.synchronize(self.state.params.device)


def run_batched(exp: Experiment, run_dir: Path | None, record: Record, rounds: int | None = None) -> PeerState:
    """Run the whole experiment with the batched engine; return the stacked final state."""
    sim = BatchedSimulation(exp, run_dir, record)
    sim.run(rounds)
    return sim.state


def simulate_batched(cfg: ExperimentConfig, exp: Experiment, run_dir: Path, *, progress: bool = True,
                     resume: bool = False, accept_config_change: bool = False) -> dict[str, Any]:
    """``p2pfl simulate`` with ``simulation.engine: batched``: the same run folder as the exact engine.

    ``resume``: continue from the last round every peer checkpointed, as the exact engine does
    (``p2pfl/resume.py``), from the same per-peer checkpoint files and generations."""
    ids = list(exp.topology.ids)
    start = prepare_resume(run_dir, ids, before=cfg.rounds,
                           check=exp.resume_check(run_dir, accept_config_change)) if resume else 0
    run = RunFolder.start(run_dir, cfg, exp.topology, exp.partition, "simulate", append=start > 0)
    threads = torch.get_num_threads()
    # One process steps every peer, with one torch thread. ``simulation.workers`` torch threads
    # were tried: a step of one peer's batch (a few small kernels) is too small to split, and the
    # threads' synchronization burnt the CPU instead (measured, cnn_small batch 16, a loaded 2-core box: 10x
    # the CPU seconds of one thread per step, 7x the wall time of the exact engine per round).
    # Python threads over the peers cannot share the model either: functional_call swaps the
    # parameters of the one module in place.
    workers = 1
    torch.set_num_threads(1)
    if progress:
        run.show_progress(len(ids) * (cfg.rounds - start), "simulating (batched)")
    try:
        sim = BatchedSimulation(exp, run_dir, run.record)
        if start:
            sim.restore(start)
        for r in range(start, cfg.rounds):
            sim.run_round(r)
    finally:
        run.close()
        torch.set_num_threads(threads)
    drop_generations(run_dir)
    return run.finish(ids, {"engine": "batched", "workers": workers, "resumed_from_round": start},
                      rounds_run=cfg.rounds - start)
