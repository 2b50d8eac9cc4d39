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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from p2pfl import procgroup
from p2pfl.algorithms.base import Algorithm, PeerState
from p2pfl.algorithms.dfedpgp import MU
from p2pfl.checkpoint import load_checkpoint, save_checkpoint
from p2pfl.config import ExperimentConfig
from p2pfl.data.loader import PeerData
from p2pfl.engine import frames
from p2pfl.engine.context import BatchedContext
from p2pfl.engine.exact import simulate_ranks
from p2pfl.engine.frames import SimulationError
from p2pfl.engine.halo import Halo, RankFailed
from p2pfl.engine.mixing import StepEntries, consensus_distances, entries_from_matrix, step_mixing
from p2pfl.experiment import Experiment
from p2pfl.payload import Payload
from p2pfl.procgroup import FAILED, Ranks, RanksError
from p2pfl.resume import drop_generations, keep_generations
from p2pfl.topology.mixing import SparseMixing
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
    """The peers of an experiment that one rank holds (every peer, in one process) on one device,
    stepped together; ``owner[g]``: the rank of peer ``g`` (`p2pfl.topology.placement.place`)."""

    def __init__(self, exp: Experiment, run_dir: Path | None, record: Record, ranks: Ranks | None = None,
                 owner: Sequence[int] | None = None) -> None:
        if getattr(exp, "app_spec", None) is not None:
            raise BatchedEngineError("simulation.engine 'batched' runs the built-in algorithms only, not a ClientApp "
                                     "('app:'); use engine 'exact'")
        self.exp = exp
        self.cfg = exp.cfg
        self.run_dir = run_dir
        self.record = record
        self.topology = exp.topology
        self.ids = list(self.topology.ids)
        self.sender_bytes = [len(pid.encode("utf-8")) for pid in self.ids]
        ranks = ranks or procgroup.single()
        owner = list(owner) if owner is not None else [0] * len(self.ids)
        self.local = [g for g, w in enumerate(owner) if w == ranks.rank]  # this rank's peers, in row order
        self.peers = [self.ids[g] for g in self.local]
        self.halo = Halo(ranks, owner, self.local)
        self.held = np.zeros(len(self.ids), dtype=bool)  # this rank's peers, as a mask over every peer
        self.held[self.local] = True
        self._step_entries: tuple[SparseMixing, StepEntries] | None = None
        nodes = [exp.make_node(pid, transport=None, models=None, record=record,  # type: ignore[arg-type]
                               run_dir=None) for pid in self.peers]
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
        datas = [PeerData(exp.dataset, part.train[g], part.test[g], self.cfg.data.batch_size, "cpu")
                 for g in self.local]
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
        P = len(self.peers)  # noqa: N806
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
        for i, pid in enumerate(self.peers):
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
            keep_generations(self.ckpt_dir, self.peers, r + 1)  # what a resume restarts from (p2pfl/resume.py)
        return recs

    def restore(self, start: int) -> None:
        """Continue at round ``start`` from every peer's checkpoint file (as ``prepare_resume`` put them
        back): parameters, algorithm state and each peer's RNG, so the run goes on as if it had not stopped."""
        assert self.ckpt_dir is not None
        device = self.state.params.device
        states = []
        for i, pid in enumerate(self.peers):
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
        for start in range(0, len(self.peers), chunk):
            host = rows_on(self.state, slice(start, start + chunk), torch.device("cpu"))
            for k, pid in enumerate(self.peers[start : start + chunk]):
                save_checkpoint(self.ckpt_dir / f"{pid}.npz", peer_state(host, k, pid), self.generators[start + k],
                                meta={"run": self.exp.fingerprint}, durable=False)

    # -- gossip ---------------------------------------------------------------------------------
    def gossip(self, r: int) -> dict[str, list]:
        """Every gossip step of round ``r`` for this rank's peers: the rows of other ranks' peers they
        read fetched (`Halo`), then one sparse weight matrix over own + halo rows, one product each."""
        P = len(self.peers)  # noqa: N806
        algo = self.algorithm
        sent, recv = np.zeros(P, dtype=np.int64), np.zeros(P, dtype=np.int64)
        missing: list[set[str]] = [set() for _ in range(P)]
        consensus = [0.0] * P
        device = self.state.params.device
        for step in range(algo.gossip_steps()):
            entries = self._entries(r, step)
            flat, scalars = algo.outgoing(self.state, r, step)
            own = flat.detach().clone()  # the snapshot every peer mixes (Jacobi, as the exact engine)
            scal = {k: (v.detach().clone().to(torch.float64) if isinstance(v, torch.Tensor)
                        else torch.full((P,), float(v), dtype=torch.float64, device=device))
                    for k, v in scalars.items()}
            ok = torch.isfinite(own).all(dim=1)  # a non-finite payload is refused by its receivers, as on the wire
            for v in scal.values():
                ok &= torch.isfinite(v)
            # the step's scalars and finiteness travel with the rows, as float64 columns
            meta = torch.stack([*scal.values(), ok.to(torch.float64)], dim=1)
            order, halo_rows, halo_meta = self.halo.exchange(entries.readers(self.held), own, meta)
            if order:
                own = torch.cat([own, halo_rows])
                scal = {k: torch.cat([v, halo_meta[:, c]]) for c, (k, v) in enumerate(scal.items())}
                ok = torch.cat([ok, halo_meta[:, -1] > 0.5])
            columns = self.local + order  # the peer of each row of `own`
            size = self._wire_sizes(r, step, own, scal, columns)
            column_of = np.full(len(self.ids), -1, dtype=np.int64)
            column_of[columns] = np.arange(len(columns), dtype=np.int64)
            mixing = step_mixing(entries, column_of, ok.cpu(), torch.tensor(size, dtype=torch.int64), len(columns),
                                 device)
            sent += np.asarray(size[:P], dtype=np.int64) * entries.out_degree
            recv += mixing.recv.numpy()
            for i, g in mixing.refused:
                missing[i].add(self.ids[g])
            if step == 0:
                consensus = consensus_distances(mixing.arrived, own[:, : min(self.exp.layout.num_shared, own.shape[1])])
            algo.combine_stacked(self.state, r, step, own, scal, mixing.weights)
        return {"sent": sent.tolist(), "recv": recv.tolist(), "consensus": consensus,
                "missing": [sorted(m) for m in missing]}

    def _entries(self, r: int, step: int) -> StepEntries:
        """This rank's rows of the step's mixing matrix (`entries_from_matrix`), kept while the
        topology hands back the same matrix (a static graph: built once for the whole run)."""
        w = self.topology.sparse_matrix(r, step, seed=self.cfg.seed, mode=self.algorithm.mode)
        if self._step_entries is None or self._step_entries[0] is not w:
            self._step_entries = (w, entries_from_matrix(w, self.local))
        return self._step_entries[1]

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
    """``p2pfl simulate`` with ``simulation.engine: batched``: the same run folder as the exact engine,
    over the same ranks (`p2pfl.engine.exact.simulate_ranks`: torchrun's, or ``simulation.workers``
    forked on a CPU), each rank stepping its own peers' rows (`run_batched_rank`).

    ``resume``: continue from the last round every peer checkpointed, as the exact engine does
    (``p2pfl/resume.py``), from the same per-peer checkpoint files and generations."""
    return simulate_ranks(cfg, exp, run_dir, run_batched_rank, {"engine": "batched"}, progress=progress,
                          resume=resume, accept_config_change=accept_config_change, label="simulating (batched)",
                          drop=lambda folder: drop_generations(folder))  # this module's name (tests replace it)


