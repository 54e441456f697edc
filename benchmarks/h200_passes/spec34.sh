# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# thirty-fourth session (2026-12-05). `spec34a`: the rows of `spec33b` without its GPU twin (the
# suite runs it): adaptive MTP (random MTP layers, so mostly plain steps) with the late catch-up on
# the chain graph (08f0848) against plain decode and against the eager catch-up (carry scratch/base33
# = `git archive a2f28d3 kiln benchmarks/*.py benchmarks/configs`), at batch 1 and 8, without
# --max-total-tokens: on an H100 the default KV budget found no room before 513b0f5.
# shellcheck shell=bash

lane0_spec34a() {
  local ad="--model-path $INK --input-len 1024 --output-len 256 --cuda-graph-max-bs 8 --batch-sizes 1,8 --warmup on"
  local mtp="--speculative-algorithm mtp --speculative-num-steps 3 --speculative-adaptive"
  # the first round compiles on a cold machine (~50 s an engine), the second finds the Triton cache warm
  step plain_1 110 $DECODE $ad --out "$R/json/plain_1.json"
  step adaptive_1 140 $DECODE $ad $mtp --out "$R/json/adaptive_1.json"
  step adaptive_base_1 140 python scratch/base33/benchmarks/decode_batch.py $C $ad $mtp --out "$R/json/adaptive_base_1.json"
  step plain_2 60 $DECODE $ad --out "$R/json/plain_2.json"
  step adaptive_2 60 $DECODE $ad $mtp --out "$R/json/adaptive_2.json"
  step adaptive_base_2 60 python scratch/base33/benchmarks/decode_batch.py $C $ad $mtp --out "$R/json/adaptive_base_2.json"
}

lane0_spec34b() {  # which Triton kernels first run inside a measured decode (benchmarks/compile_watch.py), on a cold
  # Triton cache: spec34a's adaptive batch-8 run took 6.19 ms a step where the same engine's earlier run took 4.11
  local ad="--model-path $INK --input-len 1024 --output-len 256 --cuda-graph-max-bs 8 --batch-sizes 1,8 --warmup on"
  local mtp="--speculative-algorithm mtp --speculative-num-steps 3 --speculative-adaptive"
  local cold="env TRITON_CACHE_DIR=/tmp/triton-cold-$$"
  step watch_adaptive 200 $cold python benchmarks/compile_watch.py $C $ad $mtp --out "$R/json/watch_adaptive.json"
  step watch_plain 100 $cold python benchmarks/compile_watch.py $C $ad --out "$R/json/watch_plain.json"
  step watch_minimax 150 $cold python benchmarks/compile_watch.py $C --model-path $MM --input-len 1024 --output-len 128 \
    --cuda-graph-max-bs 8 --batch-sizes 1,8 --warmup on --out "$R/json/watch_minimax.json"
  step adaptive_warm 70 $cold $DECODE $ad $mtp --out "$R/json/adaptive_warm.json"
  step plain_warm 60 $cold $DECODE $ad --out "$R/json/plain_warm.json"
}

lane0_spec34c() {  # the late catch-up graph (one replay of max_lag rows per request instead of K + 1 at a time):
  # the GPU tests it and the do_not_specialize change (f397ff1) touch; adaptive MTP (random MTP layers, mostly
  # plain steps) against plain decode and against the chain-graph catch-up (carry scratch/base34 = `git archive
  # f397ff1 kiln benchmarks/*.py benchmarks/configs`), alternated; the Triton variants first met inside the
  # measured runs (compile_watch, on a cold cache)
  local ad="--model-path $INK --input-len 1024 --output-len 256 --cuda-graph-max-bs 8 --batch-sizes 1,8 --warmup on"
  local mtp="--speculative-algorithm mtp --speculative-num-steps 3 --speculative-adaptive"
  step gpu_tests 150 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 4 tests/engine/test_cuda_graph.py \
    tests/engine/test_verify_ahead.py tests/kernels/test_verify_moves.py tests/kernels/test_attention_kernels.py
  export TRITON_CACHE_DIR=/tmp/triton-cold-$$  # cold for the first run, then shared by the rest
  step watch_adaptive 130 python benchmarks/compile_watch.py $C $ad $mtp --out "$R/json/watch_adaptive.json"
  step plain_1 50 $DECODE $ad --out "$R/json/plain_1.json"
  step adaptive_1 55 $DECODE $ad $mtp --out "$R/json/adaptive_1.json"
  step adaptive_base_1 55 python scratch/base34/benchmarks/decode_batch.py $C $ad $mtp --out "$R/json/adaptive_base_1.json"
  step adaptive_2 45 $DECODE $ad $mtp --out "$R/json/adaptive_2.json"
  step adaptive_base_2 45 python scratch/base34/benchmarks/decode_batch.py $C $ad $mtp --out "$R/json/adaptive_base_2.json"
}

lane0_spec34d() {  # the whole GPU suite at the session's end
  step gpu_suite 450 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 6 tests --ignore tests/server
}

lane0_spec34e() {  # the extend kernel's metadata pointers unspecialised on alignment: its GPU tests, the Triton
  # variants first met inside the measured runs (cold cache), and prefill / decode against f397ff1 (carry
  # scratch/base34), alternated
  local ad="--model-path $INK --input-len 1024 --output-len 256 --cuda-graph-max-bs 8 --batch-sizes 1,8 --warmup on"
  local mtp="--speculative-algorithm mtp --speculative-num-steps 3 --speculative-adaptive"
  step gpu_tests 120 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 4 tests/kernels/test_attention_kernels.py \
    tests/engine/test_cuda_graph.py -k "late or extend or attention"
  export TRITON_CACHE_DIR=/tmp/triton-cold-$$
  step watch_adaptive 130 python benchmarks/compile_watch.py $C $ad $mtp --out "$R/json/watch_adaptive.json"
  for i in 1 2; do
    step plain_$i 50 $DECODE $ad --out "$R/json/plain_$i.json"
    step plain_base_$i 60 python scratch/base34/benchmarks/decode_batch.py $C $ad --out "$R/json/plain_base_$i.json"
  done
}

lane0_spec34f() {  # a speculative engine's decode graphs (q = 1) captured with the early trigger, as plain decode's:
  # adaptive MTP's plain steps against the session's late catch-up graph without it (carry scratch/base35 =
  # `git archive 7ddacff kiln benchmarks/*.py benchmarks/configs`), alternated
  local ad="--model-path $INK --input-len 1024 --output-len 256 --cuda-graph-max-bs 8 --batch-sizes 1,8 --warmup on"
  local mtp="--speculative-algorithm mtp --speculative-num-steps 3 --speculative-adaptive"
  step plain 60 $DECODE $ad --out "$R/json/plain.json"
  for i in 1 2; do
    step adaptive_$i 50 $DECODE $ad $mtp --out "$R/json/adaptive_$i.json"
    step adaptive_base_$i 40 python scratch/base35/benchmarks/decode_batch.py $C $ad $mtp --out "$R/json/adaptive_base_$i.json"
  done
}
