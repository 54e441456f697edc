#!/usr/bin/env bash
# Two H200s (device kind nvidia-h200-x2), bf16, dummy weights: two lanes side by side, one per
# GPU (CUDA_VISIBLE_DEVICES), so that one call measures twice as much; `PHASE` picks the call.
#   PHASE=diag   lane 0: gpu-marked tests; decode profiles (GPU kernel table, host cProfile) of the
#                        8B shape at batch 1/64, Inkling bench at 1/8/64 (8K), MiniMax-M3 bench at
#                        1/32 (8K); Inkling MTP rounds (k=3) against plain decode at batch 1/8/32
#                lane 1: the agent trace, GPU-only caching against HiCache 2x and 4x
#   PHASE=tables lane 0: Inkling bench at batch 8/32/64/128, input 8192 / output 1024; MiniMax-M3
#                        bench at 8/32/64 (output 256); 8B batch-1 latency against transformers
#                lane 1: the agent trace again (as in diag)
#   PHASE=final  lane 0: gpu-marked tests (verbose); 8B batch-1 latency (Kiln only); Inkling MTP
#                        rounds (k=3) against plain decode at batch 1/8/32
#                lane 1: the agent trace's hicache-4x variant; nano-vllm's offline workload at the
#                        Qwen3-0.6B shape against transformers' continuous batching
#                then both GPUs: `run_h200_tp2.sh` (tp 2 tests, 8B and Inkling tables)
#   PHASE=spec   lane 0: gpu-marked tests of the fast path (kernels, graphs, speculative graphs);
#                        Inkling MTP rounds (k=1 and 3) against plain decode at batch 1/8/32
#                lane 1: 8B batch-1 latency against transformers; decode profiles of the 8B shape
#                        (batch 1/64) and Inkling bench (batch 1); small-kernel timings
#   PHASE=spec2|spec3|last|audit|ovl|tables2|offline2|final2|devround|phases|final3|offline3|bound|experts|tokenmap|pdl|pdl2|pdl3|pdl4|pdl5|gemv|gemv2|gemv3|gemv4|gemv5|gemv6|gemv7|gemv8|next|df|df2|fuse|fuse2|fuse3|trigger|msa|msa2|msa3|split|split2|verify8|tables8|prof8k: later passes (see the lane functions below); spec3,
#                audit, offline3, bound, experts, tokenmap, pdl* and gemv have lane 0 only, so they run on one GPU too (device kind nvidia-h200);
#                tables2 ends with the tp 2 rows (run_h200_tp2.sh: 8B, Inkling and MiniMax-M3 batch 1)
#   PHASE=tp2    both GPUs: `run_h200_tp2.sh` alone
# Every step is bounded by `timeout`; each lane's tables and logs go to $OUT/lane{0,1}.log.
#
#   PHASE=diag bash benchmarks/run_h200_x2.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
R=${OUT:-benchmarks/results/h200-x2-$(date +%Y%m%d-%H%M)}; mkdir -p "$R" "$R/json"
LLAMA=benchmarks/configs/llama-3.1-8b; QWEN=benchmarks/configs/qwen3-0.6b
INK=preset:inkling/bench; MM=preset:minimax_m3/bench
C="--dummy-init auto"
PHASE=${PHASE:-diag}

step() {  # step NAME LIMIT CMD...: one bounded command, its stdout and stderr into the lane log
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s, started $(date -u +%T))"
  timeout "$limit" "$@" 2>&1 || echo "=== $name: exit $? (124 = stopped by its limit)"
}
DECODE="python benchmarks/decode_batch.py $C"

hybrids_b1() {  # hybrids_b1 TAG LIMIT [FLAGS...]: Inkling and MiniMax-M3 bench at batch 1 with FLAGS
  local tag=$1 lim=$2; shift 2
  step inkling_b1$tag ${T_INK:-$lim} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 128 \
    --cuda-graph-max-bs 8 "$@" --out "$R/json/inkling_b1$tag.json"
  step minimax_b1$tag ${T_MM:-$lim} $DECODE --model-path $MM --batch-sizes 1 --input-len 1024 --output-len 128 \
    --cuda-graph-max-bs 8 "$@" --out "$R/json/minimax_b1$tag.json"
}

lane0_diag() {
  step gpu_tests ${T_TESTS:-150} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider --timeout 90 \
    --continue-on-collection-errors
  step decode_llama8b ${T_8B:-90} $DECODE --model-path $LLAMA --batch-sizes 1,64 --input-len 1024 --output-len 128 \
    --profile --host-profile --out "$R/json/decode_llama8b.json"
  step decode_inkling ${T_INK:-100} $DECODE --model-path $INK --batch-sizes 1,8,64 --input-len 8192 --output-len 128 \
    --profile --host-profile --out "$R/json/decode_inkling_diag.json"
  step decode_minimax ${T_MM:-80} $DECODE --model-path $MM --batch-sizes 1,32 --input-len 8192 --output-len 128 \
    --profile --out "$R/json/decode_minimax_diag.json"
  step spec_inkling ${T_SPEC:-70} $DECODE --model-path $INK --batch-sizes 1,8,32 --input-len 1024 --output-len 64 \
    --speculative-algorithm mtp --speculative-num-steps 3 --out "$R/json/spec_inkling.json"
}

lane0_bound() {  # where a K = 3 round's time goes against a plain step (Inkling bench, batch 1): every kernel
  step plain_profile ${T_P:-60} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 8 --profile --profile-steps 20 --kernel-rows 60 --out "$R/json/plain_b1.json"
  for k in 3 1; do
    step spec${k}_profile ${T_S:-80} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 64 \
      --cuda-graph-max-bs 8 --speculative-algorithm mtp --speculative-num-steps $k --profile --profile-steps 10 \
      --kernel-rows 60 --out "$R/json/spec${k}_b1.json"
  done
}
lane1_bound() { :; }

lane0_experts() {  # distinct experts a verify reads (eager, hooks); DFlash rounds with a dummy 1-layer drafter
  step count_experts ${T_CE:-100} $DECODE --model-path $INK --batch-sizes 1,8 --input-len 1024 --output-len 32 \
    --speculative-algorithm mtp --speculative-num-steps 3 --disable-cuda-graph --count-experts \
    --out "$R/json/experts.json"
  mkdir -p "$R/dflash-bench"
  echo '{"model_type": "dflash", "num_layers": 1, "block_size": 8, "mask_token_id": 49215, "hidden_size": 2048,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
    "target_layer_ids": [1, 12, 22]}' > "$R/dflash-bench/config.json"
  for k in 3 7; do
    step dflash$k ${T_DF:-100} $DECODE --model-path $INK --batch-sizes 1,8,32 --input-len 1024 --output-len 64 \
      --cuda-graph-max-bs 32 --speculative-algorithm dflash --speculative-draft-model-path "$R/dflash-bench" \
      --speculative-num-steps $k --out "$R/json/dflash$k.json"
  done
}
lane1_experts() { :; }

