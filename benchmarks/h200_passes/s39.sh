# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# thirty-ninth session (2026-12-06).
# `s39p`: the GPU test left unrun by the thirty-eighth session (no host sync in steady sampled
#   rounds under exact verification) and the draft-sampling GPU tests; then where a sampled MTP
#   round's extra ~0.5 ms over a greedy one goes at batch 1: Inkling `bench` K = 3 rounds, greedy
#   and sampled (T = 1, rejection sampling), each with the GPU kernel table (--profile) and the
#   host's phases (--host-phases); then plain sampled and greedy decode at batch 1/8/64. (It replaced
#   lane `s39`, which the thirty-eighth session had prepared: the same tests, without the profiles.)
# shellcheck shell=bash

S39_PROF="--profile --profile-steps 10 --kernel-rows 45 --host-phases"

lane0_s39p() {
  export TRITON_CACHE_DIR=/tmp/triton-s39p-$$
  local t1="--temperature 1.0" rs="--speculative-use-rejection-sampling"
  local plain="--model-path $INK --input-len 1024 --output-len 128 --cuda-graph-max-bs 64 --batch-sizes 1,8,64"
  step gpu_tests 200 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 4 tests/engine/test_host_sync.py \
    tests/engine/test_draft_sampling.py
  step greedy_prof 150 $DECODE $S38_ARGS $S38_MTP $S39_PROF --out "$R/json/greedy_prof.json"
  step rs_prof 150 $DECODE $S38_ARGS $S38_MTP $t1 $rs $S39_PROF --out "$R/json/rs_prof.json"
  step plain_t1 120 $DECODE $plain $t1 --out "$R/json/plain_t1.json"
  step plain_greedy 120 $DECODE $plain --out "$R/json/plain_greedy.json"
}

# `s39b`: the sampled round's verification in two launches (kiln/kernels/spec_verify.py), the
#   chain's draws without unread one-hot rows and torch's argmax replaced (bb6fc6e..): GPU tests
#   of the changed paths, then Inkling `bench` K = 3 sampled rounds (T = 1) at batch 1 and 8,
#   alternated against the session's start (carry scratch/base42 = `git archive aa52071 kiln
#   benchmarks/configs` plus this commit's benchmarks/*.py): rejection sampling twice each, block
#   verification and DFlash once each; greedy rounds as the control; the new kernel table.
lane0_s39b() {
  export TRITON_CACHE_DIR=/tmp/triton-s39b-$$
  local b42="python scratch/base42/benchmarks/decode_batch.py $C" t1="--temperature 1.0"
  local rs="--speculative-use-rejection-sampling" bv="--speculative-use-block-verification"
  _s38_dflash_config
  step gpu_tests 200 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 4 tests/kernels/test_spec_verify.py \
    tests/kernels/test_sampling_kernels.py tests/kernels/test_argmax.py tests/engine/test_draft_sampling.py \
    tests/engine/test_spec_sampled.py tests/engine/test_sampler.py tests/engine/test_host_sync.py
  step rs_now 90 $DECODE $S38_ARGS $S38_MTP $t1 $rs --out "$R/json/rs_now.json"
  step rs_base 90 $b42 $S38_ARGS $S38_MTP $t1 $rs --out "$R/json/rs_base.json"
  step rs_now_2 60 $DECODE $S38_ARGS $S38_MTP $t1 $rs --out "$R/json/rs_now_2.json"
  step rs_base_2 60 $b42 $S38_ARGS $S38_MTP $t1 $rs --out "$R/json/rs_base_2.json"
  step bv_now 60 $DECODE $S38_ARGS $S38_MTP $t1 $bv --out "$R/json/bv_now.json"
  step bv_base 60 $b42 $S38_ARGS $S38_MTP $t1 $bv --out "$R/json/bv_base.json"
  step dflash_now 60 $DECODE $S38_DFLASH --out "$R/json/dflash_now.json"
  step dflash_base 60 $b42 $S38_DFLASH --out "$R/json/dflash_base.json"
  step greedy 60 $DECODE $S38_ARGS $S38_MTP --out "$R/json/greedy.json"
  step rs_prof 60 $DECODE $S38_ARGS $S38_MTP $t1 $rs --batch-sizes 1 --profile --profile-steps 10 --kernel-rows 45 \
    --out "$R/json/rs_prof.json"
}

