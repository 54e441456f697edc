# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# device rounds, PDL and the decode GEMV (2026-11-30/12-01): devround, phases, final3, pdl*, gemv*, next, df, df2.
# shellcheck shell=bash

lane0_devround() {  # verify -> MTP pass on the device (no host wait between them), ShortConv state write fused
  step audit_spec ${T_SPEC:-70} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 48 \
    --cuda-graph-max-bs 8 --speculative-algorithm mtp --speculative-num-steps 3 --profile-steps 6 --sync-audit \
    --trace "$R/json/timeline_spec_b1.json"
  lane0_spec_rounds_plain
  step gpu_tests ${T_TESTS:-200} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 150 \
    tests/engine/test_host_sync.py tests/engine/test_speculative.py tests/engine/test_cuda_graph.py \
    tests/kernels/test_shortconv_kernels.py tests/engine/test_spec_sampled.py
}

lane1_devround() { :; }

lane0_phases() {  # where the host's time goes in plain steps and MTP rounds at batch 1 (unprofiled)
  step phases_plain ${T_PLAIN:-60} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 8 --host-phases --profile-steps 20
  for K in 3 1; do
    step phases_k$K ${T_SPEC:-60} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 64 \
      --cuda-graph-max-bs 8 --speculative-algorithm mtp --speculative-num-steps $K --host-phases --profile-steps 20
  done
  step gpu_tests ${T_TESTS:-100} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 90 \
    tests/engine/test_cuda_graph.py
}

lane1_phases() { :; }

lane0_final3() {  # after the device rounds and graph passes near max_tokens: the rounds table, a longer run, GPU tests
  lane0_spec_rounds_plain
  step spec_inkling_k3_long ${T_SPEC:-60} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 256 \
    --cuda-graph-max-bs 8 --speculative-algorithm mtp --speculative-num-steps 3 --host-phases --profile-steps 20 \
    --out "$R/json/spec_inkling_k3_long.json"
  step gpu_tests ${T_TESTS:-240} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 150 \
    tests/engine/test_host_sync.py tests/engine/test_speculative.py tests/engine/test_cuda_graph.py \
    tests/engine/test_kernel_path.py tests/kernels/test_shortconv_kernels.py tests/kernels/test_conv_qk_norm.py \
    ${SAMPLED_TESTS-tests/engine/test_spec_sampled.py}
}

lane1_final3() { :; }

lane0_pdl() {  # programmatic dependent launch: kernel chains, GPU tests, then batch-1 decode with and without
  step pdl_chains ${T_MICRO:-60} python -m benchmarks.kernel_bench.pdl
  step gpu_tests ${T_TESTS:-200} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 150 \
    tests/engine/test_pdl.py tests/kernels tests/engine/test_cuda_graph.py
  for v in on off; do
    if [ $v = off ]; then F=--disable-pdl; else F=; fi
    step llama8b_b1_$v ${T_8B:-75} $DECODE --model-path $LLAMA --batch-sizes 1 --input-len 1024 --output-len 128 \
      --cuda-graph-max-bs 8 $F --out "$R/json/llama8b_b1_$v.json"
    hybrids_b1 _$v 50 $F
  done
}

lane1_pdl() { :; }

lane0_pdl2() {  # GPU tests with PDL (pytest-xdist wheels carried in .device_wheels when present); cuBLAS without
  # a workspace (no split-K reduce kernel?) at batch 1; batch 64 with and without PDL
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-330} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 200 ${XDIST:-} \
    tests/kernels tests/engine/test_pdl.py tests/engine/test_cuda_graph.py tests/engine/test_host_sync.py \
    tests/engine/test_speculative.py tests/engine/test_kernel_path.py
  step llama8b_b1_noworkspace ${T_8B:-60} env CUBLAS_WORKSPACE_CONFIG=:0:0 $DECODE --model-path $LLAMA --batch-sizes 1 \
    --input-len 1024 --output-len 128 --cuda-graph-max-bs 8 --out "$R/json/llama8b_b1_noworkspace.json"
  for v in on off; do
    if [ $v = off ]; then F=--disable-pdl; else F=; fi
    step llama8b_b64_$v ${T_8B:-60} $DECODE --model-path $LLAMA --batch-sizes 64 --input-len 1024 --output-len 128 \
      --cuda-graph-max-bs 64 $F --out "$R/json/llama8b_b64_$v.json"
  done
}

lane1_pdl2() { :; }

