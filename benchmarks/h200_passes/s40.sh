# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# fortieth session (2026-12-06).
# `s40a`: where the filter's `_select_kernel` spends its ~77 us on one top-p row (a traced copy,
#   scratch/t/select_trace.py, carried), and why DFlash's batch-1 sampled rounds vary between runs:
#   three runs of the same command with the rounds' median and largest gap (decode_batch.py's
#   round_p50_ms / round_max_ms), the third with the host's phases; MTP rejection-sampling rounds
#   as the control.
# shellcheck shell=bash

lane0_s40a() {
  export TRITON_CACHE_DIR=/tmp/triton-s40a-$$
  local df="$S38_DFLASH --batch-sizes 1"
  _s38_dflash_config
  step select_trace 120 python scratch/t/select_trace.py
  step df_1 90 $DECODE $df --out "$R/json/df_1.json"
  step df_2 60 $DECODE $df --out "$R/json/df_2.json"
  step df_3 60 $DECODE $df --host-phases --profile-steps 30 --out "$R/json/df_3.json"
  step rs 60 $DECODE $S38_ARGS $S38_MTP --batch-sizes 1 --temperature 1.0 --speculative-use-rejection-sampling \
    --out "$R/json/rs.json"
}

# `s40b`: the block pass's graphs draw the sampled drafts (c95c8ce): the GPU tests of the block
#   drafters' device rounds and draws, then DFlash K = 3 sampled rounds (T = 1, rejection sampling)
#   at batch 1 and 8 alternated against the session's start (carry scratch/base44 = `git archive
#   e37c5de kiln benchmarks/configs` plus this commit's benchmarks/*.py), the new code's host
#   phases at batch 1, and greedy DFlash rounds as the control; the traced selection again.
lane0_s40b() {
  export TRITON_CACHE_DIR=/tmp/triton-s40b-$$
  local b44="python scratch/base44/benchmarks/decode_batch.py $C"
  _s38_dflash_config
  step gpu_tests 240 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 4 tests/engine/test_draft_sampling.py \
    tests/engine/test_block_rounds_on_device.py tests/engine/test_block_pass.py tests/engine/test_block_drafter.py
  step select_trace 60 python scratch/t/select_trace.py
  for i in 1 2; do
    step df_now_$i 90 $DECODE $S38_DFLASH --out "$R/json/df_now_$i.json"
    step df_base_$i 90 $b44 $S38_DFLASH --out "$R/json/df_base_$i.json"
  done
  step df_now_phases 60 $DECODE $S38_DFLASH --batch-sizes 1 --host-phases --profile-steps 30 --out "$R/json/df_now_phases.json"
  step df_greedy 60 $DECODE ${S38_DFLASH/--temperature 1.0 --speculative-use-rejection-sampling/} --out "$R/json/df_greedy.json"
}

# `s40c`: the filter's threshold table over chunks and its first search's copy in chunks
#   (`_table_kernel`, `_copy_kernel`): the GPU tests of the sampling kernels and of the samplers
#   that use them, the kernels alone against the session's start (scratch/t/select_ab.py: the
#   base's sampling.py from scratch/base44), then Inkling `bench` plain sampled decode at top-p 0.9
#   and at T = 1 without filters, and MTP K = 3 sampled rounds (T = 1), alternated against the
#   session's start (carry scratch/base44 and scratch/t).
lane0_s40c() {
  export TRITON_CACHE_DIR=/tmp/triton-s40c-$$
  local b44="python scratch/base44/benchmarks/decode_batch.py $C" t1="--temperature 1.0"
  local plain="--model-path $INK --input-len 1024 --output-len 128 --cuda-graph-max-bs 64 --batch-sizes 1,8,64"
  step gpu_tests 240 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 4 tests/kernels/test_sampling_kernels.py \
    tests/engine/test_sampler.py tests/engine/test_spec_sampled.py tests/engine/test_draft_sampling.py
  step select_ab 150 python scratch/t/select_ab.py
  step p09_now 60 $DECODE $plain $t1 --top-p 0.9 --out "$R/json/p09_now.json"
  step p09_base 60 $b44 $plain $t1 --top-p 0.9 --out "$R/json/p09_base.json"
  step t1_now 60 $DECODE $plain $t1 --out "$R/json/t1_now.json"
  step t1_base 60 $b44 $plain $t1 --out "$R/json/t1_base.json"
  step rs_now 60 $DECODE $S38_ARGS $S38_MTP $t1 --speculative-use-rejection-sampling --out "$R/json/rs_now.json"
  step rs_base 60 $b44 $S38_ARGS $S38_MTP $t1 --speculative-use-rejection-sampling --out "$R/json/rs_base.json"
  step p09_now_2 60 $DECODE $plain $t1 --top-p 0.9 --out "$R/json/p09_now_2.json"
  step p09_base_2 60 $b44 $plain $t1 --top-p 0.9 --out "$R/json/p09_base_2.json"
}

