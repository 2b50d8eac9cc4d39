#!/usr/bin/env bash
# DePRL Table 1 (Fashion-MNIST) at the papers' protocols, in priority order: the Ring column
# (pi 0.1, 0.3, 0.5), then Random, then FC; in each sweep DePRL (epochs), DisPFL, D-PSGD, then the
# literal DePRL-steps variant, seeds 0-2. Resumable: rerun it; finished cells are skipped and an
# interrupted cell continues from the last round every peer checkpointed (p2pfl/resume.py).
#
# The code runs from a snapshot of a commit (default HEAD) under runs/reproduce/code-<sha>, so that
# edits in the working tree during a run of many hours cannot change or break it; the commit is
# logged. Lowest CPU priority (the machine is shared). Logs: runs/reproduce/<sweep>.log,
# runs/reproduce/<sweep>/<cell>/log.txt; progress: runs/reproduce/table1-progress.log.
#
#   bench/reproduce/table1/run.sh [COMMIT]
set -u
cd "$(dirname "$0")/../../.."
ROOT=$PWD
PY=${PY:-$ROOT/.venv/bin/python}
OUT=${OUT:-$ROOT/runs/reproduce}
SHA=$(git rev-parse --short=12 "${1:-HEAD}") || exit 2
CODE="$OUT/code-$SHA"
mkdir -p "$OUT"
if [ ! -f "$CODE/.complete" ]; then
  rm -rf "$CODE" && mkdir -p "$CODE" && git archive "$SHA" | tar -x -C "$CODE" && touch "$CODE/.complete" || exit 2
fi
cd "$CODE"
for graph in ring random fc; do
  for pi in 0.1 0.3 0.5; do
    name="t1-$graph-pi$pi"
    echo "== $(date -u +%FT%TZ) $name (code $SHA)" >> "$OUT/table1-progress.log"
    nice -n 19 "$PY" -m p2pfl.cli sweep "bench/reproduce/table1/$graph-pi$pi.yaml" --out "$OUT/$name" --quiet \
      >> "$OUT/$name.log" 2>&1
    echo "   exit $?" >> "$OUT/table1-progress.log"
  done
done
echo "== $(date -u +%FT%TZ) all done" >> "$OUT/table1-progress.log"
