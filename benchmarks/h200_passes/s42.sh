# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# forty-second session (2026-12-06).
# shellcheck shell=bash

# `s42a`: why the sampled DFlash verify graph's kernel-to-kernel hand-offs slowed (forty-first pass:
#   every gap in that graph +0.3-0.6 us, none in the pass or draw graphs; the graph's only new
#   content is the drafter's context store, 9 kernels at its end). Batch-8 timelines of:
#   - MTP K = 3 greedy rounds (no context store) now, now with 9 and 30 trivial kernels at the end
#     of every forward, and at e37c5de: whether a larger graph alone slows its hand-offs;
#   - DFlash K = 3 sampled rounds now, now with the store in a graph of its own replayed right
#     after the forward's (carry scratch/b_split: `CudaGraphRunner(after_forward=...)`; batch 1
#     too), now without the store, now without the store and with 9 trivial kernels in its place;
#   - DFlash rounds at batch 1 and 8 just before and just after aa9a056 (the store moved inside).
#   Carry scratch/base44 (e37c5de), scratch/b_078779a and scratch/b_aa9a056 (`git archive <commit>
#   kiln benchmarks/configs` plus this commit's benchmarks/*.py), scratch/b_nostore (c5bf9d6's
#   kiln with experiment switches in `ModelRunner._forward_eager`: `KILN_NO_STORE=1` skips the
#   store, its drafts are then wrong and only its hand-offs are read; `KILN_PAD_NODES=N` adds N
#   one-element-add kernels before the LM head) and scratch/b_split; both builds are kept as diffs
#   in benchmarks/results/h100-2026-12-06-s42/call1_s42a/.
lane0_s42a() {
  export TRITON_CACHE_DIR=/tmp/triton-s42a-$$
  local exp="python scratch/b_nostore/benchmarks/decode_batch.py $C"
  local tr="--profile --profile-steps 10 --kernel-rows 2"
  local mtp8="${S38_ARGS/--batch-sizes 1,8/} --batch-sizes 8 $S38_MTP $tr" df8="${S38_DFLASH/--batch-sizes 1,8/} --batch-sizes 8 $tr"
  _s38_dflash_config
  step mtp8_now 100 $DECODE $mtp8 --trace "$R/mtp8_now.json.gz" --out "$R/json/mtp8_now.json"
  step mtp8_pad9 50 env KILN_PAD_NODES=9 $exp $mtp8 --trace "$R/mtp8_pad9.json.gz" --out "$R/json/mtp8_pad9.json"
  step df_now 60 $DECODE $S38_DFLASH $tr --trace "$R/df_now.json.gz" --out "$R/json/df_now.json"
  step df_split 60 python scratch/b_split/benchmarks/decode_batch.py $C $S38_DFLASH $tr --trace "$R/df_split.json.gz" --out "$R/json/df_split.json"
  step df8_nostore 60 env KILN_NO_STORE=1 $exp $df8 --trace "$R/df8_nostore.json.gz" --out "$R/json/df8_nostore.json"
  step mtp8_pad30 50 env KILN_PAD_NODES=30 $exp $mtp8 --trace "$R/mtp8_pad30.json.gz" --out "$R/json/mtp8_pad30.json"
  step mtp8_b44 60 python scratch/base44/benchmarks/decode_batch.py $C $mtp8 --trace "$R/mtp8_b44.json.gz" --out "$R/json/mtp8_b44.json"
  step df_pre 60 python scratch/b_078779a/benchmarks/decode_batch.py $C $S38_DFLASH $tr --trace "$R/df_pre.json.gz" --out "$R/json/df_pre.json"
  step df_post 60 python scratch/b_aa9a056/benchmarks/decode_batch.py $C $S38_DFLASH $tr --trace "$R/df_post.json.gz" --out "$R/json/df_post.json"
  step df8_nostore_pad9 60 env KILN_NO_STORE=1 KILN_PAD_NODES=9 $exp $df8 --trace "$R/df8_pad9.json.gz" --out "$R/json/df8_pad9.json"
}

# `s42b` (superseded by s43a, which ran its bisection with the graphs' edges; after s42a: the DFlash verify graph's hand-offs are as slow just before aa9a056 as after
#   it, and the MTP verify graph's are fast, now as at e37c5de): the sampled DFlash batch-8
#   timelines at e37c5de (fast in the forty-first pass) and at the two commits after it that
#   changed the sampled path (c95c8ce: the pass's draws inside its graph; ac756e0: the chunked
#   threshold table), and now greedy (s42a has now sampled); MTP greedy at batch 1 now (which of
#   its graphs hand off slowly there). Carry
#   scratch/base44, scratch/b_c95c8ce and scratch/b_ac756e0 (as in s42a).
lane0_s42b() {
  export TRITON_CACHE_DIR=/tmp/triton-s42b-$$
  local tr="--profile --profile-steps 10 --kernel-rows 2"
  local df8="${S38_DFLASH/--batch-sizes 1,8/} --batch-sizes 8 $tr"
  _s38_dflash_config
  step df8_b44 100 python scratch/base44/benchmarks/decode_batch.py $C $df8 --trace "$R/df8_b44.json.gz" --out "$R/json/df8_b44.json"
  step df8_c95 60 python scratch/b_c95c8ce/benchmarks/decode_batch.py $C $df8 --trace "$R/df8_c95.json.gz" --out "$R/json/df8_c95.json"
  step df8_ac7 60 python scratch/b_ac756e0/benchmarks/decode_batch.py $C $df8 --trace "$R/df8_ac7.json.gz" --out "$R/json/df8_ac7.json"
  step df8_greedy 60 $DECODE ${df8/--temperature 1.0 --speculative-use-rejection-sampling/} --trace "$R/df8_greedy.json.gz" --out "$R/json/df8_greedy.json"
  step mtp1_now 60 $DECODE ${S38_ARGS/--batch-sizes 1,8/} --batch-sizes 1 $S38_MTP $tr --trace "$R/mtp1_now.json.gz" --out "$R/json/mtp1_now.json"
}
