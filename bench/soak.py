"""Soak test of the round protocol (docs/protocol.md, "Soak"; issue 68): N real `p2pfl node` processes
over mutual TLS, pull mode (dfedavg, ring) and/or push-sum (dfedpgp, directed ring), under random
faults drawn from a seed, against the same task run without faults under several seeds.

    python bench/soak.py                                   # 8 peers, pull then push, ~30 minutes each
    python bench/soak.py --mode push --minutes 10 --out runs/soak
    python bench/soak.py --mode pull --peers 4 --rounds 12 --clean-seeds 2     # a smoke run

Faults (``--kinds``, each at a random round drawn from ``--seed``, printed; a fault fires once the
other peers reached that round, one at a time per peer):

* ``kill9``: kill -9 of the peer's process group, restarted after 0.2-1.5 round deadlines (``--down``);
* ``stall``: SIGSTOP, SIGCONT after as long;
* ``disk``: the peer's disk is full for 3-40 s (``--disk-s``). Each peer's run folder is its own
  16 MiB tmpfs (``--disk tmpfs``, the default where this runs as root and may mount: a real full
  device, a ballast file taking every free byte, removed at the end of the fault); elsewhere
  (``--disk hook``) the ``P2PFL_FAULT_STORAGE`` hook of `p2pfl.storage` fails every write of that
  peer with ENOSPC. A fault longer than ``checkpoint.storage_retry_s`` (``--storage-retry``, 20 s)
  stops the peer with exit 74 (one line); it is restarted once its disk is free, as an operator would;
* ``hostile``: a burst of out-of-window claims by one client thread holding a real neighbour's
  certificate (an id of the topology): Pulls, plain and asking for evidence, from one of the
  target's out-neighbours, and in push mode Pushes (a valid payload, and a withhold) from one of
  its in-neighbours with a claimed running total given of 1000, each for rounds far ahead (past
  the leading peer's round + window, and past the run's end) and behind the target's window.
  The evidence rule says none of this may move anyone;

plus one peer 2x slower throughout (``network.slowdown``).

Checked at the end, per mode (one JSON line, ``ok`` overall):

* ``exactly_once``: every peer's records are rounds 0..R-1 once each, a gap only where the next
  record says ``fast_forward_from`` (the first skipped round; docs/protocol.md, "Metrics and
  checkpoint", rule 3), and every round of a peer whose payload a neighbour mixed (the neighbour's
  record of that round does not name it missing) is in that peer's own records (rule 2);
* ``nan_count``: non-finite numbers in any record;
* push-sum: ``mass_error_max`` (max over round boundaries of |sum_i mu_i - n|, each peer's last
  recorded mu) and ``mass_error_final``, both <= 1e-6; ``min_mu``;
* hostile claims sent, refused (any status but OK), answered as a repeat (a Push of a key the target
  mixed before, behind its window: OK with 0 bytes, never mixed twice), accepted (mixed: must be 0),
  and ``moved_anyone``: a fast-forward to a round beyond
  what any peer had honestly reached (the largest recorded round + 1 seen by the soak's poller, at
  most one poll later than the fast-forwarded record) -- whatever its cause;
* accuracy: the faulted run's final mean accuracy (config seed ``--seed``) against the mean and
  standard deviation s over k = ``--clean-seeds`` fault-free runs (config seeds seed, seed+1, ...): ok
  when within the 95 % prediction interval of one more fault-free run, mean +- t(k-1) s sqrt(1 + 1/k)
  (the seeds' spread; a fixed mean +- 2 s, also reported, holds a fresh fault-free run only two times
  in three with k = 2 and three in four with k = 3, since so few samples underestimate s). The same task throughout (the synthetic
  data's own seed is fixed): only the model's init and the data order vary with the seed.

``--minutes`` sizes the rounds: a short fault-free calibration run measures seconds per round, and
R is chosen so the faulted run lasts about that long (faults cost about 1.5x); ``--rounds`` fixes R.
Every process runs in its own process group, killed in ``finally``; every tmpfs is unmounted.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import os
import queue
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from p2pfl.security.certs import make_certs  # noqa: E402
from p2pfl.storage import EXIT_STORAGE, FAULT_ENV  # noqa: E402
from p2pfl.topology import Topology, generate  # noqa: E402

KINDS = ("kill9", "stall", "disk", "hostile")
WEIGHTS = {"kill9": 3, "stall": 2, "disk": 2, "hostile": 2}
MASS_TOL = 1e-6
TMPFS_MB = 16


@dataclass
class Fault:
    kind: str  # kill9 | stall | disk | hostile | slow
    peer: str
    at_round: int  # injected once the other peers reached this round
    down_s: float = 0.0  # how long it stays killed / stopped / without disk
    fault_round: int | None = None  # the round the others had reached when it was hit
    rejoin_round: int | None = None  # ... and when it came back
    factor: float = 1.0  # slow
    exited_74: bool = False  # disk: the peer gave up (exit 74) and was restarted

    def as_dict(self) -> dict[str, Any]:
        d = {"kind": self.kind, "peer": self.peer, "at_round": self.at_round, "fault_round": self.fault_round,
             "rejoin_round": self.rejoin_round}
        if self.kind == "slow":
            d["factor"] = self.factor
        elif self.kind != "hostile":
            d["down_s"] = round(self.down_s, 1)
        if self.exited_74:
            d["exited_74"] = True
        return d


@dataclass
class Run:
    wall_s: float
    recs: dict[str, list[dict[str, Any]]]
    failed: dict[str, int] = field(default_factory=dict)
    restarts: int = 0
    unjustified_ff: list[dict[str, Any]] = field(default_factory=list)
    hostile: dict[str, Any] = field(default_factory=dict)
    timed_out: bool = False
    first_record_s: float = math.nan  # when the first record appeared (the start-up before it)


# -- reading the run folders as they grow -------------------------------------------------------------
class Tail:
    """One peer's metrics-<pid>.jsonl, read incrementally (re-read whole when rewritten atomically)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ino: int | None = None
        self.off = 0
        self.recs: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        try:
            st = self.path.stat()
        except OSError:
            return []
        if st.st_ino != self.ino or st.st_size < self.off:
            self.ino, self.off, self.recs = st.st_ino, 0, []
        if st.st_size == self.off:
            return []
        try:
            with open(self.path, "rb") as f:
                f.seek(self.off)
                data = f.read(st.st_size - self.off)
        except OSError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.off += end + 1
        new = []
        for line in data[: end + 1].splitlines():
            with contextlib.suppress(ValueError):
                if line.strip():
                    new.append(json.loads(line))
        self.recs.extend(new)
        return new