lane0_tokenmap() {  # K = 3 rounds with the draft head over a 16K-token map (FR-Spec) against the full head
  python -c "import torch; torch.save(torch.arange(16384), '$R/map16k.pt')"
  local spec="--speculative-algorithm mtp --speculative-num-steps 3"
  local run="$DECODE --model-path $INK --batch-sizes 1,8,32 --input-len 1024 --output-len 64 --cuda-graph-max-bs 32"
  step plain ${T_P:-70} $run --out "$R/json/plain.json"
  step spec3 ${T_S:-80} $run $spec --out "$R/json/spec3.json"
  step spec3_map16k ${T_S:-80} $run $spec --speculative-token-map "$R/map16k.pt" --out "$R/json/spec3_map16k.json"
}
lane1_tokenmap() { :; }

lane0_offline3() {  # nano-vllm's workload at the 8B shape: Kiln's prefill steps profiled (run 1 of 3), and
  # transformers run for up to T_HF seconds (its earlier 60 s windows saw only its full-batch phase)
  # (OFF_MODEL=qwen: the Qwen3-0.6B shape instead)
  local m=$LLAMA name=llama8b
  if [ "${OFF_MODEL:-}" = qwen ]; then m=$QWEN name=qwen; fi
  step offline_$name ${T_OFF:-570} python benchmarks/offline_throughput.py --model-path $m $C --num-runs 3 \
    --step-stats --profile-prefill --time-limit ${T_HF:-400} --out "$R/json/offline_$name.json"
}
lane1_offline3() { :; }

variant_args() {  # VARGS: the agent trace's servers from VARIANTS=device,hicache-2x,hicache-4x
  VARGS=()
  for v in ${VARIANTS//,/ }; do
    case $v in
      device) VARGS+=(--variant "device=") ;;
      hicache-*x) VARGS+=(--variant "$v=--enable-hierarchical-cache --hicache-ratio ${v//[!0-9]/}") ;;
    esac
  done
}
VARIANTS=${VARIANTS:-device,hicache-2x,hicache-4x}

lane1_diag() {
  variant_args
  step agent_trace ${T_AGENT:-470} python benchmarks/agent_trace.py \
    --serve-args "--model-path $INK --load-format dummy --skip-tokenizer-init --max-total-tokens 60000 --max-running-requests 64 --cuda-graph-max-bs 64" \
    "${VARGS[@]}" \
    --concurrency 8,32 --level-time-limit ${AGENT_LEVEL_S:-40} --time-scale 0.25 --warmup-s 10 \
    --startup-timeout 120 --log-dir "$R/json" --out "$R/agent_trace_h200.json" --plot "$R/agent_trace_h200.png"
}

lane0_tables() {
  step decode_inkling ${T_INK:-240} $DECODE --model-path $INK --batch-sizes 8,32,64,128 --input-len 8192 \
    --output-len 1024 --time-limit 90 --out "$R/json/decode_inkling.json"
  step decode_minimax ${T_MM:-150} $DECODE --model-path $MM --batch-sizes 8,32,64 --input-len 8192 \
    --output-len 256 --time-limit 60 --out "$R/json/decode_minimax.json"
  step latency_llama8b ${T_LAT:-100} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 \
    --out "$R/json/latency_llama8b.json"
}

lane1_tables() { lane1_diag; }

lane0_final() {
  step gpu_tests ${T_TESTS:-130} python -m pytest -m gpu tests -v -rfE -p no:cacheprovider --timeout 60 \
    --continue-on-collection-errors --durations 10
  step latency_llama8b ${T_LAT:-45} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 --no-hf \
    --out "$R/json/latency_llama8b_final.json"
  step spec_inkling ${T_SPEC:-80} $DECODE --model-path $INK --batch-sizes 1,8,32 --input-len 1024 --output-len 64 \
    --speculative-algorithm mtp --speculative-num-steps 3 --out "$R/json/spec_inkling.json"
  step plain_inkling ${T_PLAIN:-50} $DECODE --model-path $INK --batch-sizes 1,8,32 --input-len 1024 --output-len 64 \
    --out "$R/json/plain_inkling.json"
}

lane1_final() {
  VARIANTS=${AGENT_VARIANTS:-hicache-4x} lane1_diag
  step offline_qwen ${T_QWEN:-100} python benchmarks/offline_throughput.py --model-path $QWEN $C --num-runs 1 \
    --time-limit 30 --no-progress --out "$R/json/offline_qwen.json"
}

lane0_spec() {
  step gpu_tests ${T_TESTS:-170} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 120 \
    tests/kernels/test_kv_store.py tests/kernels/test_activation.py tests/kernels/test_conv_qk_norm.py \
    tests/kernels/test_attention_kernels.py::test_extend_mtp_addressing tests/engine/test_cuda_graph.py \
    tests/engine/test_kernel_path.py tests/kernels/test_norm.py tests/kernels/test_rotary.py
  lane0_spec_rounds
}

lane1_spec() {
  step latency_llama8b ${T_LAT:-110} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 \
    --out "$R/json/latency_llama8b.json"
  step decode_llama8b ${T_8B:-100} $DECODE --model-path $LLAMA --batch-sizes 1,64 --input-len 1024 --output-len 128 \
    --profile --out "$R/json/decode_llama8b.json"
  step decode_inkling ${T_INK:-80} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 128 \
    --profile --out "$R/json/decode_inkling_bs1.json"
  step small_ops ${T_OPS:-60} python -m benchmarks.kernels.small_ops
}

lane0_spec2() {  # after the verify-as-decode change: spec rounds again, with a warm-up per batch size
  step gpu_tests ${T_TESTS:-120} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 100 \
    tests/engine/test_cuda_graph.py tests/engine/test_kernel_path.py \
    tests/kernels/test_attention_kernels.py::test_extend_mtp_addressing
  lane0_spec_rounds
}

lane0_spec_rounds() {
  lane0_spec_rounds_plain
  step spec_inkling_profile ${T_SPROF:-60} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 48 \
    --cuda-graph-max-bs 8 --speculative-algorithm mtp --speculative-num-steps 3 --profile --host-profile \
    --out "$R/json/spec_inkling_profile.json"
}

lane0_spec3() {  # after the MTP chain graphs: the GPU tests of the speculative path, then the rounds
  step gpu_tests ${T_TESTS:-110} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 100 \
    tests/engine/test_cuda_graph.py tests/kernels/test_attention_kernels.py::test_extend_mtp_addressing \
    tests/kernels/test_attention_kernels.py::test_decode_mtp_addressing
  lane0_spec_rounds
}

