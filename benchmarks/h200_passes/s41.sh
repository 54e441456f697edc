# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# forty-first session (2026-12-06).
# shellcheck shell=bash

# `s41a`: a block drafter's K sampled positions drawn in one filter and one race
#   (`DraftSampling.draw_block`): the GPU tests of the draws and the block drafters' device rounds,
#   then DFlash K = 3 sampled rounds (T = 1, rejection sampling) at batch 1 and 8 alternated against
#   the session's start (carry scratch/base45 = `git archive 7c67b86 kiln benchmarks/configs` plus
#   this commit's benchmarks/*.py); GPU kernel tables of the batch-8 rounds now, at the session's
#   start and at the fortieth session's (carry scratch/base44 = e37c5de, the same way), for the
#   fortieth session's +0.16 ms; plain sampled decode with min-p alone (the chunked launches
#   skipped, `SamplingBatch.searches`) now against e37c5de, which had none; the kernel table of an
#   MTP K = 3 greedy round and of a plain step at batch 1.
lane0_s41a() {
  export TRITON_CACHE_DIR=/tmp/triton-s41a-$$
  local b44="python scratch/base44/benchmarks/decode_batch.py $C" b45="python scratch/base45/benchmarks/decode_batch.py $C"
  local prof="--batch-sizes 8 --profile --profile-steps 10 --kernel-rows 30"
  local minp="--model-path $INK --input-len 1024 --output-len 128 --cuda-graph-max-bs 8 --batch-sizes 1 --temperature 1.0 --min-p 0.05"
  _s38_dflash_config
  step gpu_tests 150 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 4 tests/engine/test_draft_sampling.py \
    tests/engine/test_block_rounds_on_device.py
  for i in 1 2; do
    step df_now_$i 90 $DECODE $S38_DFLASH --out "$R/json/df_now_$i.json"
    step df_b45_$i 60 $b45 $S38_DFLASH --out "$R/json/df_b45_$i.json"
  done
  step df_prof_now 60 $DECODE ${S38_DFLASH/--batch-sizes 1,8/} $prof --out "$R/json/df_prof_now.json"
  step df_prof_b45 60 $b45 ${S38_DFLASH/--batch-sizes 1,8/} $prof --out "$R/json/df_prof_b45.json"
  step df_prof_b44 60 $b44 ${S38_DFLASH/--batch-sizes 1,8/} $prof --out "$R/json/df_prof_b44.json"
  step minp_now 60 $DECODE $minp --out "$R/json/minp_now.json"
  step minp_b44 60 $b44 $minp --out "$R/json/minp_b44.json"
  step minp_now_2 40 $DECODE $minp --out "$R/json/minp_now_2.json"
  step minp_b44_2 40 $b44 $minp --out "$R/json/minp_b44_2.json"
  step mtp_prof 60 $DECODE $S38_ARGS $S38_MTP --batch-sizes 1 --profile --profile-steps 10 --kernel-rows 45 \
    --out "$R/json/mtp_prof.json"
  step plain_prof 60 $DECODE $S38_ARGS --batch-sizes 1 --profile --profile-steps 10 --kernel-rows 20 \
    --out "$R/json/plain_prof.json"
}

# `s41b`: the headline numbers on the current code: Inkling and MiniMax-M3 `bench` at batch 1
#   (three runs each: the roofline fraction), the 8B shape at batch 1 (Kiln only), MTP K = 3 greedy
#   rounds against plain decode at batch 1 / 8 / 32, and sampled rounds (T = 1, rejection sampling)
#   of MTP and DFlash K = 3 at batch 1 and 8.
lane0_s41b() {
  export TRITON_CACHE_DIR=/tmp/triton-s41b-$$
  local r="--input-len 1024 --output-len 128 --cuda-graph-max-bs 32 --batch-sizes 1,8,32 --warmup on"
  _s38_dflash_config
  for i in 1 2 3; do hybrids_b1 _$i 70; done
  step llama8b_b1 90 $DECODE --model-path $LLAMA --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8 \
    --out "$R/json/llama8b_b1.json"
  step mtp3 90 $DECODE --model-path $INK $r $S38_MTP --out "$R/json/mtp3.json"
  step plain 60 $DECODE --model-path $INK $r --out "$R/json/plain.json"
  step mtp3_rs 60 $DECODE $S38_ARGS $S38_MTP --temperature 1.0 --speculative-use-rejection-sampling --out "$R/json/mtp3_rs.json"
  step df_rs 60 $DECODE $S38_DFLASH --out "$R/json/df_rs.json"
}

