# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# tenth session (2026-12-02): the one-token down expert GEMV's first tile before the PDL wait, and
# Inkling's out_conv in its epilogue: ep (call 1: a first design holding all slots at once, later
# dropped), ep2 (call 2), ep3 (call 3), ep4 (call 4); docs/benchmarks.md, fifteenth pass. ep6 is for the
# next device session (the fused router gate, built after the last call).
# shellcheck shell=bash

lane0_ep() {  # the GPU tests of the touched paths; the expert GEMVs alone (e81e8d4 in scratch/base against
  # new) and the down-tile sweep; Inkling and MiniMax-M3 batch 1, e81e8d4 against new
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-200} python -m pytest -m gpu -q -rfE -p no:cacheprovider ${XDIST:-} tests/kernels/test_moe_gemv.py \
    tests/kernels/test_moe_kernels.py tests/kernels/test_gemv.py tests/kernels/test_shortconv_kernels.py tests/layers \
    tests/engine/test_kernel_path.py tests/engine/test_cuda_graph.py tests/engine/test_pdl.py tests/engine/test_hybrid_engine.py
  step moe_gemv_base 60 bash -c "cd scratch/base && python -m benchmarks.kernel_bench.moe --gemv 1"
  step moe_gemv_new 60 python -m benchmarks.kernel_bench.moe --gemv 1
  step moe_gemv_sweep ${T_SWEEP:-120} python -m benchmarks.kernel_bench.moe --gemv-sweep
  local HB="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  for m in inkling:$INK minimax:$MM; do
    step ${m%%:*}_b1_base 40 python scratch/base/benchmarks/decode_batch.py $C --model-path ${m#*:} $HB \
      --out "$R/json/${m%%:*}_b1_base.json"
    step ${m%%:*}_b1_new 40 $DECODE --model-path ${m#*:} $HB --out "$R/json/${m%%:*}_b1_new.json"
  done
}

lane0_ep2() {  # call 1's down kernel (all slots at once) was slower; back to slot by slot, the first tile before
  # the wait. The expert GEMVs alone and batch 1: e81e8d4 (scratch/base), new, new with the gate/up kernel
  # of e81e8d4 (scratch/v_noup), alternated
  local HB="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  for v in base new noup; do
    local dir="scratch/$v"; [ $v = new ] && dir=.; [ $v = noup ] && dir=scratch/v_noup
    step moe_gemv_$v 60 bash -c "cd $dir && python -m benchmarks.kernel_bench.moe --gemv 1"
  done
  step moe_gemv_sweep ${T_SWEEP:-120} python -m benchmarks.kernel_bench.moe --gemv-sweep
  for m in inkling:$INK minimax:$MM; do
    for v in base new noup base2 new2; do
      local dir="scratch/base/"; [ "${v%2}" = new ] && dir=""; [ $v = noup ] && dir=scratch/v_noup/
      step ${m%%:*}_b1_$v 40 python ${dir}benchmarks/decode_batch.py $C --model-path ${m#*:} $HB \
        --out "$R/json/${m%%:*}_b1_$v.json"
    done
  done
}

lane0_ep3() {  # every GPU test; the expert GEMVs alone with the early trigger (as the engine's batch-1 graphs),
  # e81e8d4 (scratch/base) / new / new with the down kernel's first tile after the wait (scratch/v_late);
  # Inkling batch 1 alternated, three each
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-250} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider ${XDIST:-} --ignore tests/server
  local HB="--batch-sizes 1 --input-len 1024 --output-len 256 --cuda-graph-max-bs 8"
  local MICRO="from kiln.kernels.launch import early_trigger; from benchmarks.kernel_bench import moe
with early_trigger(True): moe.main(['--gemv', '1'])"
  for v in base new late base2 new2 late2; do
    local dir="scratch/${v%2}"; [ "${v%2}" = new ] && dir=.; [ "${v%2}" = late ] && dir=scratch/v_late
    step moe_gemv_trig_$v 60 bash -c "cd $dir && python -c \"$MICRO\""
  done
  for v in base new late base2 new2 late2 base3 new3 late3; do
    local dir="scratch/base/"; [ "${v%[23]}" = new ] && dir=""; [ "${v%[23]}" = late ] && dir=scratch/v_late/
    step inkling_b1_$v 60 python ${dir}benchmarks/decode_batch.py $C --model-path $INK $HB --out "$R/json/inkling_b1_$v.json"
  done
}

lane0_ep4() {  # MiniMax-M3 batch 1 alternated x3 (the early down tile alone: no ShortConv there); Inkling K = 3
  # MTP rounds at batch 1 (the verify's 4 tokens take the grouped path: expected unchanged), e81e8d4 vs new x2
  local HB="--batch-sizes 1 --input-len 1024 --output-len 256 --cuda-graph-max-bs 8"
  for v in base new base2 new2 base3 new3; do
    local dir="scratch/base/"; [ "${v%[23]}" = new ] && dir=""
    step minimax_b1_$v 60 python ${dir}benchmarks/decode_batch.py $C --model-path $MM $HB --out "$R/json/minimax_b1_$v.json"
  done
  for v in base new base2 new2; do
    local dir="scratch/base/"; [ "${v%2}" = new ] && dir=""
    step inkling_mtp3_$v 60 python ${dir}benchmarks/decode_batch.py $C --model-path $INK --batch-sizes 1 --input-len 1024 \
      --output-len 128 --cuda-graph-max-bs 8 --speculative-algorithm mtp --speculative-num-steps 3 --out "$R/json/inkling_mtp3_$v.json"
  done
}

lane0_ep6() {  # for the next device session: every GPU test (the two written after call 4 among them), then
  # --fused-router-gate off / on at batch 1 for both hybrids, alternated x3
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-250} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider ${XDIST:-} --ignore tests/server
  local HB="--batch-sizes 1 --input-len 1024 --output-len 256 --cuda-graph-max-bs 8"
  for m in inkling:$INK minimax:$MM; do
    for v in off on off2 on2 off3 on3; do
      local flag=""; [ "${v%[23]}" = on ] && flag=--fused-router-gate
      step ${m%%:*}_b1_gate_$v 60 $DECODE --model-path ${m#*:} $HB $flag --out "$R/json/${m%%:*}_b1_gate_$v.json"
    done
  done
}
