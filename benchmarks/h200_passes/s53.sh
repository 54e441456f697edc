# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# fifty-third session (2026-12-07).
# shellcheck shell=bash

# `s53a` (carry scratch/b_9d0776d; the fifty-second session's `s52d`, which found no machine, and
#   more): the GPU tests of what the fifty-second session changed and did not run on a GPU (the MSA
#   kernels after `msa_extend`'s caller-given rows, the engine's block-drafter tests with
#   `block_attention`, the kernel tests that share `capture_graph` since 4a21323), then MiniMax-M3
#   `bench` + DSpark K = 3 rounds at batch 1 and 8, 1K and 8K, this tree against 9d0776d; Inkling
#   `bench` + a 1-layer DFlash drafter (B = 8), K = 3 sampled rounds at batch 1 and 8, against
#   9d0776d; the DSpark round's profile.
lane0_s53a() {
  export TRITON_CACHE_DIR=/tmp/triton-s53a-$$
  step gpu_tests 200 python -m pytest -q -p no:cacheprovider -m gpu -n 6 -rfEs tests/kernels/test_msa_kernels.py \
    tests/engine/test_cuda_graph.py tests/engine/test_block_rounds_on_device.py tests/engine/test_draft_sampling.py \
    tests/kernels/test_block_attention.py tests/kernels/test_attention_kernels.py tests/kernels/test_moe_kernels.py
  dspark_rounds_vs_base 1024 8192
  _s38_dflash_config
  step df_now 70 $DECODE $S38_DFLASH --out "$R/json/df_now.json"
  step df_base 60 python scratch/b_9d0776d/benchmarks/decode_batch.py $C $S38_DFLASH --out "$R/json/df_base.json"
  local a="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  step mm_dspark_prof 80 $DECODE --model-path $MM+dspark $a --speculative-algorithm dspark \
    --speculative-num-steps 3 --disable-pdl --gemv-max-rows 1 --profile --profile-steps 20 --kernel-rows 50 \
    --out "$R/json/mm_dspark_prof.json"
}

# `s53b` (carry scratch/b_9d0776d and scratch/b_4a21323): (1) whether Inkling's sampled DFlash
#   rounds lost 0.38 ms at batch 1 with `block_attention` (s53a: 3.01 against 2.63 ms on 9d0776d):
#   this tree and 9d0776d alternated, greedy rounds on both, and both trees' rounds profiled with
#   PDL off; (2) MiniMax-M3's extend scores only where selection reads them (no scores at all
#   at a 1K context), its GPU tests and DSpark K = 3 rounds at 1K and 8K against 4a21323.
lane0_s53b() {
  export TRITON_CACHE_DIR=/tmp/triton-s53b-$$
  step msa_tests 100 python -m pytest -q -p no:cacheprovider -m gpu -n 6 -rfEs tests/kernels/test_msa_kernels.py
  local b9="python scratch/b_9d0776d/benchmarks/decode_batch.py $C"
  DS_BASE_TREE=scratch/b_4a21323 DS_BASE_TAG=4a2 dspark_rounds_vs_base 1024 8192
  _s38_dflash_config
  local df1="${S38_DFLASH/--batch-sizes 1,8/} --batch-sizes 1"
  alternated df1 "$b9" $df1
  local g1="${df1/--temperature 1.0 --speculative-use-rejection-sampling/}"
  step dfg1_now 45 $DECODE $g1 --out "$R/json/dfg1_now.json"
  step dfg1_base 45 $b9 $g1 --out "$R/json/dfg1_base.json"
  local p="--disable-pdl --gemv-max-rows 1 --profile --profile-steps 20 --kernel-rows 40"
  step df1_prof_now 55 $DECODE $df1 $p --out "$R/json/df1_prof_now.json"
  step df1_prof_base 55 $b9 $df1 $p --out "$R/json/df1_prof_base.json"
}

# `s53c`: why a process's first sampled DFlash run is slow (s53b: batch-1 rounds 3.21 and 3.76 ms
#   in the first run of each tree, 2.54 and 2.52 in the second; p50 too, so every round): each
#   pair below starts from an empty Triton cache (the first run compiles every kernel), then runs
#   again with it filled. Every row's note counts the collector's runs inside the measurement.
#   Pair 1 with the host phases timed, pair 2 with the heap frozen again after the warm-up (what
#   the compiles left out of the collector's walks), pair 3 profiled (GPU idle, kernels). Then
#   MiniMax-M3's DSpark K = 3 sampled rounds (T = 1, rejection sampling; never measured).
lane0_s53c() {
  _s38_dflash_config
  local df1="${S38_DFLASH/--batch-sizes 1,8/} --batch-sizes 1" tag
  local -A extra=([hp]="--host-phases --profile-steps 20" [rf]="--refreeze-after-warmup"
                  [pr]="--profile --profile-steps 20 --kernel-rows 14")
  for tag in hp rf pr; do
    export TRITON_CACHE_DIR=/tmp/triton-s53c-$tag-$$
    step df1_${tag}_compiling 90 $DECODE $df1 ${extra[$tag]} --out "$R/json/df1_${tag}_compiling.json"
    step df1_${tag}_cached 45 $DECODE $df1 ${extra[$tag]} --out "$R/json/df1_${tag}_cached.json"
  done
  step ds_sampled 80 $DECODE --model-path $MM+dspark --batch-sizes 1,8 --input-len 1024 --output-len 128 \
    --cuda-graph-max-bs 8 --speculative-algorithm dspark --speculative-num-steps 3 --temperature 1.0 \
    --speculative-use-rejection-sampling --out "$R/json/ds_sampled.json"
}

# `s53d`: `s53c` cut to its first two pairs (the device time left after two asks that got no
#   machine): host phases and the collector's runs, first run against second; the heap frozen
#   again after the warm-up.
lane0_s53d() {
  _s38_dflash_config
  local df1="${S38_DFLASH/--batch-sizes 1,8/} --batch-sizes 1" tag
  local -A extra=([hp]="--host-phases --profile-steps 20" [rf]="--refreeze-after-warmup")
  for tag in hp rf; do
    export TRITON_CACHE_DIR=/tmp/triton-s53d-$tag-$$
    step df1_${tag}_compiling 80 $DECODE $df1 ${extra[$tag]} --out "$R/json/df1_${tag}_compiling.json"
    step df1_${tag}_cached 40 $DECODE $df1 ${extra[$tag]} --out "$R/json/df1_${tag}_cached.json"
  done
}
