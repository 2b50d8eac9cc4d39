"""Single-host simulation: every peer of the config on this machine, through the same Node loop.

Peers are spread over ``workers`` processes in contiguous blocks of indices (peer i -> worker
i * W // N: generated graphs join nearby indices, so a ring's or a grid's messages mostly stay in
their worker instead of all crossing the bridge, as with i mod W), each with one torch
thread and one model object that its peers borrow in turn: this keeps every core busy on
training (threads in one process would fight over the GIL). Inside a worker each peer runs its
Node in a greenlet of the worker's one thread, with an in-memory transport, and the peers take
turns (`p2pfl.turns.Turns`): one computes until it waits for its neighbours, then the next in
line runs. Messages for peers in other workers cross a queue (the bridge). The dataset is loaded
before the workers fork, so its pages are shared.
Results are bitwise independent of the worker count: each peer's randomness is its own
generator and mixing sums in plan order.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import multiprocessing as mp
import os
import queue
import threading
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from p2pfl.config import ConfigError, ExperimentConfig
from p2pfl.experiment import Experiment
from p2pfl.messages import Message
from p2pfl.modelpool import ModelPool
from p2pfl.resume import drop_generations, keep_generation, prepare_resume
from p2pfl.runfolder import RunFolder
from p2pfl.storage import StorageError
from p2pfl.storage import configure as configure_storage
from p2pfl.transport.memory import MemoryHub, MemoryTransport
from p2pfl.turns import Turns
from p2pfl.wire.codec import decode, encode_frames, parse_frame
from p2pfl.wire.validate import Expectation, WireError

log = logging.getLogger(__name__)

# On one host nobody is late: a peer waits for its neighbours however long their compute takes.
SIM_DEADLINE_S = 7 * 24 * 3600.0


class SimulationError(RuntimeError):
    pass


def simulate(cfg: ExperimentConfig, out_dir: str | Path, *, progress: bool = True,
             experiment: Experiment | None = None, resume: bool = False,
             accept_config_change: bool = False) -> dict[str, Any]:
    """Run the experiment; write the run folder; return the summary.

    ``resume``: continue an interrupted run in ``out_dir`` from the last round that *every* peer
    checkpointed (see :func:`p2pfl.resume.prepare_resume`); from round 0 when there is none. The
    checkpoints are verified first (`Experiment.resume_check`); ``accept_config_change``: go on although the
    config differs from theirs (recorded in the run folder).
    """
    if cfg.network.mode == "async":
        raise ConfigError("network.mode: async runs under `p2pfl launch` / `p2pfl node` (one process per peer); "
                          "the in-memory simulation is synchronous")
    torch.set_num_threads(1)  # before any torch work, so a forked worker inherits no thread pool
    run_dir = Path(out_dir)
    exp = experiment or Experiment.from_config(cfg)
    if (cfg.raw.get("simulation") or {}).get("engine", "exact") == "batched":
        from p2pfl.engine.batched import simulate_batched

        return simulate_batched(cfg, exp, run_dir, progress=progress, resume=resume,
                                accept_config_change=accept_config_change)
    topo = exp.topology
    ids = list(topo.ids)
    exp.layout  # noqa: B018 - build the initial model before forking (and refuse a broken app before writing)
    start = prepare_resume(run_dir, ids, before=cfg.rounds,
                           check=exp.resume_check(run_dir, accept_config_change)) if resume else 0
    run = RunFolder.start(run_dir, cfg, topo, exp.partition, "simulate", append=start > 0)
    workers = max(1, min(cfg.workers, len(ids)))
    if exp.device.type == "cuda":
        workers = 1  # CUDA does not survive fork; one process drives the GPU
    assign = {pid: i * workers // len(ids) for i, pid in enumerate(ids)}
    groups = [[p for p in ids if assign[p] == w] for w in range(workers)]

    if progress:
        run.show_progress(len(ids) * (cfg.rounds - start))
    procs: list[Any] = []
    frozen = False
    cores = worker_cores(workers) if cfg.simulation.pin_cores and workers > 1 else None
    if workers == 1:
        events: Any = queue.Queue()
        inboxes: list[Any] = [queue.Queue()]
        th = threading.Thread(target=_worker, args=(0, exp, groups[0], assign, inboxes, events, run_dir, start > 0),
                              daemon=True)
        th.start()
    else:
        ctx = mp.get_context("fork")
        events = ctx.Queue()
        inboxes = [ctx.Queue() for _ in range(workers)]
        # Move every object alive now out of the collector's reach (until the run ends): a worker's
        # full collections would otherwise write to the GC header of each object it inherited, and
        # copy-on-write duplicates those pages in every worker (~45 MB per worker at 128 peers).
        gc.freeze()
        frozen = True
        for w in range(workers):
            p = ctx.Process(target=_worker, args=(w, exp, groups[w], assign, inboxes, events, run_dir, start > 0,
                                                  cores[w] if cores else None),
                            name=f"p2pfl-sim-{w}", daemon=True)
            p.start()
            procs.append(p)
    try:
        _collect(events, run, workers, procs)
    finally:
        for box in inboxes:
            box.put(None)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        if frozen:
            gc.unfreeze()
        run.close()
    drop_generations(run_dir)
    return run.finish(ids, {"workers": workers, "resumed_from_round": start}, rounds_run=cfg.rounds - start)


def _collect(events: Any, run: RunFolder, workers: int, procs: list) -> None:
    """Record results as they come (the run folder drives the progress bar); fail fast when a worker fails."""
    finished = 0
    while finished < workers:
        try:
            kind, payload = events.get(timeout=1.0)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise SimulationError(f"worker {dead[0].name} died (exit code {dead[0].exitcode})") from None
            continue
        if kind == "rounds":
            for rec in payload:
                run.record(rec)
        elif kind == "error":
            raise SimulationError(f"peer {payload[0]} failed: {payload[1]}")
        elif kind == "storage":
            raise StorageError(*payload)
        elif kind == "done":
            finished += 1


def one_malloc_arena() -> None:
    """Make this process's threads share one glibc malloc arena (a no-op off glibc).

    Each thread of a worker (its peers' thread, the bridge, the queues' feeders) would otherwise
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


