# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# forty-eighth session (2026-12-07).
# shellcheck shell=bash

# `s48a` (the code as it stands, c576b65's kernels, whose whole GPU suite passed in the forty-sixth
#   pass; sized for the budget that failed asks left): the large-batch rows of both hybrids
#   (input 8192 / output 1024, batch 8 / 32 / 64 / 128), last measured in the fourteenth pass;
#   the LM head at 1 and 4 rows on cuBLAS, on the GEMV's rule tile and on every candidate tile
#   (`kernel_bench.lm_head --sweep`: is there a 4-row tile that streams?). Ran on an H100 after
#   six asks without a machine (docs/benchmarks.md, forty-eighth pass): no; and Inkling's batches
#   of 32 and more do not fit the 80 GB card's KV pool at this shape.
lane0_s48a() {
  export TRITON_CACHE_DIR=/tmp/triton-s48a-$$
  step lm_head 60 python -m benchmarks.kernel_bench.lm_head --rows 1 4 --sweep
  step inkling_8k ${T_INK:-150} $DECODE --model-path $INK --batch-sizes 8,32,64,128 --input-len 8192 \
    --output-len 1024 --time-limit 60 --out "$R/json/inkling_8k_1024.json"
  step minimax_8k ${T_MM:-170} $DECODE --model-path $MM --batch-sizes 8,32,64,128 --input-len 8192 \
    --output-len 1024 --time-limit 60 --out "$R/json/minimax_8k_1024.json"
}
