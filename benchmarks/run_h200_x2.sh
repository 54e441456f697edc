#!/usr/bin/env bash
# Two H200s (device kind nvidia-h200-x2), bf16, dummy weights: two lanes side by side, one per
# GPU (CUDA_VISIBLE_DEVICES), so that one call measures twice as much; `PHASE` picks the call.
#   PHASE=diag   lane 0: gpu-marked tests; decode profiles (GPU kernel table, host cProfile) of the
#                        8B shape at batch 1/64, Inkling bench at 1/8/64 (8K), MiniMax-M3 bench at
#                        1/32 (8K); Inkling MTP rounds (k=3) against plain decode at batch 1/8/32
#                lane 1: the agent trace, GPU-only caching against HiCache 2x and 4x
#   PHASE=tables lane 0: Inkling bench at batch 8/32/64/128, input 8192 / output 1024; MiniMax-M3
#                        bench at 8/32/64 (output 256); 8B batch-1 latency against transformers
#                lane 1: the agent trace again (as in diag)
#   PHASE=final  lane 0: gpu-marked tests (verbose); 8B batch-1 latency (Kiln only); Inkling MTP
#                        rounds (k=3) against plain decode at batch 1/8/32
#                lane 1: the agent trace's hicache-4x variant; nano-vllm's offline workload at the
#                        Qwen3-0.6B shape against transformers' continuous batching
#                then both GPUs: `run_h200_tp2.sh` (tp 2 tests, 8B and Inkling tables)
#   PHASE=spec   lane 0: gpu-marked tests of the fast path (kernels, graphs, speculative graphs);
#                        Inkling MTP rounds (k=1 and 3) against plain decode at batch 1/8/32
#                lane 1: 8B batch-1 latency against transformers; decode profiles of the 8B shape
#                        (batch 1/64) and Inkling bench (batch 1); small-kernel timings
#   PHASE=spec2|spec3|last|audit|ovl|tables2|offline2|final2|devround|phases|final3|offline3|bound|experts|tokenmap|pdl|pdl2|pdl3|pdl4|pdl5|gemv|gemv2|gemv3|gemv4|gemv5|gemv6|gemv7|gemv8|next|df|df2|fuse|fuse2|fuse3|trigger|msa|msa2|msa3|split|split2|verify8|tables8|prof8k|spec29a|spec29b|spec30a|spec31a|spec32a|spec32b|spec32c|spec32d|spec33a|spec33b|spec34a|spec34b|spec34c|spec34d|spec34e|spec34f|s35a|s35b|s35c|s35d|s36|s36r|s36a|s36b|s36c|s37|s37s|s37t|s38|s38s|s38b|s38c|s38d|s38e|s38f|s39p|s39b|s39c|s39d|s39e|s39f|s40a|s40b|s40c|s40d|s40e|s40f|s40g|s41a|s41b|s41c|s41d|s41e|s42a|s42b|s43a|s43b|s43c|s43d|s43e|s44a|s44b|s44c|s44d|s44h|s45a|s45b|s45c|s46a|s46b|s47a|s48a|s49a|s49b|s49c|s49d|s49e|s49f|s49g|s49h|s49i|s50a|s50b|s50c|s50d|s50e|s51a|s51b|s51c|s51d|s51e|s52a|s52b|s52c|s52d|s53a|s53b|s53c|s53d|s54a|s55a|s55b|s55c|s55d|s56a|s57a|s57b: later passes (see the lane functions in benchmarks/h200_passes/); spec3,
#                audit, offline3, bound, experts, tokenmap, pdl* and gemv have lane 0 only, so they run on one GPU too (device kind nvidia-h200);
#                tables2 ends with the tp 2 rows (run_h200_tp2.sh: 8B, Inkling and MiniMax-M3 batch 1)
#   PHASE=pf|pf2 and later: one lane (no lane1 function), on one GPU; the log's tail is printed
#   PHASE=tp2    both GPUs: `run_h200_tp2.sh` alone
# Every step is bounded by `timeout`; each lane's tables and logs go to $OUT/lane{0,1}.log.
#
#   PHASE=diag bash benchmarks/run_h200_x2.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
R=${OUT:-benchmarks/results/h200-x2-$(date +%Y%m%d-%H%M)}; mkdir -p "$R" "$R/json"
LLAMA=benchmarks/configs/llama-3.1-8b; QWEN=benchmarks/configs/qwen3-0.6b
INK=preset:inkling/bench; MM=preset:minimax_m3/bench
C="--dummy-init auto"
PHASE=${PHASE:-diag}