def worker_cores(workers: int) -> list[int] | None:
    """A core of its own for each of ``workers`` worker processes when they are exactly as many as
    the cores this process may use (``sched_getaffinity``; a sweep running cells side by side gives
    each its own slice); otherwise None, and the kernel places them (with spare cores, two runs
    pinned by the same rule would share cores while others idle). None off Linux.

    Why: a worker's threads (its peers', the bridge, the queues' feeders) wake each other many
    times a round. Unpinned, the kernel often wakes a thread on the *other* core, where it preempts
    the other worker, and then migrates threads back: measured at 128 peers on 2 cores when each
    peer was a thread, a peer thread ran only 80-87% of the wall time it spent training (the tight
    loop's single thread: 99%), and a worker was busy 86-87% of its wall time; pinned, 99-100%.
    """
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None
    return allowed if len(allowed) == workers else None


def _worker(w: int, exp: Experiment, peers: list[str], assign: dict[str, int], inboxes: list, events: Any,
            run_dir: Path, resume: bool = False, core: int | None = None) -> None:
    """Run the Nodes of ``peers`` (greenlets taking turns), bridging messages to and from the other workers."""
    if core is not None:
        os.sched_setaffinity(0, {core})  # this process and every thread it starts (see worker_cores)
    torch.set_num_threads(1)
    one_malloc_arena()

    def forward(msg: Message, remote: list[str], size: int) -> None:
        # The wire codec's own frames cross the bridge: what gRPC would carry, so dtype, manifest,
        # checksum and finiteness are checked exactly as a deployed receiver checks them.
        frames = encode_frames(msg).frames
        for ww, count in Counter(assign[p] for p in remote).items():
            inboxes[ww].put(((msg.sender, msg.round, msg.step, frames, size), count))

    hub = MemoryHub(local_peers=set(peers), forward=forward)
    # What this worker's peers expect of every payload (the same for all of them: one experiment).
    probe = exp.new_algorithm()
    specs, scalar_keys, topology_hash = probe.wire_specs(), frozenset(probe.wire_scalars()), exp.topology.hash()
    del probe

    def bridge() -> None:
        while True:
            item = inboxes[w].get()
            if item is None:
                return
            (sender, r, step, frames, size), count = item
            expected = Expectation(specs=specs, round=r, step=step, topology_hash=topology_hash,
                                   senders=frozenset((sender,)), scalar_keys=scalar_keys, wire=exp.wire_format)
            try:
                msg = decode((parse_frame(f) for f in frames), expected)
            except WireError as exc:
                log.warning("worker %d: payload of %s for (round %d, step %d) refused: %s", w, sender, r, step, exc)
                hub.refuse(sender, r, step, count, size)
                continue
            if msg.flat.device != exp.device:
                msg = dataclasses.replace(msg, flat=msg.flat.to(exp.device),
                                          indices=None if msg.indices is None else msg.indices.to(exp.device))
            hub.put(msg, count, size)

    threading.Thread(target=bridge, name=f"bridge-{w}", daemon=True).start()
    configure_storage(exp.cfg.checkpoint.storage_retry_s)  # a spawned worker starts with the default
    models = ModelPool(exp.model_factory, 1)
    turns = Turns()  # the worker's peers, greenlets of this thread, one running at a time (p2pfl/turns.py)

    records = _RecordBatch(events, len(peers))
    record = records.add

    def run(pid: str) -> None:
        try:
            with turns.held((-1, exp.topology.index(pid))):
                run_node(pid)
        except BaseException as exc:  # noqa: BLE001 - any failure stops the whole simulation
            hub.abort(f"peer {pid} failed: {exc!r}")
            records.flush()
            if isinstance(exc, StorageError):  # one line, as `p2pfl node` says it (exit 74)
                events.put(("storage", (exc.path, exc.problem)))
            else:
                events.put(("error", (pid, "".join(traceback.format_exception(exc)))))

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
    records.flush()
    events.put(("done", w))


class _RecordBatch:
    """A worker's round records, sent to the collecting process a round's worth at a time.

    One queue put per record woke the queue's feeder thread once per peer and round, beside the
    peer training (a GIL handoff each time, measured in the workers' context switches).
    Nothing is lost by waiting: a record reaches ``metrics.jsonl`` after its peer's checkpoint in
    any case, and a resumed run rewrites the rounds after the last common checkpoint.
    """

    def __init__(self, events: Any, size: int) -> None:
        self._events, self._size = events, max(1, size)
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []

    def add(self, rec: dict[str, Any]) -> None:
        with self._lock:
            self._pending.append(rec)
            if len(self._pending) < self._size:
                return
            batch, self._pending = self._pending, []
        self._events.put(("rounds", batch))

    def flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        if batch:
            self._events.put(("rounds", batch))
