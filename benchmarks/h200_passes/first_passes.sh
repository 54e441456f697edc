# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# the first passes (2026-11-29/30): diag, tables, final, spec*, last, audit, ovl, tables2, offline2, final2, bound, experts, tokenmap, offline3.
# shellcheck shell=bash

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
  step small_ops ${T_OPS:-60} python -m benchmarks.kernel_bench.small_ops
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

