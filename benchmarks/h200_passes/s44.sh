# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# forty-fourth session (2026-12-06).
# shellcheck shell=bash

# `s44a`: whether MTP's chain graph replays slowly (+0.42 us a kernel, forty-third pass) because of
#   its four memcpy nodes: the out-of-place `index_copy`s that fed layer k - 1's draft token and
#   hidden state into layer k's draft row cloned their input first. Now a `where` and an in-place
#   copy into the fresh gather (no memcpy node). graph_edges.py and timelines of greedy MTP K = 3
#   at batch 1 and 8, now and at the session's start (carry scratch/b_9f597be = `git archive
#   9f597be kiln benchmarks/configs` plus this commit's benchmarks/*.py), unprofiled rounds
#   alternated, and greedy DFlash at batch 8 now (whether its verify replays stay fast without
#   the draws).
lane0_s44a() {
  export TRITON_CACHE_DIR=/tmp/triton-s44a-$$
  local tr="--profile --profile-steps 10 --kernel-rows 2" i
  local mtp1="${S38_ARGS/--batch-sizes 1,8/} --batch-sizes 1 $S38_MTP" mtp8="${S38_ARGS/--batch-sizes 1,8/} --batch-sizes 8 $S38_MTP"
  local df8="${S38_DFLASH/--batch-sizes 1,8/} --batch-sizes 8"
  local base="python scratch/b_9f597be/benchmarks/decode_batch.py $C"
  _s38_dflash_config
  ge() {  # ge NAME LIMIT TREE DECODE_ARGS...: graph_edges.py of TREE (. or scratch/...) with its JSON and timeline
    local name=$1 lim=$2 tree=$3; shift 3
    step "$name" "$lim" python "$tree/benchmarks/graph_edges.py" --json "$R/json/$name.edges.json" -- $C "$@" \
      --trace "$R/$name.json.gz" --out "$R/json/$name.json"
  }
  ge mtp1 90 . $mtp1 $tr
  ge mtp1_base 60 scratch/b_9f597be $mtp1 $tr
  ge mtp8 60 . $mtp8 $tr
  ge mtp8_base 60 scratch/b_9f597be $mtp8 $tr
  for i in 1 2; do
    step mtp_now_$i 60 $DECODE $S38_ARGS $S38_MTP --out "$R/json/mtp_now_$i.json"
    step mtp_base_$i 60 $base $S38_ARGS $S38_MTP --out "$R/json/mtp_base_$i.json"
  done
  step df8_greedy 60 $DECODE ${df8/--temperature 1.0 --speculative-use-rejection-sampling/} $tr \
    --trace "$R/df8_greedy.json.gz" --out "$R/json/df8_greedy.json"
}

# `s44h`: the headline numbers on the current code (as s41b; for an H200 when one comes): Inkling
#   and MiniMax-M3 `bench` at batch 1 (three runs each), the 8B shape at batch 1 (Kiln only), MTP
#   K = 3 greedy rounds against plain decode at batch 1 / 8 / 32, sampled rounds (T = 1, rejection
#   sampling) of MTP and DFlash K = 3 at batch 1 and 8.
lane0_s44h() {
  lane0_s41b
}

# `s44b` (after s44a: the chain stays slow without memcpy nodes; its timeline shows ~45 small
#   PyTorch launches deriving the rows and seven more per layer for the final norm's reference
#   ops): the rows in one Triton launch (`kiln.kernels.mtp_rows`) and the final norm on the kernel
#   path. The GPU tests of the chain and the kernel, then MTP K = 3 rounds at batch 1 and 8, greedy
#   and sampled (T = 1, rejection sampling), alternated with the session's start (carry
#   scratch/b_9f597be), and a batch-1 timeline.
lane0_s44b() {
  export TRITON_CACHE_DIR=/tmp/triton-s44b-$$
  local base="python scratch/b_9f597be/benchmarks/decode_batch.py $C" tr="--profile --profile-steps 10 --kernel-rows 2" i
  local rs="--temperature 1.0 --speculative-use-rejection-sampling"
  step gpu_tests 200 python -m pytest -m gpu -rfEs -p no:cacheprovider -n 4 tests/kernels/test_mtp_rows.py \
    tests/engine/test_cuda_graph.py tests/engine/test_spec_sampled.py tests/engine/test_verify_ahead.py \
    tests/engine/test_draft_vocab.py
  for i in 1 2; do
    step mtp_now_$i 60 $DECODE $S38_ARGS $S38_MTP --out "$R/json/mtp_now_$i.json"
    step mtp_base_$i 60 $base $S38_ARGS $S38_MTP --out "$R/json/mtp_base_$i.json"
  done
  step mtp_rs_now 60 $DECODE $S38_ARGS $S38_MTP $rs --out "$R/json/mtp_rs_now.json"
  step mtp_rs_base 60 $base $S38_ARGS $S38_MTP $rs --out "$R/json/mtp_rs_base.json"
  step mtp1_tr 60 $DECODE ${S38_ARGS/--batch-sizes 1,8/} --batch-sizes 1 $S38_MTP $tr --trace "$R/mtp1.json.gz" \
    --out "$R/json/mtp1_tr.json"
}

