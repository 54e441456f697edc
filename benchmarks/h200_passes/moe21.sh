# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# twenty-first session (2026-12-04): the batch-1 MoE's loads one step ahead (the down GEMV's act,
# routing weight and expert id; the gate/up GEMV's x and the next tile's id) and the gate/up GEMV's
# tiles several per program (UP_PROGRAMS_PER_SM), both removed after call 1; GEMV streams with
# deeper pipelines (call 2); the rounds and SmolLM2's drafter (calls 3-4); offline generation as
# the prefix cache fills, before and after eviction in batches (calls 5-6). Each lane ran on the
# commit named in docs/benchmarks.md (twenty-sixth pass).
# shellcheck shell=bash

# scratch/base21 = `git archive 9459c76 kiln benchmarks/*.py benchmarks/kernel_bench benchmarks/configs`
# (the session's start, carried).
BASE21=scratch/base21
P1B21="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"

variant_tree() {  # variant_tree DIR PER_SM "UP_TILE": a copy of this tree with the gate/up GEMV's constants set
  rm -rf "$1" && mkdir -p "$1" && cp -r kiln benchmarks "$1"/ && rm -rf "$1/benchmarks/results"
  sed -i "s/^UP_PROGRAMS_PER_SM = .*/UP_PROGRAMS_PER_SM = $2/; s/^GEMV_UP_TILE = .*/GEMV_UP_TILE = $3/" \
    "$1/kiln/kernels/moe_gemv.py"
  grep -n "^UP_PROGRAMS_PER_SM\|^GEMV_UP_TILE" "$1/kiln/kernels/moe_gemv.py"
}

lane0_moe21a() {  # the MoE chain traced per variant and at the start; the best variant, the default, one tile per
  # program and the start in the engine at batch 1, alternated; the MoE kernels' GPU tests
  step trace_new 240 python -m benchmarks.kernel_bench.gemv_trace --layers 24 --chains moe --trigger on \
    --up-tiles rule,1x1024,2x1024/w8 --up-per-sm 0,2,3,4,6 --out "$R/json/trace_new.json"
  step trace_start 90 bash -c "cd $BASE21 && python -m benchmarks.kernel_bench.gemv_trace --layers 24 --chains moe \
    --trigger on --out $R/json/trace_start.json"
  # the fastest traced variant as a tree of its own
  local best
  best=$(python - "$R/json/trace_new.json" <<'PY'
import json, sys
r = min(json.load(open(sys.argv[1])), key=lambda v: v["us_per_layer"])
_, tile, per = r["xpipe"]
bn, bk, w = (2, 1024, 4) if tile == "rule" else (int(tile.split("x")[0]), int(tile.split("x")[1].split("/")[0]),
                                                int(tile.split("/w")[1]) if "/w" in tile else 4)
print(per, f"({bn}, {bk}, {w})")
PY
)
  echo "best traced variant: $best"
  variant_tree /tmp/vbest "${best%% *}" "${best#* }"
  variant_tree /tmp/vone 0 "(2, 1024, 4)"
  step INK_new1 70 $DECODE --model-path $INK $P1B21 --out "$R/json/INK_new1.json"
  step INK_best 70 python /tmp/vbest/benchmarks/decode_batch.py $C --model-path $INK $P1B21 --out "$R/json/INK_best.json"
  step INK_one 70 python /tmp/vone/benchmarks/decode_batch.py $C --model-path $INK $P1B21 --out "$R/json/INK_one.json"
  step INK_start1 70 python $BASE21/benchmarks/decode_batch.py $C --model-path $INK $P1B21 --out "$R/json/INK_start1.json"
  step INK_new2 70 $DECODE --model-path $INK $P1B21 --out "$R/json/INK_new2.json"
  step INK_start2 70 python $BASE21/benchmarks/decode_batch.py $C --model-path $INK $P1B21 --out "$R/json/INK_start2.json"
  step MM_new 70 $DECODE --model-path $MM $P1B21 --out "$R/json/MM_new.json"
  step MM_best 70 python /tmp/vbest/benchmarks/decode_batch.py $C --model-path $MM $P1B21 --out "$R/json/MM_best.json"
  step MM_start 70 python $BASE21/benchmarks/decode_batch.py $C --model-path $MM $P1B21 --out "$R/json/MM_start.json"
  step_table
  step moe_tests 150 python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/kernels/test_moe_gemv.py \
    tests/kernels/test_moe_kernels.py
}

lane0_moe21b() {  # call 2: the bytes a GEMV keeps in flight: register loads, Triton's pipelined loads (cp.async) and TMA
  step stream 420 python -m benchmarks.kernel_bench.stream_gemv --layers 24 --shapes o,qkvr,up,8b \
    --out "$R/json/stream.json"
}

lane0_moe21c() {  # call 3 (carry scratch/smol_a): park the GGUF's first half for call 4 (lane drafter19 of drafter19.sh,
  # right after); Inkling K = 3 MTP rounds against plain decode at batch 1/8/32 (the twentieth session's log of them was lost)
  mkdir -p /tmp/smol && cp scratch/smol_a/part1 /tmp/smol/part1 && ls -la /tmp/smol
  local SP="--model-path $INK --input-len 1024 --output-len 64 --cuda-graph-max-bs 32 --batch-sizes 1,8,32"
  step plain_rounds 80 $DECODE $SP --out "$R/json/plain_3.json"
  step mtp3_rounds 100 $DECODE $SP --speculative-algorithm mtp --speculative-num-steps 3 --out "$R/json/mtp3_3.json"
  step_table
}
# call 4: BUDGET=560 T_TRAIN=585 TRAIN_ARGS="--synth-share 0.15 --gen-share 0.45 --reserve-s 125 --synthetic-prompts 12000
#   --num-steps 1500 --b1-prompts 8" PHASE=drafter19 (carry .device_wheels, scratch/smol_b): SmolLM2's MTP drafter with
#   the data stage's new stop rule (benchmarks/spec_train_gpu.py)

lane0_moe21e() {  # call 5 (carry scratch/chunks): does offline generation slow down chunk by chunk (call 4's fourth
  # data chunk took 100 s against 22)? SmolLM2's shape, dummy weights, prefix cache on / off. scratch/chunks/chunks.py
  # was the first form of benchmarks/cache_fill.py (the same engine options and prompts).
  step chunks_on 200 python scratch/chunks/chunks.py on 5
  step chunks_off 160 python scratch/chunks/chunks.py off 4
}

lane0_moe21f() {  # call 6: the same with eviction in batches (kiln/engine/cache/manager.py: EVICT_MIN_SHARE)
  step cache_fill 200 python benchmarks/cache_fill.py --chunks 5 --out "$R/json/cache_fill.json"
}
