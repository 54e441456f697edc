# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# eighteenth session (2026-12-03): where a batch-1 GEMV's time goes in a dependent chain, from
# per-program timestamps (`kiln.kernels.trace`, `benchmarks/kernel_bench/gemv_trace.py`).
# shellcheck shell=bash

lane0_trace1() {  # the traced GEMV's GPU tests; the dense and o_proj chains with several tiles, trigger on and off
  step gpu_tests ${T_TESTS:-150} python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/kernels/test_gemv.py \
    -k "trace or prenorm_real or real_shapes"
  step gemv_trace ${T_TRACE:-240} python -m benchmarks.kernel_bench.gemv_trace --layers 24 --chains dense,o \
    --tiles rule,2x1024,4x512,8x256,16x128 --out "$R/json/trace1.json"
}
