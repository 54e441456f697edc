# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# eleventh session (2026-12-02): the pre-norms in the decode GEMVs' prologues (`--fold-norms-max-hidden`):
# fold (call 2), fold2 (call 3), fold3 (call 4); docs/benchmarks.md, sixteenth pass. Call 1 was ep6
# (expert_epilogue.sh). Calls 2 and 3 ran a boolean `--fold-norms` (call 2 with fma_tile's 2x1024 tile,
# call 3 with 8x512; prenorm_tile now picks 4x512);
# the lanes now say it with `--fold-norms-max-hidden` (0: off, 8192: on for every model here).
# shellcheck shell=bash

lane0_fold() {  # every GPU test; --fold-norms off / on at batch 1 for both hybrids and the 8B, alternated
  # x3; a kernel table of Inkling's batch-1 step with the norms folded
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-250} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider ${XDIST:-} --ignore tests/server
  local HB="--batch-sizes 1 --input-len 1024 --output-len 256 --cuda-graph-max-bs 8"
  for m in inkling:$INK minimax:$MM llama8b:$LLAMA; do
    for v in off on off2 on2 off3 on3; do
      local flag="--fold-norms-max-hidden 0"; [ "${v%[23]}" = on ] && flag="--fold-norms-max-hidden 8192"
      step ${m%%:*}_b1_fold_$v 60 $DECODE --model-path ${m#*:} $HB $flag --out "$R/json/${m%%:*}_b1_fold_$v.json"
    done
  done
  step inkling_b1_profile 90 $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 8 --profile --kernel-rows 30 --out "$R/json/inkling_b1_profile.json"
}

lane0_fold2() {  # the GEMV tests; the layer chain with the norms folded, every candidate tile (8B, Inkling
  # shapes); the 8B, Inkling and MiniMax-M3 at batch 1 with --fold-norms off / on (prenorm_tile), alternated x2
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-150} python -m pytest -m gpu -q -rfE -p no:cacheprovider ${XDIST:-} tests/kernels/test_gemv.py \
    tests/kernels/test_moe_kernels.py tests/kernels/test_norm.py tests/engine/test_kernel_path.py tests/engine/test_cuda_graph.py
  step chain_fold ${T_CHAIN:-200} python -m benchmarks.kernel_bench.gemv --rows 1 --chain-only --fold-sweep --layers 16
  local HB="--batch-sizes 1 --input-len 1024 --output-len 256 --cuda-graph-max-bs 8"
  for m in llama8b:$LLAMA inkling:$INK minimax:$MM; do
    for v in off on off2 on2; do
      local flag="--fold-norms-max-hidden 0"; [ "${v%2}" = on ] && flag="--fold-norms-max-hidden 8192"
      step ${m%%:*}_b1_fold_$v 60 $DECODE --model-path ${m#*:} $HB $flag --out "$R/json/${m%%:*}_b1_fold_$v.json"
    done
  done
}

lane0_fold3() {  # every GPU test (the fold now on by default up to hidden 2048); the hybrids at batch 1 with
  # the default (folded, 4x512 tile) against --fold-norms-max-hidden 0, alternated x2; the 8B's default once
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-200} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider ${XDIST:-} --ignore tests/server
  local HB="--batch-sizes 1 --input-len 1024 --output-len 256 --cuda-graph-max-bs 8"
  for m in inkling:$INK minimax:$MM; do
    for v in off default off2 default2; do
      local flag=""; [ "${v%2}" = off ] && flag="--fold-norms-max-hidden 0"
      step ${m%%:*}_b1_fold_$v 60 $DECODE --model-path ${m#*:} $HB $flag --out "$R/json/${m%%:*}_b1_fold_$v.json"
    done
  done
  step llama8b_b1_default 60 $DECODE --model-path $LLAMA $HB --out "$R/json/llama8b_b1_default.json"
}
