# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# forty-ninth session (2026-12-07).
# shellcheck shell=bash

# `s49a`: would a speculative verify's few rows stream on the GEMV's MMA path? At 4 rows every FMA
#   tile loses to cuBLAS (forty-eighth pass). 5 rows take the MMA loop (16 rows padded, so what
#   one of its tiles would do for 4), timed here on every tile of `DOT_TILES` for the LM head and
#   Inkling `bench`'s dense projections, beside cuBLAS and the FMA tiles at 4 rows.
lane0_s49a() {
  export TRITON_CACHE_DIR=/tmp/triton-s49a-$$
  step lm_head 120 python -m benchmarks.kernel_bench.lm_head --rows 4 5 8 --sweep
  step gemv_tiles 240 python -m benchmarks.kernel_bench.gemv --rows 4,5,8 --sweep --shapes inkling-bench --no-chain
}

# `s49b`: the same question in a dependent chain (`kernel_bench.gemv`'s chain: norm -> qkv -> o ->
#   norm -> gate_up -> SiLU -> down per layer, 32 layers of distinct weights), where the GEMV's
#   weight stream starts before the PDL wait: cuBLAS against the MMA GEMV (rule tile and every
#   other `DOT_TILES` tile) at 5 and 8 rows, and the FMA modes at 4 rows, Inkling `bench` shape.
lane0_s49b() {
  export TRITON_CACHE_DIR=/tmp/triton-s49b-$$
  step gemv_chain 240 python -m benchmarks.kernel_bench.gemv --rows 1,4,5,8 --chain-only --shapes inkling-bench
}
