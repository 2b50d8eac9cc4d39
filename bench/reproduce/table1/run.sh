#!/usr/bin/env bash
# DePRL Table 1 (Fashion-MNIST) at the papers' protocols, in priority order: the Ring column
# (pi 0.1, 0.3, 0.5), then Random, then FC; in each sweep DePRL (epochs), DisPFL, D-PSGD, then the
# literal DePRL-steps variant, seeds 0-2. Resumable: rerun it; finished cells are skipped and an
# interrupted cell continues from the last round every peer checkpointed (p2pfl/resume.py).
# Runs at the lowest CPU priority (the machine is shared). Logs: runs/reproduce/<sweep>.log and
# runs/reproduce/<sweep>/<cell>/log.txt; progress: runs/reproduce/table1-progress.log.
set -u
cd "$(dirname "$0")/../../.."
P2PFL=${P2PFL:-.venv/bin/p2pfl}
OUT=${OUT:-runs/reproduce}
mkdir -p "$OUT"
for graph in ring random fc; do
  for pi in 0.1 0.3 0.5; do
    name="t1-$graph-pi$pi"
    echo "== $(date -u +%FT%TZ) $name" >> "$OUT/table1-progress.log"
    nice -n 19 "$P2PFL" sweep "bench/reproduce/table1/$graph-pi$pi.yaml" --out "$OUT/$name" --quiet \
      >> "$OUT/$name.log" 2>&1
    echo "   exit $?" >> "$OUT/table1-progress.log"
  done
done
echo "== $(date -u +%FT%TZ) all done" >> "$OUT/table1-progress.log"
