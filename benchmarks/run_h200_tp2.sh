#!/usr/bin/env bash
# Tensor parallelism on two H200s (device kind nvidia-h200-x2), bf16, dummy weights, one call:
#   0. GPU tests of tp 2 = tp 1 (tests/dist, CPU/gloo cases run too)
#   1. batch-1 latency, Llama-3.1-8B shape, --tp-size 2 (torchrun, one EngineCore per rank)
#   2. decode at batch 64, Llama-3.1-8B shape, with the GPU idle fraction (rank 0)
#   3. batch-1 latency and decode at batch 8 / 32 / 64, Inkling bench, --tp-size 2
#   (5. batch-1 latency, MiniMax-M3 bench, --tp-size 2: off unless T5 > 0)
# Compare with the one-GPU rows of run_h200_fast.sh (same scripts, same shapes). A step whose limit
# (T0..T4) is 0 is skipped.
#
#   bash benchmarks/run_h200_tp2.sh    # tables on stdout, JSON in $OUT or benchmarks/results/
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
R=${OUT:-benchmarks/results/h200-tp2-$(date +%Y%m%d-%H%M)}; mkdir -p "$R"
LLAMA=benchmarks/configs/llama-3.1-8b
C="--dummy-init auto --tp-size 2"
TR="torchrun --nproc-per-node 2 --master-port 29517"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
step() { local name=$1 limit=$2; shift 2; [ "$limit" -gt 0 ] || { echo "=== $name: skipped (limit 0)"; return; }; echo "=== $name"; timeout "$limit" "$@" > >(tee "$R/$name.txt") 2> "$R/$name.err" || echo "(exit $? after limit ${limit}s)"; tail -3 "$R/$name.err"; }
step tp_tests ${T0:-120} python -m pytest tests/dist -q -p no:cacheprovider
step latency_llama8b_tp2 ${T1:-150} $TR benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 --out "$R/latency_llama8b_tp2.json"
step decode_llama8b_tp2 ${T2:-90} $TR benchmarks/decode_batch.py --model-path $LLAMA $C ${DECODE_ARGS:---batch-sizes 64 --input-len 1024 --output-len 128 --profile} --out "$R/decode_llama8b_tp2.json"
step latency_inkling_tp2 ${T3:-90} $TR benchmarks/latency.py --model-path preset:inkling/bench $C --num-runs 3 --out "$R/latency_inkling_tp2.json"
step latency_minimax_tp2 ${T5:-0} $TR benchmarks/latency.py --model-path preset:minimax_m3/bench $C --num-runs 3 --out "$R/latency_minimax_tp2.json"
step decode_inkling_tp2 ${T4:-150} $TR benchmarks/decode_batch.py --model-path preset:inkling/bench $C ${INK_DECODE_ARGS:---batch-sizes 8,32,64 --input-len 8192 --output-len 128} --out "$R/decode_inkling_tp2.json"
