# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# thirty-second session (2026-12-05). `--speculative-verify-ahead` now picks which rounds queue their
# next verify before the read-back: 'auto' (the default) prompt lookup's only, 'always' MTP's and
# block drafters' device rounds too (the thirty-first session's default, measured 5% slower for MTP
# K = 3 at batch 1). One call on one H200: the GPU tests of the verify queued ahead ('always' for
# MTP and block drafters, the default for prompt lookup), then Inkling rounds at batch 1 / 8 / 32
# under each mode against plain decode (MTP K = 3 and prompt lookup K = 4; the batch-1 MTP pair
# again, alternated), prompt lookup K = 8 at batch 1, a GPU profile of a batch-1 MTP round under
# each mode. The verify's input moves became one kernel (`kiln.kernels.verify_moves`) after the
# mode: rows of carry scratch/base32 (`git archive aad2b8f kiln benchmarks/*.py benchmarks/configs`),
# the moves as PyTorch ops, time 'always' MTP and prompt lookup against it at batch 1.
# `spec32b`: the rest of the GPU suite (mode names free: it runs at HEAD).
# spec32a ran at 8bc8210, spec32c at 70c278a and spec32d at 44493de, where the modes were named
# 'auto' (prompt lookup only; the default then), 'always' and 'off'. They are now 'prompt-lookup',
# 'all' (the default since) and 'off': check those commits out to rerun the lanes as they ran.
# shellcheck shell=bash

lane0_spec32a() {
  local mtp="--speculative-algorithm mtp --speculative-num-steps 3" ng="--speculative-algorithm ngram --ngram-always-draft"
  local ink="--model-path $INK $NGRAM26 --batch-sizes 1,8,32" b1="--model-path $INK $NGRAM26 --batch-sizes 1"
  local base="python scratch/base32/benchmarks/decode_batch.py $C"
  step gpu_ahead 150 python -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/engine/test_verify_ahead.py \
    tests/engine/test_block_rounds_on_device.py tests/kernels/test_verify_moves.py
  # batch 1 first (the rows that decide the default, in case the call is cut): the moves as ~15
  # PyTorch ops (base, aad2b8f) against one kernel; MTP with and without the verify queued ahead
  step base_mtp3_always_b1 30 $base $b1 $mtp --speculative-verify-ahead always --out "$R/json/base_mtp3_always_b1.json"
  step ink_mtp3_always_b1 30 $DECODE $b1 $mtp --speculative-verify-ahead always --out "$R/json/ink_mtp3_always_b1.json"
  step ink_mtp3_auto_b1 30 $DECODE $b1 $mtp --out "$R/json/ink_mtp3_auto_b1.json"
  step base_ngram4_auto_b1 30 $base $b1 $ng --speculative-num-steps 4 --out "$R/json/base_ngram4_auto_b1.json"
  step ink_ngram4_auto_b1 30 $DECODE $b1 $ng --speculative-num-steps 4 --out "$R/json/ink_ngram4_auto_b1.json"
  step ink_plain 40 $DECODE $ink --out "$R/json/ink_plain.json"
  step ink_mtp3_auto 45 $DECODE $ink $mtp --out "$R/json/ink_mtp3_auto.json"
  step ink_mtp3_always 45 $DECODE $ink $mtp --speculative-verify-ahead always --out "$R/json/ink_mtp3_always.json"
  step ink_ngram4_auto 45 $DECODE $ink $ng --speculative-num-steps 4 --out "$R/json/ink_ngram4_auto.json"
  step ink_ngram4_off 45 $DECODE $ink $ng --speculative-num-steps 4 --speculative-verify-ahead off \
    --out "$R/json/ink_ngram4_off.json"
  step ink_ngram8_auto 30 $DECODE $b1 $ng --speculative-num-steps 8 --out "$R/json/ink_ngram8_auto.json"
  # where the GPU's time goes in a batch-1 MTP round under each mode
  step ink_mtp3_auto_prof 40 $DECODE $b1 $mtp --profile --profile-steps 8 --kernel-rows 60 \
    --out "$R/json/ink_mtp3_auto_prof.json"
  step ink_mtp3_always_prof 40 $DECODE $b1 $mtp --speculative-verify-ahead always --profile --profile-steps 8 \
    --kernel-rows 60 --out "$R/json/ink_mtp3_always_prof.json"
}

