# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# forty-ninth session (2026-12-07).
# shellcheck shell=bash

# `s49a`: would a speculative verify's few rows stream on the GEMV's MMA path? At 4 rows every FMA
#   tile loses to cuBLAS (forty-eighth pass). 5 rows take the MMA loop (16 rows padded, so what
#   one of its tiles would do for 4), timed here on every tile of `DOT_TILES` for the LM head and
#   Inkling `bench`'s dense projections, beside cuBLAS and the FMA tiles at 4 rows.
lane0_s49a() {
  export TRITON_CACHE_DIR=/tmp/triton-s49a-$$
  step lm_head 120 python -m benchmarks.kernel_bench.lm_head --rows 4 5 8 --sweep
  step gemv_tiles 240 python -m benchmarks.kernel_bench.gemv --rows 4,5,8 --sweep --shapes inkling-bench --no-chain
}

# `s49b`: the same question in a dependent chain (`kernel_bench.gemv`'s chain: norm -> qkv -> o ->
#   norm -> gate_up -> SiLU -> down per layer, 32 layers of distinct weights), where the GEMV's
#   weight stream starts before the PDL wait: cuBLAS against the MMA GEMV (rule tile and every
#   other `DOT_TILES` tile) at 5 and 8 rows, and the FMA modes at 4 rows, Inkling `bench` shape.
lane0_s49b() {
  export TRITON_CACHE_DIR=/tmp/triton-s49b-$$
  step gemv_chain 240 python -m benchmarks.kernel_bench.gemv --rows 1,4,5,8 --chain-only --shapes inkling-bench
}

# `s49c`: where a batch-1 K = 3 MTP round's GPU time goes now, against a plain step (Inkling
#   `bench`, 1K context, random MTP layers: the cost of a round). Profiled kernel tables
#   (`decode_batch.py --profile`) with PDL off, so that each kernel's time is its own and not its
#   wait for the one before; and the same two runs unprofiled with PDL on, for the step times.
#   (PDL off also turns the GEMV off unless `--gemv-max-rows` is given: the call of this lane
#   profiled cuBLAS's path. `s49d` profiles the engine's kernels.)
lane0_s49c() {
  export TRITON_CACHE_DIR=/tmp/triton-s49c-$$
  local a="--model-path $INK --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  local s="--speculative-algorithm mtp --speculative-num-steps 3"
  step plain 90 $DECODE $a --out "$R/json/plain.json"
  step mtp 90 $DECODE $a $s --out "$R/json/mtp.json"
  step plain_prof 90 $DECODE $a --disable-pdl --profile --profile-steps 20 --kernel-rows 40 \
    --out "$R/json/plain_prof.json"
  step mtp_prof 120 $DECODE $a $s --disable-pdl --profile --profile-steps 20 --kernel-rows 60 \
    --out "$R/json/mtp_prof.json"
}

# `s49d`: `s49c`'s profiles on the engine's own kernel path: PDL off with `--gemv-max-rows 1`.
lane0_s49d() {
  export TRITON_CACHE_DIR=/tmp/triton-s49d-$$
  local a="--model-path $INK --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  local p="--disable-pdl --gemv-max-rows 1 --profile --profile-steps 20"
  step plain_prof 90 $DECODE $a $p --kernel-rows 40 --out "$R/json/plain_prof.json"
  step mtp_prof 120 $DECODE $a --speculative-algorithm mtp --speculative-num-steps 3 $p --kernel-rows 60 \
    --out "$R/json/mtp_prof.json"
}

# `s49e` (an H200: Inkling's KV at these batches does not fit an 80 GB card, forty-eighth pass):
#   the issue's large-batch rows of Inkling `bench` with the current kernels (input 8192 / output
#   1024, batch 32 / 64 / 128), last measured on an H200 in the fourteenth pass.
lane0_s49e() {
  export TRITON_CACHE_DIR=/tmp/triton-s49e-$$
  step inkling_8k ${T_INK:-400} $DECODE --model-path $INK --batch-sizes 32,64,128 --input-len 8192 \
    --output-len 1024 --time-limit 150 --out "$R/json/inkling_8k_1024.json"
}