# `s39c`: the GPU tests of test_spec_sampled.py again (the chi-square's broken variant now breaks
#   the reference, as the kernel has no seam), the sampling kernels' chunk sweep
#   (`benchmarks.kernel_bench.sampled_round`), and end to end the `_apply_kernel` / verification
#   chunk at 8192 (the default) against 2048 and 1024: Inkling `bench` sampled K = 3 rounds at
#   batch 1 and 8, plain sampled decode at 1, 8 and 64.
# decode_batch.py with the sampling kernels' chunk set: python -c "$S39_CHUNK_PY" CHUNK ARGS...
S39_CHUNK_PY="import sys, runpy; import kiln.kernels.sampling as s, kiln.kernels.spec_verify as v
c = int(sys.argv[1]); s.APPLY['CHUNK'] = c; v.CHUNK = min(c, 4096); sys.argv = ['decode_batch.py'] + sys.argv[2:]
runpy.run_path('benchmarks/decode_batch.py', run_name='__main__')"

lane0_s39c() {
  export TRITON_CACHE_DIR=/tmp/triton-s39c-$$
  local t1="--temperature 1.0" rs="--speculative-use-rejection-sampling"
  local plain="--model-path $INK --input-len 1024 --output-len 128 --cuda-graph-max-bs 64 --batch-sizes 1,8,64"
  step gpu_tests 150 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 2 tests/engine/test_spec_sampled.py
  step sweep 90 python -m benchmarks.kernel_bench.sampled_round
  for c in 8192 2048 1024; do
    step rs_$c 60 python -c "$S39_CHUNK_PY" $c $C $S38_ARGS $S38_MTP $t1 $rs --out "$R/json/rs_$c.json"
  done
  for c in 8192 2048 1024; do
    step plain_$c 60 python -c "$S39_CHUNK_PY" $c $C $plain $t1 --out "$R/json/plain_$c.json"
  done
  step rs_8192_2 60 python -c "$S39_CHUNK_PY" 8192 $C $S38_ARGS $S38_MTP $t1 $rs --out "$R/json/rs_8192_2.json"
}

# decode_batch.py with the sampler's softmax back on torch's ops (the kernels' softmax until
# the thirty-ninth session): python -c "$S39_TORCH_SOFTMAX_PY" ARGS...
S39_TORCH_SOFTMAX_PY="import sys, runpy, torch; import kiln.kernels.sampling as s
def torch_softmax(logits, temperatures):
    t = torch.where(temperatures == 0, torch.ones_like(temperatures), temperatures)
    return torch.softmax(logits.float() / t.unsqueeze(1), dim=-1)
s._softmax = torch_softmax; sys.argv = ['decode_batch.py'] + sys.argv[1:]
runpy.run_path('benchmarks/decode_batch.py', run_name='__main__')"