class Progress:
    """Polls every peer's records; tells the round each peer is in and the largest round any peer had
    honestly reached: a trained round's record (round + 1), or a fast-forward that was itself justified.

    A fast-forward record to round X is justified when X <= that bound in the poll that first saw it or
    the next one (a neighbour's record of round X - 1 is written before it publishes round X, so before
    anyone can prove X; one poll of slack for the order the files are read in)."""

    def __init__(self, dirs: dict[str, Path]) -> None:
        self.tails = {pid: Tail(d / f"metrics-{pid}.jsonl") for pid, d in dirs.items()}
        self.passes = 0
        self.top = 0  # the largest round honestly reached so far
        self.ff_seen: set[tuple[str, int]] = set()
        self.waiting: list[tuple[str, int, int, int]] = []  # (peer, from, to, poll first seen)
        self.bad: list[dict[str, Any]] = []

    def poll(self) -> None:
        for pid, t in self.tails.items():
            for r in t.poll():
                k = int(r["round"])
                if "fast_forward_from" not in r:
                    self.top = max(self.top, k + 1)
                elif (pid, k) not in self.ff_seen:  # a rewritten file is read again: judged once
                    self.ff_seen.add((pid, k))
                    self.waiting.append((pid, int(r["fast_forward_from"]), k, self.passes))
        changed = True
        while changed:  # a justified fast-forward may justify another (a chain of catch-ups)
            changed = False
            for w in list(self.waiting):
                if w[2] <= self.top:
                    self.waiting.remove(w)
                    self.top = max(self.top, w[2] + 1)
                    changed = True
        for w in list(self.waiting):
            if self.passes > w[3]:  # seen in the previous poll too and still beyond anything reached
                self.waiting.remove(w)
                self.bad.append({"peer": w[0], "from": w[1], "to": w[2], "reached": self.top})
        self.passes += 1

    def round_of(self, pid: str) -> int:
        """The round ``pid`` is in: its last recorded round + 1."""
        recs = self.tails[pid].recs
        return int(recs[-1]["round"]) + 1 if recs else 0

    def lead(self, ids: list[str]) -> int:
        return max((self.round_of(p) for p in ids), default=0)

    def unjustified(self) -> list[dict[str, Any]]:
        """Fast-forwards to a round beyond any honestly reached one (after a last poll or two)."""
        return self.bad + [{"peer": w[0], "from": w[1], "to": w[2], "reached": self.top} for w in self.waiting]


