# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# eighteenth session (2026-12-03): where a batch-1 GEMV's time goes in a dependent chain, from
# per-program timestamps (`kiln.kernels.trace`, `benchmarks/kernel_bench/gemv_trace.py`).
# Each lane ran on the commit named in docs/benchmarks.md (twenty-third pass): the variant lanes edit
# the tile rule of their day, so at a later head they measure something else.
# shellcheck shell=bash

lane0_trace1() {  # the traced GEMV's GPU tests; the dense and o_proj chains with several tiles, trigger on and off
  step gpu_tests ${T_TESTS:-150} python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/kernels/test_gemv.py \
    -k "trace or prenorm_real or real_shapes"
  step gemv_trace ${T_TRACE:-240} python -m benchmarks.kernel_bench.gemv_trace --layers 24 --chains dense,o \
    --tiles rule,2x1024,4x512,8x256,16x128 --out "$R/json/trace1.json"
}

copy_tree() {  # copy_tree NAME: a copy of kiln/ and benchmarks/ at /tmp/v_NAME for a variant's edits; prints its path
  local d=/tmp/v_$1; rm -rf "$d"; mkdir -p "$d"; cp -r kiln benchmarks "$d"/; echo "$d"
}

variant() {  # variant NAME FMA_1ROW_K2048 PRENORM_1ROW [EXPERT_UP]: a copy of the tree with other batch-1 tiles
  local d; d=$(copy_tree "$1")
  python - "$d" "$2" "$3" "${4:-}" <<'PY'
import sys
d, fma, pre, up = sys.argv[1:5]
p = f"{d}/kiln/kernels/gemv.py"; s = open(p).read()
old_fma = "bn, bk, warps = (2, 1024, 4) if k <= 4096 else (4, 1024, 8)"
old_pre = "        return dict(BLOCK_N=4, BLOCK_K=512, num_warps=4, num_stages=1)"
assert old_fma in s and old_pre in s
bn, bk, w = pre.split(",")
s = s.replace(old_fma, f"bn, bk, warps = ({fma}) if k <= 2048 else (2, 1024, 4) if k <= 4096 else (4, 1024, 8)")
s = s.replace(old_pre, f"        return dict(BLOCK_N={bn}, BLOCK_K={bk}, num_warps={w}, num_stages=1) if k <= {bk} else "
                       "dict(BLOCK_N=4, BLOCK_K=512, num_warps=4, num_stages=1)")
open(p, "w").write(s)
if up:
    p = f"{d}/kiln/kernels/moe_gemv.py"; s = open(p).read()
    assert "GEMV_UP_TILE = (2, 1024, 4)" in s
    open(p, "w").write(s.replace("GEMV_UP_TILE = (2, 1024, 4)", f"GEMV_UP_TILE = ({up})"))
print("variant", d, fma, pre, up)
PY
}

lane0_trace2() {  # chains with one K tile per program; Inkling / MiniMax-M3 batch 1 with such tiles in the engine
  step gemv_trace ${T_TRACE:-200} python -m benchmarks.kernel_bench.gemv_trace --layers 24 --chains dense,o --trigger on \
    --tiles rule,1x2048,2x2048,2x2048/w8,4x2048/w8,8x2048/w8,4x2048/w16 --router-tile 1x2048 --out "$R/json/trace2.json"
  variant b "2, 2048, 8" "4,2048,8"
  variant c "1, 2048, 4" "2,2048,8"
  variant d "2, 2048, 8" "4,2048,8" "2, 2048, 8"
  local P1="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  step INK_base 110 $DECODE --model-path $INK $P1 --out "$R/json/INK_base.json"
  for v in b c d; do
    step INK_$v 100 python /tmp/v_$v/benchmarks/decode_batch.py $C --model-path $INK $P1 --out "$R/json/INK_$v.json"
  done
  step MM_base 110 $DECODE --model-path $MM $P1 --out "$R/json/MM_base.json"
  step MM_d 100 python /tmp/v_d/benchmarks/decode_batch.py $C --model-path $MM $P1 --out "$R/json/MM_d.json"
  python - "$R/json" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*_*.json"))):
    rows = json.load(open(f)).get("rows") or [{}]
    print(f"{os.path.basename(f)[:-5]:12s} step {rows[0].get('step_ms') or float('nan'):7.3f} ms")
PY
}

