# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# thirty-third session (2026-12-05). Lane `spec32b` (the GPU suite at the thirty-second session's
# end) ran on an H100 and failed 4 tests: a capture invalidated by the garbage collector destroying
# an earlier engine's graphs, MTP's K = 1 drafts refused by the verify-moves kernel, and a count in
# the late catch-up test. `spec33a`: the whole GPU suite after the fixes, nothing deselected (ran:
# 738 passed on an H200). `spec33b` (not run yet): the late MTP catch-up on the chain graph.
# shellcheck shell=bash

lane0_spec33a() {
  step gpu_suite 420 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 6 tests --ignore tests/server
}

lane0_spec33b() {  # the late catch-up on the chain graph (08f0848): its GPU twin, then adaptive MTP (random MTP
  # layers: mostly plain steps) against plain decode, at batch 1 and 8, against the eager catch-up of the session's
  # start (carry scratch/base33 = `git archive a2f28d3 kiln benchmarks/*.py benchmarks/configs`). Long first limits:
  # a cold machine compiles for ~50 s per engine (the thirty-fourth pass's adaptive rows were cut by it).
  local ad="--model-path $INK --input-len 1024 --output-len 256 --cuda-graph-max-bs 8 --batch-sizes 1,8 --warmup on"
  local mtp="--speculative-algorithm mtp --speculative-num-steps 3 --speculative-adaptive"
  step gpu_late 200 python -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/engine/test_cuda_graph.py -k late_mtp
  for i in 1 2; do
    step plain_$i 120 $DECODE $ad --out "$R/json/plain_$i.json"
    step adaptive_$i 150 $DECODE $ad $mtp --out "$R/json/adaptive_$i.json"
    step adaptive_base_$i 150 python scratch/base33/benchmarks/decode_batch.py $C $ad $mtp --out "$R/json/adaptive_base_$i.json"
  done
}
