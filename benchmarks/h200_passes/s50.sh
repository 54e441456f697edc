# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# fiftieth session (2026-12-07). `s50a`, `s50c` and `s50d` pass --moe-gate-align-max-tokens, which
# was removed after c6dc37f (measured no faster: docs/benchmarks.md, fiftieth pass): run them at
# c6dc37f. `s50d` ran (call 1); `s50b` and `s50e` run at any later commit.
# shellcheck shell=bash

# `s50a` (carry scratch/b_6ae78c0: `git archive` of 6ae78c0, the tree before this session's two
#   changes): the GPU tests of both changes (LM heads of 2-16 rows on the GEMV's MMA loop; the gate
#   aligning a few tokens for the grouped MoE, `--moe-gate-align-max-tokens`, off by default); the
#   head against cuBLAS + cast at 1-16 rows; Inkling `bench` K = 3 MTP rounds at batch 1 and 8
#   (verifies of 4 and 32 rows, draft heads of 8) with both changes (the alignment up to 8 tokens),
#   with the head's only (the default), and on 6ae78c0. 1K / 128.
lane0_s50a() {
  export TRITON_CACHE_DIR=/tmp/triton-s50a-$$
  step gpu_kernels 100 python -m pytest -q -x -p no:cacheprovider -m gpu tests/kernels/test_gemv.py \
    tests/kernels/test_gate_align.py tests/kernels/test_moe_kernels.py -k "float_out or mma or widens or router or gates or align or layer"
  step gpu_engine 120 python -m pytest -q -x -p no:cacheprovider -m gpu tests/engine/test_verify_ahead.py \
    tests/engine/test_draft_vocab.py tests/engine/test_cuda_graph.py
  step lm_head 50 python -m benchmarks.kernel_bench.lm_head --rows 1 2 3 4 8 16
  _s50_three ink_mtp "--model-path $INK --batch-sizes 1,8 --speculative-algorithm mtp --speculative-num-steps 3"
}

# `s50c` (carry scratch/b_6ae78c0 and scratch/b_base, `git archive` of 9f44ec8, the tree before the
#   routers past 4 rows went to the GEMV's FMA loop): `s50a`'s three trees on plain decode, Inkling
#   `bench` at batch 1 and 8 and MiniMax-M3 `bench` at batch 8; and MiniMax-M3 at batch 8 on
#   9f44ec8 (against 6ae78c0: the routers' change, which the forty-ninth pass measured on Inkling only).
lane0_s50c() {
  export TRITON_CACHE_DIR=/tmp/triton-s50c-$$
  _s50_three ink "--model-path $INK --batch-sizes 1,8"
  _s50_three mm8 "--model-path $MM --batch-sizes 8"
  step mm8_base 60 python scratch/b_base/benchmarks/decode_batch.py $C --model-path $MM --batch-sizes 8 \
    --input-len 1024 --output-len 128 --cuda-graph-max-bs 8 --out "$R/json/mm8_base.json"
}

_s50_three() {  # NAME "ARGS": decode_batch.py ARGS (1K / 128) with both changes (the gate's alignment
  # up to 8 tokens: off by default), with the head's only (the default), and on scratch/b_6ae78c0 (neither)
  local a="$2 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  step $1_align 100 $DECODE $a --moe-gate-align-max-tokens 8 --out "$R/json/$1_align.json"
  step $1_now 70 $DECODE $a --out "$R/json/$1_now.json"
  step $1_head 90 python scratch/b_6ae78c0/benchmarks/decode_batch.py $C $a --out "$R/json/$1_head.json"
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

# `s50d` (carry scratch/b_6ae78c0): `s50a` and the Inkling half of `s50c` cut to one call, for a
#   budget that failed asks had mostly spent: the GPU tests, the K = 3 rounds at batch 1 and 8 on
#   the three variants, plain batch 8 with both changes and on 6ae78c0, then the LM head's timings.
lane0_s50d() {
  export TRITON_CACHE_DIR=/tmp/triton-s50d-$$
  step gpu_kernels 90 python -m pytest -q -x -p no:cacheprovider -m gpu tests/kernels/test_gemv.py \
    tests/kernels/test_gate_align.py tests/kernels/test_moe_kernels.py -k "float_out or mma or widens or router or gates or align or layer"
  step gpu_engine 110 python -m pytest -q -x -p no:cacheprovider -m gpu tests/engine/test_cuda_graph.py \
    tests/engine/test_verify_ahead.py
  _s50_three ink_mtp "--model-path $INK --batch-sizes 1,8 --speculative-algorithm mtp --speculative-num-steps 3"
  local a="--model-path $INK --batch-sizes 8 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  step ink8_align 60 $DECODE $a --moe-gate-align-max-tokens 8 --out "$R/json/ink8_align.json"
  step ink8_head 60 python scratch/b_6ae78c0/benchmarks/decode_batch.py $C $a --out "$R/json/ink8_head.json"
  step lm_head 40 python -m benchmarks.kernel_bench.lm_head --rows 1 2 4 8 16
}

# `s50e` (carry scratch/b_6ae78c0): after `s50d`: the engine GPU test that failed there (the
#   routers' fp32 rows past 16, fixed), then plain Inkling batch 8 with the LM head on the MMA loop
#   (the default) and on 6ae78c0, once each (the budget left).
lane0_s50e() {
  export TRITON_CACHE_DIR=/tmp/triton-s50e-$$
  step gpu_engine 80 python -m pytest -q -x -p no:cacheprovider -m gpu tests/engine/test_cuda_graph.py
  local a="--model-path $INK --batch-sizes 8 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  step ink8_now 55 $DECODE $a --out "$R/json/ink8_now.json"
  step ink8_head 50 python scratch/b_6ae78c0/benchmarks/decode_batch.py $C $a --out "$R/json/ink8_head.json"
}
