"""CLI start-up cost: for every ``p2pfl`` command, which heavy stacks it imports and its CPU seconds.

Why: light commands run often (the container healthcheck runs ``p2pfl health`` every 15 s in
every container; ``p2pfl algorithms``/``models``/``datasets`` are what a user types first), so
they must not pay for importing torch or Flower. Each command runs in a fresh interpreter through
the real entry point (``p2pfl.cli.main``); CPU is user+system time of that child (``getrusage``),
the minimum and median over ``--repeats`` runs.

Usage: python bench/cli_startup.py [--repeats 3]. The last line is one JSON object:
``{"<command>": {"cpu_s_min", "cpu_s_median", "imports": [heavy stacks imported]}, ...}``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "flwr", "grpc", "torchvision", "matplotlib", "ray")

# The entry point in a fresh interpreter; reports the heavy stacks it imported on stderr.
_PROBE = """
import json, sys
from p2pfl.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
sys.stderr.write("PROBE " + json.dumps([m for m in {heavy!r} if m in sys.modules]) + "\\n")
"""

COMMANDS: list[list[str]] = [
    ["--help"],
    *[[c, "--help"] for c in ("simulate", "node", "launch", "compare", "certs", "health", "algorithms", "models",
                              "datasets", "topology", "flower", "compose", "k8s", "watch", "sweep", "report")],
    ["algorithms"],
    ["models"],
    ["datasets"],
    ["topology", "check", "topology/ring-8.yaml"],
    ["health", "127.0.0.1:1", "--insecure"],
]


def run_once(args: list[str]) -> tuple[float, list[str]]:
    """CPU seconds of one run of ``p2pfl ARGS`` and the heavy stacks it imported."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-c", _PROBE.format(heavy=HEAVY), *args], capture_output=True,
                         text=True, cwd=REPO, timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    line = next((ln for ln in out.stderr.splitlines() if ln.startswith("PROBE ")), None)
    if line is None:
        raise RuntimeError(f"p2pfl {' '.join(args)} did not finish: {out.stderr[-500:]}")
    return cpu, json.loads(line[len("PROBE "):])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    figures: dict[str, dict] = {}
    for cmd in COMMANDS:
        runs = [run_once(cmd) for _ in range(args.repeats)]
        cpus = [c for c, _ in runs]
        imports = sorted({m for _, mods in runs for m in mods})
        name = " ".join(cmd)
        figures[name] = {"cpu_s_min": round(min(cpus), 2), "cpu_s_median": round(statistics.median(cpus), 2),
                         "imports": imports}
        print(f"p2pfl {name:<40} CPU {min(cpus):5.2f} s min {statistics.median(cpus):5.2f} s median   "
              f"imports: {', '.join(imports) or '-'}", flush=True)
    print(json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    main()
