"""The simulation's ranks: a torch.distributed process group, and the lockstep exchange of bytes over it.

A simulation's peers are sharded over the ranks of one process group; a rank runs its shard and,
whenever none of its peers can go on (each waits for a message), takes part in an exchange step:
every rank hands in one byte buffer per other rank and a few flags, and gets back what every
other rank addressed to it and everyone's flags (`Ranks.step`). The bytes are uint8 tensors moved
by the group's own collectives (an ``all_gather`` of the sizes and flags, then one
``all_to_all_single`` of the payloads when any rank has something to send), so one code path serves
gloo between processes of one host, gloo over TCP between hosts, and NCCL between GPUs. Nothing
here pickles: the object collectives of torch.distributed (``all_gather_object``,
``send_object_list``) unpickle what they receive, and peer payloads must only ever be parsed by the
wire codec.

How a group is formed:

* under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set, `launched`):
  `join` initializes the default group from that environment (its rendezvous, one host or many);
* a plain ``p2pfl simulate`` with ``simulation.workers: W``: the simulation forks W - 1 ranks and
  is rank 0 itself; `local` forms their gloo group over a `FileStore` in a temporary folder
  (no port to pick, nothing listening).

A world of one needs no group at all (`single`): `step` then only reports this rank's flags.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

#: The variables ``torchrun`` sets for each rank (the ``env://`` rendezvous).
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

#: How long a collective may wait for the other ranks. An exchange step waits for the slowest rank
#: to run its shard until every peer of it waits (a round of training of thousands of peers: many
#: minutes): as long as the simulation's own deadline. A rank that dies breaks its connections,
#: and the others' collectives fail at once (gloo: "Connection reset by peer"), not at this timeout.
COLLECTIVE_TIMEOUT = timedelta(days=7)

# Flags each rank reports at a step (bits of one int64).
DONE = 1  # every peer of the rank has ended
FAILED = 2  # a peer of the rank failed (its error goes to rank 0 with the step's bytes)
TIMERS = 4  # a peer of the rank waits with a deadline (it may go on without a message)


class RanksError(RuntimeError):
    """The process group failed (a rank died, a connection broke)."""


def launched() -> bool:
    """Whether this process is a rank started by ``torchrun`` (or any launcher setting its variables)."""
    return all(k in os.environ for k in TORCHRUN_ENV)


def end_launched_rank() -> None:
    """End this torchrun rank's process at once, as a forked rank ends (``os._exit``), its output flushed.

    For a rank other than 0 whose run is done: its records went to rank 0 and its group was destroyed.
    Why not return through the interpreter's teardown: there, torch's gloo backend sometimes aborts
    the process (``terminate called without an active exception``, SIGABRT, no Python frame left)
    after a run that finished; on this project's 2-rank batched run, once in about 250 launches here
    and once in CI, rank 1 both times, while rank 0 was still writing the run folder (torchrun then
    reports the launch failed). A forked rank never goes through that teardown (`multiprocessing`
    ends it with ``os._exit``), and this gives a torchrun rank the same ending."""
    import logging
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


def backend_for(device: torch.device) -> str:
    """``P2PFL_DIST_BACKEND`` if set, else NCCL for a CUDA device (where NCCL is built), else gloo."""
    chosen = os.environ.get("P2PFL_DIST_BACKEND")
    if chosen:
        return chosen
    import torch.distributed as dist

    return "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"


@dataclass
class Step:
    """What one exchange step brought: the bytes each rank addressed to this one (``received[r]``;
    empty for itself), every rank's flags, and how many bytes moved in all (between any ranks)."""

    received: list[memoryview]
    flags: list[int]
    moved: int

    def all(self, flag: int) -> bool:
        return all(f & flag for f in self.flags)

    def any(self, flag: int) -> bool:
        return any(f & flag for f in self.flags)