lane0_trace3() {  # the activation tiles one tile ahead (XPIPE) in the chains; GPU tests; both hybrids at batch 1, alternated
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-200} python -m pytest -m gpu -q -rfE -p no:cacheprovider ${XDIST:-} tests/kernels/test_gemv.py \
    tests/kernels/test_norm.py tests/kernels/test_gemv_add_norm.py tests/engine/test_kernel_path.py -k "gemv or fold or norm or greedy"
  step gemv_trace ${T_TRACE:-150} python -m benchmarks.kernel_bench.gemv_trace --layers 24 --chains dense,o --trigger on \
    --tiles rule,2x1024 --xpipe both --out "$R/json/trace3.json"
  local P1="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  variant_xpipe_off
  for r in 1 2; do
    step INK_xpipe_$r 100 $DECODE --model-path $INK $P1 --out "$R/json/INK_xpipe_$r.json"
    step INK_noxpipe_$r 100 python /tmp/v_nox/benchmarks/decode_batch.py $C --model-path $INK $P1 --out "$R/json/INK_noxpipe_$r.json"
  done
  step MM_xpipe 100 $DECODE --model-path $MM $P1 --out "$R/json/MM_xpipe.json"
  step MM_noxpipe 100 python /tmp/v_nox/benchmarks/decode_batch.py $C --model-path $MM $P1 --out "$R/json/MM_noxpipe.json"
  step_table
}

variant_xpipe_off() {  # a copy of the tree whose GEMV loads each activation tile in its own iteration
  local d; d=$(copy_tree nox)
  python - "$d" <<'PY'
import sys
p = f"{sys.argv[1]}/kiln/kernels/gemv.py"; s = open(p).read()
old = '**{"XPIPE": True, **tile}'
assert old in s
open(p, "w").write(s.replace(old, '**{"XPIPE": False, **tile}'))
PY
}

step_table() {  # the step time of every decode run of this call
  python - "$R/json" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*_*.json"))):
    d = json.load(open(f))
    if not isinstance(d, dict) or "rows" not in d:
        continue
    rows = d["rows"] or [{}]
    print(f"{os.path.basename(f)[:-5]:16s} step {rows[0].get('step_ms') or float('nan'):7.3f} ms")
PY
}

variant_rule() {  # variant_rule NAME QKVR_TILE O_TILE ROUTER_TILE: batch-1 tiles (BN,BK,warps) for K <= 2048
  local d; d=$(copy_tree "$1")
  python - "$d" "$2" "$3" "$4" <<'PY'
import sys
d, pre, fma, router = sys.argv[1:5]
p = f"{d}/kiln/kernels/gemv.py"; s = open(p).read()
old_fma = "bn, bk, warps = (2, 1024, 4) if k <= 4096 else (4, 1024, 8)"
old_pre = "    if m == 1 and n >= 2048:\n"
assert old_fma in s and old_pre in s
t = lambda v: "dict(BLOCK_N={}, BLOCK_K={}, num_warps={}, num_stages=1)".format(*v.split(","))
s = s.replace(old_fma, f"bn, bk, warps = ({fma}) if k <= 2048 else (2, 1024, 4) if k <= 4096 else (4, 1024, 8)")
s = s.replace(old_pre, f"    if m == 1 and k <= 2048:\n        return {t(pre)} if n >= 2048 else {t(router)}\n" + old_pre)
open(p, "w").write(s)
print("variant", d, "qkvr", pre, "o", fma, "router", router)
PY
}

