# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# fifty-first session (2026-12-07).
# shellcheck shell=bash

# `s51a` (carry scratch/b_6ae78c0 and scratch/b_base: `git archive`s of 6ae78c0, the tree before
#   the fiftieth session's LM-head change and router fix, and of 9f44ec8, the tree before the
#   routers past 4 rows went to the GEMV's FMA loop): the GPU test that the fiftieth session's
#   router bug failed (fp32 tiny presets in CUDA graphs); Inkling `bench` plain batch 8 with the
#   LM head of 8 rows on the MMA loop against 6ae78c0; MiniMax-M3 `bench` at batch 8 on the three
#   trees (the routers' change, measured on Inkling only in the forty-ninth pass). 1K / 128.
lane0_s51a() {
  export TRITON_CACHE_DIR=/tmp/triton-s51a-$$
  step gpu_engine 90 python -m pytest -q -x -p no:cacheprovider -m gpu tests/engine/test_cuda_graph.py \
    tests/kernels/test_moe_kernels.py -k "router or graphs"
  local a="--batch-sizes 8 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  step ink8_now 55 $DECODE --model-path $INK $a --out "$R/json/ink8_now.json"
  step ink8_head 50 python scratch/b_6ae78c0/benchmarks/decode_batch.py $C --model-path $INK $a --out "$R/json/ink8_head.json"
  step mm8_now 55 $DECODE --model-path $MM $a --out "$R/json/mm8_now.json"
  step mm8_head 50 python scratch/b_6ae78c0/benchmarks/decode_batch.py $C --model-path $MM $a --out "$R/json/mm8_head.json"
  step mm8_base 50 python scratch/b_base/benchmarks/decode_batch.py $C --model-path $MM $a --out "$R/json/mm8_base.json"
  step ink8_now2 50 $DECODE --model-path $INK $a --out "$R/json/ink8_now2.json"
}

# `s51b`: the whole GPU suite at the current code (last run whole in the forty-sixth pass, at
#   c576b65; four sessions of kernel changes since: the routers past 4 rows, the LM heads of 2-16
#   rows on the MMA loop, the router fix for fp32 rows).
lane0_s51b() {
  export TRITON_CACHE_DIR=/tmp/triton-s51b-$$
  step gpu_tests 420 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 8 tests
}

# `s51c`: `s51b` and, on a card with more than 100 GB (an H200: Inkling's KV at batch 32-128 does
#   not fit an H100's 80 GB, forty-eighth pass), Inkling `bench` at input 8192 / output 1024,
#   batch 8 / 32 / 64 / 128 with the current kernels (the large-batch row, last measured
#   on an H200 in the fourteenth pass; `s50b` has both hybrids, for a call of its own).
lane0_s51c() {
  export TRITON_CACHE_DIR=/tmp/triton-s51c-$$
  step gpu_tests ${T_SUITE:-240} python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 8 tests
  local mib
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  if [ "${mib:-0}" -gt 100000 ]; then
    step inkling_8k ${T_INK:-280} $DECODE --model-path $INK --batch-sizes 8,32,64,128 --input-len 8192 \
      --output-len 1024 --time-limit 60 --out "$R/json/inkling_8k_1024.json"
  else
    echo "=== inkling_8k: skipped (${mib} MiB: not an H200)"
  fi
}

# `s51d`: `s51b` (the whole GPU suite), then MiniMax-M3 `bench` with its DSpark drafter
#   (`preset:minimax_m3/bench+dspark`: 5 layers, B = 16, taps 3 / 13 / 22; random weights, so L ~ 1
#   and a round's time is its cost) against plain decode on the same target: K = 3 rounds at batch
#   1 and 8, K = 7 at batch 1. 1K / 128. Never measured at a real shape before.
lane0_s51d() {
  export TRITON_CACHE_DIR=/tmp/triton-s51d-$$
  step gpu_tests ${T_SUITE:-240} python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 8 tests
  local a="--input-len 1024 --output-len 128 --cuda-graph-max-bs 8" d="--speculative-algorithm dspark"
  step mm_plain 60 $DECODE --model-path $MM --batch-sizes 1,8 $a --out "$R/json/mm_plain.json"
  step mm_dspark3 80 $DECODE --model-path $MM+dspark --batch-sizes 1,8 $a $d --speculative-num-steps 3 \
    --out "$R/json/mm_dspark3.json"
  step mm_dspark7 60 $DECODE --model-path $MM+dspark --batch-sizes 1 $a $d --speculative-num-steps 7 \
    --out "$R/json/mm_dspark7.json"
}

# `s51e` (for the next session; not run): `test_pdl.py` with the GEMV's row limit pinned (the
#   suite's one failure in `s51d`, fixed in the test), then where a DSpark round's GPU time goes:
#   MiniMax-M3 `bench` plain and with its 5-layer DSpark drafter (K = 3), batch 1, profiled with PDL
#   off as `s49d` profiles Inkling's MTP rounds (`--gemv-max-rows 1` keeps the GEMV without PDL).
lane0_s51e() {
  export TRITON_CACHE_DIR=/tmp/triton-s51e-$$
  step gpu_pdl 150 python -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_pdl.py -rA
  local a="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  local p="--disable-pdl --gemv-max-rows 1 --profile --profile-steps 20"
  step mm_plain_prof 90 $DECODE --model-path $MM $a $p --kernel-rows 40 --out "$R/json/mm_plain_prof.json"
  step mm_dspark_prof 120 $DECODE --model-path $MM+dspark $a --speculative-algorithm dspark \
    --speculative-num-steps 3 $p --kernel-rows 60 --out "$R/json/mm_dspark_prof.json"
}
