# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# twelfth session (2026-12-02): decode attention reads its first block of older keys before the PDL
# wait (`early_kv`, --attention-early-kv-max-bs 0 turns it off; calls 2-4 ran the first form of that flag,
# a boolean --disable-attention-early-kv, with early_kv at every batch size); docs/benchmarks.md,
# seventeenth pass.
# Call 1 of that pass was resid1 (the residual-epilogue experiment, on branch
# experiment/residual-epilogue).
# shellcheck shell=bash

lane0_early1() {  # the attention, kernel-path and graph GPU tests; batch 1 with early_kv on (default) / off,
  # alternated: the 8B and Inkling x2, MiniMax-M3 x1
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-150} python -m pytest -m gpu -q -rfE -p no:cacheprovider ${XDIST:-} \
    tests/kernels/test_attention_kernels.py tests/engine/test_kernel_path.py tests/engine/test_cuda_graph.py
  local HB="--batch-sizes 1 --input-len 1024 --output-len 256 --cuda-graph-max-bs 8"
  for r in 1 2; do
    for m in llama8b:$LLAMA inkling:$INK; do
      step ${m%%:*}_b1_early_$r 60 $DECODE --model-path ${m#*:} $HB --out "$R/json/${m%%:*}_b1_early_$r.json"
      step ${m%%:*}_b1_late_$r 60 $DECODE --model-path ${m#*:} $HB --attention-early-kv-max-bs 0 \
        --out "$R/json/${m%%:*}_b1_late_$r.json"
    done
  done
  step minimax_b1_early 60 $DECODE --model-path $MM $HB --out "$R/json/minimax_b1_early.json"
  step minimax_b1_late 60 $DECODE --model-path $MM $HB --attention-early-kv-max-bs 0 --out "$R/json/minimax_b1_late.json"
}

lane0_rope1() {  # the GEMV, attention, kernel-path, graph and host-sync GPU tests; batch 1 with the qkv GEMV's
  # RoPE epilogue on (default) / off (--disable-fused-qkv-rope), alternated x3, on the 8B (the only Llama
  # config here: Qwen3's qk-norm keeps rope_store); then neither early_kv nor the epilogue, once
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-200} python -m pytest -m gpu -q -rfE -p no:cacheprovider ${XDIST:-} tests/kernels/test_gemv.py \
    tests/kernels/test_attention_kernels.py tests/kernels/test_rotary.py tests/engine/test_kernel_path.py \
    tests/engine/test_cuda_graph.py tests/engine/test_host_sync.py
  local HB="--batch-sizes 1 --input-len 1024 --output-len 256 --cuda-graph-max-bs 8"
  for r in 1 2 3; do
    step llama8b_b1_rope_$r 60 $DECODE --model-path $LLAMA $HB --out "$R/json/llama8b_b1_rope_$r.json"
    step llama8b_b1_norope_$r 60 $DECODE --model-path $LLAMA $HB --disable-fused-qkv-rope \
      --out "$R/json/llama8b_b1_norope_$r.json"
  done
  step llama8b_b1_neither 60 $DECODE --model-path $LLAMA $HB --disable-fused-qkv-rope --attention-early-kv-max-bs 0 \
    --out "$R/json/llama8b_b1_neither.json"
}

lane0_final12() {  # every GPU test with both on by default; batch 1 of the three models; batch 64 with early_kv
  # on / off (8B, Inkling); the 8B at batch 1 against transformers (static cache + torch.compile)
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-220} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider ${XDIST:-} --ignore tests/server
  local HB="--batch-sizes 1 --input-len 1024 --output-len 256 --cuda-graph-max-bs 8"
  for m in llama8b:$LLAMA inkling:$INK minimax:$MM; do
    step ${m%%:*}_b1_default 60 $DECODE --model-path ${m#*:} $HB --out "$R/json/${m%%:*}_b1_default.json"
  done
  local H64="--batch-sizes 64 --input-len 1024 --output-len 128 --cuda-graph-max-bs 64"
  for m in llama8b:$LLAMA inkling:$INK; do
    step ${m%%:*}_b64_early 70 $DECODE --model-path ${m#*:} $H64 --out "$R/json/${m%%:*}_b64_early.json"
    step ${m%%:*}_b64_late 70 $DECODE --model-path ${m#*:} $H64 --attention-early-kv-max-bs 0 \
      --out "$R/json/${m%%:*}_b64_late.json"
  done
  step latency_llama8b ${T_LAT:-110} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 \
    --input-len 1024 --output-len 128 --out "$R/json/latency_llama8b.json"
}

lane0_early2() {  # early_kv by batch size (call 5 ran the default of then, 8; it is 1 since): the 8B at batch 64 with the default (off at 64) against
  # --attention-early-kv-max-bs 64, alternated x2; at batch 8 the default (on) against 0
  local H64="--batch-sizes 64 --input-len 1024 --output-len 128 --cuda-graph-max-bs 64"
  for r in 1 2; do
    step llama8b_b64_default_$r 70 $DECODE --model-path $LLAMA $H64 --out "$R/json/llama8b_b64_default_$r.json"
    step llama8b_b64_early_$r 70 $DECODE --model-path $LLAMA $H64 --attention-early-kv-max-bs 64 \
      --out "$R/json/llama8b_b64_early_$r.json"
  done
  local H8="--batch-sizes 8 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  step llama8b_b8_default 60 $DECODE --model-path $LLAMA $H8 --out "$R/json/llama8b_b8_default.json"
  step llama8b_b8_late 60 $DECODE --model-path $LLAMA $H8 --attention-early-kv-max-bs 0 --out "$R/json/llama8b_b8_late.json"
}