lane0_pdl3() {  # the 8B batch-1 row against transformers; Inkling MTP rounds against plain decode; the batch-1 profile
  step latency_llama8b ${T_LAT:-240} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 \
    --out "$R/json/latency_llama8b.json"
  step plain_inkling ${T_PLAIN:-60} $DECODE --model-path $INK --batch-sizes 1,8,32 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 32 --out "$R/json/plain_inkling.json"
  step spec_inkling_k3 ${T_SPEC:-90} $DECODE --model-path $INK --batch-sizes 1,8,32 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 32 --speculative-algorithm mtp --speculative-num-steps 3 --out "$R/json/spec_inkling_k3.json"
  step plain_profile ${T_P:-60} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 8 --profile --profile-steps 20 --kernel-rows 40 --out "$R/json/plain_b1_profile.json"
  step llama8b_b64_noworkspace ${T_8B:-60} env CUBLAS_WORKSPACE_CONFIG=:0:0 $DECODE --model-path $LLAMA --batch-sizes 64 \
    --input-len 1024 --output-len 128 --cuda-graph-max-bs 64 --out "$R/json/llama8b_b64_noworkspace.json"
  step inkling_b1_noworkspace ${T_INK:-50} env CUBLAS_WORKSPACE_CONFIG=:0:0 $DECODE --model-path $INK --batch-sizes 1 \
    --input-len 1024 --output-len 128 --cuda-graph-max-bs 8 --out "$R/json/inkling_b1_noworkspace.json"
}

lane1_pdl3() { :; }

lane0_pdl4() {  # MTP rounds (k = 3) with and without PDL; the PDL engine test after launch.py's last change
  for v in on off; do
    if [ $v = off ]; then F=--disable-pdl; else F=; fi
    step spec_inkling_k3_$v ${T_SPEC:-90} $DECODE --model-path $INK --batch-sizes 1,8,32 --input-len 1024 --output-len 64 \
      --cuda-graph-max-bs 32 --speculative-algorithm mtp --speculative-num-steps 3 $F --out "$R/json/spec_inkling_k3_$v.json"
  done
  step gpu_tests ${T_TESTS:-120} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 100 tests/engine/test_pdl.py
}

lane1_pdl4() { :; }

lane0_pdl5() {  # a K = 3 round with PDL: GPU busy by kernel (profiled), then the host phases (unprofiled)
  step spec3_profile ${T_S:-60} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 8 --speculative-algorithm mtp --speculative-num-steps 3 --profile --profile-steps 20 \
    --kernel-rows 30 --out "$R/json/spec3_b1_profile.json"
  step phases_k3 ${T_SPEC:-45} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 8 --speculative-algorithm mtp --speculative-num-steps 3 --host-phases --profile-steps 20
}

lane1_pdl5() { :; }

lane0_gemv() {  # Kiln's decode GEMV (its weight stream started before the PDL wait) against cuBLAS: GPU tests,
  # the layer-chain microbenchmark, then decode of the 8B shape and Inkling bench with and without it
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-240} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 200 ${XDIST:-} \
    tests/kernels/test_gemv.py tests/engine/test_pdl.py tests/engine/test_cuda_graph.py \
    tests/engine/test_kernel_path.py tests/engine/test_host_sync.py
  step gemv_micro ${T_MICRO:-150} python -m benchmarks.kernel_bench.gemv --layers 32 --rows 1,4,8
  for rows in 8 0; do
    step llama8b_gemv$rows ${T_8B:-70} $DECODE --model-path $LLAMA --batch-sizes 1,8 --input-len 1024 --output-len 128 \
      --cuda-graph-max-bs 8 --gemv-max-rows $rows --out "$R/json/llama8b_gemv$rows.json"
    step inkling_b1_gemv$rows ${T_INK:-50} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 128 \
      --cuda-graph-max-bs 8 --gemv-max-rows $rows --out "$R/json/inkling_b1_gemv$rows.json"
  done
}

lane1_gemv() { :; }

lane0_gemv2() {  # the GEMV on by default at batch 1 (all three architectures): GPU tests, the 8B shape against
  # transformers, batch-1 decode of the hybrids with and without it
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-300} python -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout 200 ${XDIST:-} \
    tests/kernels/test_gemv.py tests/engine/test_pdl.py tests/engine/test_cuda_graph.py \
    tests/engine/test_kernel_path.py tests/engine/test_host_sync.py tests/engine/test_speculative.py
  step latency_llama8b ${T_LAT:-200} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 \
    --out "$R/json/latency_llama8b.json"
  for rows in 1 0; do hybrids_b1 _gemv$rows 50 --gemv-max-rows $rows; done
}

