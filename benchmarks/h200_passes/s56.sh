# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# fifty-sixth session (2026-12-08, no device lent; for the next session).
# shellcheck shell=bash

# `s57a` (an H200 for the headline numbers; any card for the ratios): what the ceiling of
#   docs/speculative.md ("The 2.5x target at L = 3", `benchmarks/speedup_bound.py`) leaves open.
#   At L = 4 the MTP floor is 1.60 ms (full head) and 1.50 ms (16K-token map) against the 1.878 ms
#   that 2.5x needs on the H200; the rounds were last timed seven sessions of kernels ago (2.351
#   ms, forty-sixth pass), and never with a token map since the fifth pass. Alternated, batch 1,
#   1K / 128: plain decode, MTP K = 3 with the full head and with a 16K map, DFlash K = 3 (the
#   benches' 1-layer drafter) with both heads; then the verify's distinct experts again and the
#   ceiling recomputed from this call's plain step and copy bandwidth.
lane0_s57a() {
  export TRITON_CACHE_DIR=/tmp/triton-s57a-$$
  _s38_dflash_config
  python -c "import torch; torch.save(torch.arange(16384), '$R/map16k.pt')"
  local run="$DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8 --warmup on"
  local mtp="--speculative-algorithm mtp --speculative-num-steps 3" map="--speculative-token-map $R/map16k.pt"
  local df="--speculative-algorithm dflash --speculative-num-steps 3 --speculative-draft-model-path $R/dflash-bench"
  for i in 1 2; do
    step plain_$i 60 $run --out "$R/json/plain_$i.json"
    step mtp_$i 70 $run $mtp --out "$R/json/mtp_$i.json"
    step mtp_map_$i 70 $run $mtp $map --out "$R/json/mtp_map_$i.json"
    step df_$i 70 $run $df --out "$R/json/df_$i.json"
    step df_map_$i 70 $run $df $map --out "$R/json/df_map_$i.json"
  done
  step experts 120 $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 32 $mtp \
    --disable-cuda-graph --count-experts --out "$R/json/experts.json"
  python - "$R" <<'PY'
import json, glob, statistics, sys, subprocess
r = sys.argv[1]
def med(tag, key):
    vals = [json.load(open(f))["rows"][0][key] for f in sorted(glob.glob(f"{r}/json/{tag}_[12].json"))]
    return statistics.median(vals) if vals else None
plain = med("plain", "step_ms")
for tag in ("mtp", "mtp_map", "df", "df_map"):
    rnd = med(tag, "round_ms")
    if plain and rnd:
        print(f"=== {tag}: round {rnd:.3f} ms against plain {plain:.3f}: {3 * plain / rnd:.2f}x at L = 3, {4 * plain / rnd:.2f}x at L = 4")
bw = json.load(open(f"{r}/json/plain_1.json"))["meta"].get("measured_bandwidth")
if plain and bw:  # the ceiling from this call's plain step and bandwidth (the expert count: see `experts` above)
    subprocess.run([sys.executable, "benchmarks/speedup_bound.py", "--plain-step-ms", f"{plain:.4f}",
                    "--bandwidth-tbs", f"{bw / 1e12:.4f}", "--verify-experts", "11.9"], check=False)
PY
}
