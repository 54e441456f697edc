# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# fifty-second session (2026-12-07).
# shellcheck shell=bash

# `s52a` (carry scratch/b_9d0776d: a `git archive` of 9d0776d, the block pass with one
#   `decode_attention` row per block row): the GPU tests of `block_attention`, the block pass and
#   `test_pdl.py` (the fifty-first pass's one failure, fixed in the test since); the kernel alone
#   (`kernel_bench.block_attention`: one row per block row against a block's rows in one
#   program, at 1K / 8K / 32K); then MiniMax-M3 `bench` + its 5-layer DSpark drafter, K = 3
#   rounds at batch 1 at 1K and 8K and at batch 8 at 8K, on this tree and on 9d0776d.
lane0_s52a() {
  export TRITON_CACHE_DIR=/tmp/triton-s52a-$$
  step gpu_tests 200 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_block_attention.py \
    tests/engine/test_block_pass.py tests/engine/test_pdl.py -rA
  step kbench 120 python -m benchmarks.kernel_bench.block_attention --batch 1 8 --context 1024 8192 32768 \
    --min-split-keys 64 256 1024
  local d="--speculative-algorithm dspark --speculative-num-steps 3 --cuda-graph-max-bs 8 --output-len 128"
  local base="python scratch/b_9d0776d/benchmarks/decode_batch.py $C"
  step ds1k_now 80 $DECODE --model-path $MM+dspark --batch-sizes 1 --input-len 1024 $d --out "$R/json/ds1k_now.json"
  step ds1k_base 60 $base --model-path $MM+dspark --batch-sizes 1 --input-len 1024 $d --out "$R/json/ds1k_base.json"
  step ds8k_now 60 $DECODE --model-path $MM+dspark --batch-sizes 1,8 --input-len 8192 $d --out "$R/json/ds8k_now.json"
  step ds8k_base 60 $base --model-path $MM+dspark --batch-sizes 1,8 --input-len 8192 $d --out "$R/json/ds8k_base.json"
}

# `s52b`: where a DSpark round's GPU time goes (the fifty-first session's `s51e` profiles, on this
#   tree): MiniMax-M3 `bench` plain and with its 5-layer DSpark drafter (K = 3), batch 1, 1K,
#   profiled with PDL off (`--gemv-max-rows 1` keeps the GEMV without PDL).
lane0_s52b() {
  export TRITON_CACHE_DIR=/tmp/triton-s52b-$$
  local a="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  local p="--disable-pdl --gemv-max-rows 1 --profile --profile-steps 20"
  step mm_plain_prof 90 $DECODE --model-path $MM $a $p --kernel-rows 40 --out "$R/json/mm_plain_prof.json"
  step mm_dspark_prof 120 $DECODE --model-path $MM+dspark $a --speculative-algorithm dspark \
    --speculative-num-steps 3 $p --kernel-rows 60 --out "$R/json/mm_dspark_prof.json"
}

# dspark_rounds_vs_base INPUT_LEN...: MiniMax-M3 `bench` + DSpark K = 3 rounds at batch 1 and 8, per
#   input length on this tree and on a base tree: $DS_BASE_TREE (default scratch/b_9d0776d, the block
#   pass before the fifty-second session), its rows named ds<K>k_$DS_BASE_TAG (default "base").
dspark_rounds_vs_base() {
  local d="--speculative-algorithm dspark --speculative-num-steps 3 --cuda-graph-max-bs 8 --output-len 128"
  local base="python ${DS_BASE_TREE:-scratch/b_9d0776d}/benchmarks/decode_batch.py $C" len tag
  for len in "$@"; do
    tag=ds$((len / 1024))k
    step ${tag}_now 80 $DECODE --model-path $MM+dspark --batch-sizes 1,8 --input-len $len $d \
      --out "$R/json/${tag}_now.json"
    step ${tag}_${DS_BASE_TAG:-base} 60 $base --model-path $MM+dspark --batch-sizes 1,8 --input-len $len $d \
      --out "$R/json/${tag}_${DS_BASE_TAG:-base}.json"
  done
}

# `s52c` (carry scratch/b_9d0776d): `block_attention`'s split count from programs per SM (1, the
#   new default, against 2 and 4, at least 64 or 256 keys a split; `s52a` ran the old rule, 4-8
#   programs per SM), its GPU tests; MiniMax-M3 `bench` + DSpark K = 3 rounds at batch 1 and 8, 1K
#   and 8K, this tree against 9d0776d; then `s52b`'s DSpark round profile (the plain step's
#   profile left out: device time was short).
lane0_s52c() {
  export TRITON_CACHE_DIR=/tmp/triton-s52c-$$
  step gpu_tests 120 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_block_attention.py
  step kbench 150 python -m benchmarks.kernel_bench.block_attention --batch 1 8 --context 1024 8192 32768 \
    --min-split-keys 64 256 --programs-per-sm 1 2 4
  dspark_rounds_vs_base 1024 8192
  local a="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  step mm_dspark_prof 120 $DECODE --model-path $MM+dspark $a --speculative-algorithm dspark \
    --speculative-num-steps 3 --disable-pdl --gemv-max-rows 1 --profile --profile-steps 20 --kernel-rows 60 \
    --out "$R/json/mm_dspark_prof.json"
}

# `s52d` (for the next session; not run: the device time ran out; carry scratch/b_9d0776d):
#   MiniMax-M3's verify without its per-layer metadata launches (`msa_extend` takes the batch's
#   positions and token rows; the extend score kernel sums its tiles itself: ~14 launches fewer
#   per MSA layer), with `block_attention`: the MSA GPU tests and the engine's block-drafter tests
#   on CUDA (graphs, rounds on the device: they run `block_attention` in the engine), then DSpark
#   K = 3 rounds at batch 1 and 8, 1K and 8K, this tree against 9d0776d, and the round's profile
#   again.
lane0_s52d() {
  export TRITON_CACHE_DIR=/tmp/triton-s52d-$$
  step gpu_tests 200 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_msa_kernels.py \
    tests/engine/test_cuda_graph.py tests/engine/test_block_rounds_on_device.py tests/engine/test_draft_sampling.py
  dspark_rounds_vs_base 1024 8192
  local a="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  step mm_dspark_prof 100 $DECODE --model-path $MM+dspark $a --speculative-algorithm dspark \
    --speculative-num-steps 3 --disable-pdl --gemv-max-rows 1 --profile --profile-steps 20 --kernel-rows 40 \
    --out "$R/json/mm_dspark_prof.json"
}