def run_batched_rank(ranks: Ranks, exp: Experiment, peers: list[str], assign: dict[str, int], run_dir: Path,
                     start: int, sink: Record | None) -> None:
    """One rank of the batched engine: its peers' rows (``assign``), rounds ``start..`` with the halo
    exchanges of every gossip step, and a step of `Ranks.step` at the end of each round (and once
    before the first) that brings the records to rank 0, which writes them in peer order.

    A failure on any rank ends every rank at the end of that round: the failing rank still takes its
    part in the round's collectives (`Halo.fail`: the others leave the round at once, `RankFailed`),
    and its error (the traceback's text; a storage error as one) goes to rank 0, which raises it."""
    ids = list(exp.topology.ids)
    index = {pid: i for i, pid in enumerate(ids)}
    pending: list[dict[str, Any]] = []
    error: BaseException | None = None
    sim: BatchedSimulation | None = None
    try:
        sim = BatchedSimulation(exp, run_dir, pending.append, ranks, [assign[pid] for pid in ids])
        if start:
            sim.restore(start)
    except BaseException as exc:  # noqa: BLE001 - every rank ends, rank 0 says why
        error = exc
    _round_end(ranks, pending, error, sink, index)
    assert sim is not None
    steps = sim.algorithm.gossip_steps()
    for r in range(start, exp.cfg.rounds):
        sim.halo.heads = 0
        try:
            sim.run_round(r)
        except RankFailed:
            pass  # another rank failed in this round: its error comes at the round's end
        except RanksError:
            raise  # the group is broken: no collective can tell the others
        except BaseException as exc:  # noqa: BLE001 - every rank ends, rank 0 says why
            error = exc
            if sim.halo.heads < steps:  # the others wait in this step's count exchange
                try:
                    sim.halo.fail()
                except RankFailed:
                    pass
        _round_end(ranks, pending, error, sink, index)


def _round_end(ranks: Ranks, pending: list[dict[str, Any]], error: BaseException | None, sink: Record | None,
               index: dict[str, int]) -> None:
    """Every rank's records to rank 0 (which hands them to ``sink`` in peer order) and every rank's
    error: raised on rank 0 (its own first), a `SimulationError` on the others, whenever any rank failed."""
    body = bytearray()
    if ranks.rank != 0 and pending:
        frames.pack_records(body, pending)
    if ranks.rank != 0 and error is not None:
        frames.pack_failure(body, error, f"rank {ranks.rank}")
    step = ranks.step([body if r == 0 else b"" for r in range(ranks.world)], FAILED if error is not None else 0)
    records = list(pending)
    pending.clear()
    if ranks.rank != 0:
        if step.any(FAILED):
            raise SimulationError(f"rank {ranks.rank} ends: a rank failed (rank 0 reports which)")
        return
    errors: list[BaseException] = [error] if error is not None else []
    for buf in step.received:
        for kind, entry in frames.entries(buf):
            if kind == frames.RECORDS:
                records.extend(frames.read_records(entry))
            elif (failure := frames.read_failure(kind, entry)) is not None:
                errors.append(failure)
    if sink is not None:
        for rec in sorted(records, key=lambda rec: (rec["round"], index[rec["peer"]])):
            sink(rec)
    if errors:
        raise errors[0]
    if step.any(FAILED):
        raise SimulationError("a rank failed without saying why")
