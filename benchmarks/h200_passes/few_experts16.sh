# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# sixteenth session (2026-12-03): the MoE's few-token path (`kiln.kernels.moe_few`: each selected
# expert read once, no align or sum launch) for a speculative verify at batch 1 and decode at
# batch 2-8; docs/benchmarks.md, twenty-first pass. `--moe-few-max-tokens 0` is the grouped path
# these runs compare against (the engine before this pass, at these token counts). The path measured
# slower and was removed: few1 and few2 run on commit 70c4010 (call 1 ran a first form never committed,
# so few1 there runs the second form; call 2 ran it with the tiles before its sweep: docs/benchmarks.md);
# few3 runs on any later tree.
# shellcheck shell=bash

ROUND="--model-path $INK --batch-sizes 1 --input-len 1024 --output-len 64 --cuda-graph-max-bs 32 \
--speculative-algorithm mtp --speculative-num-steps 3"

lane0_few1() {  # GPU tests of the MoE paths and the kernel path; the few-token path against the grouped path (and its
  # tiles swept) at 2/4/8 tokens; Inkling K = 3 rounds at batch 1, few / grouped alternated x2; Inkling decode at
  # batch 4 and 8, few / grouped
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-150} python -m pytest -m gpu -q -rfE -p no:cacheprovider ${XDIST:-} tests/kernels/test_moe_few.py \
    tests/kernels/test_moe_gemv.py tests/kernels/test_moe_kernels.py tests/engine/test_kernel_path.py
  step few_kernels ${T_KERN:-200} python -m benchmarks.kernel_bench.moe --few 2 4 8 --few-sweep
  for r in 1 2; do
    local lim=45; [ $r = 1 ] && lim=100
    step INK_round_few_$r $lim $DECODE $ROUND --out "$R/json/INK_round_few_$r.json"
    step INK_round_grouped_$r 45 $DECODE $ROUND --moe-few-max-tokens 0 --out "$R/json/INK_round_grouped_$r.json"
  done
  local P48="--model-path $INK --batch-sizes 4,8 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  step INK_b48_few 50 $DECODE $P48 --out "$R/json/INK_b48_few.json"
  step INK_b48_grouped 50 $DECODE $P48 --moe-few-max-tokens 0 --out "$R/json/INK_b48_grouped.json"
}

lane0_few2() {  # few1 again after the rewrite (tensor-core dots only, the gate/up K loop pipelined, the down walk in
  # splits whose last program sums them), plus MiniMax-M3 decode at batch 4 and 8, few / grouped
  lane0_few1
  local P48="--model-path $MM --batch-sizes 4,8 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  step MM_b48_few 50 $DECODE $P48 --out "$R/json/MM_b48_few.json"
  step MM_b48_grouped 50 $DECODE $P48 --moe-few-max-tokens 0 --out "$R/json/MM_b48_grouped.json"
}

lane0_few3() {  # batch 1 of the three models on the tree after the few-token path's removal (MiniMax-M3 with its LM
  # head on the GEMV, not yet measured), alternated x2 for the hybrids; the 8B against transformers
  local P1="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  for r in 1 2; do
    local lim=45; [ $r = 1 ] && lim=100
    step MM_b1_$r $lim $DECODE --model-path $MM $P1 --out "$R/json/MM_b1_$r.json"
    step INK_b1_$r 45 $DECODE --model-path $INK $P1 --out "$R/json/INK_b1_$r.json"
  done
  step llama8b_latency 150 python benchmarks/latency.py --model-path $LLAMA --dummy-init auto --num-runs 3 \
    --out "$R/json/llama8b_latency.json"
}
