# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# thirtieth session (2026-12-05; no device was lent, so none of this has run yet). A steady MTP round
# now queues the next round's verify before reading its samples back (`kiln/engine/spec/verify_ahead.py`,
# on by default on CUDA; `--disable-overlap-schedule` turns it off). One call on one H200: the GPU tests
# of the paths it touches first, then K = 3 rounds with and without it alternated against plain decode
# at batch 1 / 8 / 32, the host phases of a batch-1 round, then the rest of the GPU suite.
# shellcheck shell=bash

lane0_spec30a() {
  local mtp="--speculative-algorithm mtp --speculative-num-steps 3"
  local ink="--model-path $INK $NGRAM26 --batch-sizes 1,8,32"
  step gpu_ahead 150 python -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/engine/test_verify_ahead.py \
    tests/engine/test_cuda_graph.py tests/engine/test_host_sync.py
  step ink_plain 40 $DECODE $ink --out "$R/json/ink_plain.json"
  for i in 1 2; do
    step ink_mtp3_ahead$i 45 $DECODE $ink $mtp --out "$R/json/ink_mtp3_ahead$i.json"
    step ink_mtp3_host$i 45 $DECODE $ink $mtp --disable-overlap-schedule --out "$R/json/ink_mtp3_host$i.json"
  done
  step ink_mtp3_ahead_phases 30 $DECODE --model-path $INK $NGRAM26 --batch-sizes 1 $mtp --host-phases \
    --out "$R/json/ink_mtp3_ahead_phases.json"
  step gpu_suite 200 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 6 tests --ignore tests/server \
    --deselect tests/engine/test_verify_ahead.py --deselect tests/engine/test_cuda_graph.py
}
