# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# fifty-fourth session (2026-12-07).
# shellcheck shell=bash

# `s54a` (carry .device_wheels with the xgrammar and apache-tvm-ffi wheels: the GPU machines have
#   neither; `pip download --no-deps --only-binary=:all: --python-version <the device's> -d
#   .device_wheels xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2`): the GPU tests of the fifty-fourth session's code, none of which ran on a GPU:
#   structured output with overlap scheduling and graphs on (a step with a constrained request is
#   read back before the next is queued), the profiler's CUDA kernels, the weight update group over
#   NCCL (skips on one GPU: it needs the trainer's and the engine's). Then `s53d` (why a process's
#   first sampled DFlash run is slow), which found no machine in the fifty-third session.
lane0_s54a() {
  export TRITON_CACHE_DIR=/tmp/triton-s54a-$$
  if ls .device_wheels/*.whl > /dev/null 2>&1; then python -m pip install -q --no-deps .device_wheels/*.whl; fi
  step gpu_tests 150 python -m pytest -q -p no:cacheprovider -m gpu -rfEs tests/engine/test_grammar.py \
    tests/engine/test_profiler.py tests/dist/test_weight_update_group.py
  lane0_s53d
}
