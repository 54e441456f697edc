# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# thirty-sixth session (2026-12-05). One GPU each:
# `s36a`: Inkling's attention prologue inside the decode attention (--attention-prologue-max-bs):
#   its GPU tests, then Inkling `bench` at batch 1 / 8 with the prologue inside (max bs 8) and apart
#   (0), alternated twice.
# `s36b`: s35d (adaptive MTP at batch 32, the late catch-up graph past batch 8; carry scratch/base36
#   = `git archive 74d99af kiln benchmarks/*.py benchmarks/configs`), then MiniMax-M3 `bench` at
#   batch 1 (no Inkling prologue: its step must not have moved).
# shellcheck shell=bash

lane0_s36a() {
  export TRITON_CACHE_DIR=/tmp/triton-s36-$$
  step tests 200 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 4 tests/kernels/test_attention_prologue.py \
    tests/kernels/test_conv_qk_norm.py tests/kernels/test_attention_kernels.py \
    tests/engine/test_kernel_path.py -k "prologue or conv_qk_norm or decode or real_shapes or graph"
  local ad="--model-path $INK --input-len 1024 --output-len 256 --cuda-graph-max-bs 8 --batch-sizes 1,8 --warmup on"
  for i in 1 2; do
    step inside_$i 100 $DECODE $ad --attention-prologue-max-bs 8 --out "$R/json/inside_$i.json"
    step apart_$i 100 $DECODE $ad --attention-prologue-max-bs 0 --out "$R/json/apart_$i.json"
  done
}

lane0_s36b() {
  lane0_s35d
  local ad="--model-path $MM --input-len 1024 --output-len 256 --cuda-graph-max-bs 8 --batch-sizes 1 --warmup on"
  step minimax_1 100 $DECODE $ad --out "$R/json/minimax_1.json"
}
