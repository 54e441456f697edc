# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# forty-third session (2026-12-06).
# shellcheck shell=bash

# `s43a`: whether the CUDA graphs whose replays hand off at +0.42 us a kernel (forty-second pass:
#   the sampled DFlash verify graph, MTP's chain graph) lost their programmatic (PDL) edges at
#   capture. `benchmarks/graph_edges.py` runs decode_batch.py with every captured graph kept and
#   prints each graph's kernel-to-kernel edges by type; with the batch-8 timelines
#   (`trace_rounds.py --segments`) a graph's edges sit beside its hand-offs. MTP K = 3 greedy and
#   DFlash K = 3 sampled now, DFlash at e37c5de (its verify graph fast in the forty-first pass) and
#   at the two commits after it that changed the sampled path (c95c8ce, ac756e0), DFlash greedy,
#   and DFlash sampled at batch 1. Carry scratch/base44, scratch/b_c95c8ce and scratch/b_ac756e0
#   (as in s42b, which this replaces).
lane0_s43a() {
  export TRITON_CACHE_DIR=/tmp/triton-s43a-$$
  local tr="--profile --profile-steps 10 --kernel-rows 2" b
  local mtp8="${S38_ARGS/--batch-sizes 1,8/} --batch-sizes 8 $S38_MTP $tr" df8="${S38_DFLASH/--batch-sizes 1,8/} --batch-sizes 8 $tr"
  local df1="${S38_DFLASH/--batch-sizes 1,8/} --batch-sizes 1 $tr"
  _s38_dflash_config
  for b in base44 b_c95c8ce b_ac756e0; do cp benchmarks/graph_edges.py scratch/$b/benchmarks/; done
  ge() {  # ge NAME LIMIT TREE DECODE_ARGS...: graph_edges.py of TREE (. or scratch/...) with its JSON and timeline
    local name=$1 lim=$2 tree=$3; shift 3
    step "$name" "$lim" python "$tree/benchmarks/graph_edges.py" --json "$R/json/$name.edges.json" -- $C "$@" \
      --trace "$R/$name.json.gz" --out "$R/json/$name.json"
  }
  ge mtp8 100 . $mtp8
  ge df8 60 . $df8
  ge df8_b44 60 scratch/base44 $df8
  ge df8_c95 60 scratch/b_c95c8ce $df8
  ge df8_ac7 60 scratch/b_ac756e0 $df8
  ge df8_greedy 60 . ${df8/--temperature 1.0 --speculative-use-rejection-sampling/}
  ge df1 50 . $df1
}

# `s43b` (after s43a: the slow replays keep the fast ones' edges, so the state is the GPU's at run
#   time, not the capture's): whether slow replays are PDL's (the sampled DFlash batch-8 timelines
#   with --disable-pdl at e37c5de, whose verify graph is fast, and now), and whether they come
#   with the number of graphs captured (DFlash sampled and MTP greedy at batch 1 with graphs of
#   batch 1 only, --cuda-graph-max-bs 1, against MTP with the usual 8). Carry scratch/base44.
lane0_s43b() {
  export TRITON_CACHE_DIR=/tmp/triton-s43b-$$
  local tr="--profile --profile-steps 10 --kernel-rows 2"
  local df8="${S38_DFLASH/--batch-sizes 1,8/} --batch-sizes 8 $tr" mtp1="${S38_ARGS/--batch-sizes 1,8/} --batch-sizes 1 $S38_MTP $tr"
  local df1="${S38_DFLASH/--batch-sizes 1,8/} --batch-sizes 1 $tr"
  _s38_dflash_config
  step df8_nopdl_b44 100 python scratch/base44/benchmarks/decode_batch.py $C $df8 --disable-pdl --trace "$R/df8_nopdl_b44.json.gz" --out "$R/json/df8_nopdl_b44.json"
  step df8_nopdl 60 $DECODE $df8 --disable-pdl --trace "$R/df8_nopdl.json.gz" --out "$R/json/df8_nopdl.json"
  step df1_bs1graphs 50 $DECODE ${df1/--cuda-graph-max-bs 8/--cuda-graph-max-bs 1} --trace "$R/df1_g1.json.gz" --out "$R/json/df1_g1.json"
  step mtp1_bs1graphs 50 $DECODE ${mtp1/--cuda-graph-max-bs 8/--cuda-graph-max-bs 1} --trace "$R/mtp1_g1.json.gz" --out "$R/json/mtp1_g1.json"
  step mtp1 50 $DECODE $mtp1 --trace "$R/mtp1.json.gz" --out "$R/json/mtp1.json"
}

