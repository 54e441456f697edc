# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# twenty-ninth session (2026-12-05): the device time left was ~10 minutes, so one call on one H200,
# in order of need (a call cut by its limit still returns its log). spec28c's rows, re-ordered: how
# far prompt lookup's batch-1 round goes with longer drafts (K = 6 / 8 / 12) and with the verify on
# the 8-row GEMV loops; the ngram K = 4 round's GPU busy time (profile); then adaptive27's engine rows.
# shellcheck shell=bash

lane0_spec29a() {
  local ng="--speculative-algorithm ngram --ngram-always-draft" mtp="--speculative-algorithm mtp --speculative-num-steps 3"
  local b1="--model-path $INK $NGRAM26 --batch-sizes 1"
  step ink_plain_b1 25 $DECODE $b1 --out "$R/json/ink_plain_b1.json"
  for k in 6 8 12; do
    step ink_ngram$k 25 $DECODE $b1 $ng --speculative-num-steps $k --out "$R/json/ink_ngram$k.json"
  done
  # a verify of K + 1 rows on the one-tile GEMV loops (8 rows) instead of cuBLAS and the grouped MoE
  for k in 4 7; do
    step ink_ngram${k}_g8m8 25 $DECODE $b1 $ng --speculative-num-steps $k --gemv-max-rows 8 --moe-gemv-max-tokens 8 \
      --out "$R/json/ink_ngram${k}_g8m8.json"
  done
  step ink_ngram4_prof 40 $DECODE $b1 $ng --speculative-num-steps 4 --profile --profile-steps 10 --kernel-rows 8 \
    --out "$R/json/ink_ngram4_prof.json"
  step ad_plain 60 $DECODE $AD27 --out "$R/json/ad_plain.json"
  step ad_mtp3_adaptive 60 $DECODE $AD27 $mtp --speculative-adaptive --out "$R/json/ad_mtp3_adaptive.json"
  step ad_ngram4_adaptive 60 $DECODE $AD27 $ng --speculative-num-steps 4 --speculative-adaptive \
    --out "$R/json/ad_ngram4_adaptive.json"
  step ad_mtp3 60 $DECODE $AD27 $mtp --out "$R/json/ad_mtp3.json"
}

lane0_spec29b() {  # for the next call (refused in the twenty-ninth session: the device time was spent): adaptive
  # MTP's plain steps skip the MTP layers (late catch-up) and run under overlap scheduling. The GPU suite (with
  # test_late_mtp_catch_up_with_graphs_equals_plain), then adaptive MTP K = 3 at batch 1-64 against plain decode
  local mtp="--speculative-algorithm mtp --speculative-num-steps 3"
  step gpu_suite 270 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 6 tests --ignore tests/server
  step ad_mtp3_adaptive 60 $DECODE $AD27 $mtp --speculative-adaptive --out "$R/json/ad_mtp3_adaptive.json"
  step ad_plain 50 $DECODE $AD27 --out "$R/json/ad_plain.json"
  step ad_mtp3_adaptive_phases 40 $DECODE --model-path $INK $NGRAM26 --batch-sizes 1 $mtp --speculative-adaptive \
    --host-phases --out "$R/json/ad_mtp3_adaptive_phases.json"
}
