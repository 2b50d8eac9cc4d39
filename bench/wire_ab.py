"""CPU per transfer of the wire path, two commits side by side (A/B, interleaved).

Issue 13 asks that the wire benchmark stay within 5 % of the day it was filed (commit 2ea9fda).
Wall-clock throughput on a shared 2-core machine swings 2-4x between repeats, so this compares the
CPU time (``time.process_time``, every thread of the process) one transfer costs: the ResNet-18
body payload of ``bench/wire.py`` (same code for both trees: this checkout's ``bench/wire.py``
drives each tree's ``p2pfl`` package), plain and mutual TLS, one-way (Pull) and exchange. Each
tree is extracted with ``git archive`` into a temporary folder and run in its own process,
alternating the order every round (A B, B A, ...) so both see the same load.

    python bench/wire_ab.py [--base 2ea9fda] [--head HEAD] [--rounds 4] [--reps 10]

The last line is one JSON object: per case, the head/base ratio of the medians and of the minimums
over every sample, and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ("plain_one_way", "plain_exchange", "tls_one_way", "tls_exchange")

# Runs in a child process with one tree first on sys.path: CPU seconds of each transfer.
CHILD = r"""
import json, logging, runpy, sys, tempfile, time
from pathlib import Path
tree, wire, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, tree)
sys.argv = ["wire"]
g = runpy.run_path(wire, run_name="wirebench")
import p2pfl, torch
assert p2pfl.__file__.startswith(tree), p2pfl.__file__
torch.set_num_threads(1)
logging.basicConfig(level=logging.WARNING)
specs = g["payload_specs"](None)
numel = sum(s.numel for s in specs)
gen = torch.Generator().manual_seed(0)
flats = {p: torch.randn(numel, generator=gen) for p in ("p0", "p1")}
certs_dir = Path(tempfile.mkdtemp())
g["make_certs"](["p0", "p1"], certs_dir)
out = {}
for name, certs in (("plain", None), ("tls", certs_dir)):
    pair = g["OursPair"](specs, flats, 1 << 20, certs)
    try:
        fns = [("one_way", pair.one_way), ("exchange", pair.exchange)]
        for _, fn in fns:
            fn(); fn()  # warm-up: channels, TLS handshakes, allocator
        for kind, _ in fns:
            out[f"{name}_{kind}"] = []
        for i in range(reps):
            for kind, fn in (fns if i % 2 == 0 else fns[::-1]):
                c0 = time.process_time()
                fn()
                out[f"{name}_{kind}"].append(time.process_time() - c0)
    finally:
        pair.close()
print(json.dumps(out))
"""


def extract(commit: str, into: Path) -> Path:
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit, "p2pfl"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="2ea9fda")
    parser.add_argument("--head", default="HEAD")
    parser.add_argument("--rounds", type=int, default=4, help="A/B rounds (processes per tree)")
    parser.add_argument("--reps", type=int, default=10, help="transfers per case per process")
    args = parser.parse_args()
    samples: dict[str, dict[str, list[float]]] = {"base": {c: [] for c in CASES}, "head": {c: [] for c in CASES}}
    per_round: dict[str, list[float]] = {c: [] for c in CASES}
    with tempfile.TemporaryDirectory(prefix="wire-ab-") as tmp:
        trees = {"base": extract(args.base, Path(tmp) / "base"), "head": extract(args.head, Path(tmp) / "head")}
        # bench/wire.py puts its own checkout first on sys.path: a copy in a folder without p2pfl lets
        # each child import the tree it was given
        (Path(tmp) / "bench").mkdir()
        wire = Path(tmp) / "bench" / "wire.py"
        wire.write_bytes((ROOT / "bench" / "wire.py").read_bytes())
        for r in range(args.rounds):
            got: dict[str, dict[str, list[float]]] = {}
            for side in (("base", "head") if r % 2 == 0 else ("head", "base")):
                res = subprocess.run([sys.executable, "-c", CHILD, str(trees[side]), str(wire), str(args.reps)],
                                     capture_output=True, text=True, timeout=1800, cwd=tmp)
                if res.returncode != 0:
                    print(res.stderr[-3000:], file=sys.stderr)
                    return 1
                got[side] = json.loads(res.stdout.strip().splitlines()[-1])
                for c in CASES:
                    samples[side][c] += got[side][c]
            for c in CASES:
                per_round[c].append(statistics.median(got["head"][c]) / statistics.median(got["base"][c]))
            print(f"round {r}: " + ", ".join(f"{c} {per_round[c][-1]:.3f}" for c in CASES), file=sys.stderr)
    out: dict[str, object] = {"base": args.base, "head": args.head, "rounds": args.rounds, "reps": args.reps}
    for c in CASES:
        b, h = samples["base"][c], samples["head"][c]
        out[c] = {"base_ms_median": round(1000 * statistics.median(b), 1),
                  "head_ms_median": round(1000 * statistics.median(h), 1),
                  "ratio_median": round(statistics.median(h) / statistics.median(b), 3),
                  "ratio_min": round(min(h) / min(b), 3),
                  "ratio_per_round_median": round(statistics.median(per_round[c]), 3)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