@dataclass
class Ranks:
    """This process's place in the group: ``rank`` of ``world``, the tensors' ``device`` (CUDA for NCCL)."""

    rank: int
    world: int
    backend: str | None = None  # None: a world of one, no process group
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    owned: bool = False  # this object initialized the default group (and destroys it in `close`)
    steps: int = 0  # exchange steps taken (each is two collectives at most)

    def step(self, outgoing: list[bytes | bytearray], flags: int) -> Step:
        """One exchange step, called by every rank in the same order: ``outgoing[r]`` goes to rank r
        (this rank's own entry is ignored); returns what the others sent here and everyone's flags.

        ``outgoing`` is emptied once its buffers are in the one tensor the collective sends (the one
        buffer itself when only one rank gets bytes, as always with two ranks; else a copy of them
        all), so a step holds the bytes it sends at most twice, only for that copy."""
        self.steps += 1
        if self.world == 1:
            return Step([memoryview(b"")], [flags], 0)
        import torch.distributed as dist

        sizes = [0 if r == self.rank else len(outgoing[r]) for r in range(self.world)]
        meta = torch.tensor([*sizes, flags], dtype=torch.int64, device=self.device)
        table = [torch.empty_like(meta) for _ in range(self.world)]
        try:
            dist.all_gather(table, meta)
        except RuntimeError as exc:
            raise RanksError(f"rank {self.rank}: exchange with the other ranks failed: {exc}") from exc
        rows = [t.tolist() for t in table]  # rows[r] = (sizes rank r sends to each rank..., rank r's flags)
        moved = sum(sum(row[: self.world]) for row in rows)
        all_flags = [int(row[self.world]) for row in rows]
        if moved == 0:
            return Step([memoryview(b"")] * self.world, all_flags, 0)
        send_splits = sizes
        recv_splits = [int(rows[r][self.rank]) for r in range(self.world)]
        sending = [r for r in range(self.world) if send_splits[r]]
        if len(sending) == 1:  # one destination (always so with two ranks): its buffer as it is, no copy
            payload = outgoing[sending[0]]
        else:
            payload = bytearray().join(bytes(0) if r == self.rank else outgoing[r] for r in range(self.world))
        outgoing.clear()
        send = (torch.frombuffer(payload, dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8))
        recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=self.device)
        try:
            dist.all_to_all_single(recv, send.to(self.device), output_split_sizes=recv_splits,
                                   input_split_sizes=send_splits)
        except RuntimeError as exc:
            raise RanksError(f"rank {self.rank}: exchange with the other ranks failed: {exc}") from exc
        view = memoryview(np.ascontiguousarray(recv.cpu().numpy())).cast("B")
        received, at = [], 0
        for n in recv_splits:
            received.append(view[at : at + n])
            at += n
        return Step(received, all_flags, moved)

    def broadcast_int(self, value: int, src: int = 0) -> int:
        """``value`` of rank ``src``, on every rank (a world of one: ``value``)."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src)
        return int(t.item())

    def close(self) -> None:
        """Leave the group (destroy it if this object made it)."""
        if self.owned:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self.owned = False


def single() -> Ranks:
    """A world of one rank: no group, nothing exchanged."""
    return Ranks(rank=0, world=1)


def join(device: torch.device) -> Ranks:
    """Join the group ``torchrun`` set up (``env://``): gloo, or NCCL for CUDA (`backend_for`).

    On CUDA each rank drives the GPU of its ``LOCAL_RANK`` (modulo the GPUs it sees: more ranks
    than GPUs share them, which only gloo allows), made the current device before anything touches
    CUDA; the exchanged tensors live there for NCCL.
    """
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = backend_for(device)
    comm = torch.device("cpu")
    if device.type == "cuda":
        gpu = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(gpu)
        if backend == "nccl":
            comm = gpu
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                timeout=COLLECTIVE_TIMEOUT)
    return Ranks(rank=dist.get_rank(), world=dist.get_world_size(), backend=backend, device=comm, owned=owned)


def local(rank: int, world: int, store_path: Path) -> Ranks:
    """Rank ``rank`` of a gloo group of ``world`` processes of this host meeting at ``store_path`` (a
    file in a fresh temporary folder that every rank names)."""
    import torch.distributed as dist

    if world == 1:
        return single()
    store = dist.FileStore(str(store_path), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    return Ranks(rank=rank, world=world, backend="gloo", owned=True)
