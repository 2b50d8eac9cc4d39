"""CPU seconds of a running sweep, per cell: ``cpu.json`` in each cell folder (the PS runs' cost).

Why: a Flower baseline on Ray runs its clients in Ray worker processes (children of the raylet),
which a parent's ``getrusage`` never sees; this samples the sweep's whole process tree instead.
Every ``--every`` seconds it reads ``utime + stime`` of each process under the sweep (own time
only, so a reaped child is never counted twice), keeps each process's last value, and charges
it to the cell whose ``p2pfl`` subprocess is its ancestor. When the sweep exits it writes, per
cell, ``{"cpu_seconds", "rounds", "cpu_seconds_per_round", "peer_rounds_recorded"}``; a process
that lived less than one sampling period is missed (a lower bound, off by seconds).

    .venv/bin/python bench/reproduce/cpu_watch.py SWEEP_PID runs/reproduce/t1-ps-smoke-ring-pi0.1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.many_peers import CLK_TCK, tree_pids  # noqa: E402


def own_cpu(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (stat fields 14, 15)


def cell_of(pid: int) -> str | None:
    """The ``--out`` folder of a cell process (``p2pfl simulate|flower ... --out DIR``)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    return args[args.index("--out") + 1] if "--out" in args[:-1] else None


def children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
    except OSError:
        pass
    return out


def write_cell(cell: Path, cpu: float) -> None:
    metrics = cell / "metrics.jsonl"
    lines = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
    rounds = None
    summary = cell / "summary.json"
    if summary.is_file():
        rounds = json.loads(summary.read_text()).get("rounds")
    out = {"cpu_seconds": round(cpu, 1), "rounds": rounds, "peer_rounds_recorded": lines,
           "cpu_seconds_per_round": round(cpu / rounds, 1) if rounds else None,
           "how": "sum over the cell's process tree (Ray workers included) of utime+stime, sampled; "
                  "start-up (Ray, data, partition) included"}
    (cell / "cpu.json").write_text(json.dumps(out, indent=2) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pid", type=int, help="the sweep process")
    ap.add_argument("out", type=Path, help="the sweep's output folder (for the log)")
    ap.add_argument("--every", type=float, default=2.0)
    args = ap.parse_args()
    last: dict[int, tuple[str, float]] = {}  # pid -> (cell, cpu)
    owner: dict[int, str] = {}  # cell process pid -> cell folder
    written: set[str] = set()
    per_cell: dict[str, float] = {}
    while Path(f"/proc/{args.pid}").exists():
        for top in children(args.pid):
            cell = owner.get(top) or cell_of(top)
            if cell is None:
                continue
            owner[top] = cell
            for p in tree_pids(top):
                cpu = own_cpu(p)
                if cpu is not None:
                    last[p] = (cell, cpu)
        per_cell = {}
        for cell, cpu in last.values():
            per_cell[cell] = per_cell.get(cell, 0.0) + cpu
        live = {owner[t] for t in children(args.pid) if t in owner}
        for cell, cpu in per_cell.items():
            if cell not in live and cell not in written and (Path(cell) / "summary.json").is_file():
                write_cell(Path(cell), cpu)
                written.add(cell)
        with open(args.out / "cpu_watch.jsonl", "a") as f:
            f.write(json.dumps({"t": round(time.time(), 1), "cpu": {k: round(v, 1) for k, v in per_cell.items()}})
                    + "\n")
        time.sleep(args.every)
    for cell, cpu in per_cell.items():
        if cell not in written and (Path(cell) / "summary.json").is_file():
            write_cell(Path(cell), cpu)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
