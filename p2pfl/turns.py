"""A simulation worker's peers as greenlets of one thread, taking turns in priority order.

In the simulation a worker runs one peer at a time (a worker is one core): a peer computes until
it must wait for its neighbours' messages, then the next peer in line runs. Each peer used to be
an OS thread handing a token (the former ``RunGate``) to the next; every handoff was a kernel
thread switch, and torch's per-thread state (oneDNN scratch, autograd, allocator caches) went cold
for each of 64 threads in turn. Here each peer's Node runs in a greenlet of the worker's one
thread, and a handoff is a switch of Python stacks inside that thread: no kernel switch, no lock
handoff, and every peer's training runs on the same warm thread, as in a hand-written loop.

The in-memory transport drives it through `ticket`, `admit` and `wait` (`MemoryHub.take_gated`)
and `pause`; a peer starts with `held`. A peer waiting for its messages parks its ticket;
whoever stores the last of them (a peer of this worker, or the simulation's exchange step
bringing messages from other ranks, run by the ``idle`` hook when no peer may run) `admit`s it,
and the scheduler switches to the admitted peer of smallest priority (its round, then its index), as the thread token served its
waiters. Which peer runs when never changes a result: each peer's randomness is its own.

Switch points are only `wait` (inside `take_gated`, `take`, `pause`), never inside a torch call.
torch's grad mode is per thread, so `wait` restores the parked peer's own mode on its way back.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from greenlet import greenlet


class Ticket:
    """A peer's place in line: its greenlet, and which of its waits a timer belongs to."""

    __slots__ = ("glet", "parked", "wait_no", "admitted", "timed")

    def __init__(self, glet: greenlet) -> None:
        self.glet = glet
        self.parked = False  # inside `wait`, switched out
        self.wait_no = 0  # bumped by every wait, so a timer of an earlier wait is ignored
        self.admitted = 0  # admissions queued and not served yet: a timer running out then is no timeout
        self.timed = False  # its current wait has a live timer in the heap (`Turns._live_timers` counts them)


