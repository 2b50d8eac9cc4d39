"""Simulation at the CPU limit: the model pool and the in-memory board wake only whom they serve,
and `p2pfl simulate` imports neither Flower nor gRPC."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch import nn

from p2pfl.modelpool import ModelPool
from p2pfl.payload import Payload
from p2pfl.transport import memory
from p2pfl.transport.memory import MemoryHub


def _wait_until(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


@pytest.mark.timeout(60)
def test_model_pool_serves_waiters_by_priority_one_at_a_time() -> None:
    pool = ModelPool(lambda: nn.Linear(2, 2), 1)
    served: list[tuple] = []
    inside = threading.Semaphore(0)  # counts borrowers holding the model
    go = threading.Event()

    def borrower(prio: tuple) -> None:
        with pool.borrow(prio) as m:
            served.append(prio)
            inside.release()
            assert isinstance(m, nn.Linear)
            go.wait(10)

    holder = threading.Thread(target=borrower, args=((-1,),))
    holder.start()
    assert inside.acquire(timeout=10)
    prios = [(r, phase, i) for r in (1, 0) for phase in (1, 0) for i in (3, 0, 2)]
    threads = [threading.Thread(target=borrower, args=(p,)) for p in prios]
    for t in threads:
        t.start()
    _wait_until(lambda: len(pool._waiting) == len(prios))
    go.set()  # from now on each borrower returns at once: the pool hands the model down the queue
    for t in [holder, *threads]:
        t.join(10)
    assert served == [(-1,), *sorted(prios)]
    assert pool._free and not pool._waiting  # the model came back; nobody left waiting


@pytest.mark.timeout(60)
def test_model_pool_size_caps_concurrency_and_clears_grads() -> None:
    pool = ModelPool(lambda: nn.Linear(2, 2), 2)
    now = peak = 0
    lock = threading.Lock()

    def work(i: int) -> None:
        nonlocal now, peak
        with pool.borrow((i,)) as m:
            with lock:
                now += 1
                peak = max(peak, now)
            m(torch.ones(1, 2)).sum().backward()
            time.sleep(0.01)
            with lock:
                now -= 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert peak == 2 and len(pool._free) == 2
    assert all(p.grad is None for m in pool._free for p in m.parameters())


class _CountingEvent(threading.Event):
    sets = 0

    def set(self) -> None:
        type(self).sets += 1
        super().set()


@pytest.mark.timeout(60)
def test_memory_hub_wakes_only_the_readers_of_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory.threading, "Event", _CountingEvent)
    _CountingEvent.sets = 0
    hub = MemoryHub()
    n = 24
    got: dict[int, dict[str, Payload]] = {}

    def reader(i: int) -> None:  # reader i waits for sender s{i} and s{i+1}
        keys = [(f"s{i}", 0, 0), (f"s{(i + 1) % n}", 0, 0)]
        got[i] = hub.take(keys, time.monotonic() + 30)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    _wait_until(lambda: len(hub._waiters) == n)
    _CountingEvent.sets = 0  # (starting the threads set their own events)
    for i in range(n):
        hub.put(Payload(f"s{i}", 0, 0, "h", (), torch.full((3,), float(i)), {}), 2)
    for t in threads:
        t.join(10)
    assert all(sorted(got[i]) == sorted({f"s{i}", f"s{(i + 1) % n}"}) for i in range(n))
    assert float(got[5]["s6"].flat[0]) == 6.0
    # each reader is woken once, by the second of its two messages: n wake-ups, not one per reader
    # per message (2n) nor one per waiting thread per message (n^2)
    assert _CountingEvent.sets == n
    assert len(hub) == 0 and not hub._waiters


@pytest.mark.timeout(60)
def test_memory_hub_timeout_unregisters_and_abort_wakes() -> None:
    hub = MemoryHub()
    assert hub.take([("x", 0, 0)], time.monotonic() + 0.05) == {}
    assert not hub._waiters  # a reader that gave up leaves nothing behind
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            hub.take([("y", 0, 0)], time.monotonic() + 60)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    t = threading.Thread(target=blocked)
    t.start()
    _wait_until(lambda: bool(hub._waiters))
    hub.abort("peer p3 failed")
    t.join(10)
    assert not t.is_alive() and errors and "peer p3 failed" in str(errors[0])


@pytest.mark.timeout(120)
def test_simulate_command_imports_neither_flower_nor_grpc() -> None:
    code = (
        "import sys\n"
        "sys.argv = ['p2pfl', 'simulate', '--help']\n"
        "from p2pfl import cli\n"
        "try:\n"
        "    cli.main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "import p2pfl.simulation\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'flwr', 'grpc', 'matplotlib', 'ray'})\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout[-2000:]


@pytest.mark.timeout(120)
def test_exact_local_training_does_not_import_torch_dynamo() -> None:
    """The first ``torch.optim.Optimizer`` a process builds imports torch._dynamo (~160 MB RSS and
    seconds of CPU per simulation worker): the exact engine's SGD goes through the rule directly."""
    code = (
        "import sys, torch\n"
        "from p2pfl.algorithms.local_sgd import Phase\n"
        "from p2pfl.algorithms.base import TrainContext\n"
        "from p2pfl.data.datasets import ArrayDataset\n"
        "from p2pfl.data.loader import PeerData\n"
        "from p2pfl.models.layout import ParamLayout\n"
        "import numpy as np\n"
        "model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 4))\n"
        "layout = ParamLayout.from_model(model, ['1.weight', '1.bias'], [])\n"
        "flat = layout.flatten(model).clone()\n"
        "layout.bind(model, flat)\n"
        "g = torch.Generator().manual_seed(0)\n"
        "ds = ArrayDataset('toy', torch.randn(64, 1, 4, 4), torch.randint(0, 4, (64,)), torch.randn(8, 1, 4, 4),"
        " torch.randint(0, 4, (8,)), 4)\n"
        "data = PeerData(ds, np.arange(64), np.arange(8), 16, 'cpu')\n"
        "ctx = TrainContext(model, layout, data, g, torch.device('cpu'))\n"
        "before = flat.clone()\n"
        "ctx.train('all', Phase(lr=0.1, amount=2, unit='steps', momentum=0.9, weight_decay=1e-4))\n"
        "assert not torch.equal(before, flat)\n"
        "print('DYNAMO', 'torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "DYNAMO False" in out.stdout, out.stdout[-2000:]


@pytest.mark.timeout(300)
def test_simulate_checkpoints_without_fsync_node_with(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """simulate's checkpoints survive a kill without an fsync each (docs/protocol.md); a node's fsync."""
    import os

    from p2pfl import checkpoint
    from p2pfl.algorithms.base import PeerState
    from p2pfl.config import load_config
    from p2pfl.simulation import simulate
    from tests.conftest import tiny_config

    fsynced: list[bool] = []  # per checkpoint written: fsync'd or not (p2pfl.storage.atomic_write's durable)
    real = checkpoint.atomic_write

    def watched(path, data, durable=True, **kw):  # type: ignore[no-untyped-def]
        fsynced.append(durable)
        return real(path, data, durable=durable, **kw)

    monkeypatch.setattr(checkpoint, "atomic_write", watched)
    cfg = load_config(tiny_config(tmp_path, rounds=2, checkpoint={"every": 1}, simulation={"workers": 1}), [])
    simulate(cfg, tmp_path / "run", progress=False)
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("*.npz"))
    assert len(ckpts) == 4 and fsynced and not any(fsynced)
    state, _, meta = checkpoint.load_checkpoint(ckpts[0])
    assert state.round == 2 and meta["record"]["round"] == 1
    fsynced.clear()
    checkpoint.save_checkpoint(tmp_path / "n.npz", PeerState("p", torch.zeros(3), {}, {}, 0), torch.Generator())
    assert fsynced == [True] and os.path.exists(tmp_path / "n.npz")


_PER_THREAD_PROBE = r"""
import ctypes, os, sys, threading
first = sys.argv[1]
if first == "p2pfl":
    import p2pfl  # noqa: F401 - its process defaults, before torch loads
import torch
if first != "none":
    import p2pfl  # noqa: F401,F811

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.mallopt(-8, 1)  # one arena, as `p2pfl.engine.exact.one_malloc_arena`
torch.set_num_threads(1)
layer, x = torch.nn.Linear(512, 128), torch.randn(16, 512)
turn, done = threading.Lock(), threading.Event()

def peer():  # one peer thread's step, then it stays alive (as peers do between rounds)
    with turn:
        layer(x).sum().backward()
        layer.zero_grad(set_to_none=True)
    done.wait()

peer_ = threading.Thread(target=peer); peer_.start(); peer_.join(0.2)  # warm-up thread
before = libc.mallinfo2().uordblks
threads = [threading.Thread(target=peer) for _ in range(32)]
for t in threads:
    t.start()
while turn.locked() or any(not t.is_alive() for t in threads):
    pass
import time; time.sleep(0.3)
print(os.environ.get("MKL_DISABLE_FAST_MM"), (libc.mallinfo2().uordblks - before) / 32 / 1024)
done.set()
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_importing_p2pfl_before_torch_drops_mkls_per_thread_buffer_cache() -> None:
    """MKL's fast memory manager kept ~1 MB per thread that ran a GEMM, until the thread ended (a
    worker ran a thread per peer; it still runs a bridge and queue feeders, and user code may start
    threads): importing p2pfl first turns it off."""

    def per_thread_kb(first: str) -> tuple[str, float]:
        env = {k: v for k, v in os.environ.items() if k != "MKL_DISABLE_FAST_MM"}
        out = subprocess.run([sys.executable, "-c", _PER_THREAD_PROBE, first], capture_output=True, text=True,
                             timeout=100, env=env, check=True).stdout.split()
        return out[0], float(out[1])

    flag, kb = per_thread_kb("p2pfl")
    assert flag == "1"  # set before torch (and MKL) loaded
    assert kb < 250, f"{kb:.0f} KB kept per peer thread after a GEMM"
    if torch.backends.mkl.is_available():
        # The control, where this machine's MKL keeps such a cache at all (seen: ~1 MB per thread on
        # some hosts, none on others): without the variable the same probe keeps it.
        flag, kb_default = per_thread_kb("none")
        assert flag == "None"
        if kb_default > 250:
            assert kb_default > kb + 300, (kb_default, kb)


@pytest.mark.timeout(60)
def test_turns_run_one_peer_at_a_time_in_priority_order_and_a_pause_lets_the_others_run() -> None:
    """The simulation's per-worker scheduler: peers (greenlets of one thread) start in priority
    order whatever order they were spawned in; a peer that pauses (a slowed peer's sleep) lets the
    others run meanwhile and resumes on its turn."""
    from p2pfl.turns import Turns

    turns = Turns()
    order: list[str] = []

    def peer(i: int) -> None:
        with turns.held((0, i)):
            order.append(f"start{i}")
            if i == 0:
                t0 = time.monotonic()
                turns.pause(0.3, (1, i))
                order.append(f"resume0 after {time.monotonic() - t0 >= 0.3}")
            else:
                turns.take((1, i))  # back in line behind the peers of smaller priority
                order.append(f"resume{i}")

    for i in (2, 0, 3, 1):
        turns.spawn(peer, i)
    t0 = time.monotonic()
    turns.run()
    assert time.monotonic() - t0 < 5
    assert order == ["start0", "start1", "start2", "start3", "resume1", "resume2", "resume3", "resume0 after True"]


@pytest.mark.timeout(60)
def test_a_waiting_peer_gets_its_own_grad_mode_back_whatever_the_others_set() -> None:
    """torch's grad mode is per thread, and a worker's peers share one: a peer that waits inside
    `no_grad` must neither leak it to the peer that runs next nor lose it when it resumes."""
    from p2pfl.turns import Turns

    turns = Turns()
    seen: dict[str, bool] = {}

    def waits_without_grad() -> None:
        with turns.held((0, 0)), torch.no_grad():
            turns.take((1, 0))
            seen["a after"] = torch.is_grad_enabled()

    def trains() -> None:
        with turns.held((0, 1)):
            seen["b"] = torch.is_grad_enabled()
            x = torch.ones(2, requires_grad=True)
            (x * 3).sum().backward()
            seen["b grad"] = bool(x.grad is not None and x.grad.eq(3).all())
            with torch.no_grad():
                turns.take((1, 1))

    turns.spawn(waits_without_grad)
    turns.spawn(trains)
    turns.run()
    assert seen == {"a after": False, "b": True, "b grad": True}
    assert torch.is_grad_enabled()


@pytest.mark.timeout(60)
def test_timers_of_waits_admitted_in_time_leave_even_a_worker_that_is_never_idle() -> None:
    """A reader waits with a timeout (its deadline) and is usually admitted first; the timer it
    leaves behind must go once it expires, also when some peer is always ready to run (one worker
    holding every peer never idles): else the timer heap grows by one per wait."""
    from p2pfl.turns import Turns

    turns = Turns()
    results: list[bool] = []

    def reader(i: int) -> None:
        with turns.held((0, i)):
            for _ in range(40):
                ticket = turns.ticket()
                turns.admit((1, i), ticket)  # its messages are in before it waits
                results.append(turns.wait(ticket, 0.005))
                time.sleep(0.006)  # compute, while its timer expires

    turns.spawn(reader, 0)
    turns.spawn(reader, 1)
    turns.run()
    assert results == [True] * 80  # an admitted wait never reads as a timeout
    assert len(turns._timers) <= 2 and not turns._ready


@pytest.mark.timeout(60)
def test_dead_timers_of_waits_that_never_expire_are_dropped_once_they_outnumber_the_live_ones() -> None:
    """A simulated reader's timer is its deadline, a week away, and nearly every wait is admitted in
    time: the dead timers must not pile up (one per wait, for the whole run) while peers wait on."""
    from p2pfl.turns import Turns

    turns = Turns()
    results: list[bool] = []
    sizes: list[int] = []

    def reader(i: int) -> None:
        with turns.held((0, i)):
            for _ in range(500):
                ticket = turns.ticket()
                turns.admit((1, i), ticket)
                results.append(turns.wait(ticket, 7 * 24 * 3600.0))
                sizes.append(len(turns._timers))

    def sleeper() -> None:  # a live timer all along: parked until its (far) timeout, admitted at the end
        with turns.held((0, 9)):
            ticket = turns.ticket()
            waiting.append(ticket)
            results.append(turns.wait(ticket, 7 * 24 * 3600.0))

    waiting: list = []
    turns.spawn(sleeper)
    turns.spawn(reader, 0)
    turns.spawn(reader, 1)

    def last() -> None:
        with turns.held((2, 0)):
            turns.admit((3, 0), waiting[0])

    turns.spawn(last)
    turns.run()
    assert results == [True] * 1001
    assert max(sizes) <= 2 * 66 and turns._live_timers == 0


def _msg(sender: str, r: int) -> Payload:
    return Payload(sender, r, 0, "h", (), torch.full((3,), float(r)), {})


@pytest.mark.timeout(120)
def test_gated_readers_run_once_their_messages_are_in_also_from_a_bridge_thread() -> None:
    """A worker's ring of peers over several rounds, half of the messages arriving from a bridge
    thread (as from another worker) at random moments, while the worker may be idle: every reader
    gets both neighbours' messages, and nothing is left on the board."""
    import random

    from p2pfl.turns import Turns

    hub, turns, n, rounds = MemoryHub(), Turns(), 12, 6
    got: dict[tuple[int, int], set[str]] = {}
    bridged: list[Payload] = []
    lock = threading.Lock()
    rng = random.Random(7)

    def peer(i: int) -> None:
        with turns.held((-1, i)):
            for r in range(rounds):
                time.sleep(0.001)  # compute
                msg = _msg(f"p{i}", r)
                if i % 2:
                    with lock:
                        bridged.append(msg)
                else:
                    hub.put(msg, 2)
                keys = [(f"p{(i - 1) % n}", r, 0), (f"p{(i + 1) % n}", r, 0)]
                got[(i, r)] = set(hub.take_gated(keys, time.monotonic() + 30, None, turns, (r, i)))

    def bridge() -> None:
        delivered = 0
        while delivered < n * rounds // 2:
            with lock:
                batch, bridged[:] = list(bridged), []
            for m in batch:
                time.sleep(rng.random() * 0.003)
                hub.put(m, 2)
                delivered += 1
            time.sleep(0.001)

    t = threading.Thread(target=bridge, daemon=True)
    t.start()
    for i in range(n):
        turns.spawn(peer, i)
    turns.run()
    t.join(10)
    assert not t.is_alive()
    assert all(got[(i, r)] == {f"p{(i - 1) % n}", f"p{(i + 1) % n}"} for i in range(n) for r in range(rounds))
    assert len(hub) == 0 and not hub._waiters


@pytest.mark.timeout(60)
def test_a_gated_reader_gives_up_at_its_deadline_and_on_abort_in_its_turn_again() -> None:
    from p2pfl.transport.base import TransportError
    from p2pfl.turns import Turns

    hub, turns = MemoryHub(), Turns()
    order: list[str] = []
    errors: list[BaseException] = []

    def reader() -> None:
        with turns.held((-1, 0)):
            hub.put(_msg("a", 0), 1)
            t0 = time.monotonic()
            out = hub.take_gated([("a", 0, 0), ("never", 0, 0)], t0 + 0.3, None, turns, (0, 0))
            order.append(f"reader {sorted(out)} {0.3 <= time.monotonic() - t0 < 3}")
            assert not hub._waiters
            try:  # aborted by another thread (a failed peer elsewhere) while it waits
                hub.take_gated([("y", 0, 0)], time.monotonic() + 60, None, turns, (1, 0))
            except TransportError as exc:
                errors.append(exc)
            order.append("reader after abort")

    def other() -> None:
        with turns.held((0, 1)):
            order.append("other")  # runs while the reader waits for its deadline

    turns.spawn(reader)
    turns.spawn(other)
    aborter = threading.Timer(0.8, lambda: hub.abort("peer p9 failed"))
    aborter.start()
    turns.run()
    aborter.join(5)
    assert order == ["other", "reader ['a'] True", "reader after abort"]
    assert errors and "peer p9 failed" in str(errors[0])


def _run_recording_pins(tmp_path, monkeypatch: pytest.MonkeyPatch, allowed: set[int], **sim: object) -> list[tuple]:
    """Run a 2-worker simulation with this process limited to ``allowed`` cores; return what each
    rank pinned itself to: (core asked, affinity after the real call). Rank 0 is this process: its
    own affinity is put back when the run ends."""
    from p2pfl import simulation
    from p2pfl.config import load_config
    from p2pfl.engine import exact
    from tests.conftest import tiny_config

    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "pins.txt"
    real = os.sched_setaffinity

    def recording(pid: int, cores) -> None:
        real(pid, cores)
        if len(cores) > 1:
            return  # rank 0 (this process) putting its affinity back
        with open(log, "a") as f:  # one short line per worker, appended atomically
            f.write(f"{sorted(cores)[0]} {sorted(os.sched_getaffinity(0))}\n")

    monkeypatch.setattr(exact.os, "sched_setaffinity", recording)
    cfg = load_config(tiny_config(tmp_path, rounds=2, simulation={"workers": 2, **sim}), [])
    before = os.sched_getaffinity(0)
    real(0, allowed)
    try:
        simulation.simulate(cfg, tmp_path / "run", progress=False)
        assert os.sched_getaffinity(0) == allowed  # rank 0's pin did not outlive the run
    finally:
        real(0, before)
    return sorted(tuple(line.split(" ", 1)) for line in log.read_text().splitlines()) if log.exists() else []


@pytest.mark.timeout(120)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a single-core machine runs one worker")
def test_two_workers_on_two_cores_are_pinned_one_per_core_unless_turned_off(tmp_path, monkeypatch) -> None:
    cores = sorted(os.sched_getaffinity(0))[:2]
    pins = _run_recording_pins(tmp_path / "a", monkeypatch, set(cores))
    # each worker on its own core, and the kernel holds it there (the real call took effect)
    assert pins == [(str(cores[0]), f"[{cores[0]}]"), (str(cores[1]), f"[{cores[1]}]")]
    assert json.loads((tmp_path / "a" / "run" / "summary.json").read_text())["rounds"] == 2
    assert _run_recording_pins(tmp_path / "b", monkeypatch, set(cores), pin_cores=False) == []
    # (spare cores leave placement to the kernel: test_worker_cores_and_sweep_slots_follow_the_allowed_cores)


def test_worker_cores_and_sweep_slots_follow_the_allowed_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from p2pfl import sweep
    from p2pfl.engine import exact

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5, 1, 3, 7})
    assert exact.worker_cores(4) == [1, 3, 5, 7]
    assert exact.worker_cores(2) is None and exact.worker_cores(5) is None
    assert sweep.core_slots(2) == [[1, 3], [5, 7]]
    assert sweep.core_slots(3) == [[1], [3], [5]]
    assert sweep.core_slots(1) is None and sweep.core_slots(5) is None


