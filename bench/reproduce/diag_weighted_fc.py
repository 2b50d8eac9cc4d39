"""Diagnostic topology: FC with each peer's gossip weight proportional to its training-sample count.

DePRL's Table 1 cells mix with Metropolis weights, which on the complete graph are uniform (1/128 each):
a peer with 16 samples counts as much as one with 2,272. FedRep (the same local rule, a server's average
weighted by sample counts) scores higher on the same partition. This writes the complete graph (directed,
so that the weights may be row-stochastic without being symmetric) with ``W[i, j] = n_j / N`` for every
``i``: every peer pulls the same sample-weighted average, FedRep's aggregate without a server. Not a
paper protocol (the matrix is not doubly stochastic): a diagnostic of DePRL's gap only.

    python bench/reproduce/diag_weighted_fc.py PARTITION_JSON[.gz] topology/full-128.yaml OUT.yaml
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import yaml


def main(partition: Path, peers_from: Path, out: Path) -> None:
    opener = gzip.open if partition.suffix == ".gz" else open
    with opener(partition, "rt") as f:
        counts = [len(idx) for idx in json.load(f)["train"]]
    peers = yaml.safe_load(peers_from.read_text())["peers"]
    if len(peers) != len(counts):
        raise SystemExit(f"{peers_from}: {len(peers)} peers, but {partition} splits the data {len(counts)} ways")
    total = sum(counts)
    ids = [p["id"] for p in peers]
    row = {j: f"{n}/{total}" for j, n in zip(ids, counts, strict=True)}
    topo = {
        "name": f"full-{len(ids)}-sample-weighted",
        "directed": True,
        "peers": peers,
        "edges": [[a, b] for a in ids for b in ids if a != b],
        "weights": {"kind": "explicit", "matrix": {i: dict(row) for i in ids}},
    }
    out.write_text(f"# diag_weighted_fc.py from {partition.name}: W[i, j] = n_j / {total} for every i\n"
                   + yaml.safe_dump(topo, sort_keys=False, width=200))
    print(f"wrote {out}: {len(ids)} peers, weights n_j/{total} (min {min(counts)}, max {max(counts)} samples)")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
