#!/usr/bin/env bash
# Kiln on the hybrid `bench` presets (MODELS.md 7) on one H200, bf16, dummy weights, in one call:
#   1. batch-1 latency,    Inkling bench     (1024-token prompt, 128 generated tokens, 3 runs, median)
#   2. batch-1 latency,    MiniMax-M3 bench
#   3. offline throughput, Inkling bench     (nano-vllm workload: 256 requests, in/out 100..1024)
#   4. offline throughput, MiniMax-M3 bench
# Kiln only: transformers has no Inkling or MiniMax-M3, so its rows say "skipped".
#
# WARNING: Kiln's GPU path is still the reference path (per-sequence PyTorch attention, the MoE
# as a Python loop over the experts hit with a host sync per MoE layer, MSA selection and sparse
# attention per sequence, no CUDA graphs, no fused kernels). These numbers are the baseline the
# speed work starts from, not what the architectures can do; the roofline columns say how far.
#
# The whole script stays under BUDGET seconds (default 530): every command is bounded by the time
# left, and each offline run stops after OFFLINE_LIMIT seconds and is reported as "partial"
# (throughput over the time it ran). Offline runs are measured once (--num-runs 1) to fit.
# Dummy weights are drawn on the GPU (--dummy-init auto): Kiln's own CPU init would take minutes
# for the 5-6 B parameters of each preset.
#
#   bash benchmarks/run_h200_hybrid.sh          # results in $OUT (the device runner's folder) or
#                                               # benchmarks/results/h200-hybrid-<time>/
#   BUDGET=900 OFFLINE_LIMIT=240 bash benchmarks/run_h200_hybrid.sh   # longer offline windows
#   # CPU dry run of the script itself on the tiny presets:
#   INKLING=preset:inkling/tiny MINIMAX=preset:minimax_m3/tiny COMMON="--dtype float32 --device cpu --threads 1" \
#     LAT_IN=128 LAT_OUT=16 OFFLINE_ARGS="--num-requests 8 --min-len 16 --max-len 64" bash benchmarks/run_h200_hybrid.sh
set -u
cd "$(dirname "$0")/.."
. benchmarks/_run_bounded.sh
results_dir h200-hybrid
INKLING=${INKLING:-preset:inkling/bench}
MINIMAX=${MINIMAX:-preset:minimax_m3/bench}
OFFLINE_ARGS=${OFFLINE_ARGS:-}

gpu_line
echo "# WARNING: Kiln's GPU path is still the reference path (no CUDA graphs, no fused kernels): a baseline." | tee -a "$TABLES"
$PY -c "import torch, sys; print('# torch', torch.__version__, 'python', sys.version.split()[0])"

tag() { case $1 in preset:*) echo "${1#preset:}" | tr / -;; *) basename "$1";; esac; }  # inkling-bench

run "latency_$(tag "$INKLING")" 60 benchmarks/latency.py --model-path $INKLING $COMMON \
    --input-len "$LAT_IN" --output-len "$LAT_OUT" --num-runs 3
run "latency_$(tag "$MINIMAX")" 60 benchmarks/latency.py --model-path $MINIMAX $COMMON \
    --input-len "$LAT_IN" --output-len "$LAT_OUT" --num-runs 3
run "offline_$(tag "$INKLING")" 90 benchmarks/offline_throughput.py --model-path $INKLING $COMMON \
    --num-runs 1 --time-limit "$OFFLINE_LIMIT" --no-progress $OFFLINE_ARGS
run "offline_$(tag "$MINIMAX")" 90 benchmarks/offline_throughput.py --model-path $MINIMAX $COMMON \
    --num-runs 1 --time-limit "$OFFLINE_LIMIT" --no-progress $OFFLINE_ARGS

finish