# `s44c` (after s44b): whether a verify's graph gains from what plain decode's already has. In a
#   plain batch-1 step the kernels overlap (sum of durations 2.17 ms in a 1.29 ms replay: PDL's
#   early trigger), in a K = 3 verify they do not (2.27 in 2.24). MTP K = 3 rounds at batch 1 and 8
#   with --pdl-early-trigger (every kernel, every graph), with the one-token MoE GEMVs up to 4
#   tokens (--moe-gemv-max-tokens 4) and with Kiln's GEMV up to 4 rows (--gemv-max-rows 4),
#   against the code as it is (alternated twice for the trigger), plain decode beside them, and
#   batch 32 with and without the trigger (the fourteenth pass saw it lose there). Then which
#   Triton kernel compiles during sampled MTP rounds at batch 8 (one round of 263-346 ms in the
#   forty-first and this session's passes): `benchmarks/compile_log.py`.
lane0_s44c() {
  export TRITON_CACHE_DIR=/tmp/triton-s44c-$$
  local rs="--temperature 1.0 --speculative-use-rejection-sampling" i
  local b32="--model-path $INK --input-len 1024 --output-len 128 --cuda-graph-max-bs 32 --batch-sizes 32 --warmup on"
  for i in 1 2; do
    step mtp_$i 60 $DECODE $S38_ARGS $S38_MTP --out "$R/json/mtp_$i.json"
    step mtp_trig_$i 60 $DECODE $S38_ARGS $S38_MTP --pdl-early-trigger --out "$R/json/mtp_trig_$i.json"
  done
  step mtp_moegemv 60 $DECODE $S38_ARGS $S38_MTP --moe-gemv-max-tokens 4 --out "$R/json/mtp_moegemv.json"
  step mtp_gemv4 60 $DECODE $S38_ARGS $S38_MTP --gemv-max-rows 4 --out "$R/json/mtp_gemv4.json"
  step plain 60 $DECODE $S38_ARGS --out "$R/json/plain.json"
  step mtp32 90 $DECODE $b32 $S38_MTP --out "$R/json/mtp32.json"
  step mtp32_trig 90 $DECODE $b32 $S38_MTP --pdl-early-trigger --out "$R/json/mtp32_trig.json"
  step compiles_rs 90 python benchmarks/compile_log.py -- $C $S38_ARGS $S38_MTP $rs --out "$R/json/compiles_rs.json"
}

# `s44d` (after s44c: the first sampled rounds at batch 8 compiled another variant of exact
#   verification's two kernels, whose drafts' and uniforms' strides differ between the host path
#   and the device round; those strides are no longer specialised. And the decode attention takes
#   a verify's positions with `len_offset` 1 instead of a `positions + 1` launch per layer): the
#   GPU tests of those kernels and of the engine paths that use them, which kernels compile during
#   sampled MTP rounds at batch 1 and 8 now (`compile_log.py`), MTP K = 3 greedy rounds and plain
#   decode at batch 1 and 8 alternated with 481c346 (carry scratch/b_481c346: before
#   `len_offset`).
lane0_s44d() {
  export TRITON_CACHE_DIR=/tmp/triton-s44d-$$
  local rs="--temperature 1.0 --speculative-use-rejection-sampling"
  local base="python scratch/b_481c346/benchmarks/decode_batch.py $C"
  step gpu_tests 150 python -m pytest -m gpu -rfEs -p no:cacheprovider -n 8 tests/kernels/test_spec_verify.py \
    tests/kernels/test_mtp_rows.py tests/kernels/test_attention_kernels.py tests/engine/test_spec_sampled.py \
    tests/engine/test_cuda_graph.py tests/engine/test_verify_ahead.py tests/engine/test_kernel_path.py
  step compiles_rs 90 python benchmarks/compile_log.py -- $C $S38_ARGS $S38_MTP $rs --out "$R/json/compiles_rs.json"
  alternated mtp "$base" $S38_ARGS $S38_MTP
  step plain 40 $DECODE $S38_ARGS --out "$R/json/plain.json"
}
