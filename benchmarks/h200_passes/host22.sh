# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# twenty-second session (2026-12-04): the scheduler's host work per running request and step
# (sampling constants computed once per request, one pass over the running requests, the
# admission reserve kept as requests join, a decode row's inputs without the general path, the
# startup heap frozen out of the garbage collector). Each lane compares this tree with the
# session's start, carried as scratch/base22 = `git archive eaba6fb kiln benchmarks/*.py
# benchmarks/kernel_bench benchmarks/configs`.
# shellcheck shell=bash

BASE22=scratch/base22
SMOL=benchmarks/configs/smollm2-135m
SMOL_RUN="--model-path $SMOL --input-len 512 --output-len 256 --cuda-graph-max-bs 512"

lane0_host22a() {  # call 1: SmolLM2's shape at batch 64/256/512, this tree and the start, twice, then batch 512
  # profiled (GPU idle) with the host phases
  step smol_new1 150 $DECODE $SMOL_RUN --batch-sizes 64,256,512 --out "$R/json/smol_new1.json"
  step smol_old1 150 python $BASE22/benchmarks/decode_batch.py $C $SMOL_RUN --batch-sizes 64,256,512 --out "$R/json/smol_old1.json"
  step smol_new2 150 $DECODE $SMOL_RUN --batch-sizes 64,256,512 --out "$R/json/smol_new2.json"
  step smol_old2 150 python $BASE22/benchmarks/decode_batch.py $C $SMOL_RUN --batch-sizes 64,256,512 --out "$R/json/smol_old2.json"
  step_rows
  step smol_new_prof 90 $DECODE $SMOL_RUN --batch-sizes 512 --profile --host-phases --out "$R/json/smolprof_new.json"
  step smol_old_prof 90 python $BASE22/benchmarks/decode_batch.py $C $SMOL_RUN --batch-sizes 512 --profile --host-phases \
    --out "$R/json/smolprof_old.json"
}

lane0_host22b() {  # call 2: nano-vllm's offline workload at the Qwen3-0.6B shape and offline generation at SmolLM2's
  # shape as the prefix cache fills (cache_fill.py), this tree and the start; the engine's GPU tests
  step qwen_new 150 python benchmarks/offline_throughput.py $C --model-path $QWEN --no-hf --num-runs 2 --out "$R/json/qwen_new.json"
  step qwen_old 150 python $BASE22/benchmarks/offline_throughput.py $C --model-path $QWEN --no-hf --num-runs 2 --out "$R/json/qwen_old.json"
  step fill_new 100 python benchmarks/cache_fill.py --chunks 3 --out "$R/json/fill_new.json"
  step fill_old 100 python $BASE22/benchmarks/cache_fill.py --chunks 3 --out "$R/json/fill_old.json"
  step gpu_tests 200 python -m pytest -m gpu -q -rfE -p no:cacheprovider -n 4 tests/engine tests/test_offline.py
}

step_rows() {  # step time, decode tok/s and GPU idle of every row of every decode run of this call
  python - "$R/json" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    d = json.load(open(f))
    if not isinstance(d, dict) or "rows" not in d:
        continue
    for r in d["rows"]:
        print(f"{os.path.basename(f)[:-5]:14s} batch {r.get('batch')!s:>4} step {r.get('step_ms') or float('nan'):7.3f} ms "
              f"decode {r.get('decode_tok_s') or float('nan'):9.0f} tok/s idle {r.get('gpu_idle_frac')}")
PY
}

lane0_host22p() {  # call 2: where batch 512's host time goes now (cProfile over 20 steps); the same steps with
  # the garbage collector off (what collections still cost after the freeze)
  step smol_hprof 90 $DECODE $SMOL_RUN --batch-sizes 512 --profile --host-profile --host-rows 40 --out "$R/json/smol_hprof.json"
  step smol_nogc 90 python -c "import gc, runpy, sys; gc.disable(); sys.argv = ['decode_batch.py'] + sys.argv[1:]; \
runpy.run_path('benchmarks/decode_batch.py', run_name='__main__')" $C $SMOL_RUN --batch-sizes 64,256,512 --out "$R/json/smol_nogc.json"
  step smol_new3 90 $DECODE $SMOL_RUN --batch-sizes 64,256,512 --out "$R/json/smol_new3.json"
  step_rows
  step gpu_tests 240 python -m pytest -m gpu -q -rfE -p no:cacheprovider -n 4 tests/engine tests/test_offline.py
}