lane0_spec32b() {  # the rest of the GPU suite (~4 minutes on 6 workers in the thirty-first pass)
  step gpu_suite 290 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 6 tests --ignore tests/server \
    --deselect tests/engine/test_verify_ahead.py --deselect tests/engine/test_block_rounds_on_device.py
}

lane0_spec32c() {  # the second call: spec32a's batch-1 MTP rows were cut by the first run's compiles;
  # 'always' (one-kernel moves) against 'auto' for MTP, alternated, DFlash K = 3 under both, the old
  # PyTorch moves (carry scratch/base32) once more, and prompt lookup K = 4 over 256 tokens
  local mtp="--speculative-algorithm mtp --speculative-num-steps 3" ng="--speculative-algorithm ngram --ngram-always-draft"
  local ink="--model-path $INK $NGRAM26 --batch-sizes 1,8,32" b1="--model-path $INK $NGRAM26 --batch-sizes 1"
  local base="python scratch/base32/benchmarks/decode_batch.py $C"
  step warm_compile 120 $DECODE $b1 $mtp --speculative-verify-ahead always --out "$R/json/warm.json"
  for i in 1 2; do
    step ink_mtp3_auto_$i 45 $DECODE $ink $mtp --out "$R/json/ink_mtp3_auto_$i.json"
    step ink_mtp3_always_$i 45 $DECODE $ink $mtp --speculative-verify-ahead always --out "$R/json/ink_mtp3_always_$i.json"
  done
  step base_mtp3_always_b1 60 $base $b1 $mtp --speculative-verify-ahead always --out "$R/json/base_mtp3_always_b1.json"
  dflash_bench_config
  local df="--model-path $INK $NGRAM26 --batch-sizes 1,8 --speculative-algorithm dflash
    --speculative-draft-model-path $R/dflash-bench --speculative-num-steps 3"
  step dflash3_auto 60 $DECODE $df --out "$R/json/dflash3_auto.json"
  step dflash3_always 50 $DECODE $df --speculative-verify-ahead always --out "$R/json/dflash3_always.json"
  local ng256="--model-path $INK --input-len 1024 --output-len 256 --cuda-graph-max-bs 32 --batch-sizes 1"
  step ink_ngram4_auto_256 30 $DECODE $ng256 $ng --speculative-num-steps 4 --out "$R/json/ink_ngram4_auto_256.json"
  step ink_ngram4_off_256 30 $DECODE $ng256 $ng --speculative-num-steps 4 --speculative-verify-ahead off \
    --out "$R/json/ink_ngram4_off_256.json"
  step base_ngram4_auto_256 30 $base $ng256 $ng --speculative-num-steps 4 --out "$R/json/base_ngram4_auto_256.json"
}

lane0_spec32d() {  # the third call: DFlash K = 3 under both modes, alternated, at batch 1 / 8 / 32
  local b1="--model-path $INK $NGRAM26 --batch-sizes 1"
  dflash_bench_config
  local df="--model-path $INK $NGRAM26 --batch-sizes 1,8,32 --speculative-algorithm dflash
    --speculative-draft-model-path $R/dflash-bench --speculative-num-steps 3"
  step warm_compile 120 $DECODE $b1 --speculative-algorithm dflash --speculative-draft-model-path $R/dflash-bench \
    --speculative-num-steps 3 --speculative-verify-ahead always --out "$R/json/warm.json"
  for i in 1 2; do
    step dflash3_auto_$i 50 $DECODE $df --out "$R/json/dflash3_auto_$i.json"
    step dflash3_always_$i 50 $DECODE $df --speculative-verify-ahead always --out "$R/json/dflash3_always_$i.json"
  done
  rm -rf "$R/dflash-bench"
}