# `s49f`: `s49d`'s profiles for what else issues 4 and 6 ask about: MiniMax-M3 `bench`'s plain
#   step at batch 1 (its 42% of the roofline) and Inkling `bench`'s K = 3 round against a plain
#   step at batch 8 (PDL off with `--gemv-max-rows 1`; the unprofiled steps with PDL first).
lane0_s49f() {
  export TRITON_CACHE_DIR=/tmp/triton-s49f-$$
  local p="--disable-pdl --gemv-max-rows 1 --profile --profile-steps 20"
  local mm="--model-path $MM --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  local ink="--model-path $INK --batch-sizes 8 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  local s="--speculative-algorithm mtp --speculative-num-steps 3"
  step mm_plain 90 $DECODE $mm --out "$R/json/mm_plain.json"
  step mm_plain_prof 90 $DECODE $mm $p --kernel-rows 40 --out "$R/json/mm_plain_prof.json"
  step ink8_plain 90 $DECODE $ink --out "$R/json/ink8_plain.json"
  step ink8_mtp 90 $DECODE $ink $s --out "$R/json/ink8_mtp.json"
  step ink8_plain_prof 90 $DECODE $ink $p --kernel-rows 40 --out "$R/json/ink8_plain_prof.json"
  step ink8_mtp_prof 120 $DECODE $ink $s $p --kernel-rows 60 --out "$R/json/ink8_mtp_prof.json"
}

# `s49g` (carry scratch/b_base: `git archive` of the commit before the change, kiln, benchmarks/*.py
#   and configs): the routers' logits of 5..16 rows on the GEMV's MMA loop instead of a cast and
#   cuBLAS's split-K SIMT SGEMM (~11 us per MoE layer at batch 8 in `s49f`'s profile). Its GPU
#   tests, then batch-8 plain decode of Inkling (alternated twice) and MiniMax-M3 (once each)
#   against the tree before it. Ran on an H100 (forty-ninth pass): the tests passed, and the steps
#   were 0.70 ms slower (the MMA loop's IEEE fp32 products over 5 programs take ~30 us a layer);
#   the change was not committed.
lane0_s49g() {
  _s49_router_ab s49g 120 "widens or router or gates or real_shapes" full
}

_s49_router_ab() {  # NAME TEST_LIMIT TEST_FILTER full|short: the router changes' GPU tests, then
  # batch-8 plain decode against scratch/b_base (full: Inkling alternated twice and MiniMax-M3
  # once each; short: Inkling once each)
  export TRITON_CACHE_DIR=/tmp/triton-$1-$$
  step gpu_tests $2 python -m pytest -q -x -p no:cacheprovider -m gpu tests/kernels/test_gemv.py \
    tests/kernels/test_moe_kernels.py -k "$3"
  local base="python scratch/b_base/benchmarks/decode_batch.py $C"
  local ink="--model-path $INK --batch-sizes 8 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  local mm="--model-path $MM --batch-sizes 8 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  if [ "$4" = full ]; then
    alternated ink8 "$base" $ink
    step mm8_now_1 80 $DECODE $mm --out "$R/json/mm8_now_1.json"
    step mm8_base_1 80 $base $mm --out "$R/json/mm8_base_1.json"
  else
    step ink8_now 75 $DECODE $ink --out "$R/json/ink8_now.json"
    step ink8_base 60 $base $ink --out "$R/json/ink8_base.json"
  fi
}

# `s49h` (carry scratch/b_base, as `s49g`): the routers' logits past 4 rows on the GEMV's FMA loop,
#   blocks of 4 widened rows side by side on a second grid axis (17 x ceil(T / 4) programs for
#   Inkling's 66 x 2048 router), against the tree before it: `s49g`'s tests and steps.
lane0_s49h() {
  lane0_s49g
}

# `s49i`: `s49h` cut to the budget left: the GPU tests, then Inkling batch 8 once on each tree.
lane0_s49i() {
  _s49_router_ab s49i 90 "widens or router or gates" short
}