lane0_host22c() {  # call 3: with the collector tuned (kiln.engine.gc_tuning) and the decodes' page-table writes
  # batched: SmolLM2's shape this tree / start / this tree with the collector off, alternated; batch 512 profiled;
  # nano-vllm's workload at the Qwen3-0.6B shape, this tree and the start; the engine's GPU tests
  step smol_new1 90 $DECODE $SMOL_RUN --batch-sizes 64,256,512 --out "$R/json/smol_new1.json"
  step smol_old1 90 python $BASE22/benchmarks/decode_batch.py $C $SMOL_RUN --batch-sizes 64,256,512 --out "$R/json/smol_old1.json"
  step smol_nogc 90 python -c "import gc, runpy, sys; gc.disable(); sys.argv = ['decode_batch.py'] + sys.argv[1:]; \
runpy.run_path('benchmarks/decode_batch.py', run_name='__main__')" $C $SMOL_RUN --batch-sizes 64,256,512 --out "$R/json/smol_nogc.json"
  step smol_new2 90 $DECODE $SMOL_RUN --batch-sizes 64,256,512 --out "$R/json/smol_new2.json"
  step smol_old2 90 python $BASE22/benchmarks/decode_batch.py $C $SMOL_RUN --batch-sizes 64,256,512 --out "$R/json/smol_old2.json"
  step_rows
  step smol_prof 60 $DECODE $SMOL_RUN --batch-sizes 512 --profile --host-phases --out "$R/json/smolprof_new.json"
  step qwen_new 120 python benchmarks/offline_throughput.py $C --model-path $QWEN --no-hf --num-runs 2 --out "$R/json/qwen_new.json"
  step qwen_old 120 python $BASE22/benchmarks/offline_throughput.py $C --model-path $QWEN --no-hf --num-runs 2 --out "$R/json/qwen_old.json"
  step gpu_tests 150 python -m pytest -m gpu -q -rfE -p no:cacheprovider -n 4 tests/engine tests/test_offline.py
}

lane0_host22d() {  # call 4: everything of the session (host_tensor through the array module, _commit's count,
  # ReqOutput's pickling, the Rust decoder) against the start: SmolLM2's shape alternated, the collector off once,
  # batch 512's host phases; offline generation as the prefix cache fills (cache_fill.py); nano-vllm's workload
  # at the Qwen3-0.6B shape (the start first, so that this tree does not pay the Triton compiles alone)
  step smol_new1 90 $DECODE $SMOL_RUN --batch-sizes 64,256,512 --out "$R/json/smol_new1.json"
  step smol_old1 90 python $BASE22/benchmarks/decode_batch.py $C $SMOL_RUN --batch-sizes 64,256,512 --out "$R/json/smol_old1.json"
  step smol_new2 90 $DECODE $SMOL_RUN --batch-sizes 64,256,512 --out "$R/json/smol_new2.json"
  step smol_old2 90 python $BASE22/benchmarks/decode_batch.py $C $SMOL_RUN --batch-sizes 64,256,512 --out "$R/json/smol_old2.json"
  step smol_nogc 90 python -c "import gc, runpy, sys; gc.disable(); sys.argv = ['decode_batch.py'] + sys.argv[1:]; \
runpy.run_path('benchmarks/decode_batch.py', run_name='__main__')" $C $SMOL_RUN --batch-sizes 64,256,512 --out "$R/json/smol_nogc.json"
  step_rows
  step smol_prof 60 $DECODE $SMOL_RUN --batch-sizes 512 --profile --host-phases --out "$R/json/smolprof_new.json"
  step fill_new 100 python benchmarks/cache_fill.py --chunks 3 --out "$R/json/fill_new.json"
  step fill_old 100 python $BASE22/benchmarks/cache_fill.py --chunks 3 --out "$R/json/fill_old.json"
  step qwen_old 100 python $BASE22/benchmarks/offline_throughput.py $C --model-path $QWEN --no-hf --num-runs 2 --out "$R/json/qwen_old.json"
  step qwen_new 100 python benchmarks/offline_throughput.py $C --model-path $QWEN --no-hf --num-runs 2 --out "$R/json/qwen_new.json"
}

lane0_host22e() {  # call 6 (carry scratch/smol_tok: SmolLM2's tokenizer files, and scratch/base22 with this
  # cache_fill.py copied in): offline generation with the outputs detokenized, as an RL rollout gets them
  step text_new 100 python benchmarks/cache_fill.py --chunks 2 --tokenizer-path scratch/smol_tok --out "$R/json/text_new.json"
  step text_old 100 python $BASE22/benchmarks/cache_fill.py --chunks 2 --tokenizer-path scratch/smol_tok --out "$R/json/text_old.json"
}
