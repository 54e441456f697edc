# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# fortieth session (2026-12-06).
# `s40a`: where the filter's `_select_kernel` spends its ~77 us on one top-p row (a traced copy,
#   scratch/t/select_trace.py, carried), and why DFlash's batch-1 sampled rounds vary between runs:
#   three runs of the same command with the rounds' median and largest gap (decode_batch.py's
#   round_p50_ms / round_max_ms), the third with the host's phases; MTP rejection-sampling rounds
#   as the control.
# shellcheck shell=bash

lane0_s40a() {
  export TRITON_CACHE_DIR=/tmp/triton-s40a-$$
  local df="$S38_DFLASH --batch-sizes 1"
  _s38_dflash_config
  step select_trace 120 python scratch/t/select_trace.py
  step df_1 90 $DECODE $df --out "$R/json/df_1.json"
  step df_2 60 $DECODE $df --out "$R/json/df_2.json"
  step df_3 60 $DECODE $df --host-phases --profile-steps 30 --out "$R/json/df_3.json"
  step rs 60 $DECODE $S38_ARGS $S38_MTP --batch-sizes 1 --temperature 1.0 --speculative-use-rejection-sampling \
    --out "$R/json/rs.json"
}
