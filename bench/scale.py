"""From 128 to 10,000 peers: does `p2pfl simulate` cost the same per peer at every size? (issue 71)

One protocol at every size: a connected random 4-regular graph (`p2pfl topology gen
random_regular --k 4`, seed 0), cnn_small, D-PSGD with 3 local steps of batch 16 per peer per
round, an IID partition of Fashion-MNIST (every peer gets data), evaluation every round, no
checkpoints (``--set checkpoint.enabled=true`` adds them), the exact engine, 2 workers. Each size
runs in a fresh child process (the same imports, the same dataset load); sizes run one after the
other, smallest first.

Figures, per size:

* ``s_per_round``: the steady round, (end of the last round - end of round 0) / (rounds - 1), where
  the end of round r is the mean over peers of when a peer handed its round-r record to its
  rank's record sink (stamped in the rank, so no exchange step delays it;
  the mean, not the last peer, because peers pipeline rounds: see `_round_figures`). Round 0 holds
  the start-up of the peers (their Nodes are built in their first turn) and is not timed.
  ``ms_per_peer``: ``s_per_round`` / peers; ``cpu_ms_per_peer``: the ranks' CPU (process time,
  exchange steps included) over the same span, per peer and round.
* ``startup_s``: from launching the child to the start of the rounds: the forking process's work
  until the ranks start (imports, config, dataset and partition, topology, run folder, forking),
  plus the slowest rank's own set-up (its group, board and model) and the building of its peers'
  Nodes (each is built in its peer's first turn, interleaved with round 0: the rank stamps the
  time it spends in ``make_node``). ``startup_cpu_s``: the same in CPU seconds, load-independent
  (``parent_cpu_s`` + ``build_cpu_s``). ``startup_share_10``: its share of a 10-round run,
  startup / (startup + 10 rounds + tail); ``startup_cpu_share_10``: the CPU share against 10
  rounds at the workers' CPU per round spread over the workers (the share on an idle machine).
  ``startup_end0_s``/``startup_end0_cpu_s`` (and their ``_share_10``): the measure of the figures
  before 4fb748a, to the (mean) end of round 0 less one steady round. It counts part of round 0's
  training as start-up: in round 0 no peer can record before every peer's first training (their
  payloads cross between the ranks in the first exchange steps), so the mean end of round 0 falls
  later than one steady round after the start, where the peers' ends are spread over the round
  (at 1,024 peers, 3 rounds: 7.9 CPU s by that measure against 3.6 by this one, of which 0.24
  building Nodes; the 4.3 s between them are about 0.75 of a worker's round, 5.7 CPU s).
  ``tail_s``: from the end of the last round (its last peer) to `simulate` returning (teardown, sorted metrics,
  summary, plot).
* ``main_rss_mb``/``main_pss_mb``: the peak of the child (the process that forks the other ranks, is
  rank 0 and writes the run folder); ``workers_rss_mb``/``workers_pss_mb``: the peak of the forked ranks' sum; ``pss_mb``:
  the peak of the whole tree's PSS (pages shared after fork counted once, from
  /proc/PID/smaps_rollup), sampled from this (driver) process. ``pss_kb_per_peer``: the tree's peak PSS
  beyond the 128-peer run's (or the smallest size run), per extra peer; ``state_kb_per_peer``: what
  one peer must hold, its parameters plus its optimizer state (`PeerState` after ``init_state``).

The last line is one JSON object with every size's figures and ``cost_ratio_10000_vs_128`` (the
wall cost per peer at 10,000 over that at 128; null unless both ran). Targets (issue 71): that
ratio <= 1.15; start-up < 10% of a 10-round run; memory per peer <= 2x its parameters plus
optimizer state.

Figures (2026-12-05, 2 shared cores, load average 4-16 from other jobs: wall figures are
inflated and noisy, CPU figures less so; one run each):

* before (ceca194): 128 peers ``--rounds 4``: 12.27 ms/peer (13.85 CPU ms); 1024: 7.67 (10.87 CPU),
  start-up 12.7 s. 4096 ``--rounds 3`` did not finish in 900 s under load 13 (killed); the issue's
  figures on a quieter machine: 4096 42.9 s/round, 10,000 205 s/round (7 minutes for 2 rounds).
* after (1a13ff1 for 128/1024, 68c20f2 for 4096/10,000): 128 ``--rounds 4``: 12.39 ms/peer (13.73 CPU
  ms); 1024: 8.01 (10.37 CPU), start-up 8.9 s (9.7 % of 10 rounds); 4096 ``--rounds 2``: 7.86 CPU
  ms/peer (wall 25 ms/peer at load 11-13); 10,000 ``--rounds 2``: 38.8 s/round, 3.88 ms/peer (5.03
  CPU ms), start-up 60 s wall / 40 CPU s (13 % of 10 rounds), 156 s for the whole run; peak PSS
  12.3 GB (main 0.69 GB, workers 12.0 GB), ~1.2 MB per peer beyond the 128-peer run: 3.7-4x a
  peer's 313 KB of parameters (D-PSGD keeps no optimizer state).
* memory and start-up (2026-12-06, same host, load average 4-9 from other jobs; one run each):
  before (e5363b4, main): ``--sizes 128,1024 --rounds 3``: 128 13.53 CPU ms/peer, PSS 812 MB;
  1024 11.65 CPU ms/peer, PSS 2123 MB, 1463 KB per extra peer (4.56x the state), start-up 7.2
  CPU s (end of round 0). ``--sizes 4096 --rounds 4``: 12.10 CPU ms/peer, 14.72 ms/peer wall, PSS
  6302 MB, start-up 15.0 CPU s (end of round 0).
  after (4fb748a for 1024, ada92ad for the rest): ``--sizes 128,1024 --rounds 3``: 128 14.87 CPU
  ms/peer, PSS 750 MB; 1024 11.12 CPU ms/peer, PSS 1275 MB, 586 KB per extra peer (1.83x),
  start-up 3.6 CPU s (7.9 by the end of round 0). ``--sizes 4096 --rounds 4``: 12.19 CPU ms/peer,
  PSS 3094 MB (half), start-up 5.3 CPU s (15.8 by the end of round 0). ``--sizes 128,10000
  --rounds 10`` (25 minutes): 128 21.0 ms/peer (16.1 CPU ms); 10,000 143 s/round, 14.3 ms/peer
  (10.4 CPU ms), ``cost_ratio_10000_vs_128`` 0.679 (CPU 0.642); start-up 18.0 s / 8.8 CPU s (6.05
  in the forking process, 2.75 in the slower rank's set-up and Node building): 1.2 % of 10 rounds
  (CPU 1.7 %; by the end of round 0: 29.7 s / 15.5 CPU s, 2.0 % / 2.9 %); peak PSS 6.65 GB (main
  3.34, workers 3.35), 598 KB per peer beyond the 128-peer run: 1.86x a peer's 313 KB. The 10,000
  peers' CPU per peer-round is twice the 5.0 ms above, not because of these changes: main and
  this branch cost the same at 4096 peers, 4 rounds (12.10 and 12.19 CPU ms, above; 7.9 in the
  earlier 2-round figure). Most likely the 2-round figures were low: with 2 rounds the estimate
  is (end of round 1 - end of round 0), and when all of round 0's payloads crossed in one
  exchange step, round 1's records came before about half of a round's training.

Usage: python bench/scale.py [--sizes 128,1024,4096,10000] [--rounds 4] [--workers 2] [--set KEY=VALUE]
Quick look: python bench/scale.py --sizes 128,1024 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_SIZES = (128, 1024, 4096, 10000)
PAGE = os.sysconf("SC_PAGE_SIZE")
CLK_TCK = os.sysconf("SC_CLK_TCK")

#: The protocol, as overrides of bench/reproduce/deprl_fmnist/base.yaml (cnn_small, D-PSGD, 3 steps of 16).
PROTOCOL = ["data.partition={kind: iid}", "eval_every=1", "checkpoint.enabled=false", "algorithm.lr_decay=1.0"]
BASE_CONFIG = ROOT / "bench" / "reproduce" / "deprl_fmnist" / "base.yaml"
#: Key of the worker-side timestamp the child stamps on every record (the run folder is temporary).
STAMP = "_scale_t"


# ---- memory of the process tree, per role (Linux /proc) ------------------------------------------


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (of any of its threads)."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
    except OSError:  # exited
        pass
    return out


def _rss_pss(pid: int, pss: bool) -> tuple[int, int]:
    """(RSS, PSS) bytes of one process; PSS 0 unless ``pss`` (smaps_rollup walks every page table)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            rss = int(f.read().split()[1]) * PAGE
        if not pss:
            return rss, 0
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return rss, int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0, 0


