# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# fifty-fifth session (2026-12-07).
# shellcheck shell=bash

_s55_wheels() {  # xgrammar, apache-tvm-ffi and pydantic (xgrammar imports it) are not on the GPU image: carry .device_wheels (lane s56a)
  if ls .device_wheels/*.whl > /dev/null 2>&1; then
    python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device_wheels/*.whl \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
}

# `s55a` (an H200; carry .device_wheels): the fifty-fourth session's GPU tests (structured output
#   with overlap and graphs on, the profiler's CUDA kernels; the NCCL weight group skips on one
#   GPU), then the headline rows on the current code (lane `s41b`: the hybrids at batch 1 three
#   runs each, the 8B shape, MTP and sampled rounds; last on an H200 in the forty-sixth pass, seven
#   sessions of kernel changes ago), and a profile of Inkling's batch-1 step with PDL off (each
#   kernel charged its own time: the "what bounds the result, with a profile").
lane0_s55a() {
  export TRITON_CACHE_DIR=/tmp/triton-s55a-$$
  _s55_wheels
  step gpu_tests_s54 180 python -m pytest -q -p no:cacheprovider -m gpu -rfEs -n 4 tests/engine/test_grammar.py \
    tests/engine/test_profiler.py tests/dist/test_weight_update_group.py
  lane0_s41b
  step ink_b1_prof 60 $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8 \
    --disable-pdl --gemv-max-rows 1 --profile --profile-steps 20 --kernel-rows 24 --out "$R/json/ink_b1_prof.json"
}

# `s55b` (an H200: Inkling's KV at batch 32-128 does not fit 80 GB): lane `s50b`, both hybrids at
#   input 8192 / output 1024, batch 8 / 32 / 64 / 128 with the current kernels.
lane0_s55b() {
  lane0_s50b
}

# `s55c` (carry .device_wheels): the whole GPU suite (last whole in the fifty-first pass, on an
#   H100), then `s53d` (why a process's first sampled DFlash run is slow).
lane0_s55c() {
  export TRITON_CACHE_DIR=/tmp/triton-s55c-$$
  _s55_wheels
  step gpu_suite ${T_SUITE:-300} python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 8 tests
  lane0_s53d
}

# `s55d` (carry .device_wheels): `s55a` cut to what ~400 s hold, after starts that found no
#   machine: the GPU tests of structured output (with speculative decoding and overlap on CUDA)
#   and the profiler, the hybrids at batch 1 three runs each and the 8B shape (Kiln), and the
#   profile of Inkling's batch-1 step with PDL off.
lane0_s55d() {
  export TRITON_CACHE_DIR=/tmp/triton-s55d-$$
  _s55_wheels
  step gpu_tests_s54 150 python -m pytest -q -p no:cacheprovider -m gpu -rfEs -n 4 tests/engine/test_grammar.py \
    tests/engine/test_profiler.py tests/dist/test_weight_update_group.py
  for i in 1 2 3; do hybrids_b1 _$i 70; done
  step llama8b_b1 90 $DECODE --model-path $LLAMA --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8 \
    --out "$R/json/llama8b_b1.json"
  step ink_b1_prof 60 $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8 \
    --disable-pdl --gemv-max-rows 1 --profile --profile-steps 20 --kernel-rows 24 --out "$R/json/ink_b1_prof.json"
}

# `s56a` (for the next session; carry .device_wheels and scratch/smol_tok): what s55d found
#   missing on the GPU image: xgrammar imports pydantic (carry pydantic, pydantic-core,
#   annotated-types and typing-inspection wheels beside xgrammar's and apache-tvm-ffi's), and the
#   grammar tests' tiny model takes SmolLM2's tokenizer (`mkdir scratch/smol_tok; cp <the
#   embedded model's dir>/{tokenizer.json,tokenizer_config.json,chat_template.jinja}
#   scratch/smol_tok`). Then the structured-output GPU tests (plain with overlap, speculative
#   rounds on CUDA), the profiler's (config-only model since this session), and `s55b`'s tables
#   when the card is an H200.
lane0_s56a() {
  export TRITON_CACHE_DIR=/tmp/triton-s56a-$$ KILN_TEST_TOKENIZER_PATH=scratch/smol_tok
  _s55_wheels
  python -c "import xgrammar" || echo "=== xgrammar does not import: see the wheels above"
  step gpu_tests 200 python -m pytest -q -p no:cacheprovider -m gpu -rfEs -n 4 tests/engine/test_grammar.py \
    tests/engine/test_profiler.py
  local mib
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  if [ "${mib:-0}" -gt 100000 ]; then lane0_s50b; else echo "=== 8K tables: skipped (${mib} MiB: not an H200)"; fi
}
