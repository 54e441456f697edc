# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# thirty-seventh session (2026-12-06). One GPU:
# `s37`: MiniMax-M3 after this session's cuts (MSA's selection inside the attention kernel, by rank
#   for rows of at most 64 blocks; the indexer's projection inside the qkv GEMV; the block scores
#   inside the prologue launch) against the thirty-sixth session's head (carry scratch/base38 =
#   `git archive c4c6fd8 kiln benchmarks/*.py benchmarks/configs`) and against the scores in a
#   launch of their own (`--disable-msa-prologue-scores`, "sep" below), at 1K
#   (batch 1 / 8) and 8K (batch 1) context; the MSA kernel table (2 launches against 3); the GPU
#   tests of the MSA kernels (the prologue's DI < D cases failed to compile in the thirty-seventh
#   pass) and of MiniMax-M3's engine.
# shellcheck shell=bash

S37_ARGS="--input-len 1024 --output-len 256 --cuda-graph-max-bs 8 --batch-sizes 1,8 --warmup on"
S37_LONG="--input-len 8192 --output-len 128 --cuda-graph-max-bs 8 --batch-sizes 1 --warmup on"

# Steps the three lanes share, each under the limits LIM (decode at 1K) and LONG (8K) given.
_s37_kernel_tests() {
  step kernel_tests "$1" python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 8 tests/kernels/test_msa_prologue.py \
    tests/kernels/test_msa_kernels.py
}
_s37_engine_tests() {
  step engine_tests "$1" python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 6 tests/engine/test_kernel_path.py \
    tests/engine/test_memory_release.py -k "msa or minimax"
}
_s37_scores_pair() {  # _s37_scores_pair LIM LONG: the scores inside the prologue ("now") against apart ("sep")
  local sep="--disable-msa-prologue-scores"
  step now_a "$1" $DECODE --model-path $MM $S37_ARGS --out "$R/json/now_a.json"
  step sep_a "$1" $DECODE --model-path $MM $S37_ARGS $sep --out "$R/json/sep_a.json"
  step long_now "$2" $DECODE --model-path $MM $S37_LONG --out "$R/json/long_now.json"
  step long_sep "$2" $DECODE --model-path $MM $S37_LONG $sep --out "$R/json/long_sep.json"
}

lane0_s37() {
  export TRITON_CACHE_DIR=/tmp/triton-s37-$$
  local b38="python scratch/base38/benchmarks/decode_batch.py $C"
  _s37_kernel_tests 120
  _s37_scores_pair 70 90
  step base38_a 70 $b38 --model-path $MM $S37_ARGS --out "$R/json/base38_a.json"
  step msa_kernel 90 python -m benchmarks.kernel_bench.msa --batch 1 8 64 --context 1024 8192 16384 32768 --no-reference
  step base38_b 70 $b38 --model-path $MM $S37_ARGS --out "$R/json/base38_b.json"
  step now_b 70 $DECODE --model-path $MM $S37_ARGS --out "$R/json/now_b.json"
  _s37_engine_tests 100
}

# `s37s`: s37 without the kernel table and the repeats (for a call the device budget cuts short).
lane0_s37s() {
  export TRITON_CACHE_DIR=/tmp/triton-s37-$$
  _s37_kernel_tests 100
  _s37_scores_pair 60 80
  step base38_a 60 python scratch/base38/benchmarks/decode_batch.py $C --model-path $MM $S37_ARGS \
    --out "$R/json/base38_a.json"
  _s37_engine_tests 90
}

# `s37t`: the least of s37 (a session with ~6 minutes of device time left): the GPU tests, and the
# scores inside the prologue against --disable-msa-prologue-scores at 1K and 8K.
lane0_s37t() {
  export TRITON_CACHE_DIR=/tmp/triton-s37-$$
  _s37_kernel_tests 80
  _s37_scores_pair 45 55
  _s37_engine_tests 60
}