class RoleSampler(threading.Thread):
    """Peak RSS/PSS of a child (``main``) and of its descendants together (``workers``), from outside.

    RSS every ``period`` s; PSS every ``pss_every``-th sample (reading smaps_rollup of a few-GB
    process takes milliseconds of a core the measured run would otherwise have).
    """

    def __init__(self, pid: int, period: float = 0.5, pss_every: int = 4) -> None:
        super().__init__(daemon=True)
        self.pid, self.period, self.pss_every = pid, period, pss_every
        self.peak: dict[str, float] = {k: 0.0 for k in ("main_rss", "main_pss", "workers_rss", "workers_pss",
                                                          "rss", "pss")}
        self._stop_event = threading.Event()

    def run(self) -> None:
        n = 0
        while not self._stop_event.is_set():
            pss = n % self.pss_every == 0
            n += 1
            main = _rss_pss(self.pid, pss)
            todo, workers = _children(self.pid), [0, 0]
            while todo:
                p = todo.pop()
                r, s = _rss_pss(p, pss)
                workers[0] += r
                workers[1] += s
                todo.extend(_children(p))
            now = {"main_rss": main[0], "workers_rss": workers[0], "rss": main[0] + workers[0]}
            if pss:
                now.update(main_pss=main[1], workers_pss=workers[1], pss=main[1] + workers[1])
            for k, v in now.items():
                self.peak[k] = max(self.peak[k], v / 1e6)
            self._stop_event.wait(self.period)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)