# -- the processes -------------------------------------------------------------------------------------
def write_config(tmp: Path, args: argparse.Namespace, mode: str, seed: int, rounds: int,
                 slowdown: dict[str, float], topo: Topology, tag: str) -> Path:
    topo_path = tmp / f"topology-{mode}.yaml"
    if not topo_path.exists():
        topo.dump(topo_path)
    algorithm = ({"name": "dfedpgp", "mix_mode": "push", "body_local": 1} if mode == "push"
                 else {"name": "dfedavg", "lr": 0.1, "local_epochs": 1})
    cfg = {
        "name": f"soak-{mode}", "seed": seed, "rounds": rounds, "device": "cpu",
        "topology": str(topo_path),
        "data": {"dataset": "synthetic", "partition": {"kind": "dirichlet", "alpha": 0.5}, "batch_size": 16,
                 "params": {"num_classes": 10, "train_size": 200 * args.peers, "test_size": 100 * args.peers,
                            "shape": [1, 8, 8], "noise": args.noise, "seed": 1}},
        "model": {"name": "mlp", "hidden": 32},
        "algorithm": algorithm,
        "network": {"round_timeout_s": args.timeout, "probe_s": args.probe, "slowdown": slowdown},
        "checkpoint": {"storage_retry_s": args.storage_retry},
    }
    # the pace: every peer's training stretched (a sleep) so a round lasts about a second, not 0.03 s
    cfg["network"]["slowdown"] = {p: min(1000.0, args.pace * slowdown.get(p, 1.0)) for p in topo.ids}
    path = tmp / f"config-{mode}-{tag}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start(cfg: Path, pid: str, out: Path, certs: Path, logs: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "p2pfl.cli", "node", "--config", str(cfg), "--peer", pid, "--out", str(out),
           "--certs", str(certs)]
    with open(logs / f"{pid}.log", "a") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
                                env={**os.environ, **(env or {})})


def _signal(p: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)


def can_mount(tmp: Path) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    probe = tmp / ".mount-probe"
    probe.mkdir(exist_ok=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)],
                        capture_output=True).returncode == 0
    if ok:
        subprocess.run(["umount", str(probe)], check=False)
    probe.rmdir()
    return ok


