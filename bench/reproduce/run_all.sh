#!/usr/bin/env bash
# Runs every reproduction sweep, in priority order; resumable (rerun to continue).
# Logs: runs/reproduce/<sweep>.log ; run folders: runs/reproduce/<sweep>/<cell>/
set -u
cd "$(dirname "$0")/../.."
P2PFL=${P2PFL:-.venv/bin/p2pfl}
mkdir -p runs/reproduce
# wait for a sweep already running (e.g. from an earlier invocation of this script)
while pgrep -f "p2pfl sweep bench/reproduce" > /dev/null; do sleep 5; done
for s in deprl_fmnist/ring-128 claims/dfedmdc claims/dfedpgp claims/dfedadmm claims/dfedsam \
         deprl_fmnist/variants deprl_fmnist/full-128 deprl_fmnist/random4-128; do
  name=$(basename "$s")
  [ "$s" = "${s#deprl_fmnist/}" ] || name="deprl-$name"
  [ "$s" = "${s#claims/}" ] || name="claims-$name"
  echo "== $(date -u +%H:%M:%S) $s" >> runs/reproduce/progress.log
  $P2PFL sweep "bench/reproduce/$s.yaml" --out "runs/reproduce/$name" --quiet > "runs/reproduce/$name.log" 2>&1
  echo "   exit $?" >> runs/reproduce/progress.log
done
echo "== $(date -u +%H:%M:%S) all done" >> runs/reproduce/progress.log
