# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# thirty-fifth session (2026-12-05), prepared on the CPU (no device was lent that session); one GPU
# each, in the order of what they decide:
# `s35c`: benchmarks/kernel_bench/persistent_chain.py (is a persistent GEMV chain, handing results
#   on through device counters, nearer its bytes than one launch per GEMV with PDL and the early
#   trigger?).
# `s35d`: adaptive MTP at batch 32 (the late catch-up graph captured past batch 8) against the
#   session's start (carry scratch/base36, below) and plain decode.
# `s35a`: the whole GPU suite at the session's head (nothing has run it since the extend kernel's
#   metadata alignment, the early trigger in speculative decode graphs and the catch-up at the lag
#   bound without a chain pass).
# `s35b`: adaptive MTP's plain steps with the catch-up at the lag bound skipping the chain pass,
#   against the session's start (carry scratch/base36 = `git archive 74d99af kiln benchmarks/*.py
#   benchmarks/configs`) and plain decode, alternated, at batch 1 / 8.
# shellcheck shell=bash

S35_MTP="--speculative-algorithm mtp --speculative-num-steps 3 --speculative-adaptive"

lane0_s35c() {
  step chain 200 python -m benchmarks.kernel_bench.persistent_chain --layers 24 --shapes o,qkvr,8b --rows 1,4 \
    --per-sm 1,2,4 --block-n 2,4 --out "$R/json/persistent_chain.json"
}

lane0_s35d() {
  local ad="--model-path $INK --input-len 1024 --output-len 256 --cuda-graph-max-bs 32 --batch-sizes 32 --warmup on"
  export TRITON_CACHE_DIR=/tmp/triton-s35-$$
  step plain_32 110 $DECODE $ad --out "$R/json/plain_32.json"
  step adaptive_32 150 $DECODE $ad $S35_MTP --out "$R/json/adaptive_32.json"
  step adaptive_base_32 120 python scratch/base36/benchmarks/decode_batch.py $C $ad $S35_MTP \
    --out "$R/json/adaptive_base_32.json"
}

lane0_s35a() {
  step gpu_suite 540 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 6 tests --ignore tests/server
}

lane0_s35b() {
  local ad="--model-path $INK --input-len 1024 --output-len 256 --cuda-graph-max-bs 8 --batch-sizes 1,8 --warmup on"
  export TRITON_CACHE_DIR=/tmp/triton-s35-$$
  step plain 90 $DECODE $ad --out "$R/json/plain.json"
  for i in 1 2; do
    step adaptive_$i 130 $DECODE $ad $S35_MTP --out "$R/json/adaptive_$i.json"
    step adaptive_base_$i 80 python scratch/base36/benchmarks/decode_batch.py $C $ad $S35_MTP \
      --out "$R/json/adaptive_base_$i.json"
  done
}
