"""Cross-rank edges of contiguous blocks against `p2pfl.topology.placement.place`, and what placing costs.

On random 4-regular graphs (``p2pfl topology gen random_regular --k 4``), for each world size: the
fraction of the plans' directed edges (`directed_edges`) whose ends are on different ranks, with
peer i on rank i * W // N and with `place`; and the wall and CPU seconds of one `place` call (CPU
seconds too: on a shared machine they move far less than wall time). Each figure is one call; the
placement is deterministic, so only its time varies between runs.

    python bench/placement.py [--peers 1024,10000,100000] [--ranks 2,16,64] [--seed 0]

Ends with one JSON line of its figures.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from p2pfl.topology import generate
from p2pfl.topology.placement import contiguous, cut_edges, directed_edges, place


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def measure(n: int, worlds: list[int], seed: int) -> list[dict[str, Any]]:
    """One random 4-regular graph of ``n`` peers, placed over each of ``worlds``."""
    # Addresses by template: generated ports (base + i) would run past 65535 beyond ~15,000 peers.
    topo = generate("random_regular", n, k=4, seed=seed, address_template="peer-{i}:50051")
    edges = len(directed_edges(topo)[0])
    rows = []
    for world in worlds:
        wall, cpu = time.perf_counter(), time.process_time()
        ranks = place(topo, world)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        row = {"peers": n, "ranks": world, "directed_edges": edges,
               "cut_contiguous": round(cut_edges(topo, contiguous(n, world)) / edges, 4),
               "cut_placed": round(cut_edges(topo, ranks) / edges, 4),
               "place_wall_s": round(wall, 2), "place_cpu_s": round(cpu, 2)}
        print(f"{n:>7} peers {world:>3} ranks: cut {row['cut_contiguous']:.3f} contiguous, "
              f"{row['cut_placed']:.3f} placed; place {wall:.2f} s wall, {cpu:.2f} s CPU", flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", type=_ints, default=[1024, 10_000, 100_000])
    ap.add_argument("--ranks", type=_ints, default=[2, 16, 64])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rows = [row for n in args.peers for row in measure(n, args.ranks, args.seed)]
    print(json.dumps({"graph": "random_regular k=4", "seed": args.seed, "rows": rows}))


if __name__ == "__main__":
    main()