# `s43c`: the whole GPU suite on the current code (last run whole in the thirty-sixth pass, s35a;
#   the sessions since ran the tests of what they changed).
lane0_s43c() {
  step gpu_suite 560 python -m pytest -m gpu -rfEs -p no:cacheprovider -n 6 tests --ignore tests/server
}

# `s43d` (after s43b: without PDL every graph hands off slowly, so the slow replays are replays that
#   lost PDL's effect; c95c8ce, the first commit with them, moved the block drafters' draws from
#   eager launches into graphs): the current code with the draws eager again after the pass's
#   replay (carry scratch/b_eager: this commit's kiln with `KILN_EAGER_DRAWS=1` running
#   `BlockPass._draws` eagerly instead of its graph; the diff is kept with the results), sampled
#   DFlash K = 3 rounds at batch 8 alternated with the current code, their timelines, and batch 1;
#   a plain batch-1 Inkling decode's timeline (whether plain decode graphs' replays are fast).
lane0_s43d() {
  export TRITON_CACHE_DIR=/tmp/triton-s43d-$$
  local eager="env KILN_EAGER_DRAWS=1 python scratch/b_eager/benchmarks/decode_batch.py $C"
  local tr="--profile --profile-steps 10 --kernel-rows 2" i
  local df8="${S38_DFLASH/--batch-sizes 1,8/} --batch-sizes 8" df1="${S38_DFLASH/--batch-sizes 1,8/} --batch-sizes 1"
  _s38_dflash_config
  for i in 1 2; do
    step df8_now_$i 90 $DECODE $df8 --out "$R/json/df8_now_$i.json"
    step df8_eager_$i 60 $eager $df8 --out "$R/json/df8_eager_$i.json"
  done
  step df8_eager_tr 50 $eager $df8 $tr --trace "$R/df8_eager.json.gz" --out "$R/json/df8_eager_tr.json"
  step df1_now 40 $DECODE $df1 --out "$R/json/df1_now.json"
  step df1_eager 40 $eager $df1 --out "$R/json/df1_eager.json"
  step plain1_tr 40 $DECODE ${S38_ARGS/--batch-sizes 1,8/} --batch-sizes 1 $tr --trace "$R/plain1.json.gz" --out "$R/json/plain1.json"
}

# `s43e`: the block drafters' draws eager after the pass's replay (4b5b4b2, after s43d): their GPU
#   tests (the draws, the device rounds, the paged pass), then sampled DFlash K = 3 rounds at
#   batch 1 and 8 with a timeline of batch 8.
lane0_s43e() {
  export TRITON_CACHE_DIR=/tmp/triton-s43e-$$
  local tr="--profile --profile-steps 10 --kernel-rows 2"
  _s38_dflash_config
  step gpu_tests 130 python -m pytest -m gpu -rfEs -p no:cacheprovider -n 4 tests/engine/test_draft_sampling.py \
    tests/engine/test_block_rounds_on_device.py tests/engine/test_block_pass.py
  step df 60 $DECODE $S38_DFLASH --out "$R/json/df.json"
  step df8_tr 40 $DECODE ${S38_DFLASH/--batch-sizes 1,8/} --batch-sizes 8 $tr --trace "$R/df8.json.gz" --out "$R/json/df8_tr.json"
}