# `s41c`: `draw_block` with its per-request constants contiguous (0862adc; at one request s41a's
#   positions 1.. read the padding rows' constants): the GPU tests of the draws and of strided
#   per-row inputs, DFlash K = 3 sampled rounds at batch 1 and 8 alternated against the session's
#   start (carry scratch/base45) and once against e37c5de (carry scratch/base44), and the batch-8
#   rounds' host waits on the device (--sync-audit) and timeline (GPU gaps) now, for the +0.1 ms
#   that remains against e37c5de (whose kernel table call 1 has).
lane0_s41c() {
  export TRITON_CACHE_DIR=/tmp/triton-s41c-$$
  local b44="python scratch/base44/benchmarks/decode_batch.py $C" b45="python scratch/base45/benchmarks/decode_batch.py $C"
  _s38_dflash_config
  step gpu_tests 120 python -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 3 tests/engine/test_draft_sampling.py \
    tests/kernels/test_sampling_kernels.py -k "block_draws or strided or block_rounds"
  for i in 1 2; do
    step df_now_$i 90 $DECODE $S38_DFLASH --out "$R/json/df_now_$i.json"
    step df_b45_$i 45 $b45 $S38_DFLASH --out "$R/json/df_b45_$i.json"
  done
  step df_b44 45 $b44 $S38_DFLASH --out "$R/json/df_b44.json"
  step df8_audit_now 45 $DECODE ${S38_DFLASH/--batch-sizes 1,8/} --batch-sizes 8 --sync-audit --profile-steps 10 \
    --out "$R/json/df8_audit_now.json"
  step df8_trace_now 45 $DECODE ${S38_DFLASH/--batch-sizes 1,8/} --batch-sizes 8 --profile --profile-steps 10 \
    --kernel-rows 8 --trace "$R/df8_now.json.gz" --out "$R/json/df8_trace_now.json"
}

# `s41d`: the batch-8 sampled DFlash rounds' timelines at e37c5de and at this session's start, to
#   set beside call 3's of the current code (carry scratch/base44, scratch/base45).
lane0_s41d() {
  export TRITON_CACHE_DIR=/tmp/triton-s41d-$$
  local b44="python scratch/base44/benchmarks/decode_batch.py $C" b45="python scratch/base45/benchmarks/decode_batch.py $C"
  local tr="--batch-sizes 8 --profile --profile-steps 10 --kernel-rows 4"
  _s38_dflash_config
  step df8_trace_b44 90 $b44 ${S38_DFLASH/--batch-sizes 1,8/} $tr --trace "$R/df8_b44.json.gz" --out "$R/json/df8_trace_b44.json"
  step df8_trace_b45 60 $b45 ${S38_DFLASH/--batch-sizes 1,8/} $tr --trace "$R/df8_b45.json.gz" --out "$R/json/df8_trace_b45.json"
}

# `s41e` (written, not run: the session had no device time left; the next experiment): whether
#   the verify graph's lost PDL overlap (call 4: every MoE kernel of e37c5de's verify graph starts
#   before its predecessor ends, none of the current code's) comes with the block drafter's
#   context store inside that graph: MTP K = 3 greedy rounds at batch 8 (no context store) with
#   their timeline, now and at e37c5de; DFlash sampled rounds at batch 8 with PDL off, now and at
#   e37c5de (carry scratch/base44). Superseded by `s42a` (run: the store is not the cause) and
#   `s42b` (the bisection after it).
lane0_s41e() {
  export TRITON_CACHE_DIR=/tmp/triton-s41e-$$
  local b44="python scratch/base44/benchmarks/decode_batch.py $C"
  local tr="--batch-sizes 8 --profile --profile-steps 10 --kernel-rows 2"
  _s38_dflash_config
  step mtp8_trace_now 60 $DECODE ${S38_ARGS/--batch-sizes 1,8/} $S38_MTP $tr --trace "$R/mtp8_now.json.gz" --out "$R/json/mtp8_now.json"
  step mtp8_trace_b44 60 $b44 ${S38_ARGS/--batch-sizes 1,8/} $S38_MTP $tr --trace "$R/mtp8_b44.json.gz" --out "$R/json/mtp8_b44.json"
  step df8_nopdl_now 40 $DECODE ${S38_DFLASH/--batch-sizes 1,8/} --batch-sizes 8 --disable-pdl --out "$R/json/df8_nopdl_now.json"
  step df8_nopdl_b44 40 $b44 ${S38_DFLASH/--batch-sizes 1,8/} --batch-sizes 8 --disable-pdl --out "$R/json/df8_nopdl_b44.json"
}