step() {  # step NAME LIMIT CMD...: one bounded command, its stdout and stderr into the lane log
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s, started $(date -u +%T))"
  timeout "$limit" "$@" 2>&1 || echo "=== $name: exit $? (124 = stopped by its limit)"
}
DECODE="python benchmarks/decode_batch.py $C"

hybrids_b1() {  # hybrids_b1 TAG LIMIT [FLAGS...]: Inkling and MiniMax-M3 bench at batch 1 with FLAGS
  local tag=$1 lim=$2; shift 2
  step inkling_b1$tag ${T_INK:-$lim} $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 128 \
    --cuda-graph-max-bs 8 "$@" --out "$R/json/inkling_b1$tag.json"
  step minimax_b1$tag ${T_MM:-$lim} $DECODE --model-path $MM --batch-sizes 1 --input-len 1024 --output-len 128 \
    --cuda-graph-max-bs 8 "$@" --out "$R/json/minimax_b1$tag.json"
}

alternated() {  # alternated NAME "BASE_CMD" ARGS...: `$DECODE ARGS` and `BASE_CMD ARGS` (another tree's
  # decode_batch.py) twice each, alternated, into NAME_now_{1,2} and NAME_base_{1,2}; the first run of
  # each tree compiles its kernels (and warms up at startup), so it gets a longer limit
  local name=$1 base=$2 i; shift 2
  for i in 1 2; do
    step ${name}_now_$i $((90 - 40 * (i - 1))) $DECODE "$@" --out "$R/json/${name}_now_$i.json"
    step ${name}_base_$i $((90 - 40 * (i - 1))) $base "$@" --out "$R/json/${name}_base_$i.json"
  done
}