lane1_spec3() { :; }

lane1_spec2() {  # unprofiled 8B batch 1/64 after the overlap fix, its batch-64 idle, and the hybrid tables
  step decode_llama8b ${T_8B:-60} $DECODE --model-path $LLAMA --batch-sizes 1,64 --input-len 1024 --output-len 128 \
    --out "$R/json/decode_llama8b.json"
  step decode_llama8b_idle ${T_8BP:-50} $DECODE --model-path $LLAMA --batch-sizes 64 --input-len 1024 --output-len 128 \
    --profile --host-profile --out "$R/json/decode_llama8b_idle.json"
  step decode_inkling ${T_INK:-230} $DECODE --model-path $INK --batch-sizes 8,32,64,128 --input-len 8192 \
    --output-len 1024 --time-limit 50 --out "$R/json/decode_inkling.json"
  step decode_minimax ${T_MM:-150} $DECODE --model-path $MM --batch-sizes 128,64 --input-len 8192 \
    --output-len 1024 --time-limit 60 --out "$R/json/decode_minimax.json"
}

lane0_last() {  # MiniMax-M3 with 1024 output tokens up to batch 128
  step decode_minimax ${T_MM:-300} $DECODE --model-path $MM --batch-sizes 8,32,64,128 --input-len 8192 \
    --output-len 1024 --time-limit 120 --out "$R/json/decode_minimax_1024.json"
}

lane1_last() {  # nano-vllm's offline workload at the Llama-3.1-8B shape, Kiln against transformers
  step offline_llama8b ${T_OFF:-300} python benchmarks/offline_throughput.py --model-path $LLAMA $C --num-runs 1 \
    --time-limit 60 --no-progress --out "$R/json/offline_llama8b.json"
}

lane0_audit() {  # after the list-index sync fix: host sync audits, the batch-64 timeline, unprofiled rows
  step gpu_tests ${T_TESTS:-120} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 100 \
    tests/engine/test_host_sync.py tests/engine/test_cuda_graph.py
  step decode_llama8b ${T_8B:-70} $DECODE --model-path $LLAMA --batch-sizes 1,64 --input-len 1024 --output-len 128 \
    --out "$R/json/decode_llama8b.json"
  step timeline_llama8b ${T_8BP:-60} $DECODE --model-path $LLAMA --batch-sizes 64 --input-len 1024 --output-len 96 \
    --profile-steps 10 --trace "$R/json/timeline_llama8b.json" --sync-audit --out "$R/json/timeline_llama8b_row.json"
  step decode_inkling ${T_INK:-60} $DECODE --model-path $INK --batch-sizes 1,64 --input-len 1024 --output-len 128 \
    --out "$R/json/decode_inkling_b1.json"
  step decode_minimax ${T_MM:-70} $DECODE --model-path $MM --batch-sizes 1 --input-len 1024 --output-len 128 \
    --out "$R/json/decode_minimax_b1.json"
  step audit_hybrids ${T_AUD:-80} bash -c "$DECODE --model-path $INK --batch-sizes 64 --input-len 1024 --output-len 64 \
    --profile-steps 8 --sync-audit --trace $R/json/timeline_inkling.json && $DECODE --model-path $MM --batch-sizes 8 \
    --input-len 1024 --output-len 48 --profile-steps 8 --sync-audit"
  step audit_spec ${T_SPEC:-60} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 48 \
    --cuda-graph-max-bs 8 --speculative-algorithm mtp --speculative-num-steps 3 --profile-steps 6 --sync-audit
}

lane1_audit() { :; }

lane0_ovl() {  # after drafts-in-flight and the router/routing copies: gpu tests, hybrid batch 1, spec rounds
  step gpu_tests ${T_TESTS:-100} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 90 \
    tests/engine/test_host_sync.py tests/engine/test_cuda_graph.py tests/kernels/test_moe_kernels.py
  step decode_hybrids_b1 ${T_INK:-140} bash -c "$DECODE --model-path $INK --batch-sizes 1 --input-len 1024 \
    --output-len 128 --out $R/json/decode_inkling_b1.json && $DECODE --model-path $MM --batch-sizes 1 \
    --input-len 1024 --output-len 128 --out $R/json/decode_minimax_b1.json"
  lane0_spec_rounds_plain
}

lane0_spec_rounds_plain() {  # plain decode against MTP rounds (k = 3 and 1) at batch 1/8/32, unprofiled
  step plain_inkling ${T_PLAIN:-60} $DECODE --model-path $INK --batch-sizes 1,8,32 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 32 --out "$R/json/plain_inkling.json"
  for K in 3 1; do
    step spec_inkling_k$K ${T_SPEC:-90} $DECODE --model-path $INK --batch-sizes 1,8,32 --input-len 1024 --output-len 64 \
      --cuda-graph-max-bs 32 --speculative-algorithm mtp --speculative-num-steps $K --out "$R/json/spec_inkling_k$K.json"
  done
}

lane1_ovl() {  # nano-vllm's offline workload (8B and 0.6B shapes) and 8B batch 1, each against transformers
  step offline_llama8b ${T_OFF:-200} python benchmarks/offline_throughput.py --model-path $LLAMA $C --num-runs 1 \
    --time-limit 60 --no-progress --out "$R/json/offline_llama8b.json"
  step offline_qwen ${T_QWEN:-110} python benchmarks/offline_throughput.py --model-path $QWEN $C --num-runs 1 \
    --time-limit 30 --no-progress --out "$R/json/offline_qwen.json"
  step latency_llama8b ${T_LAT:-110} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 \
    --out "$R/json/latency_llama8b.json"
}

lane0_tables2() {  # Inkling bench at 8K / 1024 after the sync fix
  step decode_inkling ${T_INK:-200} $DECODE --model-path $INK --batch-sizes 8,32,64,128 --input-len 8192 \
    --output-len 1024 --time-limit 35 --out "$R/json/decode_inkling.json"
  step gpu_tests ${T_TESTS:-75} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 60 \
    tests/kernels/test_moe_kernels.py tests/engine/test_speculative.py
}

lane1_tables2() {  # where the 8B offline run's time goes; MiniMax-M3 bench at 8K / 1024 after the sync fix
  step offline_llama8b_steps ${T_OFF:-80} python benchmarks/offline_throughput.py --model-path $LLAMA $C --num-runs 1 \
    --no-hf --step-stats --no-progress --out "$R/json/offline_llama8b_steps.json"
  step decode_minimax ${T_MM:-200} $DECODE --model-path $MM --batch-sizes 8,32,64,128 --input-len 8192 \
    --output-len 1024 --time-limit 35 --out "$R/json/decode_minimax.json"
}

