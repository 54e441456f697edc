# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# twenty-eighth session (2026-12-05): the GPU passes the twenty-sixth and twenty-seventh sessions
# prepared without a device (ngram26*, adaptive27*), merged into few calls on one H200, plus the
# whole gpu-marked suite (last run at b2dc0dc) and the host phases of an ngram round at batch 1.
# shellcheck shell=bash

lane0_spec28a() {  # call 1: the gpu-marked suite; ngram26 (Inkling bench at batch 1/8/32: plain, ngram K = 3 / 4,
  # MTP K = 3); the host phases of an ngram K = 4 round at batch 1
  step gpu_suite 270 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 6 tests --ignore tests/server
  lane0_ngram26
  step ink_ngram4_phases 60 $DECODE --model-path $INK $NGRAM26 --batch-sizes 1 --speculative-algorithm ngram \
    --ngram-always-draft --speculative-num-steps 4 --host-phases --out "$R/json/ink_ngram4_phases.json"
}

lane0_spec28b() {  # call 2: ngram26b (batch 1: Inkling ngram K = 8, K = 4 on 8-row GEMV loops; the 8B) and
  # adaptive27's engine rows (Inkling bench at batch 1/8/32/64: plain, MTP K = 3 fixed and adaptive)
  lane0_ngram26b
  local mtp="--speculative-algorithm mtp --speculative-num-steps 3"
  step ink_plain64 100 $DECODE $AD27 --out "$R/json/ink_plain64.json"
  step ink_mtp3 140 $DECODE $AD27 $mtp --out "$R/json/ink_mtp3_64.json"
  step ink_mtp3_adaptive 140 $DECODE $AD27 $mtp --speculative-adaptive --out "$R/json/ink_mtp3_adaptive.json"
}

lane0_spec28c() {  # call 2 (replaces spec28b: failed starts and the device's start took most of the budget), in
  # order of need, since a call cut by the budget still returns its log: plain and ngram K = 8 at batch 1;
  # adaptive27's rows (plain, adaptive MTP K = 3, adaptive ngram K = 4 at batch 1-64; the fixed rounds are call 1's);
  # an ngram K = 4 round profiled (the GPU's busy time); fixed MTP K = 3 at 1-64; ngram K = 4 on the 8-row GEMV loops
  local ng="--speculative-algorithm ngram --ngram-always-draft" mtp="--speculative-algorithm mtp --speculative-num-steps 3"
  step ink_plain_b1 60 $DECODE --model-path $INK $NGRAM26 --batch-sizes 1 --out "$R/json/ink_plain_b1.json"
  step ink_ngram8 60 $DECODE --model-path $INK $NGRAM26 --batch-sizes 1 $ng --speculative-num-steps 8 \
    --out "$R/json/ink_ngram8.json"
  step ad_plain 80 $DECODE $AD27 --out "$R/json/ad_plain.json"
  step ad_mtp3_adaptive 80 $DECODE $AD27 $mtp --speculative-adaptive --out "$R/json/ad_mtp3_adaptive.json"
  step ad_ngram4_adaptive 70 $DECODE $AD27 $ng --speculative-num-steps 4 --speculative-adaptive \
    --out "$R/json/ad_ngram4_adaptive.json"
  step ink_ngram4_prof 60 $DECODE --model-path $INK $NGRAM26 --batch-sizes 1 $ng --speculative-num-steps 4 \
    --profile --profile-steps 10 --kernel-rows 8 --out "$R/json/ink_ngram4_prof.json"
  step ad_mtp3 80 $DECODE $AD27 $mtp --out "$R/json/ad_mtp3.json"
  step ink_ngram4_g8m8 60 $DECODE --model-path $INK $NGRAM26 --batch-sizes 1 $ng --speculative-num-steps 4 \
    --gemv-max-rows 8 --moe-gemv-max-tokens 8 --out "$R/json/ink_ngram4_g8m8.json"
}