def fill(path: Path) -> None:
    """Take every free byte of the file system ``path`` is on: ever smaller writes until a byte fails."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for size in (1 << 20, 1 << 16, 1 << 12, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
    finally:
        os.close(fd)


class Disks:
    """Each peer's run folder, and how its disk is made full: its own tmpfs with a ballast file, or the
    ``P2PFL_FAULT_STORAGE`` hook (a control file holding ENOSPC)."""

    def __init__(self, base: Path, ids: list[str], how: str) -> None:
        self.base, self.how = base, how
        self.mounted: list[Path] = []
        self.dirs: dict[str, Path] = {}
        self.env: dict[str, dict[str, str]] = {}
        ctl = base / "storage-fault"
        ctl.mkdir(parents=True, exist_ok=True)
        for pid in ids:
            if how == "tmpfs":
                d = base / ".disk" / pid
                d.mkdir(parents=True, exist_ok=True)
                subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}m", "tmpfs", str(d)], check=True)
                self.mounted.append(d)
                self.env[pid] = {}
            else:
                d = base / pid
                d.mkdir(parents=True, exist_ok=True)
                self.env[pid] = {FAULT_ENV: str(ctl / pid)} if how == "hook" else {}
            self.dirs[pid] = d

    def full(self, pid: str) -> None:
        if self.how == "tmpfs":
            fill(self.dirs[pid] / "ballast")
        elif self.how == "hook":
            Path(self.env[pid][FAULT_ENV]).write_text("ENOSPC")

    def free(self, pid: str) -> None:
        if self.how == "tmpfs":
            (self.dirs[pid] / "ballast").unlink(missing_ok=True)
        elif self.how == "hook":
            Path(self.env[pid][FAULT_ENV]).unlink(missing_ok=True)

    def close(self) -> dict[str, Path]:
        """Copy each tmpfs off (ballast and checkpoints left behind) and unmount it; the folders to read."""
        out = dict(self.dirs)
        for pid, d in list(self.dirs.items()):
            if d in self.mounted:
                keep = self.base / pid
                with contextlib.suppress(OSError):
                    shutil.copytree(d, keep, dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("ballast", "checkpoints"))
                out[pid] = keep
        for d in self.mounted:
            while subprocess.run(["umount", "-l", str(d)], capture_output=True).returncode == 0:
                pass
        self.mounted = []
        return out


# -- the hostile neighbour -----------------------------------------------------------------------------
class Hostile(threading.Thread):
    """One client that, on each burst, claims out-of-window rounds to the burst's target with real
    neighbour certificates; counts what it sent and how it was answered."""

    def __init__(self, topo: Topology, cfg: Path, certs: Path, mode: str, rounds: int, window: int,
                 rng: random.Random, progress: Progress, ids: list[str]) -> None:
        super().__init__(daemon=True, name="hostile")
        self.topo, self.certs, self.mode, self.rounds, self.window = topo, certs, mode, rounds, window
        self.rng, self.progress, self.ids = rng, progress, ids
        self.bursts: queue.Queue[str | None] = queue.Queue()
        self.lock = threading.Lock()
        self.sent = self.refused = self.repeats = self.accepted = self.done = 0
        self.codes: dict[str, int] = {}
        self.claims: list[dict[str, Any]] = []
        self.errors: list[str] = []
        from p2pfl.config import load_config
        from p2pfl.experiment import Experiment

        c = load_config(cfg)
        self.chunk = int(c.network.chunk_kb) * 1024
        self.specs = Experiment.from_config(c).new_algorithm().wire_specs()

    def run(self) -> None:
        while (target := self.bursts.get()) is not None:
            self.done += 1
            try:
                self.burst(target)
            except Exception as exc:  # noqa: BLE001 -- a broken attacker must not end the soak; it is reported
                self.errors.append(f"{type(exc).__name__}: {exc}"[:200])

    def burst(self, target: str) -> None:
        import grpc
        import torch

        from p2pfl.payload import Payload
        from p2pfl.proto import peer_pb2
        from p2pfl.security import TLSConfig
        from p2pfl.transport.grpc_service import (
            EVIDENCE_MD,
            GIVEN_MD,
            KEEP_MD,
            PULL_METHOD,
            PUSH_METHOD,
            channel_options,
        )
        from p2pfl.wire.codec import encode_frames

        lead, cur = self.progress.lead(self.ids), self.progress.round_of(target)
        ahead = [lead + self.window + 6, lead + self.window + 7, self.rounds + 100]
        behind = [cur - self.window - 2] if cur - self.window - 2 >= 0 else []
        outs = sorted(self.topo.possible_out_neighbours(target))
        ins = sorted(self.topo.possible_in_neighbours(target))
        roles = [("pull", self.rng.choice(outs))] if outs else []
        if self.mode == "push" and ins:
            roles.append(("push", self.rng.choice(ins)))
        h = self.topo.hash()
        for kind, me in roles:
            creds = TLSConfig.load(self.certs, me).channel_credentials()
            with grpc.secure_channel(self.topo.address(target), creds,
                                     options=channel_options(self.chunk, target)) as ch:
                pull = ch.unary_stream(PULL_METHOD, request_serializer=peer_pb2.PullRequest.SerializeToString,
                                       response_deserializer=lambda b: b)
                push = ch.stream_unary(PUSH_METHOD, request_serializer=lambda b: b,
                                       response_deserializer=peer_pb2.PushReply.FromString)
                for r in ahead + behind:
                    self.claims.append({"target": target, "as": me, "kind": kind, "round": r})
                    if kind == "pull":
                        for md in (None, ((EVIDENCE_MD, "1"),)):
                            try:
                                list(pull(peer_pb2.PullRequest(requester=me, round=r, step=0, topology_hash=h),
                                          timeout=5, metadata=md))
                                self.count("OK", "accepted")
                            except grpc.RpcError as e:
                                self.count(e.code().name, "refused")
                    else:
                        g = torch.Generator().manual_seed(r)
                        numel = sum(s.numel for s in self.specs)
                        msg = Payload(me, r, 0, h, self.specs, torch.randn(numel, generator=g), {"mu": 1.0})
                        frames = list(encode_frames(msg, self.chunk))
                        for md in (((GIVEN_MD, "1000.0"),), ((GIVEN_MD, "1000.0"), (KEEP_MD, "1"))):
                            try:
                                reply = push(iter(frames), timeout=5, metadata=md)
                                dup = reply.bytes_received == 0
                                self.count("OK_REPEAT" if dup else "OK", "repeat" if dup else "accepted")
                            except grpc.RpcError as e:
                                self.count(e.code().name, "refused")

    def count(self, code: str, how: str) -> None:
        with self.lock:
            self.sent += 1
            self.refused += how == "refused"
            self.repeats += how == "repeat"
            self.accepted += how == "accepted"
            self.codes[code] = self.codes.get(code, 0) + 1

    def stop(self) -> dict[str, Any]:
        self.bursts.put(None)
        self.join(60)
        return {"bursts": self.done, "claims_sent": self.sent, "refused": self.refused,
                "answered_as_repeat": self.repeats, "accepted": self.accepted,
                "answers": dict(sorted(self.codes.items())), "errors": self.errors[:5]}


# -- one run --------------------------------------------------------------------------------------------
def run(cfg: Path, ids: list[str], base: Path, certs: Path, faults: list[Fault], limit_s: float, *,
        disk: str = "none", hostile: Hostile | None = None, topo: Topology | None = None) -> Run:
    logs = base / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    disks = Disks(base, ids, disk)
    dirs = disks.dirs
    prog = Progress(dirs)
    if hostile is not None:
        hostile.progress = prog
        hostile.start()
    procs: dict[str, subprocess.Popen] = {}
    restarts = 0
    timed_out = True
    t0 = time.monotonic()
    first = math.nan
    pending = sorted((f for f in faults if f.kind != "slow"), key=lambda f: f.at_round)
    restore: list[tuple[float, Fault]] = []
    try:
        procs = {pid: start(cfg, pid, dirs[pid], certs, logs, disks.env[pid]) for pid in ids}
        while time.monotonic() - t0 < limit_s:
            prog.poll()
            now = time.monotonic() - t0
            if math.isnan(first) and prog.top > 0:
                first = now
            busy = {g.peer for _, g in restore}
            for f in list(pending):
                others = [q for q in ids if q != f.peer]
                if prog.lead(others) < f.at_round:
                    break  # sorted by round: none later is due either
                if f.kind != "hostile" and f.peer in busy:
                    continue  # one fault at a time per peer: wait until it is back
                pending.remove(f)
                f.fault_round = prog.lead(others)
                if f.kind == "hostile":
                    if hostile is not None:
                        hostile.bursts.put(f.peer)
                    continue
                p = procs[f.peer]
                if p.poll() is not None:
                    f.fault_round = None  # finished (or failed) already: nothing to hit
                    continue
                if f.kind == "kill9":
                    _signal(p, signal.SIGKILL)
                    p.wait(10)
                elif f.kind == "stall":
                    _signal(p, signal.SIGSTOP)
                else:
                    disks.full(f.peer)
                restore.append((now + f.down_s, f))
                busy.add(f.peer)
            for item in [x for x in restore if x[0] <= now]:
                restore.remove(item)
                f = item[1]
                f.rejoin_round = prog.lead([p for p in ids if p != f.peer])
                if f.kind == "kill9":
                    procs[f.peer] = start(cfg, f.peer, dirs[f.peer], certs, logs, disks.env[f.peer])
                    restarts += 1
                elif f.kind == "stall":
                    _signal(procs[f.peer], signal.SIGCONT)
                else:
                    disks.free(f.peer)
            # a peer that gave up on its full disk (exit 74) is restarted once its disk is free
            busy = {g.peer for _, g in restore if g.kind == "disk"}
            for pid, p in procs.items():
                if p.poll() == EXIT_STORAGE and pid not in busy:
                    hit = [f for f in faults if f.kind == "disk" and f.peer == pid and f.fault_round is not None]
                    if hit:
                        hit[-1].exited_74 = True
                    procs[pid] = start(cfg, pid, dirs[pid], certs, logs, disks.env[pid])
                    restarts += 1
            if not restore and all(p.poll() is not None and p.returncode != EXIT_STORAGE for p in procs.values()) \
                    and not any(f.kind != "hostile" for f in pending):
                timed_out = False
                break
            time.sleep(0.1)
    finally:
        for p in procs.values():
            if p.poll() is None:
                _signal(p, signal.SIGCONT)
                _signal(p, signal.SIGKILL)
                p.wait(10)
        hstats = hostile.stop() if hostile is not None else {}
        prog.poll()
        prog.poll()
        wall = time.monotonic() - t0
        for pid in ids:
            disks.free(pid)
        dirs = disks.close()
    failed = {pid: p.returncode for pid, p in procs.items() if p.returncode != 0}
    recs = {pid: _read(dirs[pid] / f"metrics-{pid}.jsonl") for pid in ids}
    return Run(wall, recs, failed, restarts, prog.unjustified(), hstats, timed_out, first)


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            if line.strip():
                out.append(json.loads(line))
    return out


# -- what is checked -------------------------------------------------------------------------------------
def draw_faults(rng: random.Random, ids: list[str], n: int, rounds: int, timeout: float, kinds: list[str],
                down: tuple[float, float], disk_s: tuple[float, float]) -> list[Fault]:
    """``n`` faults at random rounds in the first 85% of the run (so that the end settles), one slow peer
    among them. Kills and stalls last ``down`` round deadlines; a full disk ``disk_s`` seconds."""
    faults = [Fault("slow", rng.choice(ids), 0, factor=2.0)]
    pool = [k for k in kinds for _ in range(WEIGHTS[k])]
    hi = max(1, int(rounds * 0.85))
    for _ in range(max(0, n - 1)):
        kind = rng.choice(pool)
        at = rng.randint(1, hi)
        if kind == "disk":
            faults.append(Fault(kind, rng.choice(ids), at, down_s=rng.uniform(*disk_s)))
        else:
            faults.append(Fault(kind, rng.choice(ids), at, down_s=rng.uniform(*down) * timeout))
    return faults


def mass_errors(recs: dict[str, list[dict[str, Any]]], n: int) -> dict[int, float]:
    """|sum_i mu_i - n| per round boundary, over the rounds every peer recorded (push mode only).

    A peer that skipped rounds (fast-forward) still holds its mass: its last recorded mu counts.
    """
    by_peer = {pid: {int(r["round"]): float(r["mu"]) for r in rs if "mu" in r} for pid, rs in recs.items()}
    if not any(by_peer.values()):
        return {}
    out: dict[int, float] = {}
    last = max(max(v) for v in by_peer.values() if v)
    held: dict[str, float] = {}
    for k in range(last + 1):
        now = {pid: v[k] for pid, v in by_peer.items() if k in v}
        held.update(now)
        if now and len(held) == n:
            out[k] = abs(sum(held.values()) - n)
    return out


def final_mass_error(recs: dict[str, list[dict[str, Any]]], n: int) -> float | None:
    """|sum_i mu_i - n| over each peer's last recorded mu (the run's end: every edge settled)."""
    last = [float(r["mu"]) for rs in recs.values() for r in rs[-1:] if "mu" in r]
    return abs(sum(last) - n) if len(last) == n else None


def exactly_once(recs: dict[str, list[dict[str, Any]]], rounds: int, topo: Topology) -> dict[str, Any]:
    """Every (peer, round) once; gaps only where fast_forward_from says so; every mixed round recorded."""
    dups: list[list[Any]] = []
    missing: list[list[Any]] = []  # (peer, round): neither recorded nor skipped by a fast-forward
    unrecorded_mixed: list[list[Any]] = []  # (peer, round, by): a neighbour mixed it, the peer has no record
    bad_ff: list[list[Any]] = []  # (peer, round, fast_forward_from, previous recorded round)
    skipped = dict.fromkeys(recs, 0)
    for pid, rs in recs.items():
        seen: set[int] = set()
        for r in rs:
            k = int(r["round"])
            if k in seen:
                dups.append([pid, k])
            seen.add(k)
        explained: set[int] = set()
        for r in rs:
            if "fast_forward_from" in r:
                explained |= set(range(int(r["fast_forward_from"]), int(r["round"])))
        skipped[pid] = len(explained - seen)
        missing += [[pid, k] for k in range(rounds) if k not in seen and k not in explained]
        order = [int(r["round"]) for r in rs]
        if order != sorted(order):
            dups.append([pid, "out of order"])
        for prev, r in zip(rs, rs[1:], strict=False):  # the record after a gap names its first skipped round
            if "fast_forward_from" in r and int(r["fast_forward_from"]) != int(prev["round"]) + 1:
                bad_ff.append([pid, int(r["round"]), int(r["fast_forward_from"]), int(prev["round"])])
    have = {pid: {int(r["round"]) for r in rs} for pid, rs in recs.items()}
    for by, rs in recs.items():
        ins = topo.possible_in_neighbours(by)
        for r in rs:
            for j in ins:
                k = int(r["round"])
                if j not in r.get("missing", []) and k not in have.get(j, set()) and j in have:
                    unrecorded_mixed.append([j, k, by])
    return {"exactly_once": not dups and not missing and not unrecorded_mixed and not bad_ff,
            "duplicates": dups[:50], "missing": missing[:50], "mixed_but_unrecorded": unrecorded_mixed[:50],
            "inconsistent_fast_forward": bad_ff[:50],
            "rounds_skipped_by_fast_forward": skipped}


def nan_count(recs: dict[str, list[dict[str, Any]]]) -> int:
    return sum(1 for rs in recs.values() for r in rs for v in r.values()
               if isinstance(v, float) and not math.isfinite(v))


def final_acc(recs: dict[str, list[dict[str, Any]]]) -> float | None:
    accs = [float(rs[-1]["acc"]) for rs in recs.values() if rs and "acc" in rs[-1]]
    return statistics.fmean(accs) if accs and len(accs) == len(recs) else None


# Student's t, two-sided 95 % (0.975 quantile), by degrees of freedom: 1..10, then 15, 20, 30.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 15: 2.131, 20: 2.086, 30: 2.042}


def prediction_half_width(std: float, k: int) -> float | None:
    """Half-width of the 95 % prediction interval for one more run, from ``k`` clean runs of sample std ``std``.

    "Within the seeds' spread" asks whether the faulted run could be one more draw of the fault-free runs.
    With k runs that is mean +- t(k-1) * s * sqrt(1 + 1/k), not mean +- 2 s: two or three samples give an s
    that is often far below the true spread (with k = 2 the 2 s window holds a fresh fault-free run only
    about two times in three, with k = 3 three in four), so a fixed 2 s refuses honest runs at random.
    """
    if k < 2:
        return None
    df = k - 1
    t = _T975.get(df) or _T975[max(d for d in _T975 if d <= df)]
    return t * std * math.sqrt(1.0 + 1.0 / k)


def summarize(mode: str, faulty: Run, cleans: dict[int, Run], faults: list[Fault], n: int, rounds: int,
              topo: Topology, disk: str) -> dict[str, Any]:
    once = exactly_once(faulty.recs, rounds, topo)
    errs = mass_errors(faulty.recs, n) if mode == "push" else {}
    mass_max = max(errs.values()) if errs else None
    mass_final = final_mass_error(faulty.recs, n) if mode == "push" else None
    acc = final_acc(faulty.recs)
    clean_accs = {s: final_acc(r.recs) for s, r in cleans.items()}
    vals = [a for a in clean_accs.values() if a is not None]
    mean = statistics.fmean(vals) if vals else None
    std = statistics.stdev(vals) if len(vals) > 1 else None
    within = (None if acc is None or mean is None or std is None
              else abs(acc - mean) <= 2 * std + 1e-12)
    half = prediction_half_width(std, len(vals)) if std is not None else None
    within_pred = None if acc is None or mean is None or half is None else abs(acc - mean) <= half + 1e-12
    counts: dict[str, int] = {}
    for f in faults:
        if f.fault_round is not None or f.kind == "slow":
            counts[f.kind] = counts.get(f.kind, 0) + 1
    h = dict(faulty.hostile)
    h["moved_anyone"] = bool(faulty.unjustified_ff)
    res: dict[str, Any] = {
        "rounds": rounds,
        **once,
        "nan_count": nan_count(faulty.recs),
        "failed_peers": faulty.failed,
        "timed_out": faulty.timed_out,
        "restarts": faulty.restarts,
        "fast_forwards": sum(1 for rs in faulty.recs.values() for r in rs if "fast_forward_from" in r),
        "unjustified_fast_forwards": faulty.unjustified_ff[:20],
        "hostile": h,
        "faults_injected": counts,
        "faults": [f.as_dict() for f in sorted(faults, key=lambda f: (f.fault_round or 0, f.at_round))
                   if f.fault_round is not None or f.kind == "slow"],
        "disk": disk,
        "accuracy": {"faulted": _r(acc), "clean_mean": _r(mean), "clean_std": _r(std),
                     "clean": {str(s): _r(a) for s, a in clean_accs.items()}, "within_2std": within,
                     "prediction_95_half_width": _r(half), "within_prediction_95": within_pred},
        "s_per_round": round(faulty.wall_s / rounds, 3),
        "s_per_round_clean": (round(statistics.fmean(r.wall_s for r in cleans.values()) / rounds, 3)
                              if cleans else None),
        "wall_s": round(faulty.wall_s, 1),
    }
    if mode == "push":
        res.update({
            "mass_error_max": mass_max, "mass_error_final": mass_final,
            "mass_error_rounds": sorted(k for k, e in errs.items() if e > MASS_TOL)[:50],
            "min_mu": min((float(r["mu"]) for rs in faulty.recs.values() for r in rs if "mu" in r), default=None),
            "withheld_steps": sum(1 for rs in faulty.recs.values() for r in rs if r.get("withheld")),
            "ledger_settlements": sum(1 for rs in faulty.recs.values() for r in rs if r.get("mu_settled")),
        })
    ok = (once["exactly_once"] and res["nan_count"] == 0 and not faulty.failed and not faulty.timed_out
          and not h["moved_anyone"] and h.get("accepted", 0) == 0
          and (within_pred is not False)
          and (mode != "push" or (mass_max is not None and mass_max <= MASS_TOL
                                  and mass_final is not None and mass_final <= MASS_TOL)))
    res["ok"] = bool(ok)
    return res


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


# -- the driver --------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--mode", choices=["push", "pull", "both"], default="both")
    ap.add_argument("--minutes", type=float, default=30.0, help="how long each mode's faulted run should last")
    ap.add_argument("--rounds", type=int, default=None, help="fix the rounds (default: sized to --minutes)")
    ap.add_argument("--faults", type=int, default=None,
                    help="number of faults, the slow peer included (default: 3 per minute, at least 6)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {','.join(KINDS)}")
    ap.add_argument("--seed", type=int, default=0, help="draws the faults; the faulted run's config seed")
    ap.add_argument("--clean-seeds", type=int, default=3, help="fault-free runs, config seeds seed, seed+1, ...")
    ap.add_argument("--topology", default="ring")
    ap.add_argument("--pace", type=float, default=20.0,
                    help="network.slowdown of every peer (a sleep of pace-1 times its training: ~0.5 s rounds "
                         "at little CPU); the slow peer 2x that")
    ap.add_argument("--noise", type=float, default=4.0,
                    help="the synthetic task's noise (10 classes, 8x8; 4: a nearest-centroid 0.63, not saturated)")
    ap.add_argument("--timeout", type=float, default=8.0, help="network.round_timeout_s")
    ap.add_argument("--probe", type=float, default=0.5, help="network.probe_s")
    ap.add_argument("--storage-retry", type=float, default=20.0, help="checkpoint.storage_retry_s")
    ap.add_argument("--disk", choices=["auto", "tmpfs", "hook"], default="auto",
                    help="how a disk is made full (auto: tmpfs where root may mount, else the hook)")
    ap.add_argument("--disk-s", type=float, nargs=2, default=(3.0, 40.0), metavar=("MIN", "MAX"))
    ap.add_argument("--base-port", type=int, default=None)
    ap.add_argument("--limit", type=float, default=None, help="give up a run after this many seconds")
    ap.add_argument("--out", type=Path, default=None, help="keep the run folders here")
    ap.add_argument("--down", type=float, nargs=2, default=(0.2, 1.5), metavar=("MIN", "MAX"),
                    help="how long a killed/stalled peer stays down, in round deadlines")
    ap.add_argument("--no-clean", action="store_true", help="skip the fault-free runs (no accuracy check)")
    args = ap.parse_args(argv)
    # SIGTERM (a timeout wrapper) ends like ^C: the finally blocks kill the peers and unmount the disks
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    kinds = [k for k in args.kinds.split(",") if k]
    if bad := [k for k in kinds if k not in KINDS]:
        ap.error(f"unknown fault kinds: {bad}")
    if args.base_port is None:
        args.base_port = random.Random(os.getpid()).randint(21000, 58000)
    modes = ["pull", "push"] if args.mode == "both" else [args.mode]
    print(f"soak: seed {args.seed}, modes {modes}, {args.peers} peers, kinds {kinds}", file=sys.stderr, flush=True)
    out: dict[str, Any] = {"bench": "soak", "seed": args.seed, "peers": args.peers, "kinds": kinds, "modes": {}}
    with tempfile.TemporaryDirectory(prefix="p2pfl-soak-") as td:
        tmp = args.out or Path(td)
        tmp.mkdir(parents=True, exist_ok=True)
        disk = ("tmpfs" if can_mount(tmp) else "hook") if args.disk == "auto" else args.disk
        if "disk" not in kinds:
            disk = "none"
        ids = [f"p{i}" for i in range(args.peers)]
        certs = tmp / "certs"
        if not (certs / "ca.crt").exists():
            make_certs(ids, certs)
        for mi, mode in enumerate(modes):
            mdir = tmp / mode
            if mdir.exists():
                shutil.rmtree(mdir)
            mdir.mkdir(parents=True)
            kind = "directed_ring" if mode == "push" and args.topology == "ring" else args.topology
            topo = generate(kind, args.peers, base_port=args.base_port + 40 * mi)
            rng = random.Random(f"{args.seed}/{mode}")
            rounds, calib = args.rounds, None
            if rounds is None:  # size the rounds: a short fault-free run measures seconds per round
                r0 = 20
                c = run(write_config(mdir, args, mode, args.seed, r0, {}, topo, "calib"), ids, mdir / "calib",
                        certs, [], 600)
                calib = round((c.wall_s - (0 if math.isnan(c.first_record_s) else c.first_record_s)) / (r0 - 1), 3)
                rounds = max(12, int(args.minutes * 60 / (1.5 * calib)))
                print(f"soak: {mode}: {calib} s/round fault-free; {rounds} rounds", file=sys.stderr, flush=True)
            limit = args.limit or max(600.0, args.minutes * 60 * 4)
            n_faults = args.faults if args.faults is not None else max(6, round(3 * args.minutes))
            cleans: dict[int, Run] = {}
            if not args.no_clean:
                for s in range(args.seed, args.seed + args.clean_seeds):
                    cleans[s] = run(write_config(mdir, args, mode, s, rounds, {}, topo, f"clean{s}"), ids,
                                    mdir / f"clean-seed{s}", certs, [], limit)
                    print(f"soak: {mode}: clean seed {s}: {cleans[s].wall_s:.0f} s, acc {final_acc(cleans[s].recs)}",
                          file=sys.stderr, flush=True)
            faults = draw_faults(rng, ids, n_faults, rounds, args.timeout, kinds, tuple(args.down), tuple(args.disk_s))
            slow = {f.peer: f.factor for f in faults if f.kind == "slow"}
            cfg = write_config(mdir, args, mode, args.seed, rounds, slow, topo, "faulted")
            hostile = (Hostile(topo, cfg, certs, mode, rounds, 2, random.Random(f"{args.seed}/{mode}/hostile"),
                               None, ids)  # type: ignore[arg-type]
                       if "hostile" in kinds else None)
            faulty = run(cfg, ids, mdir / "faulted", certs, faults, limit, disk=disk, hostile=hostile, topo=topo)
            res = summarize(mode, faulty, cleans, faults, args.peers, rounds, topo, disk)
            if calib is not None:
                res["s_per_round_calibration"] = calib
            out["modes"][mode] = res
            print(f"soak: {mode}: {json.dumps(res, sort_keys=True)}", file=sys.stderr, flush=True)
    out["ok"] = all(m["ok"] for m in out["modes"].values())
    print(json.dumps(out, sort_keys=True))
    return out


if __name__ == "__main__":
    main()
