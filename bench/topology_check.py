"""Bounded loading figures: `p2pfl topology check` on a large ring, and the refusal of a YAML alias bomb.

Each figure is one fresh ``p2pfl`` process (what a user runs), timed by wall clock with its peak
RSS from ``getrusage``; repeated, min and median reported. Before issue 16 the 20,000-peer check
built a 3.2 GB dense matrix, and the alias bomb ran > 30 s and > 4 GiB before a MemoryError.

    python bench/topology_check.py [--peers 20000] [--repeat 3]

Ends with one JSON line of its figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str]) -> tuple[float, float, float, int]:
    """(wall s, CPU s, peak RSS of the child in MiB, exit code) of one ``p2pfl`` command.

    CPU seconds (user + sys) are reported too: on a shared machine they move far less than wall time.
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "p2pfl.cli", *args], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, max(after.ru_maxrss, before.ru_maxrss) / 1024, res.returncode


def _alias_bomb(levels: int = 9) -> str:
    text, prev = 'a: &a ["x","x","x","x","x","x","x","x","x"]\n', "a"
    for i in range(levels - 1):
        text += f"l{i}: &l{i} [" + ",".join([f"*{prev}"] * 9) + "]\n"
        prev = f"l{i}"
    return text + f"peers: *{prev}\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from p2pfl.topology import generate

    with tempfile.TemporaryDirectory() as tmp:
        ring = Path(tmp) / "ring.yaml"
        generate("ring", args.peers, base_port=1024).dump(ring)
        bomb = Path(tmp) / "bomb.yaml"
        bomb.write_text(_alias_bomb())
        figures: dict[str, object] = {"peers": args.peers, "ring_file_mb": round(ring.stat().st_size / 2**20, 2)}
        # ascending memory: RUSAGE_CHILDREN's peak is a maximum over every child so far
        for name, cmd, want in (("startup_only", ["--help"], 0),
                                ("alias_bomb", ["topology", "check", str(bomb)], 2),
                                ("ring_check", ["topology", "check", str(ring)], 0)):
            walls, cpus, peaks = [], [], []
            for _ in range(args.repeat):
                wall, cpu, peak, code = _run(cmd)
                if code != want:
                    raise SystemExit(f"{name}: exit {code}, expected {want}")
                walls.append(wall)
                cpus.append(cpu)
                peaks.append(peak)
            figures[f"{name}_s_min"] = round(min(walls), 3)
            figures[f"{name}_s_median"] = round(statistics.median(walls), 3)
            figures[f"{name}_cpu_s_min"] = round(min(cpus), 3)
            figures[f"{name}_cpu_s_median"] = round(statistics.median(cpus), 3)
            figures[f"{name}_peak_rss_mb"] = round(max(peaks), 1)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
