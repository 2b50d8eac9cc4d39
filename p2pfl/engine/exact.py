"""The exact engine: every peer of the config through the same Node loop as a deployment, sharded
over the ranks of a torch.distributed process group (`p2pfl.simulation` picks it or the batched one).

Peers are placed on the ranks by partitioning the graph (`p2pfl.topology.placement.place`:
balanced, computed alike by every rank, and with few of the plans' edges between ranks, since a
payload that crosses is wire-encoded, sent at an exchange step and decoded; contiguous blocks of
indices, peer i -> rank i * W // N, whenever they cut no more, as on a ring). A rank's peers need
not be contiguous indices: its group is the peers that ``assign`` gives it. A rank is one process
with one torch thread and one model object that its peers borrow in turn: this keeps every core busy on training
(threads in one process would fight over the GIL). Inside a rank each peer runs its Node in a
greenlet of the rank's one thread, with an in-memory transport, and the peers take turns
(`p2pfl.turns.Turns`): one computes until it waits for its neighbours, then the next in line runs.

When none of a rank's peers can go on, the rank takes an *exchange step* with the others
(`p2pfl.procgroup.Ranks.step`, in lockstep: every rank takes part in every step): the wire
frames of the messages its peers published for peers of other ranks go out as byte tensors, and
what the others sent for its peers comes in, parsed and checked by the wire codec (dtype,
manifest, checksum, finiteness, as a deployed receiver checks them) before it reaches the board.
The step also carries each rank's flags (done, failed, waiting on a timer), so the ranks agree
when the run ends (every rank done), when a peer failed anywhere (every board aborts), and when
no message can ever come (a deadlock: every rank raises), and the other ranks' metrics records to
rank 0, which alone writes the run folder's files (config, metrics, summary, plot, progress bar);
each peer's checkpoint is written by the rank that runs it.

How the ranks come to be (one code path, `_run_rank`):

* ``torchrun --nproc-per-node K [rendezvous flags] $(which p2pfl) simulate -c CONFIG --out RUN``:
  each process is a rank of the group torchrun set up (`p2pfl.procgroup.join`; gloo, or NCCL
  for CUDA); the world size is the number of ranks, ``simulation.workers`` is not used;
* plain ``p2pfl simulate`` with ``simulation.workers: W``: this process forks W - 1 ranks
  (after the dataset is loaded, so its pages are shared) and is rank 0 itself; they form a gloo
  group over a file store (`p2pfl.procgroup.local`). ``W = 1``: one rank, no group.

Results are bitwise independent of the number of ranks: each peer's randomness is its own
generator and mixing sums in plan order (tests/test_distributed_sim.py).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import heapq
import itertools
import logging
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from p2pfl import procgroup
from p2pfl.config import ConfigError, ExperimentConfig
from p2pfl.engine import frames
from p2pfl.engine.frames import SimulationError
from p2pfl.experiment import Experiment
from p2pfl.modelpool import ModelPool
from p2pfl.payload import Payload
from p2pfl.procgroup import DONE, FAILED, TIMERS, Ranks, RanksError
from p2pfl.resume import drop_generations, keep_generation, prepare_resume
from p2pfl.runfolder import RunFolder
from p2pfl.storage import StorageError
from p2pfl.storage import configure as configure_storage
from p2pfl.topology.placement import place
from p2pfl.transport.memory import MemoryHub, MemoryTransport
from p2pfl.turns import Turns
from p2pfl.wire.codec import decode, encode_frames, parse_frame
from p2pfl.wire.validate import Expectation, WireError

log = logging.getLogger(__name__)

# On one host nobody is late: a peer waits for its neighbours however long their compute takes.
SIM_DEADLINE_S = 7 * 24 * 3600.0


#: What runs one rank's peers (`_run_rank` here, `p2pfl.engine.batched.run_batched_rank`):
#: ``(ranks, exp, peers of this rank, rank of every peer, run folder, round to start at, sink)``;
#: ``sink`` is where records go on rank 0 (the run folder), None on the other ranks.
RankRunner = Callable[[Ranks, Experiment, list[str], dict[str, int], Path, int,
                       Callable[[dict[str, Any]], Any] | None], None]


def simulate_exact(cfg: ExperimentConfig, exp: Experiment, run_dir: Path, *, progress: bool = True,
                   resume: bool = False, accept_config_change: bool = False) -> dict[str, Any]:
    """``p2pfl simulate`` with ``simulation.engine: exact`` (the default): join torchrun's group when
    launched by it, else fork the ranks of ``simulation.workers``; the summary on rank 0, ``{}`` on the others."""
    return simulate_ranks(cfg, exp, run_dir, _run_rank, {}, progress=progress, resume=resume,
                          accept_config_change=accept_config_change)


def simulate_ranks(cfg: ExperimentConfig, exp: Experiment, run_dir: Path, runner: RankRunner,
                   summary: dict[str, Any], *, progress: bool, resume: bool, accept_config_change: bool,
                   label: str = "simulating", drop: Callable[[Path], None] | None = None) -> dict[str, Any]:
    """A simulation over ranks, whatever runs a rank's peers (``runner``, called on every rank): the
    ranks formed (torchrun's, or ``simulation.workers`` forked), the run folder and resume on rank 0,
    the summary (``summary`` added) on rank 0, ``{}`` on the others. ``drop``: what removes the
    checkpoint generations of a finished run (`p2pfl.resume.drop_generations` unless given)."""
    ranks = procgroup.join(exp.device) if procgroup.launched() else None
    if ranks is not None and exp.device.type == "cuda" and exp.device.index is None:
        exp.device = torch.device("cuda", torch.cuda.current_device())  # this rank's GPU (join chose it)
    try:
        return _simulate(cfg, exp, run_dir, ranks, runner, summary, progress=progress, resume=resume,
                         accept_config_change=accept_config_change, label=label, drop=drop or drop_generations)
    finally:
        if ranks is not None:
            ranks.close()


def _simulate(cfg: ExperimentConfig, exp: Experiment, run_dir: Path, launched: Ranks | None, runner: RankRunner,
              summary: dict[str, Any], *, progress: bool, resume: bool, accept_config_change: bool,
              label: str, drop: Callable[[Path], None]) -> dict[str, Any]:
    topo = exp.topology
    ids = list(topo.ids)
    exp.layout  # noqa: B018 - build the initial model before forking (and refuse a broken app before writing)
    if launched is None:
        rank, world = 0, max(1, min(cfg.workers, len(ids)))
        if exp.device.type == "cuda":
            world = 1  # CUDA does not survive fork; one process drives the GPU (torchrun: one rank per GPU)
    else:
        rank, world = launched.rank, launched.world
        if world > len(ids):
            raise ConfigError(f"{world} ranks for {len(ids)} peers: start at most one rank per peer")
    run: RunFolder | None = None
    start = 0
    if rank == 0:  # only rank 0 touches the run folder's own files
        try:
            start = prepare_resume(run_dir, ids, before=cfg.rounds,
                                   check=exp.resume_check(run_dir, accept_config_change)) if resume else 0
            run = RunFolder.start(run_dir, cfg, topo, exp.partition, "simulate", append=start > 0)
        except BaseException:
            if launched is not None:
                launched.broadcast_int(-1)  # the other ranks stop too (they wait for the round to start at)
            raise
    if launched is not None:
        start = launched.broadcast_int(start)  # also: rank 0 put the checkpoints back before any peer reads one
        if start < 0:
            raise SimulationError("rank 0 could not prepare the run folder (its error says why)")
    assign = dict(zip(ids, place(topo, world), strict=True))  # both engines' ranks, one placement
    groups = [[p for p in ids if assign[p] == w] for w in range(world)]
    if run is not None and progress:
        run.show_progress(len(ids) * (cfg.rounds - start), label)

    procs: list[Any] = []
    frozen = False
    store_dir: str | None = None
    affinity: set[int] | None = None
    ranks = launched
    try:
        if ranks is None and world > 1:
            store_dir = tempfile.mkdtemp(prefix="p2pfl-ranks-")
            store = Path(store_dir) / "store"
            cores = worker_cores(world) if cfg.simulation.pin_cores else None
            ctx = mp.get_context("fork")
            # Move every object alive now out of the collector's reach (until the run ends): a rank's
            # full collections would otherwise write to the GC header of each object it inherited, and
            # copy-on-write duplicates those pages in every rank (~45 MB per rank at 128 peers).
            gc.freeze()
            frozen = True
            for w in range(1, world):
                p = ctx.Process(target=_rank_process, args=(w, world, store, exp, runner, groups[w], assign,
                                                            run_dir, start, cores[w] if cores else None),
                                name=f"p2pfl-sim-{w}", daemon=True)
                p.start()
                procs.append(p)
            if cores:
                affinity = os.sched_getaffinity(0)
                os.sched_setaffinity(0, {cores[0]})  # this thread only: put back when the run ends
            ranks = procgroup.local(0, world, store)
        elif ranks is None:
            ranks = procgroup.single()
        assert run is None or rank == 0
        try:
            runner(ranks, exp, groups[rank], assign, run_dir, start, run.record if run is not None else None)
        except RanksError as exc:
            raise SimulationError(_dead_rank(procs) or str(exc)) from None
    finally:
        if ranks is not None and ranks is not launched:
            ranks.close()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        if frozen:
            gc.unfreeze()
        if affinity is not None:
            os.sched_setaffinity(0, affinity)
        if store_dir is not None:
            shutil.rmtree(store_dir, ignore_errors=True)
        if run is not None:
            run.close()
    if run is None:
        return {}
    drop(run_dir)
    return run.finish(ids, {**summary, "workers": world, "resumed_from_round": start}, rounds_run=cfg.rounds - start)


def _dead_rank(procs: list) -> str | None:
    """Which forked rank died (the reason the group broke), if one did."""
    for p in procs:
        p.join(timeout=2)
    dead = [p for p in procs if p.exitcode not in (None, 0)]
    return f"rank process {dead[0].name} died (exit code {dead[0].exitcode})" if dead else None


def _rank_process(rank: int, world: int, store: Path, exp: Experiment, runner: RankRunner, peers: list[str],
                  assign: dict[str, int], run_dir: Path, start: int, core: int | None) -> None:
    """A forked rank of a plain ``p2pfl simulate``: join the local group, run its peers."""
    if core is not None:
        os.sched_setaffinity(0, {core})  # this process and every thread it starts (see worker_cores)
    torch.set_num_threads(1)
    one_malloc_arena()
    ranks = procgroup.local(rank, world, store)
    try:
        runner(ranks, exp, peers, assign, run_dir, start, None)
    except (SimulationError, StorageError):  # rank 0 reports it (it has every rank's errors)
        sys.exit(1)
    finally:
        ranks.close()


def one_malloc_arena() -> None:
    """Make this process's threads share one glibc malloc arena (a no-op off glibc).

    Each thread of a rank (its peers' thread, and any torch or a user's code starts) would otherwise
    get an arena of its own (up to 8 per core), each keeping the freed blocks it allocated: when
    every peer was a thread of its own, about 200 MB more per worker at 64 peers, measured.

    Call it in the process that forks the workers too, before it starts any thread (`p2pfl
    simulate` does, before its progress bar): an arena a thread of the parent created is
    inherited by every worker, and glibc hands it out to the worker's threads in turn whatever
    the limit says, so half of each worker's peers allocated from a second, fragmenting heap.
    """
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").mallopt(-8, 1)  # M_ARENA_MAX = -8 (malloc.h)
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
        pass


def release_free_memory() -> None:
    """Return the free pages inside glibc malloc's heap to the system (``malloc_trim(0)``; a no-op off glibc).

    A rank allocates and frees blocks the size of a peer's parameters all the time (the copy a peer
    mixes into, the payloads from other ranks, the exchange buffers), between blocks that live on
    (other peers' parameters): the freed ones become holes in the heap that glibc neither returns
    to the system nor always reuses. Measured at 1,024 peers in one process: 541 MB of the heap
    free against 550 MB in use. (Sending such blocks to mappings of their own instead, with a
    fixed M_MMAP_THRESHOLD, also sent a training step's activations there: twice the CPU per
    peer at 128 peers.) A trim costs a rank milliseconds, and the pages it releases fault in again
    when reused; the exchange step calls it at most every ``TRIM_EVERY_S``.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, looked up once (None: not Linux, or not glibc)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not glibc: nothing to release
        return None


def worker_cores(workers: int) -> list[int] | None:
    """A core of its own for each of ``workers`` worker processes when they are exactly as many as
    the cores this process may use (``sched_getaffinity``; a sweep running cells side by side gives
    each its own slice); otherwise None, and the kernel places them (with spare cores, two runs
    pinned by the same rule would share cores while others idle). None off Linux.

    Why (measured when a worker still had bridge and queue-feeder threads beside its peers'): threads
    that wake each other many times a round. Unpinned, the kernel often wakes a thread on the *other* core, where it preempts
    the other worker, and then migrates threads back: measured at 128 peers on 2 cores when each
    peer was a thread, a peer thread ran only 80-87% of the wall time it spent training (the tight
    loop's single thread: 99%), and a worker was busy 86-87% of its wall time; pinned, 99-100%.
    """
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None
    return allowed if len(allowed) == workers else None


def _run_rank(ranks: Ranks, exp: Experiment, peers: list[str], assign: dict[str, int], run_dir: Path,
              start: int, sink: Callable[[dict[str, Any]], Any] | None) -> None:
    """Run the Nodes of ``peers`` (greenlets taking turns) and the exchange steps with the other ranks
    until every rank is done. ``sink``: where records go (rank 0: the run folder); None: to rank 0."""
    resume = start > 0
    rank, world = ranks.rank, ranks.world
    outboxes = [bytearray() for _ in range(world)]  # what goes to each rank at the next step
    # Payloads for each rank not sent yet: heaps of ((round, step, index of its first reader there),
    # arrival, payload, wire size, readers there). A payload is encoded at the step that sends it
    # (until then it is the published tensor, which the sender's waiting parameters share), and a
    # step sends at most STEP_BYTES to a rank (`_fill`): a round's payloads for another rank are
    # gigabytes at 10,000 peers, and sending them in one step held them three times at once
    # (outbox, received buffer, decoded payloads). Earliest reader first: the receiving rank
    # runs its peers in that order, so each step's payloads complete the peers it runs next.
    queued: list[list[tuple[tuple[int, int, int], int, Payload, int, int]]] = [[] for _ in range(world)]
    arrival = itertools.count()
    index = exp.topology.index

    def forward(msg: Payload, remote: list[str], size: int) -> None:
        by_rank: dict[int, list[int]] = {}
        for p in remote:
            by_rank.setdefault(assign[p], []).append(index(p))
        for r, readers in by_rank.items():
            heapq.heappush(queued[r], ((msg.round, msg.step, min(readers)), next(arrival), msg, size, len(readers)))

    def fill(r: int) -> None:
        """Encode queued payloads for rank ``r`` into its outbox, up to STEP_BYTES (at least one).
        The wire codec's own frames cross between ranks: what gRPC would carry."""
        q, box = queued[r], outboxes[r]
        while q and (not box or len(box) < STEP_BYTES):
            _, _, msg, size, count = heapq.heappop(q)
            enc = encode_frames(msg)
            frames.pack_payload(box, msg, size, count, [enc.frame_parts(i) for i in range(len(enc))])

    hub = MemoryHub(local_peers=set(peers), forward=forward) if world > 1 else MemoryHub()
    # What this rank's peers expect of every payload (the same for all of them: one experiment).
    probe = exp.new_algorithm()
    specs, scalar_keys, topology_hash = probe.wire_specs(), frozenset(probe.wire_scalars()), exp.topology.hash()
    del probe
    trimmed = time.monotonic()
    pending: list[dict[str, Any]] = []  # records for rank 0
    # this rank's failure (the first), then those other ranks reported (rank 0): what to raise
    errors: list[BaseException] = []
    failed = False  # a peer of this rank failed
    failure_seen = False  # a peer of some rank failed

    def record(rec: dict[str, Any]) -> None:
        if sink is not None:
            sink(rec)
        else:
            pending.append(rec)

    def deliver(buf: memoryview) -> None:
        for kind, body in frames.entries(buf):
            if kind == frames.PAYLOAD:
                sender, r, step, size, count, parts = frames.unpack_payload(body)
                expected = Expectation(specs=specs, round=r, step=step, topology_hash=topology_hash,
                                       senders=frozenset((sender,)), scalar_keys=scalar_keys, wire=exp.wire_format)
                try:
                    msg = decode((parse_frame(f) for f in parts), expected)
                except WireError as exc:
                    log.warning("rank %d: payload of %s for (round %d, step %d) refused: %s", rank, sender, r, step,
                                exc)
                    hub.refuse(sender, r, step, count, size)
                    continue
                if msg.flat.device != exp.device:
                    msg = dataclasses.replace(msg, flat=msg.flat.to(exp.device),
                                              indices=None if msg.indices is None else msg.indices.to(exp.device))
                hub.put(msg, count, size)
            elif kind == frames.RECORDS and sink is not None:
                for rec in frames.read_records(body):
                    sink(rec)
            elif (failure := frames.read_failure(kind, body)) is not None:
                errors.append(failure)

    def exchange(flags: int) -> procgroup.Step:
        nonlocal failure_seen, trimmed
        if pending:
            frames.pack_records(outboxes[0], pending)
            pending.clear()
        for r in range(world):
            fill(r)
        out = list(outboxes)
        for r in range(world):
            outboxes[r] = bytearray()
        step = ranks.step(out, flags | (FAILED if failed else 0))
        for buf in step.received:
            if len(buf):
                deliver(buf)
        del out
        if time.monotonic() - trimmed >= TRIM_EVERY_S:  # the step's buffers are gone: free pages back
            release_free_memory()
            trimmed = time.monotonic()
        if step.any(FAILED):
            failure_seen = True
            if not hub.aborted:
                hub.abort("a peer of another rank failed")
        if step.moved == 0 and not step.any(FAILED) and not step.all(DONE) and not step.any(TIMERS):
            # Every rank is idle, nothing moved, no peer has a deadline to wait out: no message can come.
            raise SimulationError("deadlock: every peer waits for a message that no peer will send")
        return step

    def idle(seconds: float | None) -> None:
        """No peer of this rank can go on: an exchange step (lockstep with the other ranks).

        A timer counts (TIMERS) only when it is not a reader's deadline (a week, SIM_DEADLINE_S):
        when every rank is idle and nothing moves, only a peer's own pause can end the wait; a
        deadline would, a week later, only record the neighbours as missing."""
        paused = seconds is not None and seconds < SIM_DEADLINE_S / 2
        step = exchange(TIMERS if paused else 0)
        if step.moved == 0 and paused and not step.any(FAILED):
            # Nothing can come before this rank's pause ends (the others wait in the next step).
            time.sleep(seconds)  # type: ignore[arg-type]

    configure_storage(exp.cfg.checkpoint.storage_retry_s)  # a started rank has the default
    models = ModelPool(exp.model_factory, 1)
    turns = Turns(idle=idle)  # the rank's peers, greenlets of this thread, one running at a time (p2pfl/turns.py)

    def run(pid: str) -> None:
        nonlocal failed
        try:
            with turns.held((-1, exp.topology.index(pid))):
                run_node(pid)
        except BaseException as exc:  # noqa: BLE001 - any failure stops the whole simulation
            if hub.aborted:
                return  # woken by the abort of another failure: that one is reported
            hub.abort(f"peer {pid} failed: {exc!r}")
            failed = True
            if rank == 0:
                errors.insert(0, frames.failure(exc, f"peer {pid}"))
            else:
                frames.pack_failure(outboxes[0], exc, f"peer {pid}")

    def run_node(pid: str) -> None:
        node = exp.make_node(pid, transport=MemoryTransport(hub, pid, turns, exp.topology.index(pid)), models=models,
                             record=record, run_dir=run_dir)
        node.on_round = keep_generation(node, exp.cfg.checkpoint_every)
        # Atomic but not fsynced: a kill of any process loses nothing written (the page cache
        # keeps it); only an OS crash could tear the latest generation. One fsync per peer per
        # checkpoint was ~1 s of a 128-peer checkpoint round here (docs/protocol.md).
        node.durable_checkpoints = False
        if resume:
            node.resume()
        node.deadline_s = SIM_DEADLINE_S
        node.run()

    for pid in peers:
        turns.spawn(run, pid)
    turns.run()
    while not exchange(DONE).all(DONE):  # the other ranks' peers may still need this rank's steps
        pass
    if errors:
        raise errors[0]
    if failed or failure_seen:
        raise SimulationError("a peer of another rank failed (rank 0 reports which)")


#: The payload bytes one step sends a rank, at most (one payload more when a single one is larger).
STEP_BYTES = 32 << 20
#: Seconds between two `release_free_memory` calls of a rank, at least (one at most per exchange step).
TRIM_EVERY_S = 0.25
