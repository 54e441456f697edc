# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# thirtieth session (2026-12-05; no device was lent, so none of this has run yet). Speculative rounds
# now queue the next round's verify before the host commits (`kiln/engine/spec/verify_ahead.py`, on by
# default on CUDA; `--disable-overlap-schedule` turns it off): MTP rounds right behind the chain pass,
# prompt lookup's between the read-back and the commit. One call on one H200: the GPU tests of the
# paths it touches first, then rounds with and without it against plain decode (MTP K = 3 at batch
# 1 / 8 / 32; prompt lookup K = 4 and 8 at batch 1), the host phases of a batch-1 MTP round, then the
# rest of the GPU suite (a step cut by its limit still leaves its log). The thirty-first session added
# the GPU test of block drafters on the device round to the first step.
# shellcheck shell=bash

lane0_spec30a() {
  local mtp="--speculative-algorithm mtp --speculative-num-steps 3" ng="--speculative-algorithm ngram --ngram-always-draft"
  local ink="--model-path $INK $NGRAM26 --batch-sizes 1,8,32" b1="--model-path $INK $NGRAM26 --batch-sizes 1"
  step gpu_ahead 170 python -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/engine/test_verify_ahead.py \
    tests/engine/test_verify_ahead_events.py tests/engine/test_block_rounds_on_device.py tests/engine/test_cuda_graph.py \
    tests/engine/test_host_sync.py
  step ink_plain 40 $DECODE $ink --out "$R/json/ink_plain.json"
  step ink_mtp3_ahead 45 $DECODE $ink $mtp --out "$R/json/ink_mtp3_ahead.json"
  step ink_mtp3_host 45 $DECODE $ink $mtp --disable-overlap-schedule --out "$R/json/ink_mtp3_host.json"
  step ink_ngram4_ahead 30 $DECODE $b1 $ng --speculative-num-steps 4 --out "$R/json/ink_ngram4_ahead.json"
  step ink_ngram4_host 30 $DECODE $b1 $ng --speculative-num-steps 4 --disable-overlap-schedule \
    --out "$R/json/ink_ngram4_host.json"
  step ink_ngram8_ahead 30 $DECODE $b1 $ng --speculative-num-steps 8 --out "$R/json/ink_ngram8_ahead.json"
  step ink_mtp3_ahead_phases 30 $DECODE $b1 $mtp --host-phases --out "$R/json/ink_mtp3_ahead_phases.json"
  step gpu_suite 160 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 6 tests --ignore tests/server \
    --deselect tests/engine/test_verify_ahead.py --deselect tests/engine/test_verify_ahead_events.py \
    --deselect tests/engine/test_block_rounds_on_device.py --deselect tests/engine/test_cuda_graph.py
}
