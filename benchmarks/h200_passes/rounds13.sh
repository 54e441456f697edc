# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# thirteenth session (2026-12-03): the speculative rounds against today's plain step, where a
# round's time goes, and the batch-64 idle fraction; docs/benchmarks.md, eighteenth pass.
# shellcheck shell=bash

# K = 3 MTP rounds on the Inkling bench preset (the eighteenth pass's rounds command)
ROUNDS13="--model-path $INK --input-len 1024 --output-len 64 --cuda-graph-max-bs 32 --speculative-algorithm mtp \
  --speculative-num-steps 3"

rounds_vs_base13() {  # the tree against scratch/base at batch 1/8/32, alternated x2 (steps mtp3_{new,base}_{1,2})
  for r in 1 2; do
    step mtp3_new_$r 60 $DECODE $ROUNDS13 --batch-sizes 1,8,32 --out "$R/json/mtp3_new_$r.json"
    step mtp3_base_$r 60 python scratch/base/benchmarks/decode_batch.py $C $ROUNDS13 --batch-sizes 1,8,32 \
      --out "$R/json/mtp3_base_$r.json"
  done
}

lane0_rounds1() {  # the GPU tests of what the twelfth session changed on the CPU only (decode attention's
  # empty-sequence guard and early_kv masks, the shared rotation, the Llama layer's rope hand-over) and of the
  # speculative graphs; Inkling plain decode against K = 3 MTP rounds at batch 1/8/32; a K = 3 round's host
  # phases and GPU timeline at batch 1; the 8B's GPU idle fraction at batch 64
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-170} python -m pytest -m gpu -q -rfE -p no:cacheprovider ${XDIST:-} tests/kernels/test_gemv.py \
    tests/kernels/test_attention_kernels.py tests/kernels/test_rotary.py tests/engine/test_kernel_path.py \
    tests/engine/test_cuda_graph.py tests/engine/test_speculative.py tests/engine/test_host_sync.py
  local SP="--model-path $INK --input-len 1024 --output-len 64 --cuda-graph-max-bs 32"
  step inkling_plain 70 $DECODE $SP --batch-sizes 1,8,32 --out "$R/json/inkling_plain.json"
  step inkling_mtp3 80 $DECODE $SP --batch-sizes 1,8,32 --speculative-algorithm mtp --speculative-num-steps 3 \
    --out "$R/json/inkling_mtp3.json"
  step inkling_mtp3_phases 50 $DECODE $SP --batch-sizes 1 --speculative-algorithm mtp --speculative-num-steps 3 \
    --host-phases --profile-steps 20 --out "$R/json/inkling_mtp3_phases.json"
  step inkling_mtp3_profile 60 $DECODE $SP --batch-sizes 1 --speculative-algorithm mtp --speculative-num-steps 3 \
    --profile --profile-steps 10 --kernel-rows 70 --trace "$R/json/inkling_mtp3_trace.json.gz" \
    --out "$R/json/inkling_mtp3_profile.json"
  step llama8b_b64_idle 70 $DECODE --model-path $LLAMA --batch-sizes 64 --input-len 1024 --output-len 128 \
    --cuda-graph-max-bs 64 --profile --out "$R/json/llama8b_b64_idle.json"
}

lane0_host1() {  # fewer host ops on a round's critical path (50f3cd0) against e3550a8 (scratch/base): the GPU
  # tests of the graph, speculative and sampler paths; K = 3 MTP rounds at batch 1/8/32 alternated x2; host
  # phases of a batch-1 round, both; plain decode at batch 1, both
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-170} python -m pytest -m gpu -p no:cacheprovider -rfE ${XDIST:-} tests/engine/test_cuda_graph.py \
    tests/engine/test_speculative.py tests/engine/test_host_sync.py tests/engine/test_kernel_path.py \
    tests/engine/test_spec_sampled.py tests/engine/test_block_drafter.py tests/engine/test_draft_vocab.py \
    tests/engine/test_overlap.py tests/engine/test_page_tables.py
  local SP="$ROUNDS13"
  rounds_vs_base13
  step phases_new 40 $DECODE $SP --batch-sizes 1 --host-phases --profile-steps 20 --out "$R/json/phases_new.json"
  step phases_base 40 python scratch/base/benchmarks/decode_batch.py $C $SP --batch-sizes 1 --host-phases \
    --profile-steps 20 --out "$R/json/phases_base.json"
  local HB="--model-path $INK --batch-sizes 1 --input-len 1024 --output-len 256 --cuda-graph-max-bs 8"
  step plain_new 40 $DECODE $HB --out "$R/json/plain_new.json"
  step plain_base 40 python scratch/base/benchmarks/decode_batch.py $C $HB --out "$R/json/plain_base.json"
}