lane1_gemv2() { :; }

lane0_gemv3() {  # every GPU test with the GEMV on by default; where an 8B batch-1 step goes now (profile)
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-300} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider --timeout 200 ${XDIST:-} \
    --continue-on-collection-errors
  step llama8b_b1_profile ${T_8B:-80} $DECODE --model-path $LLAMA --batch-sizes 1 --input-len 1024 --output-len 128 \
    --cuda-graph-max-bs 8 --profile --profile-steps 20 --kernel-rows 30 --out "$R/json/llama8b_b1_profile.json"
}

lane1_gemv3() { :; }

lane0_gemv4() {  # without the early trigger: every GPU test, the speculative sync test three more times, the 8B
  # shape against transformers, the hybrids at batch 1
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-200} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider --timeout 150 ${XDIST:-} \
    --ignore tests/server
  for i in 1 2 3; do
    step spec_sync_$i 40 python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/engine/test_host_sync.py -k speculative
  done
  step latency_llama8b ${T_LAT:-110} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 --no-hf \
    --out "$R/json/latency_llama8b.json"
  step inkling_b1 ${T_INK:-40} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 128 \
    --cuda-graph-max-bs 8 --out "$R/json/inkling_b1.json"
  step minimax_b1 ${T_MM:-40} $DECODE --model-path $MM --batch-sizes 1 --input-len 1024 --output-len 128 \
    --cuda-graph-max-bs 8 --out "$R/json/minimax_b1.json"
}

lane1_gemv4() { :; }

lane0_gemv5() {  # the speculative tail failure: every GPU test with the GEMV off, then on (KILN_TEST_GEMV_MAX_ROWS),
  # the test's scenario over many prompt seeds on real graphs (scratch/, not in the repository), the GEMV tiles
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests_gemv0 ${T_TESTS:-200} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider --timeout 150 ${XDIST:-} \
    --ignore tests/server
  if [ -f scratch/spec_tail_gpu.py ]; then step seeds_gemv0 ${T_SEEDS:-130} python -m scratch.spec_tail_gpu 16 0 6; fi
  KILN_TEST_GEMV_MAX_ROWS=1 step gpu_tests_gemv1 ${T_TESTS:-200} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider \
    --timeout 150 ${XDIST:-} --ignore tests/server
  step gemv_tiles ${T_MICRO:-60} python -m benchmarks.kernel_bench.gemv --rows 1,2,4 --layers 8
}

lane1_gemv5() { :; }

lane0_gemv6() {  # after the HostPool fix and the fixed GEMV tiles: the probe of a failed registration's error,
  # every GPU test with the GEMV off and on, the tile sweep, batch-1 latency with the GEMV
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step probe 30 python -c "
import torch; c = torch.cuda.cudart(); t = torch.empty(1 << 16); n = t.numel() * 4
print('register', int(c.cudaHostRegister(t.data_ptr(), n, 0)), 'again', int(c.cudaHostRegister(t.data_ptr(), n, 0)))
try:
    torch.ones(4, device='cuda').sum().item(); print('next op: no error')
except Exception as e: print('next op raised:', str(e).splitlines()[0])
c.cudaHostUnregister(t.data_ptr())"
  step gpu_tests_gemv0 ${T_TESTS:-180} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider --timeout 150 ${XDIST:-} \
    --ignore tests/server
  KILN_TEST_GEMV_MAX_ROWS=1 step gpu_tests_gemv1 ${T_TESTS:-180} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider \
    --timeout 150 ${XDIST:-} --ignore tests/server
  step gemv_sweep ${T_MICRO:-100} python -m benchmarks.kernel_bench.gemv --rows 1,2,4 --layers 16 --sweep
  step latency_llama8b ${T_LAT:-70} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 --no-hf \
    --gemv-max-rows 1 --out "$R/json/latency_llama8b.json"
  step inkling_b1 ${T_INK:-40} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 128 \
    --cuda-graph-max-bs 8 --gemv-max-rows 1 --out "$R/json/inkling_b1.json"
}

lane1_gemv6() { :; }

