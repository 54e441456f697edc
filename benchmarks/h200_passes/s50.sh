# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# fiftieth session (2026-12-07).
# shellcheck shell=bash

# `s50a` (carry scratch/b_6ae78c0 and scratch/b_base: `git archive`s of 6ae78c0, the tree before the
#   LM heads of 2-16 rows went to the GEMV's MMA loop, and of 9f44ec8, the tree before the routers
#   past 4 rows went to its FMA loop): the GPU tests of both; the head against cuBLAS + cast at 1-16
#   rows; Inkling `bench` K = 3 MTP rounds at batch 1 and 8 and plain decode at batch 8 against
#   6ae78c0 (the head's change: a verify's 4 / 32 rows, the draft heads' 8, a batch-8 step's 8);
#   MiniMax-M3 `bench` plain at batch 8, 6ae78c0 against 9f44ec8 (the routers' change, not
#   measured there in the forty-ninth pass). 1K / 128.
lane0_s50a() {
  export TRITON_CACHE_DIR=/tmp/triton-s50a-$$
  step gpu_kernels 90 python -m pytest -q -x -p no:cacheprovider -m gpu tests/kernels/test_gemv.py \
    tests/kernels/test_moe_kernels.py -k "float_out or mma or widens or router or gates"
  step gpu_engine 120 python -m pytest -q -x -p no:cacheprovider -m gpu tests/engine/test_verify_ahead.py \
    tests/engine/test_draft_vocab.py
  step lm_head 60 python -m benchmarks.kernel_bench.lm_head --rows 1 2 3 4 8 16
  local head="python scratch/b_6ae78c0/benchmarks/decode_batch.py $C" base="python scratch/b_base/benchmarks/decode_batch.py $C"
  local a="--input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  local s="--speculative-algorithm mtp --speculative-num-steps 3"
  step ink_mtp_now 100 $DECODE --model-path $INK --batch-sizes 1,8 $a $s --out "$R/json/ink_mtp_now.json"
  step ink_mtp_head 80 $head --model-path $INK --batch-sizes 1,8 $a $s --out "$R/json/ink_mtp_head.json"
  step ink8_now 60 $DECODE --model-path $INK --batch-sizes 8 $a --out "$R/json/ink8_now.json"
  step ink8_head 60 $head --model-path $INK --batch-sizes 8 $a --out "$R/json/ink8_head.json"
  step mm8_head 75 $head --model-path $MM --batch-sizes 8 $a --out "$R/json/mm8_head.json"
  step mm8_base 60 $base --model-path $MM --batch-sizes 8 $a --out "$R/json/mm8_base.json"
}

# `s50b` (an H200: Inkling's KV at batch 32-128 does not fit an 80 GB card, forty-eighth pass): the
#   issue's large-batch table with the current kernels, both hybrids at input 8192 / output 1024,
#   batch 8 / 32 / 64 / 128 (last measured on an H200 in the fourteenth pass, with its flags).
lane0_s50b() {
  export TRITON_CACHE_DIR=/tmp/triton-s50b-$$
  local a="--batch-sizes 8,32,64,128 --input-len 8192 --output-len 1024 --time-limit 60"
  step inkling_8k ${T_INK:-280} $DECODE --model-path $INK $a --out "$R/json/inkling_8k_1024.json"
  step minimax_8k ${T_MM:-280} $DECODE --model-path $MM $a --out "$R/json/minimax_8k_1024.json"
}