def test_a_nan_payload_is_checked_once_when_stored_and_refused_to_every_reader(caplog) -> None:
    """The board checks a payload's values once, when it is stored (then still in the cache), not
    once per reader; every reader refuses it as the gRPC receiver would, and it still counts down."""
    from p2pfl.topology import generate
    from p2pfl.transport.memory import MemoryTransport

    checks: list[str] = []
    real = memory._finite
    hub = MemoryHub()
    topo = generate("ring", 3)
    bad = Payload("p1", 0, 0, "h", (), torch.tensor([1.0, float("nan")]), {})
    good = Payload("p2", 0, 0, "h", (), torch.tensor([2.0, 3.0]), {})
    try:
        memory._finite = lambda m: (checks.append(m.sender), real(m))[1]
        hub.put(bad, 2)
        hub.put(good, 2)
        rejected: set[str] = set()
        got = hub.take([("p1", 0, 0), ("p2", 0, 0)], time.monotonic() + 5, None, rejected)
        assert list(got) == ["p2"] and rejected == {"p1"}
        with caplog.at_level("WARNING", logger="p2pfl.transport.memory"):
            res = MemoryTransport(hub, "p0").exchange(Payload("p0", 0, 0, "h", (), torch.zeros(2), {}),
                                                      topo.plan("p0", 0, 0, seed=0, mode="pull"), 5.0)
    finally:
        memory._finite = real
    assert list(res.received) == ["p2"] and res.missing == ["p1"]
    assert "payload from p1 rejected: NaN or Inf values" in caplog.text
    assert sorted(checks) == ["p0", "p1", "p2"]  # once per stored message, not per read
    assert len(hub) == 1  # both reads of p1 and p2 consumed them; p0's own payload waits for p1, p2