class Turns:
    """The scheduler of one worker's peer greenlets; `run` them from the thread that made this."""

    def __init__(self, idle: Callable[[float | None], None] | None = None) -> None:
        # ``idle(seconds)``: called (lock not held) when no peer may run, with the seconds to the
        # earliest live timer (None: none); it may admit peers (the simulation's exchange step with
        # the other ranks). Without it the scheduler waits for another thread to admit one.
        self._idle = idle
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # another thread admitting a peer (no idle hook)
        # heap (priority, arrival, ticket, None for an admission | the wait_no of a timeout)
        self._ready: list[tuple[tuple, int, Ticket, int | None]] = []
        self._timers: list[tuple[float, int, Ticket, int]] = []  # heap (deadline, arrival, ticket, wait_no)
        self._live_timers = 0  # entries of `_timers` whose wait is still parked; the rest are dead (`_unpark`)
        self._arrival = itertools.count()
        self._main: greenlet | None = None
        self._jobs: list[tuple[Callable[..., Any], tuple]] = []

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Add a peer: ``fn(*args)`` runs in its own greenlet once `run` starts (it should begin with
        `held` or `take` so that it waits its turn)."""
        self._jobs.append((fn, args))

    def run(self) -> None:
        """Run every spawned peer to its end, switching between them at their waits."""
        self._main = greenlet.getcurrent()
        # Peers left, counted rather than found by a scan of every greenlet on every switch (that
        # scan was O(peers) per switch, O(peers^2) per round: ~0.5 s of a round per worker at
        # 5,000 peers per worker, issue 71). A peer only ever switches back to this (main)
        # greenlet, by `wait` or by ending, so after each switch only the peer just run can have
        # ended.
        live = 0
        for fn, args in self._jobs:
            g = greenlet(fn)
            g.switch(*args)  # runs to its first wait (or to its end)
            live += not g.dead
        self._jobs.clear()
        while live:
            ticket, result = self._next()
            ticket.glet.switch(result)
            live -= ticket.glet.dead

    def _next(self) -> tuple[Ticket, bool]:
        """The next peer to run: one whose timer ran out while parked (False), else the admitted
        one of smallest priority (True); when there is none, calls the ``idle`` hook (or waits,
        without holding the lock, for another thread to admit one). Expired timers are moved on every call, so timers of waits
        that were admitted in time leave the heap even when the worker is never idle."""
        with self._lock:
            while True:
                now = time.monotonic()
                while self._timers and self._timers[0][0] <= now:
                    _, arrival, ticket, no = heapq.heappop(self._timers)
                    if ticket.parked and ticket.wait_no == no and not ticket.admitted:
                        heapq.heappush(self._ready, ((), arrival, ticket, no))  # () goes before any priority
                while self._ready:
                    _, _, ticket, no = heapq.heappop(self._ready)
                    if no is None:  # an admission: its peer is parked by now (only parked peers let this run)
                        self._unpark(ticket)
                        ticket.admitted -= 1
                        return ticket, True
                    if ticket.parked and ticket.wait_no == no and not ticket.admitted:  # unless admitted meanwhile
                        self._unpark(ticket)
                        return ticket, False
                if self._idle is not None:
                    seconds = self._timers[0][0] - now if self._live_timers else None
                    self._lock.release()
                    try:
                        self._idle(seconds)
                    finally:
                        self._lock.acquire()
                    continue
                self._wake.wait(self._timers[0][0] - now if self._timers else None)

    def _unpark(self, ticket: Ticket) -> None:
        """End ``ticket``'s wait (lock held): the timer it may have left in the heap is dead from now.

        Dead timers are dropped when they expire, and all at once when they outnumber the live ones:
        a reader's timer is its deadline (a week in the simulation), so waits admitted in time would
        otherwise pile up one dead timer each, for good. (Readers used to cap their timeout at 1 s
        instead, which woke every parked peer once a second: at 10,000 peers, whose rounds take
        minutes, that was tens of futile switches per peer and round, issue 71.) Amortized O(1)
        per wait: a rebuild of m entries follows at least m/2 waits.
        """
        ticket.parked = False
        if ticket.timed:
            ticket.timed = False
            self._live_timers -= 1
            dead = len(self._timers) - self._live_timers
            if dead > 64 and dead > self._live_timers:
                self._timers = [t for t in self._timers if t[2].parked and t[2].wait_no == t[3]]
                heapq.heapify(self._timers)

    # -- what the peers call ----------------------------------------------------------------------
    def ticket(self) -> Ticket:
        """A place in line for the calling peer, for `admit` and `wait`."""
        return Ticket(greenlet.getcurrent())

    def admit(self, priority: tuple, ticket: Ticket) -> None:
        """Put ``ticket``'s peer in line to run (from any thread): once per `wait` it will make."""
        with self._lock:
            ticket.admitted += 1
            heapq.heappush(self._ready, (priority, next(self._arrival), ticket, None))
            self._wake.notify()

    def wait(self, ticket: Ticket, timeout: float | None = None) -> bool:
        """Let the others run until ``ticket`` is admitted and its turn comes (True), or until
        ``timeout`` seconds pass with no admission queued (False; one that comes later is for the
        next wait on ``ticket``). Call from ``ticket``'s own peer."""
        assert self._main is not None and ticket.glet is greenlet.getcurrent()
        grad = torch.is_grad_enabled()
        with self._lock:
            ticket.wait_no += 1
            ticket.parked = True
            if timeout is not None:
                heapq.heappush(self._timers, (time.monotonic() + timeout, next(self._arrival), ticket,
                                              ticket.wait_no))
                ticket.timed = True
                self._live_timers += 1
        admitted = self._main.switch()
        torch.set_grad_enabled(grad)
        return bool(admitted)

    def take(self, priority: tuple = ()) -> None:
        """Queue for a turn with ``priority`` and wait for it (the peers ahead in line run first)."""
        ticket = self.ticket()
        self.admit(priority, ticket)
        self.wait(ticket)

    @contextmanager
    def held(self, priority: tuple = ()) -> Iterator[None]:
        """Run the block as a turn: it starts when this peer's turn comes."""
        self.take(priority)
        yield

    def pause(self, seconds: float, priority: tuple = ()) -> None:
        """Sleep ``seconds`` letting the others run, then queue for a turn with ``priority``."""
        self.wait(self.ticket(), seconds)
        self.take(priority)
