# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# twenty-fifth session (2026-12-04): the resume's recapture without warm-ups, and `kiln rl` itself on
# CUDA. The start's tree is carried as scratch/base25 = `git archive 1c5837d kiln benchmarks/*.py
# benchmarks/kernel_bench benchmarks/configs`.
# shellcheck shell=bash

RL_SHAPE25="--dtype bfloat16 --device cuda --dummy-init auto --model-path preset:inkling/bench --prompts 8 --samples 4 \
  --prompt-len 256 --max-new-tokens 128 --micro-batch 16 --steps 3 --lora-rank 0 --release-memory"

lane0_rl25a() {  # call 1 (carry scratch/base25, scratch/smol_tok = SmolLM2's tokenizer files): the GRPO step's resume,
  # recapture with and without warm-ups (this tree against the start); then `kiln rl` on CUDA (never run there
  # before): the Inkling `small` preset with random weights and a pseudo-random reward (benchmarks/timing_reward.py),
  # full weights and LoRA, micro-batches of 8
  step rl_new 120 python benchmarks/rl_step.py $RL_SHAPE25 --out "$R/json/rl_new.json"
  step rl_base 120 python scratch/base25/benchmarks/rl_step.py $RL_SHAPE25 --out "$R/json/rl_base.json"
  kiln_rl_small rl_full rl_lora:--lora-rank,16,--lr,5e-4  # (run as these commands, inline, before the helper existed)
}

lane0_rl25b() {  # call 2 (carry scratch/smol_tok): the GRPO step with the bf16 trainer's fp32 master weights (kiln rl's
  # default now) at micro-batches of 8, full and LoRA, against bf16 weights without masters; `kiln rl` on CUDA
  # again, whose trainer now takes the engine's bf16 (call 1: fp32 trainer against a bf16 engine)
  local shape=${RL_SHAPE25/--micro-batch 16/--micro-batch 8}
  step rl_masters 200 python benchmarks/rl_step.py ${shape/--lora-rank 0/--lora-rank 16} --out "$R/json/rl_masters.json"
  step rl_nomaster 120 python benchmarks/rl_step.py $shape --no-master-weights --out "$R/json/rl_nomaster.json"
  kiln_rl_small rl_full
}