# `s40d`: why plain sampled decode at top-p 0.9 did not follow the filter's kernel time at batch 1
#   (1.44 ms, now and at the session's start, against 1.34 at T = 1 without a filter): both with
#   the GPU kernel table (--profile) and the host's phases, at batch 1 (carry scratch/base44).
lane0_s40d() {
  export TRITON_CACHE_DIR=/tmp/triton-s40d-$$
  local b44="python scratch/base44/benchmarks/decode_batch.py $C"
  local a="--model-path $INK --input-len 1024 --output-len 128 --cuda-graph-max-bs 8 --batch-sizes 1 --temperature 1.0"
  local prof="--profile --profile-steps 10 --kernel-rows 30 --host-phases"
  step p09_now_prof 90 $DECODE $a --top-p 0.9 $prof --out "$R/json/p09_now_prof.json"
  step p09_base_prof 90 $b44 $a --top-p 0.9 $prof --out "$R/json/p09_base_prof.json"
  step t1_now_prof 60 $DECODE $a $prof --out "$R/json/t1_now_prof.json"
}

# `s40e`: where a sampled round's ~3 ms of host work goes at batch 1: DFlash and MTP K = 3 rounds
#   (T = 1, rejection sampling) with the host's phases and a cProfile of 10 steady rounds after the
#   GPU profile window (own time per function), and MTP's greedy rounds' phases as the control.
lane0_s40e() {
  export TRITON_CACHE_DIR=/tmp/triton-s40e-$$
  local t1="--temperature 1.0" rs="--speculative-use-rejection-sampling"
  local hp="--batch-sizes 1 --profile --profile-steps 10 --kernel-rows 12 --host-profile --host-rows 45 --host-phases"
  _s38_dflash_config
  step df_host 90 $DECODE $S38_DFLASH $hp --out "$R/json/df_host.json"
  step rs_host 60 $DECODE $S38_ARGS $S38_MTP $t1 $rs $hp --out "$R/json/rs_host.json"
  step greedy_phases 60 $DECODE $S38_ARGS $S38_MTP --batch-sizes 1 --host-phases --profile-steps 20 \
    --out "$R/json/greedy_phases.json"
}

# `s40f`: the block drafter's context store inside the target forward (so inside its CUDA graphs):
#   the GPU tests of the block drafters and graphs, then DFlash K = 3 rounds, sampled (T = 1,
#   rejection sampling) and greedy, at batch 1 and 8, alternated against the session's start
#   (carry scratch/base44), and the new code's host phases at batch 1 (sampled).
lane0_s40f() {
  export TRITON_CACHE_DIR=/tmp/triton-s40f-$$
  local b44="python scratch/base44/benchmarks/decode_batch.py $C"
  local greedy="${S38_DFLASH/--temperature 1.0 --speculative-use-rejection-sampling/}"
  _s38_dflash_config
  step gpu_tests 200 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 4 tests/engine/test_block_rounds_on_device.py \
    tests/engine/test_draft_sampling.py tests/engine/test_block_drafter.py tests/engine/test_cuda_graph.py
  for i in 1 2; do
    step df_now_$i 90 $DECODE $S38_DFLASH --out "$R/json/df_now_$i.json"
    step df_base_$i 60 $b44 $S38_DFLASH --out "$R/json/df_base_$i.json"
  done
  step greedy_now 60 $DECODE $greedy --out "$R/json/greedy_now.json"
  step greedy_base 60 $b44 $greedy --out "$R/json/greedy_base.json"
  step df_now_phases 60 $DECODE $S38_DFLASH --batch-sizes 1 --host-phases --profile-steps 30 --out "$R/json/df_now_phases.json"
}

# `s40g`: the draws in a graph of their own after the pass's: the block drafters' sampled GPU test,
#   then DFlash K = 3 sampled rounds at batch 1 and 8 alternated against the session's start
#   (carry scratch/base44). The session's last device seconds: nothing else.
lane0_s40g() {
  export TRITON_CACHE_DIR=/tmp/triton-s40g-$$
  local b44="python scratch/base44/benchmarks/decode_batch.py $C"
  _s38_dflash_config
  step gpu_tests 60 python -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/engine/test_draft_sampling.py -k block
  for i in 1 2; do
    step df_now_$i 80 $DECODE $S38_DFLASH --out "$R/json/df_now_$i.json"
    step df_base_$i 40 $b44 $S38_DFLASH --out "$R/json/df_base_$i.json"
  done
}
