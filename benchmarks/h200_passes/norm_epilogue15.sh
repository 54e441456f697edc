# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# fifteenth session (2026-12-03): the Llama family's pre-norms in the epilogue of the GEMV before
# them (`gemv_add_norm`, o_proj and down_proj; on above --fold-norms-max-hidden), for the 8B at
# batch 1; docs/benchmarks.md, twentieth pass.
# shellcheck shell=bash

L8B="--model-path $LLAMA --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"

lane0_normout1() {  # GPU tests of the GEMV, the norm epilogue and the kernel path; the dense chain at the 8B shape
  # (the epilogue mode beside the others); the 8B at batch 1, alternated x2: the tree (norm epilogue, LM head on the
  # GEMV), the tree with --disable-norm-epilogue, and 7fbd6ec (the fourteenth session's head, scratch/base15)
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-150} python -m pytest -m gpu -q -rfE -p no:cacheprovider ${XDIST:-} tests/kernels/test_gemv_add_norm.py \
    tests/kernels/test_gemv.py tests/kernels/test_norm.py tests/engine/test_kernel_path.py tests/engine/test_cuda_graph.py
  step chain 120 python -m benchmarks.kernel_bench.gemv --rows 1,2 --chain-only --layers 16 --shapes llama-8b
  for r in 1 2; do
    local lim=45; [ $r = 1 ] && lim=100
    step llama8b_epi_$r $lim $DECODE $L8B --out "$R/json/llama8b_epi_$r.json"
    step llama8b_sep_$r 45 $DECODE $L8B --disable-norm-epilogue --out "$R/json/llama8b_sep_$r.json"
    step llama8b_base_$r $lim python scratch/base15/benchmarks/decode_batch.py $C $L8B --out "$R/json/llama8b_base_$r.json"
  done
}

lane0_normout2() {  # every GPU test; the 8B at batch 1 against transformers (same weights, same process, 3 runs each)
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-260} python -m pytest -m gpu tests -q -p no:cacheprovider -rfE ${XDIST:-} --ignore tests/server
  step llama8b_latency 280 python benchmarks/latency.py --model-path $LLAMA --dummy-init auto --num-runs 3 \
    --out "$R/json/llama8b_latency.json"
}

lane0_normout3() {  # the LM head on the GEMV: the 8B at batch 1, the tree against scratch/v_nohead (its LM head on
  # cuBLAS, scratch/make_variants15.sh), and Inkling at batch 1 against 7fbd6ec (scratch/base15), alternated x2;
  # the dense chain at the Inkling shape (the epilogue against the fold the hybrids use)
  local P1="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-100} python -m pytest -m gpu -q -rfE -p no:cacheprovider ${XDIST:-} \
    tests/kernels/test_gemv_add_norm.py tests/engine/test_kernel_path.py tests/engine/test_cuda_graph.py
  for r in 1 2; do
    local lim=45; [ $r = 1 ] && lim=100
    step llama8b_tree_$r $lim $DECODE $L8B --out "$R/json/llama8b_tree_$r.json"
    step llama8b_nohead_$r $lim python scratch/v_nohead/benchmarks/decode_batch.py $C $L8B --out "$R/json/llama8b_nohead_$r.json"
    for m in INK; do
      step ${m}_b1_tree_$r $lim $DECODE --model-path ${!m} $P1 --out "$R/json/${m}_b1_tree_$r.json"
      step ${m}_b1_base_$r $lim python scratch/base15/benchmarks/decode_batch.py $C --model-path ${!m} $P1 \
        --out "$R/json/${m}_b1_base_$r.json"
    done
  done
  step chain_inkling 90 python -m benchmarks.kernel_bench.gemv --rows 1 --chain-only --layers 16 --shapes inkling-bench
}

lane0_normout4() {  # MiniMax-M3 at batch 1 (its LM head on the GEMV now), the tree against 7fbd6ec, alternated x2
  # (not run in the fifteenth session: its start was refused and then too little device time was left)
  local P1="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  for r in 1 2; do
    local lim=40; [ $r = 1 ] && lim=90
    step MM_b1_tree_$r $lim $DECODE --model-path $MM $P1 --out "$R/json/MM_b1_tree_$r.json"
    step MM_b1_base_$r $lim python scratch/base15/benchmarks/decode_batch.py $C --model-path $MM $P1 \
      --out "$R/json/MM_b1_base_$r.json"
  done
}
