# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# fewer launches, MSA, the MoE at one token, decode attention splits (2026-12-01/02): fuse*, trigger, msa*, split*, verify8, tables8, prof8k.
# shellcheck shell=bash

lane0_fuse() {  # fewer launches per layer (RoPE + cache write, the split merge inside the attention kernel,
  # SiLU-and-mul inside the gate_up GEMV): every GPU test, then batch 1 against the previous commit's code in
  # the same call (scratch/base: `git archive` of it, carried), alternating, then the 8B against transformers
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-240} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider ${XDIST:-} --ignore tests/server
  B8="--model-path $LLAMA $C --num-runs 3 --no-hf"
  HB="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  for i in 1 2; do
    step latency_llama8b_base_$i 60 python scratch/base/benchmarks/latency.py $B8 --out "$R/json/llama8b_base_$i.json"
    step latency_llama8b_new_$i 60 python benchmarks/latency.py $B8 --out "$R/json/llama8b_new_$i.json"
  done
  for m in inkling:$INK minimax:$MM; do
    step ${m%%:*}_b1_base 40 python scratch/base/benchmarks/decode_batch.py $C --model-path ${m#*:} $HB \
      --out "$R/json/${m%%:*}_b1_base.json"
    step ${m%%:*}_b1_new 40 python benchmarks/decode_batch.py $C --model-path ${m#*:} $HB --out "$R/json/${m%%:*}_b1_new.json"
  done
  step latency_llama8b_hf ${T_LAT:-120} python benchmarks/latency.py --model-path $LLAMA $C --num-runs 3 \
    --out "$R/json/latency_llama8b.json"
}

lane1_fuse() { :; }

lane0_fuse2() {  # the routers' logits through the GEMV: every GPU test, then batch 1 and a K = 3 MTP round on the
  # hybrids with the previous commit's code (scratch/base), this code with the routers on cuBLAS (scratch/mid) and
  # this code, alternating
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-240} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider ${XDIST:-} --ignore tests/server
  HB="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  SP="--batch-sizes 1 --input-len 1024 --output-len 64 --cuda-graph-max-bs 32 --speculative-algorithm mtp
    --speculative-num-steps 3"
  for m in inkling:$INK minimax:$MM; do
    for v in base:scratch/base/ mid:scratch/mid/ new:; do
      step ${m%%:*}_b1_${v%%:*} 40 python ${v#*:}benchmarks/decode_batch.py $C --model-path ${m#*:} $HB \
        --out "$R/json/${m%%:*}_b1_${v%%:*}.json"
    done
  done
  for v in base:scratch/base/ mid:scratch/mid/ new:; do
    step inkling_mtp3_${v%%:*} 50 python ${v#*:}benchmarks/decode_batch.py $C --model-path $INK $SP \
      --out "$R/json/inkling_mtp3_${v%%:*}.json"
  done
}

lane1_fuse2() { :; }

lane0_fuse3() {  # after the review's changes: every GPU test; batch 1 with the early trigger off / on again, now
  # that fewer small kernels sit between the GEMVs
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-240} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider ${XDIST:-} --ignore tests/server
  B8="--model-path $LLAMA $C --num-runs 3 --no-hf"
  step latency_llama8b 60 python benchmarks/latency.py $B8 --out "$R/json/llama8b.json"
  step latency_llama8b_trigger 60 python benchmarks/latency.py $B8 --pdl-early-trigger --out "$R/json/llama8b_trigger.json"
  hybrids_b1 "" 40
  hybrids_b1 _trigger 40 --pdl-early-trigger
}

lane1_fuse3() { :; }

lane0_trigger() {  # prepared for the next session (not run yet): can --pdl-early-trigger become the default?
  # Every GPU test with it on in the engines the tests build, then batch 8 / 64 with it off and on
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  KILN_TEST_PDL_EARLY_TRIGGER=1 step gpu_tests_trigger ${T_TESTS:-240} python -m pytest -m gpu tests -q -rfE \
    -p no:cacheprovider ${XDIST:-} --ignore tests/server
  for f in "" --pdl-early-trigger; do
    step llama8b_b64${f:+_trigger} 60 $DECODE --model-path $LLAMA --batch-sizes 8,64 --input-len 1024 --output-len 128 \
      $f --out "$R/json/llama8b_b64${f:+_trigger}.json"
    step inkling_b64${f:+_trigger} 60 $DECODE --model-path $INK --batch-sizes 8,64 --input-len 1024 --output-len 128 \
      $f --out "$R/json/inkling_b64${f:+_trigger}.json"
  done
  # where a batch-1 hybrid step goes now, with the trigger on (the kernel table of each)
  for m in $INK $MM; do
    step profile_b1_${m#preset:} 70 $DECODE --model-path $m --batch-sizes 1 --input-len 1024 --output-len 64 \
      --cuda-graph-max-bs 8 --pdl-early-trigger --profile --kernel-rows 45
  done
}

lane1_trigger() { :; }

lane0_msa() {  # seventh session: every GPU test; MSA scores sized to fill the GPU, the MoE one-token path, lam once, the bias in the kernel
  # against 813b32e (scratch/base) at batch 1 and 64; Inkling batch 64 with the early trigger off / on again
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-240} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider ${XDIST:-} --ignore tests/server
  step moe_t1 ${T_MICRO:-60} python -m benchmarks.kernel_bench.moe ${MOE_ARGS:---gemv 1 2 4}
  local OLD="python scratch/base/benchmarks/decode_batch.py $C" NEW="$DECODE"
  for v in OLD NEW; do
    step inkling_b1_$v 45 ${!v} --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8
    step minimax_b1_$v 45 ${!v} --model-path $MM --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8
  done
  for v in OLD NEW; do
    step minimax_b64_$v 60 ${!v} --model-path $MM --batch-sizes 64 --input-len 1024 --output-len 128
  done
  for f in "" --pdl-early-trigger; do
    step inkling_b64${f:+_trigger} 50 $DECODE --model-path $INK --batch-sizes 64 --input-len 1024 --output-len 128 $f
  done
  # without PDL every kernel's time is its own: where a batch-1 Inkling step goes now
  step profile_inkling_nopdl 50 $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 8 --disable-pdl --profile --kernel-rows 30
}

lane1_msa() { :; }

lane0_msa2() {  # the MoE one-token tiles swept; Inkling batch 64 with the trigger (its compile outlasted call 2's
  # limit); the hybrids at batch 1 with the trigger; MiniMax-M3 at 8K context
  step moe_sweep ${T_MICRO:-120} python -m benchmarks.kernel_bench.moe --gemv-sweep
  step inkling_b64_trigger 90 $DECODE --model-path $INK --batch-sizes 64 --input-len 1024 --output-len 128 --pdl-early-trigger
  hybrids_b1 _trigger 45 --pdl-early-trigger
  step minimax_8k 150 $DECODE --model-path $MM --batch-sizes 8,64 --input-len 8192 --output-len 256 --time-limit 50
}

lane1_msa2() { :; }

lane0_msa3() {  # the swept MoE one-token tiles: their GPU tests, the hybrids at batch 1
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 4"; fi
  step moe_tests 90 python -m pytest -m gpu -q -p no:cacheprovider ${XDIST:-} tests/kernels/test_moe_kernels.py \
    tests/engine/test_cuda_graph.py tests/engine/test_kernel_path.py
  hybrids_b1 "" 45
}

lane1_msa3() { :; }

lane0_split() {  # eighth session: decode attention's least keys per split and its tiled merge
  # the attention GPU tests; the split sweep with the engine's grid (table of 128K); the hybrids at
  # batch 1 against 4987a32 (scratch/base); Inkling MTP rounds against plain decode
  step attn_tests ${T_TESTS:-120} python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/kernels/test_attention_kernels.py
  step attn_sweep ${T_MICRO:-150} python -m benchmarks.kernel_bench.attention --batch 1 8 64 --context 1024 8192 \
    --table-len 131072 --min-split-keys 64 128 256 512 --no-reference
  local OLD="python scratch/base/benchmarks/decode_batch.py $C" NEW="$DECODE"
  for v in OLD NEW; do
    step inkling_b1_$v 45 ${!v} --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8
    step minimax_b1_$v 45 ${!v} --model-path $MM --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8
    step llama8b_b1_$v 50 ${!v} --model-path $LLAMA --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8
  done
}

lane1_split() { :; }

lane0_split2() {  # the split sweep again (least keys x most splits, 32K too), with V loaded beside K; the
  # old kernel (4987a32) timed by the same script; batch 1 end to end against 4987a32
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 4"; fi
  step attn_tests ${T_TESTS:-150} python -m pytest -m gpu -q -rfE -p no:cacheprovider ${XDIST:-} tests/kernels/test_attention_kernels.py
  step attn_sweep ${T_MICRO:-160} python -m benchmarks.kernel_bench.attention --batch 1 8 --context 1024 8192 32768 \
    --table-len 131072 --min-split-keys 64 128 --max-splits 16 32 128 --no-reference
  (cd scratch/base && step attn_old 60 python -m benchmarks.kernel_bench.attention --batch 1 8 --context 1024 8192 32768 \
    --table-len 131072 --no-reference)
  local OLD="python scratch/base/benchmarks/decode_batch.py $C" NEW="$DECODE"
  for v in OLD NEW; do
    step inkling_b1_$v 45 ${!v} --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8
    step llama8b_b1_$v 50 ${!v} --model-path $LLAMA --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8
  done
}

lane1_split2() { :; }

lane0_verify8() {  # every GPU test at this session's head; Inkling MTP rounds (K = 3) against plain decode
  # at batch 1/8/32; the 8B shape at batch 1 with an 8K context against 4987a32 (the split cap's case)
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-250} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider ${XDIST:-} --ignore tests/server
  step plain_inkling 60 $DECODE --model-path $INK --batch-sizes 1,8,32 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 32 --out "$R/json/plain_inkling.json"
  step spec_inkling_k3 90 $DECODE --model-path $INK --batch-sizes 1,8,32 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 32 --speculative-algorithm mtp --speculative-num-steps 3 --out "$R/json/spec_inkling_k3.json"
  local OLD="python scratch/base/benchmarks/decode_batch.py $C" NEW="$DECODE"
  for v in OLD NEW; do
    step llama8b_b1_8k_$v 50 ${!v} --model-path $LLAMA --batch-sizes 1 --input-len 8192 --output-len 128 --cuda-graph-max-bs 8
  done
}

lane1_verify8() { :; }

lane0_tables8() {  # the hybrids at 8K context and batch 8 to 128 (output 256), after the split cap
  step inkling_8k 170 $DECODE --model-path $INK --batch-sizes 8,32,64,128 --input-len 8192 --output-len 256 \
    --time-limit 40 --out "$R/json/inkling_8k.json"
  step minimax_8k 150 $DECODE --model-path $MM --batch-sizes 32,128 --input-len 8192 --output-len 256 \
    --time-limit 50 --out "$R/json/minimax_8k.json"
}

lane1_tables8() { :; }

lane0_prof8k() {  # where the split cap's kernel gain went: the 8B shape's batch-1 step at 8K profiled, old and new
  local OLD="python scratch/base/benchmarks/decode_batch.py $C" NEW="$DECODE"
  for v in OLD NEW; do
    step llama8b_8k_profile_$v 60 ${!v} --model-path $LLAMA --batch-sizes 1 --input-len 8192 --output-len 64 \
      --cuda-graph-max-bs 8 --profile --profile-steps 20 --kernel-rows 8
  done
}

lane1_prof8k() { :; }

