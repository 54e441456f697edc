#!/usr/bin/env bash
# One GRPO step's parts on one H200 (benchmarks/rl_step.py): Inkling bench (5.76 B params, dummy
# weights drawn on the GPU, no tokenizer), engine bf16, trainer bf16 + AdamW, 8 prompts x 4
# samples, prompt 256, 128 new tokens, 2 steps per phase (the first warm-up), recompute in micro-batches of 8 samples (full weights, then LoRA rank 16),
# the engine's memory released around training (--release-memory).
# Bounded by BUDGET seconds (default 480). If the bench preset does not fit or runs out of time,
# the script falls back to preset:inkling/small with the time left.
#
#   bash benchmarks/run_h200_rl.sh          # results in $OUT or benchmarks/results/h200-rl-<time>/
#   BUDGET=900 STEPS=5 bash benchmarks/run_h200_rl.sh
#   COMMON="--device cpu --threads 1" MODEL=preset:inkling/tiny SHAPE="--prompts 2 --samples 2 --prompt-len 16 --max-new-tokens 8" bash benchmarks/run_h200_rl.sh   # CPU dry run
set -u
cd "$(dirname "$0")/.."
BUDGET=${BUDGET:-480}
. benchmarks/_run_bounded.sh
STEPS=${STEPS:-2}
MICRO=${MICRO:-8}  # samples per recompute + backward: the whole batch of 32 OOMs on bench
MODEL=${MODEL:-preset:inkling/bench}
results_dir h200-rl

gpu_line
$PY -c "import torch, sys; print('# torch', torch.__version__, 'python', sys.version.split()[0])"

SHAPE=${SHAPE:-"--prompts 8 --samples 4 --prompt-len 256 --max-new-tokens 128"}
RELEASE=${RELEASE---release-memory}  # as the colocated loop on CUDA; RELEASE= keeps the engine resident
RL_ARGS="$COMMON $SHAPE --steps $STEPS --micro-batch $MICRO --lora-rank 16 $RELEASE"
run rl_step_bench 120 benchmarks/rl_step.py --model-path "$MODEL" $RL_ARGS
if ! grep -q "^lora " "$TABLES"; then
  echo "## bench preset did not finish: falling back to preset:inkling/small" | tee -a "$TABLES"
  run rl_step_small 60 benchmarks/rl_step.py --model-path preset:inkling/small $RL_ARGS
fi

finish
