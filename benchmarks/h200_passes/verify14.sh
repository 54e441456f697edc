# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# fourteenth session (2026-12-03): the verify forward of a batch-1 speculative round (4 rows at
# K = 3) on the decode paths: the dense projections on the GEMV's 4-row loop (--gemv-max-rows 4,
# with the folded norms) and the MoE on the expert GEMVs (--moe-gemv-max-tokens 4);
# docs/benchmarks.md, nineteenth pass.
# shellcheck shell=bash

# K = 3 MTP rounds at batch 1 on the Inkling bench preset (the eighteenth pass's rounds command)
ROUNDS14="--model-path $INK --input-len 1024 --output-len 64 --cuda-graph-max-bs 32 --speculative-algorithm mtp \
  --speculative-num-steps 3 --batch-sizes 1"

verify_variants14() {  # verify_variants14 RUN FIRST_LIMIT: one b1 round per variant (steps mtp3_<variant>_RUN)
  local r=$1 lim=$2
  step mtp3_default_$r $lim $DECODE $ROUNDS14 --out "$R/json/mtp3_default_$r.json"
  step mtp3_g4_$r $lim $DECODE $ROUNDS14 --gemv-max-rows 4 --out "$R/json/mtp3_g4_$r.json"
  step mtp3_m4_$r $lim $DECODE $ROUNDS14 --moe-gemv-max-tokens 4 --out "$R/json/mtp3_m4_$r.json"
  step mtp3_g4m4_$r $lim $DECODE $ROUNDS14 --gemv-max-rows 4 --moe-gemv-max-tokens 4 --out "$R/json/mtp3_g4m4_$r.json"
}

lane0_verify1() {  # GPU tests of the GEMV, the expert GEMVs and the speculative graphs (the new verify-on-GEMV
  # test among them); the expert GEMVs against the grouped MoE at 1/2/4/8 tokens; K = 3 rounds at batch 1 with
  # the verify on cuBLAS + grouped MoE (default), the GEMV, the expert GEMVs, both: alternated x2; the
  # round's kernel table with both
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-200} python -m pytest -m gpu -q -rfE -p no:cacheprovider ${XDIST:-} tests/kernels/test_moe_gemv.py \
    tests/kernels/test_gemv.py tests/engine/test_cuda_graph.py tests/engine/test_kernel_path.py
  step moe_gemv_tokens 90 python -m benchmarks.kernel_bench.moe --gemv 1 2 4 8
  verify_variants14 1 90
  verify_variants14 2 45
  step mtp3_g4m4_profile 60 $DECODE $ROUNDS14 --gemv-max-rows 4 --moe-gemv-max-tokens 4 --profile --profile-steps 10 \
    --kernel-rows 45 --out "$R/json/mtp3_g4m4_profile.json"
}

lane0_verify2() {  # every GPU test (the conv epilogues over a verify's chunks: o_conv in the o_proj GEMV, out_conv in
  # the grouped MoE's sum; the greedy argmax kernel); K = 3 rounds at batch 1, and plain decode at batch 1 and 4, the
  # tree against 5639e9d (the thirteenth session's head, scratch/base), alternated x2; the argmax against torch's;
  # the 8B at batch 1, both; the speedup table (plain and rounds at batch 1/8/32); the round's kernel table
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-240} python -m pytest -m gpu tests -q -p no:cacheprovider -rfE ${XDIST:-} --ignore tests/server
  local P4="--model-path $INK --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  for r in 1 2; do
    step mtp3_new_$r 90 $DECODE $ROUNDS14 --out "$R/json/mtp3_new_$r.json"
    step mtp3_base_$r 90 python scratch/base/benchmarks/decode_batch.py $C $ROUNDS14 --out "$R/json/mtp3_base_$r.json"
  done
  step plain_new 45 $DECODE $P4 --batch-sizes 1,4 --out "$R/json/plain_new.json"
  step plain_base 45 python scratch/base/benchmarks/decode_batch.py $C $P4 --batch-sizes 1,4 --out "$R/json/plain_base.json"
  step small_ops 60 python -m benchmarks.kernel_bench.small_ops --quick
  local L1="--model-path $LLAMA --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  step llama8b_new 60 $DECODE $L1 --out "$R/json/llama8b_new.json"
  step llama8b_base 60 python scratch/base/benchmarks/decode_batch.py $C $L1 --out "$R/json/llama8b_base.json"
  step plain_table 60 $DECODE --model-path $INK --input-len 1024 --output-len 64 --cuda-graph-max-bs 32 \
    --batch-sizes 1,8,32 --out "$R/json/plain_table.json"
  step mtp3_table 70 $DECODE ${ROUNDS14/--batch-sizes 1/--batch-sizes 1,8,32} --out "$R/json/mtp3_table.json"
  step mtp3_profile 50 $DECODE $ROUNDS14 --profile --profile-steps 10 --kernel-rows 30 --out "$R/json/mtp3_profile.json"
}

lane0_verify5() {  # (after two refused starts, what the device time left allows) the GPU tests of the kernel path
  # (the harness fix), the few-row verify, the argmax and the grouped conv epilogue; plain decode at batch 1 and 4 with the conv
  # epilogues at 2-4 rows for a verify only (the tree now) against 5639e9d; K = 3 rounds at batch 1, the tree
  # against v_nosum and v_h32 (scratch/make_variants14.sh)
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-80} python -m pytest -m gpu -q -rfE -p no:cacheprovider ${XDIST:-} tests/engine/test_kernel_path.py \
    tests/engine/test_cuda_graph.py tests/kernels/test_argmax.py tests/kernels/test_moe_gemv.py -k \
    "kernel_path or few_rows or argmax or grouped_conv or out_conv or gemv_on_cuda"
  local P4="--model-path $INK --input-len 1024 --output-len 128 --cuda-graph-max-bs 8 --batch-sizes 1,4"
  step plain_tree 60 $DECODE $P4 --out "$R/json/plain_tree.json"
  step plain_base 45 python scratch/base/benchmarks/decode_batch.py $C $P4 --out "$R/json/plain_base.json"
  for v in tree v_nosum v_h32; do
    local D=$DECODE; [ $v = tree ] || D="python scratch/$v/benchmarks/decode_batch.py $C"
    step mtp3_$v 45 $D $ROUNDS14 --out "$R/json/mtp3_$v.json"
  done
}
