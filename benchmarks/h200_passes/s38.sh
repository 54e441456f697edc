# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# thirty-eighth session (2026-12-06).
# `s38`: sampled drafts inside the MTP chain graph (kiln/engine/spec/draft_sampling.py), so that
#   rounds of sampled requests under exact verification run on the device like greedy ones. First
#   the GPU tests (the new ones, the chain graph's and exact verification's, and the GPU twin of
#   Inkling's prologue inside the attention, unrun since the thirty-sixth session); then Inkling
#   `bench` MTP K = 3 rounds at 1K context, batch 1 and 8: greedy, sampled at temperature 1 with
#   rejection sampling (now, and before: carry scratch/base39 = `git archive 392a08e kiln
#   benchmarks/configs` plus this commit's benchmarks/*.py, whose decode_batch.py has
#   --temperature), with block verification, and plain sampled decode.
# shellcheck shell=bash

S38_ARGS="--model-path $INK --input-len 1024 --output-len 128 --cuda-graph-max-bs 8 --batch-sizes 1,8 --warmup on"
S38_MTP="--speculative-algorithm mtp --speculative-num-steps 3"
# DFlash K = 3 sampled rounds with a dummy one-layer drafter (the config of lane `experts`)
S38_DFLASH="--model-path $INK --batch-sizes 1,8 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8 --warmup on
  --speculative-algorithm dflash --speculative-draft-model-path $R/dflash-bench --speculative-num-steps 3
  --temperature 1.0 --speculative-use-rejection-sampling"

_s38_dflash_config() {
  mkdir -p "$R/dflash-bench"
  echo '{"model_type": "dflash", "num_layers": 1, "block_size": 8, "mask_token_id": 49215, "hidden_size": 2048,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
    "target_layer_ids": [1, 12, 22]}' > "$R/dflash-bench/config.json"
}

lane0_s38() {
  export TRITON_CACHE_DIR=/tmp/triton-s38-$$
  local b39="python scratch/base39/benchmarks/decode_batch.py $C" t1="--temperature 1.0"
  step gpu_tests 200 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 6 tests/engine/test_draft_sampling.py \
    tests/engine/test_spec_sampled.py tests/engine/test_cuda_graph.py tests/kernels/test_attention_prologue.py \
    "tests/engine/test_kernel_path.py::test_prologue_in_attention_on_cuda_equals_prologue_kernel"
  step greedy 120 $DECODE $S38_ARGS $S38_MTP --out "$R/json/greedy.json"
  step rs_now 120 $DECODE $S38_ARGS $S38_MTP $t1 --speculative-use-rejection-sampling --out "$R/json/rs_now.json"
  step rs_base 120 $b39 $S38_ARGS $S38_MTP $t1 --speculative-use-rejection-sampling --out "$R/json/rs_base.json"
  step bv_now 120 $DECODE $S38_ARGS $S38_MTP $t1 --speculative-use-block-verification --out "$R/json/bv_now.json"
  step plain_t1 90 $DECODE $S38_ARGS $t1 --out "$R/json/plain_t1.json"
  step rs_now_2 100 $DECODE $S38_ARGS $S38_MTP $t1 --speculative-use-rejection-sampling --out "$R/json/rs_now_2.json"
}

# `s38s`: the least of s38 (little device time left): the new GPU tests and the sampled rounds now
# against before at batch 1 and 8.
lane0_s38s() {
  export TRITON_CACHE_DIR=/tmp/triton-s38-$$
  step gpu_tests 150 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 4 tests/engine/test_draft_sampling.py
  step rs_now 120 $DECODE $S38_ARGS $S38_MTP --temperature 1.0 --speculative-use-rejection-sampling \
    --out "$R/json/rs_now.json"
  step rs_base 120 python scratch/base39/benchmarks/decode_batch.py $C $S38_ARGS $S38_MTP --temperature 1.0 \
    --speculative-use-rejection-sampling --out "$R/json/rs_base.json"
}