lane0_gemv7() {  # the GEMV's second tile rule: its tests, the Inkling-shape sweep, batch 1 with the GEMV off and on
  step gemv_tests 60 python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/kernels/test_gemv.py
  step gemv_sweep ${T_MICRO:-70} python -m benchmarks.kernel_bench.gemv --rows 1 --shapes inkling-bench,llama-8b --sweep --no-chain
  for rows in 1 0; do
    step latency_llama8b_gemv$rows ${T_LAT:-60} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 --no-hf \
      --gemv-max-rows $rows --out "$R/json/latency_llama8b_gemv$rows.json"
    hybrids_b1 _gemv$rows 35 --gemv-max-rows $rows
  done
}

lane1_gemv7() { :; }

lane0_gemv8() {  # the GEMV on by default (1 row on CUDA): every GPU test, then the 8B shape against transformers
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-170} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider --timeout 150 ${XDIST:-} \
    --ignore tests/server
  step latency_llama8b ${T_LAT:-200} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 \
    --out "$R/json/latency_llama8b.json"
}

lane1_gemv8() { :; }

lane0_next() {  # prepared for the next session (not run yet): the full GPU suite twice (the host pool's final
  # version), then batch 1 with the early trigger off and on (8B against transformers once, hybrids)
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  for i in 1 2; do
    step gpu_tests_$i ${T_TESTS:-150} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider --timeout 150 ${XDIST:-} \
      --ignore tests/server
  done
  step latency_llama8b ${T_LAT:-150} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 \
    --out "$R/json/latency_llama8b.json"
  step latency_llama8b_trigger ${T_LAT2:-60} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 --no-hf \
    --pdl-early-trigger --out "$R/json/latency_llama8b_trigger.json"
  hybrids_b1 "" 35
  hybrids_b1 _trigger 35 --pdl-early-trigger
}

lane1_next() { :; }

lane0_df() {  # where a DFlash K = 3 round's time goes at batch 1 (dummy 1-layer drafter): GPU kernels, host
  mkdir -p "$R/dflash-bench"
  echo '{"model_type": "dflash", "num_layers": 1, "block_size": 8, "mask_token_id": 49215, "hidden_size": 2048,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
    "target_layer_ids": [1, 12, 22]}' > "$R/dflash-bench/config.json"
  DF="--model-path $INK --input-len 1024 --output-len 64 --cuda-graph-max-bs 32 --speculative-algorithm dflash
    --speculative-draft-model-path $R/dflash-bench --speculative-num-steps 3"
  step dflash3 ${T_DF:-60} $DECODE $DF --batch-sizes 1,8 --out "$R/json/dflash3.json"
  step dflash3_profile ${T_DFP:-90} $DECODE $DF --batch-sizes 1 --profile --profile-steps 10 --kernel-rows 45 \
    --host-profile --host-phases --out "$R/json/dflash3_profile.json"
  step mtp3_phases ${T_MP:-60} $DECODE --model-path $INK --input-len 1024 --output-len 64 --cuda-graph-max-bs 32 \
    --speculative-algorithm mtp --speculative-num-steps 3 --batch-sizes 1 --host-phases --out "$R/json/mtp3.json"
}

lane1_df() { :; }

lane0_df2() {  # the paged block pass on CUDA graphs: every GPU test, then DFlash rounds (K = 3, 7) at batch
  # 1 / 8 / 32 against plain decode in the same call, and where a K = 3 round's time goes at batch 1
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-200} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider --timeout 200 ${XDIST:-} \
    --ignore tests/server
  mkdir -p "$R/dflash-bench"
  echo '{"model_type": "dflash", "num_layers": 1, "block_size": 8, "mask_token_id": 49215, "hidden_size": 2048,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
    "target_layer_ids": [1, 12, 22]}' > "$R/dflash-bench/config.json"
  DF="--model-path $INK --input-len 1024 --output-len 64 --cuda-graph-max-bs 32 --speculative-algorithm dflash
    --speculative-draft-model-path $R/dflash-bench"
  step plain ${T_PL:-60} $DECODE --model-path $INK --input-len 1024 --output-len 64 --cuda-graph-max-bs 32 \
    --batch-sizes 1,8,32 --out "$R/json/plain.json"
  for k in 3 7; do
    step dflash$k ${T_DF:-80} $DECODE $DF --speculative-num-steps $k --batch-sizes 1,8,32 --out "$R/json/dflash$k.json"
  done
  step dflash3_phases ${T_DFP:-60} $DECODE $DF --speculative-num-steps 3 --batch-sizes 1 --profile --profile-steps 10 \
    --kernel-rows 30 --host-phases --out "$R/json/dflash3_profile.json"
}

lane1_df2() { :; }

