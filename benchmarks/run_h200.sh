#!/usr/bin/env bash
# Kiln vs Hugging Face transformers on one H200, bf16, dummy weights (config dirs only), in one call:
#   1. offline throughput, Qwen3-0.6B shape   (nano-vllm workload: 256 requests, in/out 100..1024)
#   2. batch-1 latency,   Llama-3.1-8B shape  (1024-token prompt, 128 generated tokens)
#   3. batch-1 latency,   Qwen3-0.6B shape
#   4. offline throughput, Llama-3.1-8B shape
# The whole script stays under BUDGET seconds (default 530): every command is bounded by the time
# left, and each offline run (Kiln and transformers alike) stops after OFFLINE_LIMIT seconds;
# a stopped run is reported as "partial" (throughput over the time it ran). Offline runs are
# measured once (--num-runs 1) to fit; latency keeps 3 runs.
#
#   bash benchmarks/run_h200.sh                 # results in $OUT (the device runner's folder) or
#                                               # benchmarks/results/h200-<time>/
#   BUDGET=900 OFFLINE_LIMIT=300 bash benchmarks/run_h200.sh   # longer, e.g. a complete offline run
set -u
cd "$(dirname "$0")/.."
. benchmarks/_run_bounded.sh
OFFLINE_LIMIT_8B=${OFFLINE_LIMIT_8B:-45}
results_dir h200
QWEN=${QWEN:-benchmarks/configs/qwen3-0.6b}
LLAMA=${LLAMA:-benchmarks/configs/llama-3.1-8b}

gpu_line
$PY -c "import torch, transformers, sys; print('# torch', torch.__version__, 'transformers', transformers.__version__, 'python', sys.version.split()[0])"

run offline_qwen3-0.6b 120 benchmarks/offline_throughput.py --model-path $QWEN $COMMON \
    --num-runs 1 --time-limit "$OFFLINE_LIMIT" --no-progress
run latency_llama-3.1-8b 90 benchmarks/latency.py --model-path $LLAMA $COMMON \
    --input-len "$LAT_IN" --output-len "$LAT_OUT" --num-runs 3
run latency_qwen3-0.6b 90 benchmarks/latency.py --model-path $QWEN $COMMON \
    --input-len "$LAT_IN" --output-len "$LAT_OUT" --num-runs 3
run offline_llama-3.1-8b 120 benchmarks/offline_throughput.py --model-path $LLAMA $COMMON \
    --num-runs 1 --time-limit "$OFFLINE_LIMIT_8B" --no-progress

finish
