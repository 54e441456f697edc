# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# twenty-fourth session (2026-12-04): the RL trainer's MoE as grouped GEMMs (torch._grouped_mm)
# against the per-expert loop, and the colocated resume split into the weights' copy and the
# pools + CUDA graphs. The loop's two forms are carried as trees: scratch/base23u = `git archive
# 027ba1a kiln benchmarks/*.py benchmarks/kernel_bench benchmarks/configs` (sorted by expert,
# w13[e] indexed per expert) and scratch/base24 = the same of 00045d8 (views from one unbind).
# shellcheck shell=bash

RL_SHAPE24="--model-path preset:inkling/bench --prompts 8 --samples 4 --prompt-len 256 --max-new-tokens 128 --micro-batch 8"
TRAINER24="--dtype bfloat16 --device cuda --dummy-init auto --samples 8 --prompt-len 256 --new-tokens 128 --repeats 3"

lane0_rl24a() {  # call 1 (carry scratch/base23u, scratch/base24): the grouped experts' GPU tests; the trainer's
  # recompute + backward of one micro-batch: sorted loop, unbind loop, grouped; a profile; the GRPO step
  step grouped_tests 90 python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/ops/test_moe_ref.py
  step trainer_sorted 90 python scratch/base23u/benchmarks/trainer_profile.py $TRAINER24
  step trainer_unbind 90 python scratch/base24/benchmarks/trainer_profile.py $TRAINER24
  step trainer_grouped 90 python benchmarks/trainer_profile.py $TRAINER24
  step trainer_grouped_prof 120 python benchmarks/trainer_profile.py $TRAINER24 --profile --rows 30
  step rl_bench 330 python benchmarks/rl_step.py --dtype bfloat16 --device cuda $C $RL_SHAPE24 --steps 3 \
    --lora-rank 16 --release-memory --out "$R/json/rl_bench.json"
}

lane0_rl24b() {  # call 2: every GPU test; the GRPO step with the loop's max_running_requests (32) and the direct
  # full sync; the trainer at 16 and 32 samples a micro-batch; the step with micro-batches of 32
  step gpu_tests 330 python -m pytest -m gpu -q -rfE -p no:cacheprovider -n 6 tests --ignore tests/server
  step rl_bench 200 python benchmarks/rl_step.py --dtype bfloat16 --device cuda $C $RL_SHAPE24 --steps 3 \
    --lora-rank 16 --release-memory --out "$R/json/rl_bench.json"
  step trainer16 60 python benchmarks/trainer_profile.py ${TRAINER24/--samples 8/--samples 16}
  step trainer32 60 python benchmarks/trainer_profile.py ${TRAINER24/--samples 8/--samples 32}
  step rl_mb32 120 python benchmarks/rl_step.py --dtype bfloat16 --device cuda $C ${RL_SHAPE24/--micro-batch 8/--micro-batch 32} \
    --steps 2 --lora-rank 0 --release-memory --out "$R/json/rl_mb32.json"
}

lane0_rl24c() {  # call 3: the GPU tests of this session's paths (skips reported); the GRPO step with the LoRA sync
  # from the trainer's model; the full-weights step in micro-batches of 16
  step gpu_tests 150 python -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/ops/test_moe_ref.py \
    tests/engine/test_memory_release.py tests/engine/test_model_copy.py
  step rl_bench 200 python benchmarks/rl_step.py --dtype bfloat16 --device cuda $C $RL_SHAPE24 --steps 3 \
    --lora-rank 16 --release-memory --out "$R/json/rl_bench.json"
  step rl_mb16 150 python benchmarks/rl_step.py --dtype bfloat16 --device cuda $C ${RL_SHAPE24/--micro-batch 8/--micro-batch 16} \
    --steps 3 --lora-rank 0 --release-memory --out "$R/json/rl_mb16.json"
}

lane0_rl24d() {  # call 4 (carry scratch/base24b = git archive of the rl24c commit): the trainer's sequences batched
  # (padded attention with the relative bias, ShortConv history in two copies) against one launch set per
  # sequence; a profile; the GRPO step at micro-batches of 8 (full, LoRA) and 16 (full)
  step gpu_tests 200 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 4 tests/ops tests/models tests/rl
  step trainer_before 60 python scratch/base24b/benchmarks/trainer_profile.py $TRAINER24
  step trainer_after 60 python benchmarks/trainer_profile.py $TRAINER24
  step trainer_before16 60 python scratch/base24b/benchmarks/trainer_profile.py ${TRAINER24/--samples 8/--samples 16}
  step trainer_after16 60 python benchmarks/trainer_profile.py ${TRAINER24/--samples 8/--samples 16} --profile --rows 25
  step rl_bench 200 python benchmarks/rl_step.py --dtype bfloat16 --device cuda $C $RL_SHAPE24 --steps 3 \
    --lora-rank 16 --release-memory --out "$R/json/rl_bench.json"
  step rl_mb16 120 python benchmarks/rl_step.py --dtype bfloat16 --device cuda $C ${RL_SHAPE24/--micro-batch 8/--micro-batch 16} \
    --steps 3 --lora-rank 0 --release-memory --out "$R/json/rl_mb16.json"
}

lane0_rl24e() {  # call 5 (carry scratch/smol_tok = SmolLM2's tokenizer files): `kiln rl` itself on CUDA (never run
  # there before): the Inkling `small` preset with random weights and a pseudo-random reward
  # (benchmarks/timing_reward.py), full weights and LoRA, micro-batches of 8; then every GPU test.
  # Call 5 ran this without --tokenizer-path (not in the tree yet): init-model found no tokenizer on the host
  kiln_rl_small rl_full rl_lora:--lora-rank,16,--lr,5e-4  # (the helper since the twenty-fifth session; limits were 120/150/150 s)
  step gpu_tests 330 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 6 tests --ignore tests/server
}