lane0_offline2() {  # nano-vllm's workload again, with the prefill-shaped warm-up, step stats and transformers
  step offline_llama8b ${T_OFF:-230} python benchmarks/offline_throughput.py --model-path $LLAMA $C --num-runs 1 \
    --time-limit 60 --step-stats --no-progress --out "$R/json/offline_llama8b.json"
  step offline_qwen ${T_QWEN:-120} python benchmarks/offline_throughput.py --model-path $QWEN $C --num-runs 1 \
    --time-limit 30 --step-stats --no-progress --out "$R/json/offline_qwen.json"
}

lane1_offline2() {  # MiniMax-M3 bench at batch 64 and 128, 8K / 1024
  step decode_minimax ${T_MM:-330} $DECODE --model-path $MM --batch-sizes 64,128 --input-len 8192 \
    --output-len 1024 --time-limit 130 --out "$R/json/decode_minimax_64_128.json"
}

lane0_final2() {  # exact verification (rejection sampling, block verification) on the GPU
  step gpu_tests ${T_TESTS:-150} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 140 \
    tests/engine/test_spec_sampled.py
}

lane1_final2() { :; }

lane0_devround() {  # verify -> MTP pass on the device (no host wait between them), ShortConv state write fused
  step audit_spec ${T_SPEC:-70} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 48 \
    --cuda-graph-max-bs 8 --speculative-algorithm mtp --speculative-num-steps 3 --profile-steps 6 --sync-audit \
    --trace "$R/json/timeline_spec_b1.json"
  lane0_spec_rounds_plain
  step gpu_tests ${T_TESTS:-200} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 150 \
    tests/engine/test_host_sync.py tests/engine/test_speculative.py tests/engine/test_cuda_graph.py \
    tests/kernels/test_shortconv_kernels.py tests/engine/test_spec_sampled.py
}

lane1_devround() { :; }

lane0_phases() {  # where the host's time goes in plain steps and MTP rounds at batch 1 (unprofiled)
  step phases_plain ${T_PLAIN:-60} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 8 --host-phases --profile-steps 20
  for K in 3 1; do
    step phases_k$K ${T_SPEC:-60} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 64 \
      --cuda-graph-max-bs 8 --speculative-algorithm mtp --speculative-num-steps $K --host-phases --profile-steps 20
  done
  step gpu_tests ${T_TESTS:-100} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 90 \
    tests/engine/test_cuda_graph.py
}

lane1_phases() { :; }

lane0_final3() {  # after the device rounds and graph passes near max_tokens: the rounds table, a longer run, GPU tests
  lane0_spec_rounds_plain
  step spec_inkling_k3_long ${T_SPEC:-60} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 256 \
    --cuda-graph-max-bs 8 --speculative-algorithm mtp --speculative-num-steps 3 --host-phases --profile-steps 20 \
    --out "$R/json/spec_inkling_k3_long.json"
  step gpu_tests ${T_TESTS:-240} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 150 \
    tests/engine/test_host_sync.py tests/engine/test_speculative.py tests/engine/test_cuda_graph.py \
    tests/engine/test_kernel_path.py tests/kernels/test_shortconv_kernels.py tests/kernels/test_conv_qk_norm.py \
    ${SAMPLED_TESTS-tests/engine/test_spec_sampled.py}
}

lane1_final3() { :; }

lane0_pdl() {  # programmatic dependent launch: kernel chains, GPU tests, then batch-1 decode with and without
  step pdl_chains ${T_MICRO:-60} python -m benchmarks.kernels.pdl
  step gpu_tests ${T_TESTS:-200} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 150 \
    tests/engine/test_pdl.py tests/kernels tests/engine/test_cuda_graph.py
  for v in on off; do
    if [ $v = off ]; then F=--disable-pdl; else F=; fi
    step llama8b_b1_$v ${T_8B:-75} $DECODE --model-path $LLAMA --batch-sizes 1 --input-len 1024 --output-len 128 \
      --cuda-graph-max-bs 8 $F --out "$R/json/llama8b_b1_$v.json"
    hybrids_b1 _$v 50 $F
  done
}

lane1_pdl() { :; }

lane0_pdl2() {  # GPU tests with PDL (pytest-xdist wheels carried in .device_wheels when present); cuBLAS without
  # a workspace (no split-K reduce kernel?) at batch 1; batch 64 with and without PDL
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-330} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 200 ${XDIST:-} \
    tests/kernels tests/engine/test_pdl.py tests/engine/test_cuda_graph.py tests/engine/test_host_sync.py \
    tests/engine/test_speculative.py tests/engine/test_kernel_path.py
  step llama8b_b1_noworkspace ${T_8B:-60} env CUBLAS_WORKSPACE_CONFIG=:0:0 $DECODE --model-path $LLAMA --batch-sizes 1 \
    --input-len 1024 --output-len 128 --cuda-graph-max-bs 8 --out "$R/json/llama8b_b1_noworkspace.json"
  for v in on off; do
    if [ $v = off ]; then F=--disable-pdl; else F=; fi
    step llama8b_b64_$v ${T_8B:-60} $DECODE --model-path $LLAMA --batch-sizes 64 --input-len 1024 --output-len 128 \
      --cuda-graph-max-bs 64 $F --out "$R/json/llama8b_b64_$v.json"
  done
}

lane1_pdl2() { :; }

lane0_pdl3() {  # the 8B batch-1 row against transformers; Inkling MTP rounds against plain decode; the batch-1 profile
  step latency_llama8b ${T_LAT:-240} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 \
    --out "$R/json/latency_llama8b.json"
  step plain_inkling ${T_PLAIN:-60} $DECODE --model-path $INK --batch-sizes 1,8,32 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 32 --out "$R/json/plain_inkling.json"
  step spec_inkling_k3 ${T_SPEC:-90} $DECODE --model-path $INK --batch-sizes 1,8,32 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 32 --speculative-algorithm mtp --speculative-num-steps 3 --out "$R/json/spec_inkling_k3.json"
  step plain_profile ${T_P:-60} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 8 --profile --profile-steps 20 --kernel-rows 40 --out "$R/json/plain_b1_profile.json"
  step llama8b_b64_noworkspace ${T_8B:-60} env CUBLAS_WORKSPACE_CONFIG=:0:0 $DECODE --model-path $LLAMA --batch-sizes 64 \
    --input-len 1024 --output-len 128 --cuda-graph-max-bs 64 --out "$R/json/llama8b_b64_noworkspace.json"
  step inkling_b1_noworkspace ${T_INK:-50} env CUBLAS_WORKSPACE_CONFIG=:0:0 $DECODE --model-path $INK --batch-sizes 1 \
    --input-len 1024 --output-len 128 --cuda-graph-max-bs 8 --out "$R/json/inkling_b1_noworkspace.json"
}