lane0_gemv13() {  # every GPU test (the host-ops change touches every graph replay); K = 3 MTP rounds at batch 1
  # with the verify's (4 rows) and the chain's (5 rows per layer) dense projections on Kiln's GEMV
  # (--gemv-max-rows 5; default 1: cuBLAS) alternated x2; then plain decode and K = 3 rounds at batch 1/8/32
  # in the same call (the speedup table)
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-230} python -m pytest -m gpu tests -p no:cacheprovider -rfE ${XDIST:-} --ignore tests/server
  local SP="$ROUNDS13"
  for r in 1 2; do
    step mtp3_b1_default_$r 60 $DECODE $SP --batch-sizes 1 --out "$R/json/mtp3_b1_default_$r.json"
    step mtp3_b1_g5_$r 45 $DECODE $SP --batch-sizes 1 --gemv-max-rows 5 --out "$R/json/mtp3_b1_g5_$r.json"
  done
  step plain_table 60 $DECODE --model-path $INK --input-len 1024 --output-len 64 --cuda-graph-max-bs 32 \
    --batch-sizes 1,8,32 --out "$R/json/plain_table.json"
  step mtp3_table 70 $DECODE $SP --batch-sizes 1,8,32 --out "$R/json/mtp3_table.json"
}

lane0_tile13() {  # the block drafters' GPU tests (their paged pass copies inputs with one multi-tensor copy since
  # e063100); the grouped MoE's tiles at a verify's 4 and 8 tokens swept (benchmarks.kernel_bench.moe --sweep, with
  # narrow-N candidates); a copy of the tree whose pick_config takes the fastest (scratch/v_tile, made by
  # scratch/make_tile_variant.py) against the tree, K = 3 MTP rounds at batch 1, alternated x2
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-90} python -m pytest -m gpu -p no:cacheprovider -rfE ${XDIST:-} tests/engine/test_block_pass.py \
    tests/engine/test_block_drafter.py tests/kernels/test_moe_kernels.py
  step moe_sweep ${T_SWEEP:-200} python -m benchmarks.kernel_bench.moe --tokens 4 8 --sweep --sweep-json "$R/json/moe_sweep.json"
  step variant 30 python scratch/make_tile_variant.py "$R/json/moe_sweep.json" scratch/v_tile
  step variant_check 60 python scratch/check_tile.py scratch/v_tile
  local SP="--model-path $INK --input-len 1024 --output-len 64 --cuda-graph-max-bs 8 --speculative-algorithm mtp \
    --speculative-num-steps 3"
  for r in 1 2; do
    step mtp3_b1_default_$r 60 $DECODE $SP --batch-sizes 1 --out "$R/json/mtp3_b1_default_$r.json"
    step mtp3_b1_tile_$r 60 python scratch/v_tile/benchmarks/decode_batch.py $C $SP --batch-sizes 1 \
      --out "$R/json/mtp3_b1_tile_$r.json"
  done
}

lane0_perreq13() {  # less host work per request (da64eb9) against 50f3cd0 (scratch/base; the code of calls 3-4):
  # the speculative GPU tests; K = 3 MTP rounds at batch 1/8/32 alternated x2; host phases of a batch-32 round, both
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-90} python -m pytest -m gpu -p no:cacheprovider -rfE ${XDIST:-} tests/engine/test_speculative.py \
    tests/engine/test_cuda_graph.py tests/engine/test_spec_sampled.py tests/engine/test_block_pass.py \
    tests/engine/test_page_tables.py tests/engine/test_host_sync.py tests/engine/test_draft_vocab.py
  local SP="$ROUNDS13"
  rounds_vs_base13
  step phases32_new 40 $DECODE $SP --batch-sizes 32 --host-phases --profile-steps 20 --out "$R/json/phases32_new.json"
  step phases32_base 40 python scratch/base/benchmarks/decode_batch.py $C $SP --batch-sizes 32 --host-phases \
    --profile-steps 20 --out "$R/json/phases32_base.json"
}
