# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# forty-sixth session (2026-12-06).
# shellcheck shell=bash

# `s46a` (s45c with the whole budget: the forty-fifth session's unrun commits afe165b and c43d215):
#   their GPU tests, then plain decode of Inkling at batch 1 and 8 alternated with 68f8378 (carry
#   scratch/b_68f8378: before the attention scale in one launch and the LM head's fp32 logits
#   straight from the GEMV), and MTP K = 3 rounds, greedy alternated and sampled once each, against
#   9391fcc (carry scratch/b_9391fcc: before the draft heads of one row on the GEMV, their fp32
#   output, and a greedy round's committed counts in one launch).
lane0_s46a() {
  export TRITON_CACHE_DIR=/tmp/triton-s46a-$$
  local b68="python scratch/b_68f8378/benchmarks/decode_batch.py $C" b93="python scratch/b_9391fcc/benchmarks/decode_batch.py $C"
  local rs="--temperature 1.0 --speculative-use-rejection-sampling"
  step gpu_tests 120 python -m pytest -m gpu -rfEs -p no:cacheprovider -n 8 tests/kernels/test_gemv.py \
    tests/kernels/test_greedy_accept.py tests/kernels/test_attn_scale.py tests/engine/test_kernel_path.py \
    tests/engine/test_cuda_graph.py tests/engine/test_spec_sampled.py tests/engine/test_draft_vocab.py \
    tests/engine/test_spec_kernel_path.py tests/kernels/test_mtp_layer_io.py
  alternated plain "$b68" $S38_ARGS
  alternated mtp "$b93" $S38_ARGS $S38_MTP
  step mtp_rs_now 45 $DECODE $S38_ARGS $S38_MTP $rs --out "$R/json/mtp_rs_now.json"
  step mtp_rs_base 45 $b93 $S38_ARGS $S38_MTP $rs --out "$R/json/mtp_rs_base.json"
}