lane1_pdl3() { :; }

lane0_pdl4() {  # MTP rounds (k = 3) with and without PDL; the PDL engine test after launch.py's last change
  for v in on off; do
    if [ $v = off ]; then F=--disable-pdl; else F=; fi
    step spec_inkling_k3_$v ${T_SPEC:-90} $DECODE --model-path $INK --batch-sizes 1,8,32 --input-len 1024 --output-len 64 \
      --cuda-graph-max-bs 32 --speculative-algorithm mtp --speculative-num-steps 3 $F --out "$R/json/spec_inkling_k3_$v.json"
  done
  step gpu_tests ${T_TESTS:-120} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 100 tests/engine/test_pdl.py
}

lane1_pdl4() { :; }

lane0_pdl5() {  # a K = 3 round with PDL: GPU busy by kernel (profiled), then the host phases (unprofiled)
  step spec3_profile ${T_S:-60} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 8 --speculative-algorithm mtp --speculative-num-steps 3 --profile --profile-steps 20 \
    --kernel-rows 30 --out "$R/json/spec3_b1_profile.json"
  step phases_k3 ${T_SPEC:-45} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 8 --speculative-algorithm mtp --speculative-num-steps 3 --host-phases --profile-steps 20
}

lane1_pdl5() { :; }

lane0_gemv() {  # Kiln's decode GEMV (its weight stream started before the PDL wait) against cuBLAS: GPU tests,
  # the layer-chain microbenchmark, then decode of the 8B shape and Inkling bench with and without it
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-240} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 200 ${XDIST:-} \
    tests/kernels/test_gemv.py tests/engine/test_pdl.py tests/engine/test_cuda_graph.py \
    tests/engine/test_kernel_path.py tests/engine/test_host_sync.py
  step gemv_micro ${T_MICRO:-150} python -m benchmarks.kernels.gemv --layers 32 --rows 1,4,8
  for rows in 8 0; do
    step llama8b_gemv$rows ${T_8B:-70} $DECODE --model-path $LLAMA --batch-sizes 1,8 --input-len 1024 --output-len 128 \
      --cuda-graph-max-bs 8 --gemv-max-rows $rows --out "$R/json/llama8b_gemv$rows.json"
    step inkling_b1_gemv$rows ${T_INK:-50} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 128 \
      --cuda-graph-max-bs 8 --gemv-max-rows $rows --out "$R/json/inkling_b1_gemv$rows.json"
  done
}

lane1_gemv() { :; }

lane0_gemv2() {  # the GEMV on by default at batch 1 (all three architectures): GPU tests, the 8B shape against
  # transformers, batch-1 decode of the hybrids with and without it
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-300} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 200 ${XDIST:-} \
    tests/kernels/test_gemv.py tests/engine/test_pdl.py tests/engine/test_cuda_graph.py \
    tests/engine/test_kernel_path.py tests/engine/test_host_sync.py tests/engine/test_speculative.py
  step latency_llama8b ${T_LAT:-200} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 \
    --out "$R/json/latency_llama8b.json"
  for rows in 1 0; do hybrids_b1 _gemv$rows 50 --gemv-max-rows $rows; done
}

lane1_gemv2() { :; }

lane0_gemv3() {  # every GPU test with the GEMV on by default; where an 8B batch-1 step goes now (profile)
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-300} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider --timeout 200 ${XDIST:-} \
    --continue-on-collection-errors
  step llama8b_b1_profile ${T_8B:-80} $DECODE --model-path $LLAMA --batch-sizes 1 --input-len 1024 --output-len 128 \
    --cuda-graph-max-bs 8 --profile --profile-steps 20 --kernel-rows 30 --out "$R/json/llama8b_b1_profile.json"
}

lane1_gemv3() { :; }

lane0_gemv4() {  # without the early trigger: every GPU test, the speculative sync test three more times, the 8B
  # shape against transformers, the hybrids at batch 1
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-200} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider --timeout 150 ${XDIST:-} \
    --ignore tests/server
  for i in 1 2 3; do
    step spec_sync_$i 40 python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/engine/test_host_sync.py -k speculative
  done
  step latency_llama8b ${T_LAT:-110} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 --no-hf \
    --out "$R/json/latency_llama8b.json"
  step inkling_b1 ${T_INK:-40} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 128 \
    --cuda-graph-max-bs 8 --out "$R/json/inkling_b1.json"
  step minimax_b1 ${T_MM:-40} $DECODE --model-path $MM --batch-sizes 1 --input-len 1024 --output-len 128 \
    --cuda-graph-max-bs 8 --out "$R/json/minimax_b1.json"
}

lane1_gemv4() { :; }

lane0_gemv5() {  # the speculative tail failure: every GPU test with the GEMV off, then on (KILN_TEST_GEMV_MAX_ROWS),
  # the test's scenario over many prompt seeds on real graphs (scratch/, not in the repository), the GEMV tiles
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests_gemv0 ${T_TESTS:-200} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider --timeout 150 ${XDIST:-} \
    --ignore tests/server
  if [ -f scratch/spec_tail_gpu.py ]; then step seeds_gemv0 ${T_SEEDS:-130} python -m scratch.spec_tail_gpu 16 0 6; fi
  KILN_TEST_GEMV_MAX_ROWS=1 step gpu_tests_gemv1 ${T_TESTS:-200} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider \
    --timeout 150 ${XDIST:-} --ignore tests/server
  step gemv_tiles ${T_MICRO:-60} python -m benchmarks.kernels.gemv --rows 1,2,4 --layers 8
}

lane1_gemv5() { :; }

lane0_gemv6() {  # after the HostPool fix and the fixed GEMV tiles: the probe of a failed registration's error,
  # every GPU test with the GEMV off and on, the tile sweep, batch-1 latency with the GEMV
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step probe 30 python -c "
import torch; c = torch.cuda.cudart(); t = torch.empty(1 << 16); n = t.numel() * 4
print('register', int(c.cudaHostRegister(t.data_ptr(), n, 0)), 'again', int(c.cudaHostRegister(t.data_ptr(), n, 0)))
try:
    torch.ones(4, device='cuda').sum().item(); print('next op: no error')
except Exception as e: print('next op raised:', str(e).splitlines()[0])
c.cudaHostUnregister(t.data_ptr())"
  step gpu_tests_gemv0 ${T_TESTS:-180} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider --timeout 150 ${XDIST:-} \
    --ignore tests/server
  KILN_TEST_GEMV_MAX_ROWS=1 step gpu_tests_gemv1 ${T_TESTS:-180} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider \
    --timeout 150 ${XDIST:-} --ignore tests/server
  step gemv_sweep ${T_MICRO:-100} python -m benchmarks.kernels.gemv --rows 1,2,4 --layers 16 --sweep
  step latency_llama8b ${T_LAT:-70} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 --no-hf \
    --gemv-max-rows 1 --out "$R/json/latency_llama8b.json"
  step inkling_b1 ${T_INK:-40} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 128 \
    --cuda-graph-max-bs 8 --gemv-max-rows 1 --out "$R/json/inkling_b1.json"
}