kiln_rl_small() {  # kiln_rl_small RUN [FLAGS]...: `kiln rl` on the Inkling `small` preset with random weights and a
  # pseudo-random reward (benchmarks/timing_reward.py), 4 steps of 8 prompts x 4 samples in micro-batches of 8; each RUN
  # is "name[:flags]" (flags comma-separated); prints each run's metrics.jsonl. Needs scratch/smol_tok carried.
  local d=/tmp/inkling-small run name flags
  [ -d $d ] || step init_model 60 python -m kiln init-model --arch inkling --preset small --out $d --tokenizer-path scratch/smol_tok
  for run in "$@"; do
    name=${run%%:*}; flags=""; [ "$run" != "$name" ] && flags=${run#*:}
    step "$name" 130 python -m kiln rl --model-path $d --num-steps 4 --prompts-per-step 8 --samples-per-prompt 4 \
      --micro-batch-size 8 --reward benchmarks/timing_reward.py:reward --progress false ${flags//,/ } --out-dir "$R/json/$name"
  done
  for run in "$@"; do
    name=${run%%:*}; echo "== $name"; cat "$R/json/$name/metrics.jsonl"; rm -rf "$R/json/$name"/ckpt-*
  done
}

pack_outputs() {  # The device returns at most 8 files: every folder the lanes wrote (json/, a generated drafter
  # config) in one tarball, and the timelines in another when there are more than four.
  local dirs=() d
  for d in "$R"/*/; do [ -d "$d" ] && dirs+=("$(basename "$d")"); done
  if [ ${#dirs[@]} -gt 0 ]; then tar czf "$R/json.tgz" -C "$R" "${dirs[@]}" && rm -rf "${dirs[@]/#/$R/}"; fi
  local traces=("$R"/*.json.gz)
  if [ -e "${traces[0]}" ] && [ ${#traces[@]} -gt 4 ]; then
    tar czf "$R/traces.tgz" -C "$R" "${traces[@]##*/}" && rm -f "${traces[@]}"
  fi
}

# The lane functions, one file per group of passes.
for pass_file in benchmarks/h200_passes/*.sh; do source "$pass_file"; done

nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
python -c "import torch,triton,transformers;print('# torch',torch.__version__,'triton',triton.__version__,'transformers',transformers.__version__)"
case $PHASE in
  diag|tables|final|spec|spec2|spec3|last|audit|ovl|tables2|offline2|final2|devround|phases|final3|offline3|bound|experts|tokenmap|pdl|pdl2|pdl3|pdl4|pdl5|gemv|gemv2|gemv3|gemv4|gemv5|gemv6|gemv7|gemv8|next|df|df2|fuse|fuse2|fuse3|trigger|msa|msa2|msa3|split|split2|verify8|tables8|prof8k)
    (export CUDA_VISIBLE_DEVICES=0; lane0_$PHASE) > "$R/lane0.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1; lane1_$PHASE) > "$R/lane1.log" 2>&1 &
    wait
    if [ "$PHASE" = last ]; then OUT=$R/json/tp2 T0=0 T1=0 T2=0 T3=${TP_T3:-100} T4=0 bash benchmarks/run_h200_tp2.sh > "$R/tp2.log" 2>&1; fi
    if [ "$PHASE" = tables2 ]; then OUT=$R/json/tp2 T0=0 T1=${TP_T1:-90} T2=${TP_T2:-60} T3=${TP_T3:-60} T4=0 T5=${TP_T5:-60} \
      DECODE_ARGS="--batch-sizes 64 --input-len 1024 --output-len 128" bash benchmarks/run_h200_tp2.sh > "$R/tp2.log" 2>&1; fi
    if [ "$PHASE" = final2 ]; then OUT=$R/json/tp2 T0=0 T1=0 T2=0 T3=0 T4=${TP_T4:-240} \
      INK_DECODE_ARGS="--batch-sizes 8,32,64,128 --input-len 8192 --output-len 1024 --time-limit 40" \
      bash benchmarks/run_h200_tp2.sh > "$R/tp2.log" 2>&1; fi
    if [ "$PHASE" = final ]; then OUT=$R/json/tp2 T0=${TP_T0:-0} T1=${TP_T1:-100} T2=${TP_T2:-70} T3=${TP_T3:-0} T4=${TP_T4:-90} bash benchmarks/run_h200_tp2.sh > "$R/tp2.log" 2>&1; fi
    pack_outputs
    if [[ " devround phases final3 offline3 bound experts tokenmap pdl pdl2 pdl3 pdl4 pdl5 gemv gemv2 gemv3 gemv4 gemv5 gemv6 gemv7 gemv8 next df df2 fuse fuse2 fuse3 trigger msa msa2 msa3 split split2 verify8 tables8 prof8k " == *" $PHASE "* ]]; then grep -v "Warning\|_warn_once\|_set_sync_debug_mode\|^  *$" "$R/lane0.log" | tail -c 11000; exit 0; fi
    if [ "$PHASE" = audit ]; then grep -v "^\[" "$R/lane0.log" | grep -v "^  \+[0-9.]\+ us"; else grep -v "^\[" "$R/lane0.log" | grep -v "^  "; fi; echo; grep -v "^\[" "$R/lane1.log" | tail -30 ;;
  tp2) bash benchmarks/run_h200_tp2.sh ;;
  *) if declare -F "lane0_$PHASE" > /dev/null && ! declare -F "lane1_$PHASE" > /dev/null; then  # one-lane passes
       (export CUDA_VISIBLE_DEVICES=0; "lane0_$PHASE") > "$R/lane0.log" 2>&1
       pack_outputs
       grep -v "Warning\|_warn_once\|_set_sync_debug_mode\|^  *$" "$R/lane0.log" | tail -c 11000; exit 0
     fi
     echo "PHASE must be one of the lane functions' names above (diag, tables, ..., devround) or tp2"; exit 2 ;;
esac
