# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# seventeenth session (2026-12-03): what each kernel adds to a batch-1 step's critical path, measured
# by cutting its launches (`benchmarks/critical_path.py`); docs/benchmarks.md, twenty-second pass.
# crit1 ran (calls 1-2) with a tool before 270a011 whose cuts did not all fix the routing; crit2 needs
# commit 15c4b55 (the gate inside the expert GEMVs, removed after it); crit3-crit5 run on any later tree.
# shellcheck shell=bash

CP="python benchmarks/critical_path.py"

cut_runs() {  # cut_runs TAG MODEL_ARGS CUT...: one decode_batch run per cut ("none": nothing cut)
  local tag=$1 margs=$2 lim=110; shift 2  # the first run of each model may compile
  for c in "$@"; do
    local flag="" name="${tag}_${c//,/+}"; [ "$c" != none ] && flag="--cut $c"
    [ -e "$R/json/$name.json" ] && name="${name}_$(date +%H%M%S)"  # a repeated cut keeps every run
    step "$name" $lim $CP $flag -- $C $margs --out "$R/json/$name.json"
    lim=45
  done
}

cut_table() {  # the step (or round) time of every run of this call, by tag and cut
  python - "$R/json" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    rows = json.load(open(f))["rows"]
    r = rows[0] if rows else {}
    print(f"{os.path.basename(f)[:-5]:40s} step {r.get('step_ms') or float('nan'):7.3f} ms  round {r.get('round_ms') or float('nan'):7.3f} ms  {r.get('note', '')}")
PY
}

lane0_crit1() {  # batch-1 steps of both hybrids and Inkling K = 3 rounds, with single kernels and groups cut
  local P1="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  cut_runs INK "--model-path $INK $P1" gate prologue attention expert_up expert_down experts none gemv norm \
    gate,prologue,attention gate,prologue,attention,norm,experts none
  cut_runs MM "--model-path $MM $P1" gate attention experts gemv gate,attention none
  local RD="--model-path $INK --batch-sizes 1 --input-len 1024 --output-len 64 --cuda-graph-max-bs 8 \
--speculative-algorithm mtp --speculative-num-steps 3"
  cut_runs RND "$RD" none gate attention grouped gemv norm
  cut_table
}

lane0_crit2() {  # GPU tests of the gate inside the expert GEMVs; batch 1 with it (default) and without, alternated x2
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-170} python -m pytest -m gpu -q -rfE -p no:cacheprovider ${XDIST:-} \
    tests/kernels/test_moe_gated_experts.py tests/kernels/test_moe_gemv.py tests/kernels/test_moe_kernels.py \
    tests/engine/test_kernel_path.py -k "gate or gemv or moe or expert or fold"
  local P1="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  for r in 1 2; do
    local lim=45; [ $r = 1 ] && lim=100
    step INK_gated_$r $lim $DECODE --model-path $INK $P1 --out "$R/json/INK_gated_$r.json"
    step INK_gatekernel_$r 45 $DECODE --model-path $INK $P1 --disable-gate-in-experts --out "$R/json/INK_gatekernel_$r.json"
    step MM_gated_$r $lim $DECODE --model-path $MM $P1 --out "$R/json/MM_gated_$r.json"
    step MM_gatekernel_$r 45 $DECODE --model-path $MM $P1 --disable-gate-in-experts --out "$R/json/MM_gatekernel_$r.json"
  done
  cut_table
}

lane0_crit3() {  # Inkling batch 1 again, every cut against the gate cut that each one implies now (critical_path.IMPLIES)
  local P1="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  cut_runs INK "--model-path $INK $P1" none gate prologue attention experts expert_down gemv gate none
  cut_table
}

lane0_crit4() {  # the cuts whose call-2 and call-4 times disagreed (gemv, experts) and the GEMV-only step, twice each
  local P1="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  cut_runs INK "--model-path $INK $P1" gemv experts prologue,attention,norm,experts gemv experts \
    prologue,attention,norm,experts
  cut_table
}

lane0_crit5() {  # the GEMV-only step and the gemv cut with the GPU idle fraction (--profile): is a slow run host-bound?
  local P1="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8 --profile"
  cut_runs INK "--model-path $INK $P1" prologue,attention,norm,experts prologue,attention,norm,experts \
    prologue,attention,norm,experts gemv gemv
  python - "$R/json" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    r = (json.load(open(f))["rows"] or [{}])[0]
    print(f"{os.path.basename(f)[:-5]:48s} step {r.get('step_ms') or float('nan'):7.3f} ms  GPU idle {r.get('gpu_idle_frac')}")
PY
}