lane0_trace4() {  # one-K-tile tiles (ONE_TILE) for qkvr / o / the router in the chain and in the engine at batch 1
  step gemv_trace ${T_TRACE:-150} python -m benchmarks.kernel_bench.gemv_trace --layers 24 --chains dense --trigger on \
    --tiles rule,8x2048/w8+4x2048/w8,16x2048/w16+2x2048/w8,8x2048/w8+rule,rule+4x2048/w8,rule+2x2048/w8 \
    --out "$R/json/trace4a.json"
  step gemv_trace_router ${T_TRACE:-100} python -m benchmarks.kernel_bench.gemv_trace --layers 24 --chains dense \
    --trigger on --tiles rule,8x2048/w8+4x2048/w8 --router-tile 1x2048 --out "$R/json/trace4b.json"
  variant_rule one1 "8,2048,8" "4, 2048, 8" "1,2048,4"
  variant_rule one2 "16,2048,16" "2, 2048, 8" "1,2048,4"
  local P1="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  for r in 1 2; do
    step INK_base_$r 100 $DECODE --model-path $INK $P1 --out "$R/json/INK_base_$r.json"
    for v in one1 one2; do
      step INK_${v}_$r 100 python /tmp/v_$v/benchmarks/decode_batch.py $C --model-path $INK $P1 --out "$R/json/INK_${v}_$r.json"
    done
  done
  step MM_base 100 $DECODE --model-path $MM $P1 --out "$R/json/MM_base.json"
  for v in one1 one2; do
    step MM_$v 100 python /tmp/v_$v/benchmarks/decode_batch.py $C --model-path $MM $P1 --out "$R/json/MM_$v.json"
  done
  step_table
}

lane0_trace5() {  # the one-tile rule and XPIPE in the code: every GPU test; both hybrids and the 8B at batch 1 against the session's start
  # scratch/base18 = `git archive 82d6277 kiln benchmarks/{decode_batch,common,roofline,dummy_weights}.py benchmarks/configs` (carried)
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  local P1="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8" B=scratch/base18/benchmarks/decode_batch.py
  for r in 1 2; do
    step INK_new_$r 100 $DECODE --model-path $INK $P1 --out "$R/json/INK_new_$r.json"
    step INK_start_$r 100 python $B $C --model-path $INK $P1 --out "$R/json/INK_start_$r.json"
    step MM_new_$r 100 $DECODE --model-path $MM $P1 --out "$R/json/MM_new_$r.json"
    step MM_start_$r 100 python $B $C --model-path $MM $P1 --out "$R/json/MM_start_$r.json"
  done
  step L8B_new 120 $DECODE --model-path $LLAMA $P1 --out "$R/json/L8B_new.json"
  step L8B_start 120 python $B $C --model-path $LLAMA $P1 --out "$R/json/L8B_start.json"
  step_table
  step gpu_tests ${T_TESTS:-200} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider ${XDIST:-} --ignore tests/server
}

lane0_slots1() {  # needs e196893 (GEMV_DOWN_ALL_SLOTS, removed after this call): the down GEMV's slots all at once at batch 1, its GPU tests
  local d; d=$(copy_tree all)
  sed -i 's/^GEMV_DOWN_ALL_SLOTS = False$/GEMV_DOWN_ALL_SLOTS = True/' "$d/kiln/kernels/moe_gemv.py"
  grep -n "^GEMV_DOWN_ALL_SLOTS" "$d/kiln/kernels/moe_gemv.py"
  local P1="--batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8"
  step INK_allslots 70 python $d/benchmarks/decode_batch.py $C --model-path $INK $P1 --out "$R/json/INK_allslots.json"
  step INK_slotbyslot 40 $DECODE --model-path $INK $P1 --out "$R/json/INK_slotbyslot.json"
  step_table
  step gpu_tests 60 python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/kernels/test_moe_gemv.py -k all_slots
}

lane0_moetrace1() {  # NOT RUN YET (prepared at the end of the eighteenth session): the traced expert GEMVs' GPU tests; the MoE chain's trace
  if ls .device_wheels/*.whl > /dev/null 2>&1; then pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  step gpu_tests ${T_TESTS:-150} python -m pytest -m gpu -q -rfE -p no:cacheprovider ${XDIST:-} tests/kernels/test_moe_gemv.py \
    tests/kernels/test_gemv.py tests/benchmarks/test_gemv_trace.py -k "trace or one_token or activation_tiles or moe_chain"
  step moe_trace ${T_TRACE:-200} python -m benchmarks.kernel_bench.gemv_trace --layers 24 --chains moe,dense --trigger on \
    --out "$R/json/moetrace1.json"
}
