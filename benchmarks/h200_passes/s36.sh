# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# thirty-sixth session (2026-12-05). One GPU each:
# `s36a`: the two prologues' GPU tests; Inkling's attention prologue inside the decode attention
#   (--attention-prologue-max-bs): Inkling `bench` at batch 1 / 8 with it (max bs 8) and without
#   (0), alternated twice.
# `s36b`: MiniMax-M3's prologue in one launch and its stacked indexer projections: MiniMax-M3
#   `bench` at batch 1 / 8 with the prologue (the default), with --disable-msa-prologue, and at the
#   session's start (carry scratch/base37 = `git archive e11df81 kiln benchmarks/*.py
#   benchmarks/configs`), alternated twice.
# `s36c`: s35d (adaptive MTP at batch 32, the late catch-up graph past batch 8; carry scratch/base36
#   = `git archive 74d99af kiln benchmarks/*.py benchmarks/configs`).
# shellcheck shell=bash

S36_ARGS="--input-len 1024 --output-len 256 --cuda-graph-max-bs 8 --batch-sizes 1,8 --warmup on"

lane0_s36a() {
  export TRITON_CACHE_DIR=/tmp/triton-s36-$$
  step tests 200 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 4 tests/kernels/test_attention_prologue.py \
    tests/kernels/test_msa_prologue.py tests/kernels/test_conv_qk_norm.py tests/kernels/test_attention_kernels.py \
    tests/engine/test_kernel_path.py
  for i in 1 2; do
    step inside_$i 100 $DECODE --model-path $INK $S36_ARGS --attention-prologue-max-bs 8 --out "$R/json/inside_$i.json"
    step apart_$i 100 $DECODE --model-path $INK $S36_ARGS --attention-prologue-max-bs 0 --out "$R/json/apart_$i.json"
  done
}

lane0_s36b() {
  export TRITON_CACHE_DIR=/tmp/triton-s36-$$
  for i in 1 2; do
    step msa_one_$i 110 $DECODE --model-path $MM $S36_ARGS --out "$R/json/msa_one_$i.json"
    step msa_five_$i 110 $DECODE --model-path $MM $S36_ARGS --disable-msa-prologue --out "$R/json/msa_five_$i.json"
    [ "$i" = 1 ] && step msa_base 110 python scratch/base37/benchmarks/decode_batch.py $C --model-path $MM \
      $S36_ARGS --out "$R/json/msa_base.json"
  done
}

lane0_s36c() {
  lane0_s35d
}

# `s36`: s36a and s36b in one call, each comparison once (for a session whose device time is
# short); `s36r`: the same comparisons again, the other way round.
lane0_s36() {  # most wanted first: a call cut short by the device budget keeps what ran
  export TRITON_CACHE_DIR=/tmp/triton-s36-$$
  step kernel_tests 90 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 8 tests/kernels/test_attention_prologue.py \
    tests/kernels/test_msa_prologue.py tests/kernels/test_msa_kernels.py
  step inside 80 $DECODE --model-path $INK $S36_ARGS --attention-prologue-max-bs 8 --out "$R/json/inside.json"
  step apart 80 $DECODE --model-path $INK $S36_ARGS --attention-prologue-max-bs 0 --out "$R/json/apart.json"
  step msa_one 80 $DECODE --model-path $MM $S36_ARGS --out "$R/json/msa_one.json"
  step msa_base 80 python scratch/base37/benchmarks/decode_batch.py $C --model-path $MM $S36_ARGS \
    --out "$R/json/msa_base.json"
  step msa_five 80 $DECODE --model-path $MM $S36_ARGS --disable-msa-prologue --out "$R/json/msa_five.json"
  # thirty-seventh session: MSA's selection inside the attention kernel; base38 = before it (c4c6fd8)
  [ -d scratch/base38 ] && step msa_base38 80 python scratch/base38/benchmarks/decode_batch.py $C --model-path $MM \
    $S36_ARGS --out "$R/json/msa_base38.json"
  step msa_kernel 60 python -m benchmarks.kernel_bench.msa --batch 1 8 64 --context 1024 8192 32768 --no-reference
  step engine_tests 100 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 6 tests/engine/test_kernel_path.py \
    tests/engine/test_memory_release.py -k "prologue or msa or minimax"
}

lane0_s36r() {
  export TRITON_CACHE_DIR=/tmp/triton-s36-$$
  step msa_base 90 python scratch/base37/benchmarks/decode_batch.py $C --model-path $MM $S36_ARGS \
    --out "$R/json/msa_base_r.json"
  step msa_five 90 $DECODE --model-path $MM $S36_ARGS --disable-msa-prologue --out "$R/json/msa_five_r.json"
  step msa_one 90 $DECODE --model-path $MM $S36_ARGS --out "$R/json/msa_one_r.json"
  step apart 90 $DECODE --model-path $INK $S36_ARGS --attention-prologue-max-bs 0 --out "$R/json/apart_r.json"
  step inside 90 $DECODE --model-path $INK $S36_ARGS --attention-prologue-max-bs 8 --out "$R/json/inside_r.json"
  step ink_base 90 python scratch/base37/benchmarks/decode_batch.py $C --model-path $INK $S36_ARGS \
    --out "$R/json/ink_base_r.json"
}
