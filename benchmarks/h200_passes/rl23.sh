# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# twenty-third session (2026-12-04): the colocated engine's memory release on CUDA (never run on a
# GPU before), the GRPO step's parts on the fast engine (docs/rl.md's H200 table was measured on
# the reference path), and the detokenizer's per-token work (text kept in chunks). The detokenizer
# lane compares this tree with the session's start, carried as scratch/base23 = `git archive
# b2ba361 kiln benchmarks/*.py benchmarks/kernel_bench benchmarks/configs`.
# shellcheck shell=bash

BASE23=scratch/base23
RL_SHAPE="--model-path preset:inkling/bench --prompts 8 --samples 4 --prompt-len 256 --max-new-tokens 128 --micro-batch 8"

lane0_rl23a() {  # call 1: release / resume on CUDA (GPU tests), then one GRPO step's parts on Inkling bench
  # with the engine's memory released around training, full weights then LoRA rank 16
  step release_tests 150 python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/engine/test_memory_release.py
  step rl_bench 420 python benchmarks/rl_step.py --dtype bfloat16 --device cuda $C $RL_SHAPE --steps 3 --lora-rank 16 \
    --release-memory --out "$R/json/rl_bench.json"
}

lane0_rl23b() {  # call 2 (carry scratch/smol_tok: SmolLM2's tokenizer files, and scratch/base23): offline generation
  # with the outputs detokenized, this tree and the start, alternated; then every GPU test
  step text_new1 100 python benchmarks/cache_fill.py --chunks 2 --tokenizer-path scratch/smol_tok --out "$R/json/text_new1.json"
  step text_old1 100 python $BASE23/benchmarks/cache_fill.py --chunks 2 --tokenizer-path scratch/smol_tok --out "$R/json/text_old1.json"
  step gpu_tests 330 python -m pytest -m gpu -q -rfE -p no:cacheprovider -n 6 tests --ignore tests/server
}

lane0_rl23c() {  # call 2: the GPU tests of the routing and release changes; Inkling bench decode at batch 64 with
  # routing capture on: this tree (asynchronous copy) against the start (a blocking copy per forward), and off
  step gpu_tests 150 python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/engine/test_memory_release.py \
    tests/engine/test_host_sync.py tests/engine/test_overlap.py
  local run="--model-path $INK --batch-sizes 64 --input-len 1024 --output-len 128 --cuda-graph-max-bs 64"
  step routed_new 110 $DECODE $run --enable-return-routed-experts --out "$R/json/routed_new.json"
  step routed_old 110 python $BASE23/benchmarks/decode_batch.py $C $run --enable-return-routed-experts --out "$R/json/routed_old.json"
  step plain_new 110 $DECODE $run --out "$R/json/plain_new.json"
  step_rows
}

lane0_rl23d() {  # call 3: the routing test again (its sync at a request's end removed), then one GRPO step's parts
  # on Inkling bench with the engine's memory released around training, full weights then LoRA rank 16
  step routing_test 120 python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/engine/test_host_sync.py -k routing
  step rl_bench 450 python benchmarks/rl_step.py --dtype bfloat16 --device cuda $C $RL_SHAPE --steps 3 --lora-rank 16 \
    --release-memory --out "$R/json/rl_bench.json"
}

lane0_rl23e() {  # call 4 (carry scratch/smol_tok and scratch/base23): weights released to pinned host memory: the
  # release tests, then the GRPO step's full-weights phase with release; offline generation with text, this tree
  # and the start (the detokenizer's text kept in chunks)
  step release_tests 100 python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/engine/test_memory_release.py
  step rl_bench 200 python benchmarks/rl_step.py --dtype bfloat16 --device cuda $C $RL_SHAPE --steps 3 --lora-rank 0 \
    --release-memory --out "$R/json/rl_pinned.json"
  step text_new1 90 python benchmarks/cache_fill.py --chunks 2 --tokenizer-path scratch/smol_tok --out "$R/json/text_new1.json"
  step text_old1 90 python $BASE23/benchmarks/cache_fill.py --chunks 2 --tokenizer-path scratch/smol_tok --out "$R/json/text_old1.json"
}

lane0_rl23f() {  # call 5 (carry scratch/smol_tok and scratch/base23): offline generation with text alternated, the
  # start first (call 4 ran this tree first, on a fresh machine), then every GPU test
  step text_old2 80 python $BASE23/benchmarks/cache_fill.py --chunks 2 --tokenizer-path scratch/smol_tok --out "$R/json/text_old2.json"
  step text_new2 80 python benchmarks/cache_fill.py --chunks 2 --tokenizer-path scratch/smol_tok --out "$R/json/text_new2.json"
  step text_old3 80 python $BASE23/benchmarks/cache_fill.py --chunks 2 --tokenizer-path scratch/smol_tok --out "$R/json/text_old3.json"
  step text_new3 80 python benchmarks/cache_fill.py --chunks 2 --tokenizer-path scratch/smol_tok --out "$R/json/text_new3.json"
  step gpu_tests 300 python -m pytest -m gpu -q -rfE -p no:cacheprovider -n 6 tests --ignore tests/server
}

lane0_rl23g() {  # call 6 (carry scratch/base23): the trainer's recompute and backward on one micro-batch of 8 samples
  # (Inkling bench, routing replay): the experts loop sorted by expert against the start's scatter per expert; a profile
  local args="--dtype bfloat16 --device cuda $C --samples 8 --prompt-len 256 --new-tokens 128 --repeats 3"
  step trainer_old 100 python $BASE23/benchmarks/trainer_profile.py $args
  step trainer_new 140 python benchmarks/trainer_profile.py $args --profile --rows 30
}