# ---- one size, in a child process ---------------------------------------------------------------


def _stamp_records() -> None:
    """Stamp every record with (monotonic time, this rank's process CPU time) where its peer makes it.

    Rank 0 sends the other ranks' records to the run folder at exchange steps, so their arrival says
    little about when a round ended; the stamp is taken in the rank, at the Node's own record call
    (the ranks fork after this runs, so they inherit the wrappers). CLOCK_MONOTONIC is one clock for
    all processes of the machine. Rank 0 is the process that forked the others: its CPU stamps count
    from when it began to run its peers, as a forked rank's count from its fork.
    """
    from p2pfl.engine import exact as simulation
    from p2pfl.experiment import Experiment

    make_node = Experiment.make_node
    cpu0: dict[int, float] = {}
    # this process's start-up as a rank: (wall, CPU) from its start to its first Node, plus building its Nodes
    built: dict[int, list[float]] = {}
    began: dict[int, tuple[float, float]] = {}

    def stamping(self: Any, pid: str, *args: Any, record: Any, **kwargs: Any) -> Any:
        def stamped(rec: dict[str, Any]) -> None:
            me = os.getpid()
            rec[STAMP] = (time.monotonic(), time.process_time() - cpu0.get(me, 0.0), me, *built[me])
            record(rec)

        me, w0, c0 = os.getpid(), time.monotonic(), time.process_time()
        if me not in built:  # its first Node: the rank's own set-up (group, board, model) before it
            t_start, c_start = began.get(me, (w0, c0))
            built[me] = [w0 - t_start, c0 - c_start]
        node = make_node(self, pid, *args, record=stamped, **kwargs)
        built[me][0] += time.monotonic() - w0
        built[me][1] += time.process_time() - c0
        return node

    Experiment.make_node = stamping  # type: ignore[method-assign]
    run_rank = simulation._run_rank

    def started(ranks: Any, *args: Any, **kwargs: Any) -> None:
        # The forking process's CPU when this rank began: everything the run did before any peer.
        if ranks.rank == 0:
            parent_cpu = cpu0[os.getpid()] = time.process_time()
        else:
            with open(f"/proc/{os.getppid()}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            parent_cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK
        began[os.getpid()] = (time.monotonic(), time.process_time())
        line = "FORK " + json.dumps({"w": ranks.rank, "pid": os.getpid(), "parent_cpu": parent_cpu, "t": time.monotonic()})
        sys.stdout.flush()
        os.write(1, (line + "\n").encode())  # one write: the ranks share the pipe, a line must not interleave
        run_rank(ranks, *args, **kwargs)

    simulation._run_rank = started


def _round_figures(metrics: Path, peers: int, rounds: int) -> dict[str, Any]:
    """Round times (wall) and the workers' CPU per round from the stamped records.

    A round's time is the *mean* over peers of when they finished it, not the last peer's: peers
    pipeline rounds (one waiting for a neighbour lets the others run ahead), so when the slowest
    peer finishes round 0 most have done much of round 1, and the last peer's times would credit
    the work of the early rounds to round 0. The mean moves one round's work per round.
    The workers' CPU likewise: per worker, the mean of its peers' CPU stamps of the round.
    """
    t_sum: dict[int, float] = {}
    t_max: dict[int, float] = {}
    cpu: dict[tuple[int, int], list[float]] = {}  # (round, worker pid) -> its CPU stamps of the round
    count: dict[int, int] = {}
    build: dict[int, tuple[float, float]] = {}  # worker pid -> (wall, CPU) of its set-up and building its Nodes
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        r, (t, c, pid, b_wall, b_cpu) = int(rec["round"]), rec[STAMP]
        build[pid] = max(build.get(pid, (0.0, 0.0)), (b_wall, b_cpu))
        t_sum[r] = t_sum.get(r, 0.0) + t
        t_max[r] = max(t_max.get(r, 0.0), t)
        cpu.setdefault((r, pid), []).append(c)
        count[r] = count.get(r, 0) + 1
    if sorted(count) != list(range(rounds)) or any(v != peers for v in count.values()):
        raise RuntimeError(f"expected {peers} records for each of {rounds} rounds, got {count}")
    mean = {r: t_sum[r] / peers for r in t_sum}
    pids = {pid for _, pid in cpu}

    def mean_cpu(r: int, pid: int) -> float:
        return sum(cpu[(r, pid)]) / len(cpu[(r, pid)])

    span = rounds - 1
    per_worker = {p: (mean_cpu(rounds - 1, p) - mean_cpu(0, p)) / span for p in pids}
    return {"s_per_round": (mean[rounds - 1] - mean[0]) / span,
            "cpu_s_per_round": sum(per_worker.values()),
            # a worker's CPU from its fork to the (mean) end of round 0, less one round: building its peers
            "worker_startup_cpu_s": max(mean_cpu(0, p) - per_worker[p] for p in pids),
            "end0": mean[0], "end_last": t_max[rounds - 1], "build": {str(p): v for p, v in build.items()},
            "round_s": [round(mean[r] - mean[r - 1], 3) for r in range(1, rounds)]}


def child_main(args: argparse.Namespace) -> None:
    from p2pfl.engine.exact import one_malloc_arena

    one_malloc_arena()  # as `p2pfl simulate` does, before any thread
    import torch
    import yaml

    from p2pfl.config import load_config
    from p2pfl.experiment import Experiment
    from p2pfl.simulation import simulate
    from p2pfl.topology import generate

    torch.set_num_threads(1)
    _stamp_records()
    t_imported = time.monotonic()
    n = args.child
    with tempfile.TemporaryDirectory(prefix="p2pfl-scale-") as tmp:
        topo = generate("random_regular", n, k=4, seed=0, name=f"random4-{n}")
        path = Path(tmp) / f"random4-{n}.yaml"
        path.write_text(yaml.dump(topo.to_dict(), Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False))
        cfg = load_config(args.config, [*PROTOCOL, f"rounds={args.rounds}", f"simulation.workers={args.workers}",
                                        f"topology={path}", *args.set])
        exp = Experiment.from_config(cfg)
        algo = exp.new_algorithm()
        from p2pfl.algorithms import PeerState

        st = PeerState(peer_id=exp.topology.ids[0], params=exp._init[1].clone())
        algo.init_state(st, torch.Generator().manual_seed(0))
        state_bytes = st.params.numel() * st.params.element_size() + sum(
            t.numel() * t.element_size() for t in st.extra.values() if isinstance(t, torch.Tensor))
        del st, algo
        run_dir = Path(tmp) / "run"
        t_sim = time.monotonic()
        summary = simulate(cfg, run_dir, progress=False, experiment=exp)
        t_done = time.monotonic()
        fig = _round_figures(run_dir / "metrics.jsonl", n, args.rounds)
    out = {"peers": n, "workers": summary["workers"], "final_acc_mean": summary["final_acc_mean"],
           "state_bytes": state_bytes, "param_bytes": exp._init[1].numel() * exp._init[1].element_size(),
           "t_imported": t_imported, "t_simulate": t_sim, "t_done": t_done, **fig}
    print("RESULT " + json.dumps(out), flush=True)


def run_size(n: int, args: argparse.Namespace) -> dict[str, Any]:
    """Run size ``n`` in a fresh child; add start-up, tail and peak memory."""
    argv = [sys.executable, __file__, f"--config={args.config}", f"--rounds={args.rounds}",
            f"--workers={args.workers}", *(f"--set={s}" for s in args.set), f"--child={n}"]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    sampler = RoleSampler(proc.pid)
    sampler.start()
    try:
        out, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # its workers are daemonic children: they go with it
        proc.communicate()
        raise SystemExit(f"{n} peers: no result within {args.timeout} s") from None
    finally:
        sampler.stop()
    if proc.returncode:
        raise SystemExit(f"{n} peers: child failed (exit code {proc.returncode})")
    def parsed(line: str, tag: str) -> Any:
        try:
            return json.loads(line[len(tag):])
        except ValueError as exc:  # say which line (once seen: "Extra data", not reproduced)
            raise SystemExit(f"{n} peers: unreadable {tag.strip()} line from the child ({exc}): {line[:400]!r}") from None

    res = parsed(next(ln for ln in reversed(out.splitlines()) if ln.startswith("RESULT ")), "RESULT ")
    forks = [parsed(ln, "FORK ") for ln in out.splitlines() if ln.startswith("FORK ")]
    # Start-up: the forking process's work (imports, config, dataset, partition, run folder) until
    # the ranks start, plus the slowest rank's own set-up and building of its Nodes (stamped in it).
    parent_cpu = max((f["parent_cpu"] for f in forks), default=0.0)
    start_t = {f["pid"]: f["t"] for f in forks}
    build = {int(p): v for p, v in res["build"].items()}
    startup = max(start_t[p] - t0 + w for p, (w, _) in build.items())
    startup_cpu = parent_cpu + max(c for _, c in build.values())
    # The earlier measure: to the mean end of round 0, less one steady round. It counts about half a
    # round of training as start-up: every peer of round 0 waits for all the others' first training
    # (the first exchange), while in a steady round their ends are spread over the round.
    end0_cpu = parent_cpu + res["worker_startup_cpu_s"]
    idle_round = res["cpu_s_per_round"] / max(1, res["workers"])  # a round's wall time if no one else ran
    spr = res["s_per_round"]
    end0 = res["end0"] - t0 - spr
    tail = res["t_done"] - res["end_last"]
    fig = {
        "peers": n, "workers": res["workers"], "rounds": args.rounds,
        "s_per_round": round(spr, 3), "ms_per_peer": round(1000 * spr / n, 3),
        "cpu_ms_per_peer": round(1000 * res["cpu_s_per_round"] / n, 3), "round_s": res["round_s"],
        "startup_s": round(startup, 2), "import_s": round(res["t_imported"] - t0, 2),
        "to_simulate_s": round(res["t_simulate"] - t0, 2), "tail_s": round(tail, 2),
        "startup_share_10": round(startup / (startup + 10 * spr + tail), 4),
        "startup_cpu_s": round(startup_cpu, 2),
        "startup_cpu_share_10": round(startup_cpu / (startup_cpu + 10 * idle_round), 4),
        "startup_end0_s": round(end0, 2), "startup_end0_share_10": round(end0 / (end0 + 10 * spr + tail), 4),
        "startup_end0_cpu_s": round(end0_cpu, 2),
        "startup_end0_cpu_share_10": round(end0_cpu / (end0_cpu + 10 * idle_round), 4),
        "parent_cpu_s": round(parent_cpu, 2), "build_cpu_s": round(max(c for _, c in build.values()), 2),
        "total_s": round(time.monotonic() - t0, 2),
        **{f"{k}_mb": round(v, 1) for k, v in sampler.peak.items()},
        "state_kb_per_peer": round(res["state_bytes"] / 1024, 1), "param_kb": round(res["param_bytes"] / 1024, 1),
        "final_acc_mean": res["final_acc_mean"],
    }
    return fig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="comma-separated peer counts")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per run (>= 2; round 0 is not timed)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--config", default=str(BASE_CONFIG), help="base config (the protocol's overrides apply on top)")
    ap.add_argument("--set", action="append", default=[], help="extra config override dotted.key=VALUE")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per size before the child is killed")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error("--rounds must be >= 2")
    if args.child:
        child_main(args)
        return
    sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    load_before = os.getloadavg()[0]
    runs: dict[int, dict[str, Any]] = {}
    for n in sizes:
        runs[n] = fig = run_size(n, args)
        print(f"{n:6d} peers: {fig['s_per_round']:.2f} s/round, {fig['ms_per_peer']:.2f} ms/peer "
              f"({fig['cpu_ms_per_peer']:.2f} CPU ms), start-up {fig['startup_s']:.1f} s "
              f"({100 * fig['startup_share_10']:.1f}% of 10 rounds; {fig['startup_cpu_s']:.1f} CPU s, "
              f"{100 * fig['startup_cpu_share_10']:.1f}%), tail {fig['tail_s']:.1f} s, "
              f"PSS {fig['pss_mb']:.0f} MB (main {fig['main_pss_mb']:.0f}, workers {fig['workers_pss_mb']:.0f}), "
              f"RSS main {fig['main_rss_mb']:.0f} MB, workers {fig['workers_rss_mb']:.0f} MB", flush=True)
    base = runs[sizes[0]]
    for n in sizes[1:]:
        runs[n]["pss_kb_per_peer"] = round(1000 * (runs[n]["pss_mb"] - base["pss_mb"]) / (n - sizes[0]), 1)
        runs[n]["pss_vs_state"] = round(runs[n]["pss_kb_per_peer"] * 1000 / 1024 / base["state_kb_per_peer"], 3)

    def ratio(a: int, b: int, key: str) -> float | None:
        return round(runs[a][key] / runs[b][key], 3) if a in runs and b in runs else None

    summary = {
        "sizes": sizes, "rounds": args.rounds, "workers": args.workers,
        "runs": {str(n): runs[n] for n in sizes},
        "cost_ratio_10000_vs_128": ratio(10000, 128, "ms_per_peer"),
        "cpu_ratio_10000_vs_128": ratio(10000, 128, "cpu_ms_per_peer"),
        "cost_ratio_max_vs_min": ratio(sizes[-1], sizes[0], "ms_per_peer"),
        "cpu_ratio_max_vs_min": ratio(sizes[-1], sizes[0], "cpu_ms_per_peer"),
        "cpus": os.cpu_count(), "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