lane1_gemv6() { :; }

lane0_gemv7() {  # the GEMV's second tile rule: its tests, the Inkling-shape sweep, batch 1 with the GEMV off and on
  step gemv_tests 60 python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/kernels/test_gemv.py
  step gemv_sweep ${T_MICRO:-70} python -m benchmarks.kernels.gemv --rows 1 --shapes inkling-bench,llama-8b --sweep --no-chain
  for rows in 1 0; do
    step latency_llama8b_gemv$rows ${T_LAT:-60} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 --no-hf \
      --gemv-max-rows $rows --out "$R/json/latency_llama8b_gemv$rows.json"
    hybrids_b1 _gemv$rows 35 --gemv-max-rows $rows
  done
}

lane1_gemv7() { :; }

lane0_gemv8() {  # the GEMV on by default (1 row on CUDA): every GPU test, then the 8B shape against transformers
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-170} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider --timeout 150 ${XDIST:-} \
    --ignore tests/server
  step latency_llama8b ${T_LAT:-200} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 \
    --out "$R/json/latency_llama8b.json"
}

lane1_gemv8() { :; }

lane0_next() {  # prepared for the next session (not run yet): the full GPU suite twice (the host pool's final
  # version), then batch 1 with the early trigger off and on (8B against transformers once, hybrids)
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  for i in 1 2; do
    step gpu_tests_$i ${T_TESTS:-150} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider --timeout 150 ${XDIST:-} \
      --ignore tests/server
  done
  step latency_llama8b ${T_LAT:-150} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 \
    --out "$R/json/latency_llama8b.json"
  step latency_llama8b_trigger ${T_LAT2:-60} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 --no-hf \
    --pdl-early-trigger --out "$R/json/latency_llama8b_trigger.json"
  hybrids_b1 "" 35
  hybrids_b1 _trigger 35 --pdl-early-trigger
}

lane1_next() { :; }

lane0_df() {  # where a DFlash K = 3 round's time goes at batch 1 (dummy 1-layer drafter): GPU kernels, host
  mkdir -p "$R/dflash-bench"
  echo '{"model_type": "dflash", "num_layers": 1, "block_size": 8, "mask_token_id": 49215, "hidden_size": 2048,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
    "target_layer_ids": [1, 12, 22]}' > "$R/dflash-bench/config.json"
  DF="--model-path $INK --input-len 1024 --output-len 64 --cuda-graph-max-bs 32 --speculative-algorithm dflash
    --speculative-draft-model-path $R/dflash-bench --speculative-num-steps 3"
  step dflash3 ${T_DF:-60} $DECODE $DF --batch-sizes 1,8 --out "$R/json/dflash3.json"
  step dflash3_profile ${T_DFP:-90} $DECODE $DF --batch-sizes 1 --profile --profile-steps 10 --kernel-rows 45 \
    --host-profile --host-phases --out "$R/json/dflash3_profile.json"
  step mtp3_phases ${T_MP:-60} $DECODE --model-path $INK --input-len 1024 --output-len 64 --cuda-graph-max-bs 32 \
    --speculative-algorithm mtp --speculative-num-steps 3 --batch-sizes 1 --host-phases --out "$R/json/mtp3.json"
}

lane1_df() { :; }

lane0_df2() {  # the paged block pass on CUDA graphs: every GPU test, then DFlash rounds (K = 3, 7) at batch
  # 1 / 8 / 32 against plain decode in the same call, and where a K = 3 round's time goes at batch 1
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-200} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider --timeout 200 ${XDIST:-} \
    --ignore tests/server
  mkdir -p "$R/dflash-bench"
  echo '{"model_type": "dflash", "num_layers": 1, "block_size": 8, "mask_token_id": 49215, "hidden_size": 2048,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
    "target_layer_ids": [1, 12, 22]}' > "$R/dflash-bench/config.json"
  DF="--model-path $INK --input-len 1024 --output-len 64 --cuda-graph-max-bs 32 --speculative-algorithm dflash
    --speculative-draft-model-path $R/dflash-bench"
  step plain ${T_PL:-60} $DECODE --model-path $INK --input-len 1024 --output-len 64 --cuda-graph-max-bs 32 \
    --batch-sizes 1,8,32 --out "$R/json/plain.json"
  for k in 3 7; do
    step dflash$k ${T_DF:-80} $DECODE $DF --speculative-num-steps $k --batch-sizes 1,8,32 --out "$R/json/dflash$k.json"
  done
  step dflash3_phases ${T_DFP:-60} $DECODE $DF --speculative-num-steps 3 --batch-sizes 1 --profile --profile-steps 10 \
    --kernel-rows 30 --host-phases --out "$R/json/dflash3_profile.json"
}

lane1_df2() { :; }