# `s39d`: the session's last pass: the GPU tests of everything the session changed (sampling
#   kernels with the two-launch softmax and 1K chunks, verification kernel, sampler, draft sampling,
#   exact verification's chi-square, host sync), the kernel sweep, then Inkling `bench` sampled
#   K = 3 rounds (rejection sampling) and plain sampled decode with the new softmax against
#   torch's (alternated), the session's start (carry scratch/base42), block verification and
#   DFlash now, and greedy rounds and plain greedy decode as controls.
lane0_s39d() {
  export TRITON_CACHE_DIR=/tmp/triton-s39d-$$
  local b42="python scratch/base42/benchmarks/decode_batch.py $C" t1="--temperature 1.0" tsm="python -c"
  local rs="--speculative-use-rejection-sampling" bv="--speculative-use-block-verification"
  local plain="--model-path $INK --input-len 1024 --output-len 128 --cuda-graph-max-bs 64 --batch-sizes 1,8,64"
  _s38_dflash_config
  step gpu_tests 200 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 4 tests/kernels/test_sampling_kernels.py \
    tests/kernels/test_spec_verify.py tests/engine/test_sampler.py tests/engine/test_spec_sampled.py \
    tests/engine/test_draft_sampling.py tests/engine/test_host_sync.py
  step sweep 60 python -m benchmarks.kernel_bench.sampled_round --chunks 1024 --rows 1,8,32
  step rs_now 60 $DECODE $S38_ARGS $S38_MTP $t1 $rs --out "$R/json/rs_now.json"
  step rs_torchsm 60 $tsm "$S39_TORCH_SOFTMAX_PY" $C $S38_ARGS $S38_MTP $t1 $rs --out "$R/json/rs_torchsm.json"
  step rs_base42 60 $b42 $S38_ARGS $S38_MTP $t1 $rs --out "$R/json/rs_base42.json"
  step rs_now_2 60 $DECODE $S38_ARGS $S38_MTP $t1 $rs --out "$R/json/rs_now_2.json"
  step rs_torchsm_2 60 $tsm "$S39_TORCH_SOFTMAX_PY" $C $S38_ARGS $S38_MTP $t1 $rs --out "$R/json/rs_torchsm_2.json"
  step plain_now 60 $DECODE $plain $t1 --out "$R/json/plain_now.json"
  step plain_torchsm 60 $tsm "$S39_TORCH_SOFTMAX_PY" $C $plain $t1 --out "$R/json/plain_torchsm.json"
  step plain_base42 60 $b42 $plain $t1 --out "$R/json/plain_base42.json"
  step plain_greedy 60 $DECODE $plain --out "$R/json/plain_greedy.json"
  step bv_now 60 $DECODE $S38_ARGS $S38_MTP $t1 $bv --out "$R/json/bv_now.json"
  step dflash_now 60 $DECODE $S38_DFLASH --out "$R/json/dflash_now.json"
  step greedy 60 $DECODE $S38_ARGS $S38_MTP --out "$R/json/greedy.json"
}

# `s39e`: the sampling kernels' GPU tests after the softmax moved to kiln/kernels/softmax.py, and
#   what top-p costs: the filter's `_select_kernel` per launch shape (`sampled_round --select`),
#   plain sampled decode at top-p 0.9 and 1.0 (batch 1/8/64).
lane0_s39e() {
  export TRITON_CACHE_DIR=/tmp/triton-s39e-$$
  local plain="--model-path $INK --input-len 1024 --output-len 128 --cuda-graph-max-bs 64 --batch-sizes 1,8,64"
  step gpu_tests 150 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 4 tests/kernels/test_sampling_kernels.py \
    tests/kernels/test_spec_verify.py
  step select 90 python -m benchmarks.kernel_bench.sampled_round --rows 1,8,64 \
    --select 8:4096:1024:8,16:4096:1024:8,32:8192:2048:8,8:4096:1024:16,8:4096:512:4,16:8192:1024:16
  step plain_p09 60 $DECODE $plain --temperature 1.0 --top-p 0.9 --out "$R/json/plain_p09.json"
  step plain_p10 60 $DECODE $plain --temperature 1.0 --out "$R/json/plain_p10.json"
}

# `s39f`: the ShortConv kernel unspecialised on its metadata pointers' alignment and on T and B
#   (five variants at the first prefill batch of 64 in the thirty-eighth pass): its GPU tests (one
#   variant per mode), compile_watch on an empty cache at a first sampled batch of 64, and plain
#   greedy decode at batch 1/8/64 against the code before (carry scratch/base43 = `git archive
#   38c6dd6 kiln benchmarks/configs` plus this commit's benchmarks/*.py).
lane0_s39f() {
  export TRITON_CACHE_DIR=/tmp/triton-s39f-$$
  local a="--dummy-init auto --model-path $INK --input-len 1024 --output-len 32 --cuda-graph-max-bs 64 --batch-sizes 64,64"
  local plain="--model-path $INK --input-len 1024 --output-len 128 --cuda-graph-max-bs 64 --batch-sizes 1,8,64"
  step gpu_tests 60 python -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/kernels/test_shortconv_kernels.py
  step watch_sampled 100 python benchmarks/compile_watch.py $a --temperature 1.0
  step plain_now 45 $DECODE $plain --out "$R/json/plain_now.json"
  step plain_base43 60 python scratch/base43/benchmarks/decode_batch.py $C $plain --out "$R/json/plain_base43.json"
}
