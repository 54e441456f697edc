# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# twentieth session (2026-12-04): the batch-1 MoE after its trace (docs/benchmarks.md, twenty-fourth
# pass): the gate on one warp with one reduction per top-k round, the down GEMV two slots ahead, the
# up GEMV's per-tile sums (64 registers, 8 programs per SM). Each lane ran on the commit named in
# docs/benchmarks.md (twenty-fifth pass).
# shellcheck shell=bash

# scratch/base20 = `git archive 01e255f kiln benchmarks/*.py benchmarks/kernel_bench benchmarks/configs`
# (the session's start, carried).
BASE20=scratch/base20
P1B="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"

lane0_moe20a() {  # the MoE chain traced per change and at the start; both hybrids at batch 1 against the start; every GPU test
  python -c "import xdist" 2>/dev/null && XDIST="-n 6"
  step trace_new 200 python -m benchmarks.kernel_bench.gemv_trace --layers 24 --chains moe --trigger on \
    --gate-warps 4,1 --down-ahead 1,2 --out "$R/json/trace_new.json"
  step trace_start 90 bash -c "cd $BASE20 && python -m benchmarks.kernel_bench.gemv_trace --layers 24 --chains moe \
    --trigger on --out $R/json/trace_start.json"
  step INK_new 100 $DECODE --model-path $INK $P1B --out "$R/json/INK_new.json"
  step INK_start 100 python $BASE20/benchmarks/decode_batch.py $C --model-path $INK $P1B --out "$R/json/INK_start.json"
  step MM_new 100 $DECODE --model-path $MM $P1B --out "$R/json/MM_new.json"
  step MM_start 100 python $BASE20/benchmarks/decode_batch.py $C --model-path $MM $P1B --out "$R/json/MM_start.json"
  step_table
  step gpu_tests ${T_TESTS:-200} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider ${XDIST:-} --ignore tests/server
}

lane0_moe20b() {  # call 2 (carry scratch/base20, scratch/smol_a): park the GGUF's first half for call 3 (lane drafter19
  # of drafter19.sh); Inkling K = 3 MTP rounds against plain decode at batch 1/8/32; both hybrids at batch 1 against the
  # start again, alternated
  mkdir -p /tmp/smol && cp scratch/smol_a/part1 /tmp/smol/part1 && ls -la /tmp/smol
  local SP="--model-path $INK --input-len 1024 --output-len 64 --cuda-graph-max-bs 32 --batch-sizes 1,8,32"
  step plain_rounds 70 $DECODE $SP --out "$R/json/plain_2.json"
  step mtp3_rounds 90 $DECODE $SP --speculative-algorithm mtp --speculative-num-steps 3 --out "$R/json/mtp3_2.json"
  step INK_start2 60 python $BASE20/benchmarks/decode_batch.py $C --model-path $INK $P1B --out "$R/json/INK_start2.json"
  step INK_new2 60 $DECODE --model-path $INK $P1B --out "$R/json/INK_new2.json"
  step MM_start2 60 python $BASE20/benchmarks/decode_batch.py $C --model-path $MM $P1B --out "$R/json/MM_start2.json"
  step MM_new2 60 $DECODE --model-path $MM $P1B --out "$R/json/MM_new2.json"
  step_table
}
# Calls 3 and 4 of that session (docs/speculative.md, "Again on the GPU, with the padded attention"; their
# logs were lost with the session's machine):
#   BUDGET=550 TRAIN_ARGS="--gen-share 0.3 --reserve-s 130 --b1-prompts 8" PHASE=drafter19   (carry .device_wheels,
#     scratch/smol_b; lane drafter19 of drafter19.sh)
#   python benchmarks/spec_train_gpu.py run --target /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf --work /tmp/w3 \
#     --export $OUT/export --budget-s 480 --synth-share 0.2 --gen-share 0.5 --reserve-s 75 --synthetic-prompts 12000 \
#     --num-steps 2000
