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
# No network there: make huggingface_hub fail fast (transformers probes the Hub for flash kernels).
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-$(command -v python || command -v python3)}
BUDGET=${BUDGET:-530}
OFFLINE_LIMIT=${OFFLINE_LIMIT:-60}
OFFLINE_LIMIT_8B=${OFFLINE_LIMIT_8B:-45}
RES=${OUT:-benchmarks/results/h200-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$RES"
TABLES="$RES/tables.txt"
: > "$TABLES"
QWEN=${QWEN:-benchmarks/configs/qwen3-0.6b}
LLAMA=${LLAMA:-benchmarks/configs/llama-3.1-8b}
COMMON=${COMMON:-"--dtype bfloat16 --device cuda"}  # overridable for a CPU dry run of this script
LAT_IN=${LAT_IN:-1024}
LAT_OUT=${LAT_OUT:-128}

echo "# $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
$PY -c "import torch, transformers, sys; print('# torch', torch.__version__, 'transformers', transformers.__version__, 'python', sys.version.split()[0])"

run() {  # run NAME MIN_SECONDS ARGS...: one benchmark, bounded by the time left
  local name=$1 need=$2; shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt "$need" ]; then
    echo "## $name: skipped, ${left}s left of the ${BUDGET}s budget (needs ~${need}s)" | tee -a "$TABLES"
    return
  fi
  echo "## $name  (t=${SECONDS}s, ${left}s left)"
  echo "\$ $PY $*" >> "$TABLES"
  local t0=$SECONDS
  timeout -s INT -k 15 "$left" $PY "$@" --out "$RES/$name.json" >> "$TABLES" 2> "$RES/$name.log"
  local rc=$?
  echo "   rc=$rc in $((SECONDS - t0))s; stderr log: $RES/$name.log"
  if [ $rc -ne 0 ]; then
    echo "## $name: exit code $rc (124/130 = stopped by the time budget); last log lines:" | tee -a "$TABLES"
    tail -n 15 "$RES/$name.log" | tee -a "$TABLES"
  fi
  echo >> "$TABLES"
}

run offline_qwen3-0.6b 120 benchmarks/offline_throughput.py --model-path $QWEN $COMMON \
    --num-runs 1 --time-limit "$OFFLINE_LIMIT" --no-progress
run latency_llama-3.1-8b 90 benchmarks/latency.py --model-path $LLAMA $COMMON \
    --input-len "$LAT_IN" --output-len "$LAT_OUT" --num-runs 3
run latency_qwen3-0.6b 90 benchmarks/latency.py --model-path $QWEN $COMMON \
    --input-len "$LAT_IN" --output-len "$LAT_OUT" --num-runs 3
run offline_llama-3.1-8b 120 benchmarks/offline_throughput.py --model-path $LLAMA $COMMON \
    --num-runs 1 --time-limit "$OFFLINE_LIMIT_8B" --no-progress

echo
echo "================ all tables (also in $TABLES) ================"
cat "$TABLES"
echo "# total ${SECONDS}s"
