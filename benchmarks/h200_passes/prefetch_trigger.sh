# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# ninth session (2026-12-02): the early trigger in small graphs, the GEMV's L2 prefetch, Inkling's cache write in
# its prologue: pf (call 1), pf2 (call 2).
# shellcheck shell=bash

lane0_pf() {  # every GPU test; batch 1 of the three models against 9b1b466 (scratch/base), with each new
  # default turned off in turn (--gemv-l2-prefetch-mb 0, --pdl-early-trigger-max-tokens 0); an Inkling K = 3 round
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-250} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider ${XDIST:-} --ignore tests/server
  local OLD="scratch/base/" B8="--model-path $LLAMA $C --num-runs 3 --no-hf"
  local HB="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  for v in base:$OLD: new:: nopf::--gemv-l2-prefetch-mb=0 notrig::--pdl-early-trigger-max-tokens=0; do
    IFS=: read -r tag dir flag <<< "$v"
    step llama8b_b1_$tag 60 python ${dir}benchmarks/latency.py $B8 $flag --out "$R/json/llama8b_b1_$tag.json"
  done
  for m in inkling:$INK minimax:$MM; do
    for v in base:$OLD: new:: nopf::--gemv-l2-prefetch-mb=0 notrig::--pdl-early-trigger-max-tokens=0; do
      IFS=: read -r tag dir flag <<< "$v"
      [ "${m%%:*}" = minimax ] && [ "$tag" = notrig ] && continue
      step ${m%%:*}_b1_$tag 40 python ${dir}benchmarks/decode_batch.py $C --model-path ${m#*:} $HB $flag \
        --out "$R/json/${m%%:*}_b1_$tag.json"
    done
  done
  step inkling_mtp3_new 50 $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 8 --speculative-algorithm mtp --speculative-num-steps 3 --out "$R/json/inkling_mtp3_new.json"
}

lane0_pf2() {  # the final defaults (trigger in graphs of <= 8 rows, no prefetch): Inkling plain decode against
  # K = 3 MTP rounds at batch 1/8/32; the hybrids' tables at input 8192 / output 1024, batch 8 to 128
  step plain_inkling 60 $DECODE --model-path $INK --batch-sizes 1,8,32 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 32 --out "$R/json/plain_inkling.json"
  step spec_inkling_k3 90 $DECODE --model-path $INK --batch-sizes 1,8,32 --input-len 1024 --output-len 64 \
    --cuda-graph-max-bs 32 --speculative-algorithm mtp --speculative-num-steps 3 --out "$R/json/spec_inkling_k3.json"
  step inkling_8k_1024 ${T_INK8:-200} $DECODE --model-path $INK --batch-sizes 8,32,64,128 --input-len 8192 \
    --output-len 1024 --time-limit 60 --out "$R/json/inkling_8k_1024.json"
  step minimax_8k_1024 ${T_MM8:-220} $DECODE --model-path $MM --batch-sizes 8,32,64,128 --input-len 8192 \
    --output-len 1024 --time-limit 60 --out "$R/json/minimax_8k_1024.json"
}

lane0_pf3() {  # call 2's large batches ran slower than the eighth session's (other machine, longer output):
  # the same call, 9b1b466 (scratch/base) against this code with and without the small graphs' trigger
  local OLD="python scratch/base/benchmarks/decode_batch.py $C"
  for v in base new notrig; do
    local cmd="$DECODE" flag=""
    [ $v = base ] && cmd=$OLD
    [ $v = notrig ] && flag=--pdl-early-trigger-max-tokens=0
    step inkling_8k_$v 80 $cmd --model-path $INK --batch-sizes 64,128 --input-len 8192 --output-len 256 \
      --time-limit 40 $flag --out "$R/json/inkling_8k_$v.json"
  done
  for v in base new; do
    local cmd="$DECODE"
    [ $v = base ] && cmd=$OLD
    step spec_inkling_k3_b32_$v 60 $cmd --model-path $INK --batch-sizes 32 --input-len 1024 --output-len 64 \
      --cuda-graph-max-bs 32 --speculative-algorithm mtp --speculative-num-steps 3 --out "$R/json/spec_b32_$v.json"
  done
}

lane0_pf4() {  # OUTPUT_LEN (default 64), BATCHES (32), VARIANTS. call 3's K = 3 rounds at batch 32: 9.73 ms on 9b1b466 against 11.23 on this code; alternated,
  # with the small graphs' trigger off too
  local OLD="python scratch/base/benchmarks/decode_batch.py $C"
  for v in ${VARIANTS:-base new notrig base2 new2}; do
    local cmd="$DECODE" flag=""
    [ "${v%%[0-9]*}" = base ] && cmd=$OLD
    [ $v = notrig ] && flag=--pdl-early-trigger-max-tokens=0
    step spec_inkling_k3_b32_$v 60 $cmd --model-path $INK --batch-sizes ${BATCHES:-32} --input-len 1024 --output-len ${OUTPUT_LEN:-64} \
      --cuda-graph-max-bs 32 --speculative-algorithm mtp --speculative-num-steps 3 $flag --out "$R/json/spec_b32_$v.json"
  done
}

lane0_pf5() {  # Inkling's o_conv in the o_proj GEMV's epilogue: the GPU tests it touches, then batch 1
  # against 9b1b466 (scratch/base)
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-150} python -m pytest -m gpu -q -rfE -p no:cacheprovider ${XDIST:-} tests/kernels/test_gemv.py \
    tests/kernels/test_conv_qk_norm.py tests/kernels/test_shortconv_kernels.py tests/engine/test_kernel_path.py \
    tests/engine/test_cuda_graph.py tests/engine/test_pdl.py tests/engine/test_hybrid_engine.py
  local HB="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  step inkling_b1_base 40 python scratch/base/benchmarks/decode_batch.py $C --model-path $INK $HB --out "$R/json/inkling_b1_base.json"
  step inkling_b1_new 40 $DECODE --model-path $INK $HB --out "$R/json/inkling_b1_new.json"
}
