# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# forty-seventh session (2026-12-07).
# shellcheck shell=bash

# `s47a` (s46b with a whole budget, and the slot sum in the down GEMM): the grouped MoE without its
#   align launch up to 256 routed ids and LM heads of up to 4 rows on the GEMV (7429965, 781ee9b),
#   then the grouped MoE's slot sum in the down GEMM's last programs up to 32 tokens (313665c).
#   Their GPU tests; the kernel benches of all three (`kernel_bench.moe --down-sum`, `--inline-align`,
#   `kernel_bench.lm_head`); Inkling MTP K = 3 rounds and plain decode at batch 1 and 8 alternated
#   with cbbaa61 (carry scratch/b_cbbaa61: before the sum in the down GEMM) and with c576b65 (carry
#   scratch/b_c576b65: before all three); MiniMax-M3 plain decode against c576b65; sampled MTP once each.
#   Ran on an H100 (docs/benchmarks.md, forty-seventh pass); all three changes measured slower and
#   were removed with the bench options this lane calls (`--down-sum`, `--inline-align`), so it
#   runs again only at a8aed30.
lane0_s47a() {
  export TRITON_CACHE_DIR=/tmp/triton-s47a-$$
  local base="python scratch/b_c576b65/benchmarks/decode_batch.py $C" pre="python scratch/b_cbbaa61/benchmarks/decode_batch.py $C"
  local rs="--temperature 1.0 --speculative-use-rejection-sampling"
  local mm="--model-path $MM --input-len 1024 --output-len 128 --cuda-graph-max-bs 8 --batch-sizes 1,8 --warmup on"
  step gpu_tests 120 python -m pytest -m gpu -rfEs -p no:cacheprovider -n 8 tests/kernels/test_moe_kernels.py \
    tests/kernels/test_moe_gemv.py tests/kernels/test_moe_sum.py tests/engine/test_kernel_path.py \
    tests/engine/test_spec_sampled.py tests/engine/test_draft_vocab.py tests/engine/test_spec_kernel_path.py
  step down_sum 60 python -m benchmarks.kernel_bench.moe --down-sum 2 4 8 32
  alternated mtp_sum "$pre" $S38_ARGS $S38_MTP
  alternated plain_sum "$pre" $S38_ARGS
  alternated mtp "$base" $S38_ARGS $S38_MTP
  alternated plain "$base" $S38_ARGS
  step inline_align 60 python -m benchmarks.kernel_bench.moe --inline-align 4 8 32
  step lm_head 40 python -m benchmarks.kernel_bench.lm_head --rows 1 4
  alternated mm "$base" $mm
  step mtp_rs_now 45 $DECODE $S38_ARGS $S38_MTP $rs --out "$R/json/mtp_rs_now.json"
  step mtp_rs_base 45 $base $S38_ARGS $S38_MTP $rs --out "$R/json/mtp_rs_base.json"
}
