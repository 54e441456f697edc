# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# forty-fifth session (2026-12-06).
# shellcheck shell=bash

# `s45a` (after s44d: three GPU tests failed, two of them a test's own layout at batch 1 and one a
#   call count that now included the start-up warm-up's; the compile log still met the sampler's
#   selection without filters and the seeded uniforms after startup): every gpu-marked test, then
#   which kernels compile during sampled MTP rounds at batch 1 and 8 with the warm-up's first
#   request now seeded, at temperature 1 and without filters.
lane0_s45a() {
  export TRITON_CACHE_DIR=/tmp/triton-s45a-$$
  local rs="--temperature 1.0 --speculative-use-rejection-sampling"
  step gpu_tests 330 python -m pytest -m gpu -rfEs -p no:cacheprovider -n 8 tests
  step compiles_rs 120 python benchmarks/compile_log.py -- $C $S38_ARGS $S38_MTP $rs --out "$R/json/compiles_rs.json"
}

# `s45b`: MTP's chain graph with each layer's inputs and outputs in one launch each
#   (`kiln.kernels.mtp_layer_io`: the draft row's override, the embedding and h^{k-1} gathers, the
#   two input norms and their concatenation before `eh_proj`; the residual add, the site store,
#   the draft rows' gather and the final norm after the block). Its GPU tests and the chain's,
#   then MTP K = 3 rounds at batch 1 and 8, greedy and sampled (T = 1, rejection
#   sampling), alternated with 68f8378 (carry scratch/b_68f8378: before the fused steps). Also
#   Inkling's full-layer attention scale in one launch (`kiln.kernels.attn_scale`, six before):
#   its GPU test and plain decode at batch 1 and 8 against 68f8378.
lane0_s45b() {
  export TRITON_CACHE_DIR=/tmp/triton-s45b-$$
  local base="python scratch/b_68f8378/benchmarks/decode_batch.py $C"
  local rs="--temperature 1.0 --speculative-use-rejection-sampling"
  step gpu_tests 120 python -m pytest -m gpu -rfEs -p no:cacheprovider -n 8 tests/kernels/test_mtp_layer_io.py \
    tests/kernels/test_attn_scale.py tests/kernels/test_mtp_rows.py tests/engine/test_cuda_graph.py \
    tests/engine/test_spec_sampled.py
  alternated mtp "$base" $S38_ARGS $S38_MTP
  step mtp_rs_now 45 $DECODE $S38_ARGS $S38_MTP $rs --out "$R/json/mtp_rs_now.json"
  step mtp_rs_base 45 $base $S38_ARGS $S38_MTP $rs --out "$R/json/mtp_rs_base.json"
  step plain_now 30 $DECODE $S38_ARGS --out "$R/json/plain_now.json"
  step plain_base 30 $base $S38_ARGS --out "$R/json/plain_base.json"
}

# `s45c` (after s45b: the fused layer steps took 0.07 ms off a round; plain decode with the attention
#   scale in one launch measured 1.31 against 1.30 ms, one run each): GPU tests, then
#   plain decode of Inkling at batch 1 and 8 against 68f8378
#   (carry scratch/b_68f8378: before the attention scale's launch and the LM head's fp32 output from
#   the GEMV, `gemv(..., float_out=True)`); MTP K = 3 rounds at batch 1 and 8, greedy and
#   sampled, against 9391fcc (carry scratch/b_9391fcc: before the draft heads on the GEMV,
#   their fp32 output and a greedy round's counts in one launch, `kiln.kernels.greedy_accept`).
#   Never run as written: the forty-sixth session ran it, with alternated runs, as `s46a`.
lane0_s45c() {
  lane0_s46a
}