# `s38b`: the seeded noise in one launch (kiln/kernels/seeded_noise.py) against af3e09b (carry
# scratch/base40 = `git archive af3e09b kiln benchmarks/configs` plus benchmarks/*.py): its GPU
# tests, the sampled MTP rounds again (the chain graph draws K times per round), and plain sampled
# decode at batch 1 / 8 / 64 (every request seeded), with greedy decode beside it.
lane0_s38b() {
  export TRITON_CACHE_DIR=/tmp/triton-s38-$$
  local b40="python scratch/base40/benchmarks/decode_batch.py $C" t1="--temperature 1.0"
  local rs="--speculative-use-rejection-sampling"
  local plain="--model-path $INK --input-len 1024 --output-len 128 --cuda-graph-max-bs 64 --batch-sizes 1,8,64"
  step gpu_tests 150 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 6 tests/kernels/test_seeded_noise_kernel.py \
    tests/engine/test_draft_sampling.py tests/engine/test_sampler.py tests/engine/test_seeded_noise.py
  for i in 1 2; do
    step rs_now_$i 120 $DECODE $S38_ARGS $S38_MTP $t1 $rs --out "$R/json/rs_now_$i.json"
    step rs_base40_$i 120 $b40 $S38_ARGS $S38_MTP $t1 $rs --out "$R/json/rs_base40_$i.json"
  done
  step plain_now 120 $DECODE $plain $t1 --out "$R/json/plain_now.json"
  step plain_base40 120 $b40 $plain $t1 --out "$R/json/plain_base40.json"
  step plain_greedy 120 $DECODE $plain --out "$R/json/plain_greedy.json"
}

# `s38c`: the block drafters' sampled drafts drawn on the device in their device round
# (BlockDraftRunner._draw_on_device) against the commit before (carry scratch/base41 = `git archive
# 29bb87a kiln benchmarks/configs` plus benchmarks/*.py): the GPU tests of sampled drafts and of the block
# rounds; DFlash K = 3 rounds (a dummy one-layer drafter, as lane `experts`) at temperature 1 with
# rejection sampling at batch 1 / 8; and the sampled plain decode's first batch-64 step, twice in one
# process (the ~6 s wait of lane s38b: once, or every time?).
lane0_s38c() {
  export TRITON_CACHE_DIR=/tmp/triton-s38-$$
  local df="$S38_DFLASH"
  _s38_dflash_config
  step gpu_tests 200 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 6 tests/engine/test_draft_sampling.py \
    tests/engine/test_block_rounds_on_device.py tests/engine/test_block_drafter.py
  for i in 1 2; do
    step df_now_$i 120 $DECODE $df --out "$R/json/df_now_$i.json"
    step df_base41_$i 120 python scratch/base41/benchmarks/decode_batch.py $C $df --out "$R/json/df_base41_$i.json"
  done
  step plain64 120 $DECODE --model-path $INK --input-len 1024 --output-len 64 --cuda-graph-max-bs 64 \
    --batch-sizes 64,64 --temperature 1.0 --out "$R/json/plain64.json"
}

# `s38d`: which Triton variant the first sampled batch-64 step compiles (lane s38c: ~6.4 s once per
# Triton cache): benchmarks/compile_watch.py on an empty cache, sampled then greedy.
lane0_s38d() {
  export TRITON_CACHE_DIR=/tmp/triton-s38d-$$
  local a="--dummy-init auto --model-path $INK --input-len 1024 --output-len 32 --cuda-graph-max-bs 64 --batch-sizes 64,64"
  step watch_sampled 200 python benchmarks/compile_watch.py $a --temperature 1.0
  step watch_greedy 120 python benchmarks/compile_watch.py $a
}

# `s38e`: the selection kernel unspecialised on its parameter pointers' alignment (lane s38d found
# three variants of it, ~2.3 s each, at the first sampled batch of 64): its GPU test, and
# compile_watch on an empty cache again.
lane0_s38e() {
  export TRITON_CACHE_DIR=/tmp/triton-s38e-$$
  local a="--dummy-init auto --model-path $INK --input-len 1024 --output-len 32 --cuda-graph-max-bs 64 --batch-sizes 64,64"
  step gpu_tests 120 python -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/kernels/test_sampling_kernels.py
  step watch_sampled 200 python benchmarks/compile_watch.py $a --temperature 1.0
}

# `s38f`: after the selection kernel's fix, the sampled device rounds on an empty Triton cache: DFlash
# (its first run compiled inside the measurement in s38c) three times, MTP once.
lane0_s38f() {
  export TRITON_CACHE_DIR=/tmp/triton-s38f-$$
  local df="$S38_DFLASH"
  _s38_dflash_config
  for i in 1 2 3; do
    step df_now_$i 120 $DECODE $df --out "$R/json/df_now_$i.json"
  done
  step rs_now 120 $DECODE $S38_ARGS $S38_MTP --temperature 1.0 --speculative-use-rejection-sampling \
    --out "$R/json/rs_now.json"
}
