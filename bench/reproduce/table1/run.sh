#!/usr/bin/env bash
# DePRL Table 1 (Fashion-MNIST) at the papers' protocols, in priority order: the Ring column
# (pi 0.1, 0.3, 0.5), then DFedSAM's claim (../claims/dfedsam.yaml, seeds 0-2), then the parameter-server
# baselines of the Ring on Flower (ps-ring-pi0.{1,3,5}.yaml, DePRL Table 7), then Random, then FC, then the
# claims whose cells ran on a GPU with the batched engine (DFedPGP, DFedMDC, DFedADMM; about 3.5 hours
# here) as the exact engine's cross-check, then DFedADMM's claim at 100, 200, 300, 400 and 500 rounds (each
# longer file extends the shorter one's final checkpoints), then at 5 local epochs, then DFedPGP's claim at
# 100 and 200 rounds, then DFedMDC's and DFedSAM's at 100, DFedMDC's at 200, DFedSAM's at 5 local epochs
# (50 rounds, then the grid's at 100), then DFedMDC's last step (DFedAvgM > Local) at 300 and 500; each (graph, pi)
# as three sweep files: DePRL (epochs) seeds 0-2, then seed 0 of D-PSGD, the literal DePRL-steps variant and
# DisPFL, then their seeds 1-2.
# The cells of a sweep that finished on a GPU (runs/reproduce/<name>-gpu, ../run_gpu.sh, batched engine)
# are not run here again (`p2pfl sweep --only` the others; a sweep with none left is skipped), except the
# claims' exact-engine cross-checks of the default order, and every cell with RERUN_GPU=1.
# Resumable: rerun it; finished cells are skipped and an interrupted cell continues from the last
# round every peer checkpointed (p2pfl/resume.py). Cells whose evidence is committed
# (docs/results/runs/) count as finished on a fresh checkout too (results_md.py --restore puts them
# back under runs/reproduce first).
#
#   bench/reproduce/table1/run.sh                       # the 27 protocol files, 4 claims, 3 PS files, in order
#   bench/reproduce/table1/run.sh smoke-ring-pi0.1      # named sweeps of this folder only
#   bench/reproduce/table1/run.sh claims/dfedadmm       # a claim's sweep (bench/reproduce/claims/)
#   COMMIT=<sha> bench/reproduce/table1/run.sh          # run another commit's code
#
# The code runs from a snapshot of one commit under runs/reproduce/code-<sha> (remembered in
# runs/reproduce/code.current and reused until COMMIT says otherwise), so edits in the working
# tree during runs of many hours can neither change nor break them, and resumed cells keep their
# exact config. Lowest CPU priority (the machine is shared). Logs: runs/reproduce/<sweep>.log,
# runs/reproduce/<sweep>/<cell>/log.txt; progress: runs/reproduce/table1-progress.log.
set -u
cd "$(dirname "$0")/../../.."
ROOT=$PWD
PY=${PY:-$ROOT/.venv/bin/python}
OUT=${OUT:-$ROOT/runs/reproduce}
mkdir -p "$OUT"
SHA=$(git rev-parse --short=12 "${COMMIT:-$(cat "$OUT/code.current" 2>/dev/null || echo HEAD)}") || exit 2
CODE="$OUT/code-$SHA"
if [ ! -f "$CODE/.complete" ]; then
  rm -rf "$CODE" && mkdir -p "$CODE" && git archive "$SHA" | tar -x -C "$CODE" && touch "$CODE/.complete" || exit 2