lane0_fuse() {  # fewer launches per layer (RoPE + cache write, the split merge inside the attention kernel,
  # SiLU-and-mul inside the gate_up GEMV): every GPU test, then batch 1 against the previous commit's code in
  # the same call (scratch/base: `git archive` of it, carried), alternating, then the 8B against transformers
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-240} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider ${XDIST:-} --ignore tests/server
  B8="--model-path $LLAMA $C --num-runs 3 --no-hf"
  HB="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  for i in 1 2; do
    step latency_llama8b_base_$i 60 python scratch/base/benchmarks/latency.py $B8 --out "$R/json/llama8b_base_$i.json"
    step latency_llama8b_new_$i 60 python benchmarks/latency.py $B8 --out "$R/json/llama8b_new_$i.json"
  done
  for m in inkling:$INK minimax:$MM; do
    step ${m%%:*}_b1_base 40 python scratch/base/benchmarks/decode_batch.py $C --model-path ${m#*:} $HB \
      --out "$R/json/${m%%:*}_b1_base.json"
    step ${m%%:*}_b1_new 40 python benchmarks/decode_batch.py $C --model-path ${m#*:} $HB --out "$R/json/${m%%:*}_b1_new.json"
  done
  step latency_llama8b_hf ${T_LAT:-120} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 \
    --out "$R/json/latency_llama8b.json"
}

lane1_fuse() { :; }

lane0_fuse2() {  # the routers' logits through the GEMV: every GPU test, then batch 1 and a K = 3 MTP round on the
  # hybrids with the previous commit's code (scratch/base), this code with the routers on cuBLAS (scratch/mid) and
  # this code, alternating
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-240} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider ${XDIST:-} --ignore tests/server
  HB="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  SP="--batch-sizes 1 --input-len 1024 --output-len 64 --cuda-graph-max-bs 32 --speculative-algorithm mtp
    --speculative-num-steps 3"
  for m in inkling:$INK minimax:$MM; do
    for v in base:scratch/base/ mid:scratch/mid/ new:; do
      step ${m%%:*}_b1_${v%%:*} 40 python ${v#*:}benchmarks/decode_batch.py $C --model-path ${m#*:} $HB \
        --out "$R/json/${m%%:*}_b1_${v%%:*}.json"
    done
  done
  for v in base:scratch/base/ mid:scratch/mid/ new:; do
    step inkling_mtp3_${v%%:*} 50 python ${v#*:}benchmarks/decode_batch.py $C --model-path $INK $SP \
      --out "$R/json/inkling_mtp3_${v%%:*}.json"
  done
}

lane1_fuse2() { :; }

lane0_fuse3() {  # after the review's changes: every GPU test; batch 1 with the early trigger off / on again, now
  # that fewer small kernels sit between the GEMVs
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-240} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider ${XDIST:-} --ignore tests/server
  B8="--model-path $LLAMA $C --num-runs 3 --no-hf"
  step latency_llama8b 60 python benchmarks/latency.py $B8 --out "$R/json/llama8b.json"
  step latency_llama8b_trigger 60 python benchmarks/latency.py $B8 --pdl-early-trigger --out "$R/json/llama8b_trigger.json"
  hybrids_b1 "" 40
  hybrids_b1 _trigger 40 --pdl-early-trigger
}

lane1_fuse3() { :; }

lane0_trigger() {  # prepared for the next session (not run yet): can --pdl-early-trigger become the default?
  # Every GPU test with it on in the engines the tests build, then batch 8 / 64 with it off and on
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  KILN_TEST_PDL_EARLY_TRIGGER=1 step gpu_tests_trigger ${T_TESTS:-240} python -m pytest -m gpu tests -q -rfE \
    -p no:cacheprovider ${XDIST:-} --ignore tests/server
  for f in "" --pdl-early-trigger; do
    step llama8b_b64${f:+_trigger} 60 $DECODE --model-path $LLAMA --batch-sizes 8,64 --input-len 1024 --output-len 128 \
      $f --out "$R/json/llama8b_b64${f:+_trigger}.json"
    step inkling_b64${f:+_trigger} 60 $DECODE --model-path $INK --batch-sizes 8,64 --input-len 1024 --output-len 128 \
      $f --out "$R/json/inkling_b64${f:+_trigger}.json"
  done
  # where a batch-1 hybrid step goes now, with the trigger on (the kernel table of each)
  for m in $INK $MM; do
    step profile_b1_${m#preset:} 70 $DECODE --model-path $m --batch-sizes 1 --input-len 1024 --output-len 64 \
      --cuda-graph-max-bs 8 --pdl-early-trigger --profile --kernel-rows 45
  done
}

lane1_trigger() { :; }

lane0_msa() {  # seventh session: every GPU test; MSA scores sized to fill the GPU, the MoE one-token path, lam once, the bias in the kernel
  # against 813b32e (scratch/base) at batch 1 and 64; Inkling batch 64 with the early trigger off / on again
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-240} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider ${XDIST:-} --ignore tests/server
  step moe_t1 ${T_MICRO:-60} python -m benchmarks.kernels.moe ${MOE_ARGS:---gemv 1 2 4}
  local OLD="python scratch/base/benchmarks/decode_batch.py $C" NEW="$DECODE"
  for v in OLD NEW; do
    step inkling_b1_$v 45 ${!v} --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8
    step minimax_b1_$v 45 ${!v} --model-path $MM --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8
  done
  for v in OLD NEW; do
    step minimax_b64_$v 60 ${!v} --model-path $MM --batch-sizes 64 --input-len 1024 --output-len 128
  done
  for f in "" --pdl-early-trigger; do
    step inkling_b64${f:+_trigger} 50 $DECODE --model-path $INK --batch-sizes 64 --input-len 1024 --output-len 128 $f
  done
  # without PDL every kernel's time is its own: where a batch-1 Inkling step goes now
  step profile_inkling_nopdl 50 $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 8 --disable-pdl --profile --kernel-rows 30
}

lane1_msa() { :; }

lane0_msa2() {  # the MoE one-token tiles swept; Inkling batch 64 with the trigger (its compile outlasted call 2's
  # limit); the hybrids at batch 1 with the trigger; MiniMax-M3 at 8K context
  step moe_sweep ${T_MICRO:-120} python -m benchmarks.kernels.moe --gemv-sweep
  step inkling_b64_trigger 90 $DECODE --model-path $INK --batch-sizes 64 --input-len 1024 --output-len 128 --pdl-early-trigger
  hybrids_b1 _trigger 45 --pdl-early-trigger
  step minimax_8k 150 $DECODE --model-path $MM --batch-sizes 8,64 --input-len 8192 --output-len 256 --time-limit 50
}

lane1_msa2() { :; }

lane0_msa3() {  # the swept MoE one-token tiles: their GPU tests, the hybrids at batch 1
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 4"; fi
  step moe_tests 90 python -m pytest -m gpu -q -p no:cacheprovider ${XDIST:-} tests/kernels/test_moe_kernels.py \
    tests/engine/test_cuda_graph.py tests/engine/test_kernel_path.py
  hybrids_b1 "" 45
}

lane1_msa3() { :; }

lane0_split() {  # eighth session: decode attention's least keys per split and its tiled merge
  # the attention GPU tests; the split sweep with the engine's grid (table of 128K); the hybrids at
  # batch 1 against 4987a32 (scratch/base); Inkling MTP rounds against plain decode
  step attn_tests ${T_TESTS:-120} python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/kernels/test_attention_kernels.py
  step attn_sweep ${T_MICRO:-150} python -m benchmarks.kernels.attention --batch 1 8 64 --context 1024 8192 \
    --table-len 131072 --min-split-keys 64 128 256 512 --no-reference
  local OLD="python scratch/base/benchmarks/decode_batch.py $C" NEW="$DECODE"
  for v in OLD NEW; do
    step inkling_b1_$v 45 ${!v} --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8
    step minimax_b1_$v 45 ${!v} --model-path $MM --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8
    step llama8b_b1_$v 50 ${!v} --model-path $LLAMA --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8
  done
}

lane1_split() { :; }

lane0_split2() {  # the split sweep again (least keys x most splits, 32K too), with V loaded beside K; the
  # old kernel (4987a32) timed by the same script; batch 1 end to end against 4987a32
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 4"; fi
  step attn_tests ${T_TESTS:-150} python -m pytest -m gpu -q -rfE -p no:cacheprovider ${XDIST:-} tests/kernels/test_attention_kernels.py
  step attn_sweep ${T_MICRO:-160} python -m benchmarks.kernels.attention --batch 1 8 --context 1024 8192 32768 \
    --table-len 131072 --min-split-keys 64 128 --max-splits 16 32 128 --no-reference
  (cd scratch/base && step attn_old 60 python -m benchmarks.kernels.attention --batch 1 8 --context 1024 8192 32768 \
    --table-len 131072 --no-reference)
  local OLD="python scratch/base/benchmarks/decode_batch.py $C" NEW="$DECODE"
  for v in OLD NEW; do
    step inkling_b1_$v 45 ${!v} --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8
    step llama8b_b1_$v 50 ${!v} --model-path $LLAMA --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8
  done
}

lane1_split2() { :; }

lane0_verify8() {  # every GPU test at this session's head; Inkling MTP rounds (K = 3) against plain decode
  # at batch 1/8/32; the 8B shape at batch 1 with an 8K context against 4987a32 (the split cap's case)
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-250} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider ${XDIST:-} --ignore tests/server
  step plain_inkling 60 $DECODE --model-path $INK --batch-sizes 1,8,32 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 32 --out "$R/json/plain_inkling.json"
  step spec_inkling_k3 90 $DECODE --model-path $INK --batch-sizes 1,8,32 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 32 --speculative-algorithm mtp --speculative-num-steps 3 --out "$R/json/spec_inkling_k3.json"
  local OLD="python scratch/base/benchmarks/decode_batch.py $C" NEW="$DECODE"
  for v in OLD NEW; do
    step llama8b_b1_8k_$v 50 ${!v} --model-path $LLAMA --batch-sizes 1 --input-len 8192 --output-len 128 --cuda-graph-max-bs 8
  done
}

