#!/usr/bin/env bash
# The GPU fast path (Triton kernels + CUDA graphs + overlap scheduling) on one H200, bf16, dummy
# weights, in one call (each command bounded by `timeout`):
#   0. GPU tests: every kernel against its reference, graph replay vs eager vs CPU
#   1. batch-1 latency, Llama-3.1-8B shape, Kiln and transformers (static cache + compile)
#   2. decode at batch 1 and 64, Llama-3.1-8B shape (1K prompt), GPU idle fraction at 64
#   3. batch-1 latency, Inkling and MiniMax-M3 bench presets
#   4. decode at batch 8 / 32 / 64 / 128, Inkling bench (8K prompt; output shortened to fit)
#   5. offline throughput (nano-vllm workload), Qwen3-0.6B shape, Kiln and transformers
#
#   bash benchmarks/run_h200_fast.sh   # tables on stdout, JSON in $OUT or benchmarks/results/
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
R=${OUT:-benchmarks/results/h200-fast-$(date +%Y%m%d-%H%M)}; mkdir -p "$R"
LLAMA=benchmarks/configs/llama-3.1-8b; QWEN=benchmarks/configs/qwen3-0.6b
C="--dummy-init auto"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch,triton,transformers;print('# torch',torch.__version__,'triton',triton.__version__,'transformers',transformers.__version__)"
step() { local name=$1 limit=$2; shift 2; echo "=== $name"; timeout "$limit" "$@" > >(tee "$R/$name.txt") 2> "$R/$name.err" || echo "(exit $? after limit ${limit}s; tail of stderr:)"; tail -3 "$R/$name.err"; }
step gpu_tests ${T0:-150} python -m pytest -m gpu tests/kernels tests/engine/test_cuda_graph.py -q -p no:cacheprovider
step latency_llama8b ${T1:-170} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 --out "$R/latency_llama8b.json"
step decode_llama8b ${T2:-60} python benchmarks/decode_batch.py --model-path $LLAMA $C --batch-sizes 64 --input-len 1024 --output-len 128 --profile --out "$R/decode_llama8b.json"
step latency_inkling ${T3:-60} python benchmarks/latency.py --model-path preset:inkling/bench $C --num-runs 3 --out "$R/latency_inkling.json"
step latency_minimax ${T3:-60} python benchmarks/latency.py --model-path preset:minimax_m3/bench $C --num-runs 3 --out "$R/latency_minimax.json"
step decode_inkling ${T4:-100} python benchmarks/decode_batch.py --model-path preset:inkling/bench $C --batch-sizes 8,32,64,128 --input-len 8192 --output-len ${INK_OUT:-128} --profile --out "$R/decode_inkling.json"
step offline_qwen ${T5:-120} python benchmarks/offline_throughput.py --model-path $QWEN $C --num-runs 1 --time-limit 45 --no-progress --out "$R/offline_qwen.json"
