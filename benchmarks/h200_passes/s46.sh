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

# `s46b` (after s46a: the draft heads on the GEMV and a greedy round's counts in one launch took
#   0.06 ms off a batch-1 round on an H200): the grouped MoE without its align launch up to 256
#   routed ids (each GEMM program's rows from the ids in registers; a verify's 4 tokens at batch 1,
#   32 at batch 8, decode at 8), and LM heads of up to 4 rows on the GEMV (the verify's 4-row head took
#   cuBLAS and a cast; HEAD_GEMV_MAX_ROWS). Their GPU tests; the grouped path's two variants at
#   2-40 tokens (`kernel_bench.moe --inline-align`); the LM head at 1-5 rows on cuBLAS and on the
#   GEMV; MTP K = 3 rounds at batch 1 and 8 now and at c576b65 (carry scratch/b_c576b65: before
#   both), once each: sized for the ~300 s that five asks without a machine left.
#   Ran (as s47a) on an H100 in the forty-seventh pass; both changes were removed, and `--inline-align`
#   with them, so it runs only at a23282f..a8aed30.
lane0_s46b() {
  export TRITON_CACHE_DIR=/tmp/triton-s46b-$$
  local base="python scratch/b_c576b65/benchmarks/decode_batch.py $C"
  step gpu_tests 80 python -m pytest -m gpu -rfEs -p no:cacheprovider -n 8 tests/kernels/test_moe_kernels.py \
    tests/kernels/test_moe_gemv.py tests/engine/test_kernel_path.py tests/engine/test_spec_sampled.py \
    tests/engine/test_draft_vocab.py
  step inline_align 50 python -m benchmarks.kernel_bench.moe --inline-align 4 5 8 32
  step lm_head 30 python -m benchmarks.kernel_bench.lm_head --rows 1 4
  step mtp_now 60 $DECODE $S38_ARGS $S38_MTP --out "$R/json/mtp_now.json"
  step mtp_base 60 $base $S38_ARGS $S38_MTP --out "$R/json/mtp_base.json"
}