lane1_verify8() { :; }

lane0_tables8() {  # the hybrids at 8K context and batch 8 to 128 (output 256), after the split cap
  step inkling_8k 170 $DECODE --model-path $INK --batch-sizes 8,32,64,128 --input-len 8192 --output-len 256 \
    --time-limit 40 --out "$R/json/inkling_8k.json"
  step minimax_8k 150 $DECODE --model-path $MM --batch-sizes 32,128 --input-len 8192 --output-len 256 \
    --time-limit 50 --out "$R/json/minimax_8k.json"
}

lane1_tables8() { :; }

lane0_prof8k() {  # where the split cap's kernel gain went: the 8B shape's batch-1 step at 8K profiled, old and new
  local OLD="python scratch/base/benchmarks/decode_batch.py $C" NEW="$DECODE"
  for v in OLD NEW; do
    step llama8b_8k_profile_$v 60 ${!v} --model-path $LLAMA --batch-sizes 1 --input-len 8192 --output-len 64 \
      --cuda-graph-max-bs 8 --profile --profile-steps 20 --kernel-rows 8
  done
}

lane1_prof8k() { :; }

nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
python -c "import torch,triton,transformers;print('# torch',torch.__version__,'triton',triton.__version__,'transformers',transformers.__version__)"
case $PHASE in
  diag|tables|final|spec|spec2|spec3|last|audit|ovl|tables2|offline2|final2|devround|phases|final3|offline3|bound|experts|tokenmap|pdl|pdl2|pdl3|pdl4|pdl5|gemv|gemv2|gemv3|gemv4|gemv5|gemv6|gemv7|gemv8|next|df|df2|fuse|fuse2|fuse3|trigger|msa|msa2|msa3|split|split2|verify8|tables8|prof8k)
    (export CUDA_VISIBLE_DEVICES=0; lane0_$PHASE) > "$R/lane0.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1; lane1_$PHASE) > "$R/lane1.log" 2>&1 &
    wait
    if [ "$PHASE" = last ]; then OUT=$R/json/tp2 T0=0 T1=0 T2=0 T3=${TP_T3:-100} T4=0 bash benchmarks/run_h200_tp2.sh > "$R/tp2.log" 2>&1; fi
    if [ "$PHASE" = tables2 ]; then OUT=$R/json/tp2 T0=0 T1=${TP_T1:-90} T2=${TP_T2:-60} T3=${TP_T3:-60} T4=0 T5=${TP_T5:-60} \
      DECODE_ARGS="--batch-sizes 64 --input-len 1024 --output-len 128" bash benchmarks/run_h200_tp2.sh > "$R/tp2.log" 2>&1; fi
    if [ "$PHASE" = final2 ]; then OUT=$R/json/tp2 T0=0 T1=0 T2=0 T3=0 T4=${TP_T4:-240} \
      INK_DECODE_ARGS="--batch-sizes 8,32,64,128 --input-len 8192 --output-len 1024 --time-limit 40" \
      bash benchmarks/run_h200_tp2.sh > "$R/tp2.log" 2>&1; fi
    if [ "$PHASE" = final ]; then OUT=$R/json/tp2 T0=${TP_T0:-0} T1=${TP_T1:-100} T2=${TP_T2:-70} T3=${TP_T3:-0} T4=${TP_T4:-90} bash benchmarks/run_h200_tp2.sh > "$R/tp2.log" 2>&1; fi
    tar czf "$R/json.tgz" -C "$R" json && rm -rf "$R/json"
    if [[ " devround phases final3 offline3 bound experts tokenmap pdl pdl2 pdl3 pdl4 pdl5 gemv gemv2 gemv3 gemv4 gemv5 gemv6 gemv7 gemv8 next df df2 fuse fuse2 fuse3 trigger msa msa2 msa3 split split2 verify8 tables8 prof8k " == *" $PHASE "* ]]; then grep -v "Warning\|_warn_once\|_set_sync_debug_mode\|^  *$" "$R/lane0.log" | tail -c 11000; exit 0; fi
    if [ "$PHASE" = audit ]; then grep -v "^\[" "$R/lane0.log" | grep -v "^  \+[0-9.]\+ us"; else grep -v "^\[" "$R/lane0.log" | grep -v "^  "; fi; echo; grep -v "^\[" "$R/lane1.log" | tail -30 ;;
  tp2) bash benchmarks/run_h200_tp2.sh ;;
  *) echo "PHASE must be one of the lane functions' names above (diag, tables, ..., devround) or tp2"; exit 2 ;;
esac