fi
echo "$SHA" > "$OUT/code.current"
# A fresh checkout has no runs/: put the committed finished cells back, so they are not run again.
"$PY" "$ROOT/bench/reproduce/results_md.py" --restore --runs "$OUT" >> "$OUT/table1-progress.log" 2>&1
DEFAULT=0 CROSS=
if [ $# -eq 0 ]; then
  DEFAULT=1
  for g in ring random fc; do
    for pi in 0.1 0.3 0.5; do set -- "$@" "$g-pi$pi" "$g-pi$pi-seed0" "$g-pi$pi-seeds12"; done
    # the parameter-server baselines (Flower, CPU only) before Random and FC, which a lent GPU runs far faster
    [ "$g" = ring ] && set -- "$@" claims/dfedsam ps-ring-pi0.1 ps-ring-pi0.3 ps-ring-pi0.5
  done
  # claims whose cells ran on a GPU (batched engine, ../run_gpu.sh): the exact engine's cross-check, last
  CROSS="claims/dfedpgp claims/dfedmdc claims/dfedadmm"  # run here even though their GPU cells finished
  # then the claims run longer where their 50-round curves had not flattened (claims/*-long*.yaml),
  # DFedADMM's 50-round claim at the paper's 5 local epochs (claims/dfedadmm-e5.yaml), and DFedPGP's at 100
  # rounds (claims/dfedpgp-long.yaml, from round 0: the 50-round cells kept no checkpoints), then 200,
  # then DFedMDC's and DFedSAM's at 100 rounds (from round 0 too), then DFedMDC's at 200, then DFedSAM's
  # claim at 5 local epochs (claims/dfedsam-e5.yaml) and its grid cells at 100 rounds (from round 0)
  set -- "$@" $CROSS claims/dfedadmm-long claims/dfedadmm-long200 claims/dfedadmm-long300 \
    claims/dfedadmm-long400 claims/dfedadmm-long500 claims/dfedadmm-e5 claims/dfedpgp-long \
    claims/dfedpgp-long200 claims/dfedmdc-long claims/dfedsam-long \
    claims/dfedmdc-long200 claims/dfedsam-e5 claims/dfedsam-e5-long claims/dfedmdc-long300 claims/dfedmdc-long500
fi
cd "$CODE"
left_after_gpu() {  # left_after_gpu SWEEP_FILE FOLDER: the sweep's cells not finished in FOLDER, one a line
  "$PY" - "$1" "$2" <<'EOF'
import sys
from pathlib import Path
from p2pfl.sweep import load_sweep, plan_cells
for c in plan_cells(load_sweep(sys.argv[1])):
    if not (Path(sys.argv[2]) / c.name / "summary.json").is_file():
        print(c.name)
EOF
}
for sweep in "$@"; do
  case "$sweep" in
    claims/*) name="claims-${sweep#claims/}"; file="bench/reproduce/$sweep.yaml" ;;
    *) name="t1-$sweep"; file="bench/reproduce/table1/$sweep.yaml" ;;
  esac
  # the sweep file comes from the snapshot too: a file added after its commit is not there (COMMIT names an older one)
  if [ ! -f "$file" ]; then
    echo "== $(date -u +%FT%TZ) $name: $file is not in the code snapshot $SHA; skipped (COMMIT=<a commit that has it>)" \
      >> "$OUT/table1-progress.log"
    continue
  fi
  only=() note=
  # a claim's longer file (claims/<stem>-long<N>) starts from the final checkpoints of the longest shorter one
  # run here (<stem>-long<M>, M < N, or <stem>-long): a copy of that folder makes each of its finished cells
  # `extendable` (p2pfl sweep), so only the added rounds run
  if [[ "$sweep" =~ ^claims/(.+-long)([0-9]+)$ ]] && [ ! -e "$OUT/$name" ]; then
    stem=${BASH_REMATCH[1]} n=${BASH_REMATCH[2]} best=-1 shorter=
    for d in "$OUT/claims-$stem" "$OUT/claims-$stem"[0-9]*; do
      m=${d##*/claims-$stem}
      if [ -d "$d" ] && [[ "${m:-0}" =~ ^[0-9]+$ ]] && [ "${m:-0}" -lt "$n" ] && [ "${m:-0}" -gt "$best" ]; then
        best=${m:-0} shorter=${d##*/}
      fi
    done
    if [ -n "$shorter" ]; then
      rm -rf "$OUT/$name.tmp" && cp -a "$OUT/$shorter" "$OUT/$name.tmp" && rm -f "$OUT/$name.tmp/sweep.json" \
        && mv "$OUT/$name.tmp" "$OUT/$name" \
        && echo "== $(date -u +%FT%TZ) $name: seeded from $shorter's final checkpoints" >> "$OUT/table1-progress.log"
    fi
  fi
  if [ -z "${RERUN_GPU:-}" ] && [[ " $CROSS " != *" $sweep "* ]] && [ -d "$OUT/$name-gpu" ] \
      && left=$(left_after_gpu "$file" "$OUT/$name-gpu"); then
    if [ -z "$left" ]; then
      echo "== $(date -u +%FT%TZ) $name: every cell finished on a GPU ($name-gpu, run_gpu.sh); skipped" \
        >> "$OUT/table1-progress.log"
      continue
    fi
    for cell in $left; do only+=(--only "$cell"); done
    note=", the cells not finished on a GPU: $(echo $left)"
  fi
  echo "== $(date -u +%FT%TZ) $name (code $SHA$note)" >> "$OUT/table1-progress.log"
  nice -n 19 "$PY" -m p2pfl.cli sweep "$file" --out "$OUT/$name" --quiet "${only[@]}" \
    >> "$OUT/$name.log" 2>&1
  echo "   exit $?" >> "$OUT/table1-progress.log"
done
echo "== $(date -u +%FT%TZ) done: $*" >> "$OUT/table1-progress.log"
