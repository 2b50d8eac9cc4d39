#!/bin/bash
# The GPU checks of the batched engine (issue 11), as one bounded script for a lent GPU machine.
#
# Run from the repository root on a machine whose python3 holds PyTorch with CUDA. What this
# project needs beyond that image travels in .gpu/ (ignored by git; bench/gpu_prepare.sh builds it):
# .gpu/whl/*.whl (pydantic, greenlet, isal, ... for that machine's Python) and .gpu/fashion-mnist/*.gz
# (the Debian package's files). Each step has its own time limit, so a slow step costs only itself;
# everything it prints lands in $OUT (default ./gpu-out):
#
#   env.txt          GPU, driver, torch
#   pytest.txt       the batched engine on CUDA against the exact engine on CPU, every algorithm
#   cnn_small.txt    bench/many_peers.py, 128 cnn_small peers, exact vs batched on the GPU
#   phases.txt       bench/batched_phases.py: the batched round's time by phase
#   base_*.txt       with BASE=DIR: the batched engine's figures for the p2pfl in DIR (before/after)
#   host.txt         batched_host.py: a vmapped step at 3 peers x batch 1 against 128 x 16 (how much of a
#                    step is fixed per-step cost: launches, Python; whether CUDA graphs would pay)
#   tf32.txt         batched_phases.py again with ``tf32: true`` (the default is IEEE float32): its cost
#   idle*.txt        batched_idle.py: epoch phases on DePRL's pi 0.1 split, the live peers only against the
#                    padded stack (idle: cnn_small; idle_alexnet: AlexNet, what its Table 1 cells cost)
#   alexnet*.txt     the same two benchmarks with 128 AlexNet peers (alexnet_batched.txt: batched only,
#                    with its peak host memory)
#
#   stacked.txt      issue 71: bench/many_peers.py, 128 cnn_small peers, batched against the bare stacked loop
#                    (engine ``stacked``: vmapped step, one sparse product for the mix; target batched_vs_stacked
#                    <= 1.15)
#   stacked10k.txt   the same at 10,000 peers (random 4-regular, IID split, evaluation every round, no
#                    checkpoints, as bench/scale.py): batched_vs_stacked <= 1.15 and batched <= 2 s a round
#   deprl_alexnet.txt  128 peers, DePRL at the authors' settings with alexnet_fmnist (issue 69's GPU cells):
#                    s/round x 200 must fit a lease
#   (pytest also runs tests/test_launch.py's CUDA case: 4 `p2pfl node` processes with device cuda record
#   what simulate records on the GPU)
#
# Issue 71's checks alone: STEPS="env pytest stacked stacked10k deprl_alexnet" (about 9 minutes at most).
# STEPS="env pytest tf32" picks steps (default: every step but alexnet_batched, idle, idle_alexnet and issue
# 71's three).
# DEV=cpu PEERS=8 ROUNDS=3 bash bench/gpu_checks.sh   dry-runs the script itself on a CPU box.
set -u
OUT=${OUT:-./gpu-out}
DEV=${DEV:-cuda}
ROUNDS=${ROUNDS:-11}
PEERS=${PEERS:-}
BASE=${BASE:-}
PY=${PY:-python3}
mkdir -p "$OUT"
source bench/gpu_env.sh  # wheels and data (.gpu/)
export PYTHONUNBUFFERED=1
peers=(); [ -n "$PEERS" ] && peers=(--peers "$PEERS")

STEPS=${STEPS:-env pytest phases host tf32 cnn_small alexnet_phases alexnet}
step() {  # step NAME SECONDS CMD...: run CMD with a time limit, its output into $OUT/NAME.txt
  local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*|*" ${name#base_} "*) ;; *) return 0 ;; esac
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" >"$OUT/$name.txt" 2>&1
  local rc=$?
  echo "   rc $rc after $((SECONDS - t0)) s; last lines:"
  tail -n 4 "$OUT/$name.txt" | cut -c1-600
}

step env 30 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; \
  $PY -c 'import torch, p2pfl.simulation; print(torch.__version__, torch.cuda.is_available())'"
if [ "$DEV" = cuda ]; then
  step pytest 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_batched.py -k cuda tests/test_data.py::test_cuda_peer_matches_cpu_peer \
    tests/test_precision.py tests/test_launch.py::test_launch_on_cuda_records_what_simulate_records_on_cuda
fi
step phases 50 "$PY" bench/batched_phases.py --set device="$DEV" --rounds "$ROUNDS" "${peers[@]}"
step host 60 "$PY" bench/batched_host.py --set device="$DEV" "${peers[@]}"
step tf32 50 "$PY" bench/batched_phases.py --set device="$DEV" --set tf32=true --rounds "$ROUNDS" "${peers[@]}"
step cnn_small 100 "$PY" bench/many_peers.py --engines exact,batched --set device="$DEV" --rounds "$ROUNDS" --repeats 2 "${peers[@]}"
if [ -n "$BASE" ]; then  # the same benchmarks over an older p2pfl (its p2pfl/ beside these scripts in $BASE/bench)
  step base_cnn_small 50 "$PY" "$BASE/bench/many_peers.py" --engines batched --set device="$DEV" --rounds "$ROUNDS" \
    --repeats 2 "${peers[@]}"
  step base_phases 50 "$PY" "$BASE/bench/batched_phases.py" --set device="$DEV" --rounds "$ROUNDS" "${peers[@]}"
fi
step alexnet_phases 75 "$PY" bench/batched_phases.py --set device="$DEV" --set model.name=alexnet --rounds 4 "${peers[@]}"
step alexnet 120 "$PY" bench/many_peers.py --engines batched,exact --set device="$DEV" --set model.name=alexnet \
  --rounds 4 --repeats 1 "${peers[@]}"
step idle 90 "$PY" bench/batched_idle.py --set device="$DEV" --set data.partition.pi=0.1 --repeats 2 "${peers[@]}"
step idle_alexnet 120 "$PY" bench/batched_idle.py --set device="$DEV" --set model.name=alexnet \
  --set data.partition.pi=0.1 --blocks all,personal --repeats 1 "${peers[@]}"
step stacked 90 "$PY" bench/many_peers.py --engines batched,stacked --set device="$DEV" --rounds "$ROUNDS" --repeats 2 \
  "${peers[@]}"
step stacked10k 220 "$PY" bench/many_peers.py --engines batched,stacked --peers "${PEERS:-10000}" --graph random_regular \
  --set device="$DEV" --set "data.partition={kind: iid}" --set eval_every=1 --set checkpoint.enabled=false \
  --set algorithm.lr_decay=1.0 --rounds 4 --repeats 1
step deprl_alexnet 110 "$PY" bench/many_peers.py --engines batched --set device="$DEV" \
  --set "algorithm={name: deprl, preset: deprl-authors}" --set model.name=alexnet_fmnist --set model.head_layers=3 \
  --set eval_pre_gossip=true --set checkpoint.enabled=false --rounds 3 --repeats 1 "${peers[@]}"
step alexnet_batched 90 "$PY" bench/many_peers.py --engines batched --set device="$DEV" --set model.name=alexnet \
  --rounds 4 --repeats 1 "${peers[@]}"
