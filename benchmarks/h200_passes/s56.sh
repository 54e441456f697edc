# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# defined in the fifty-sixth session (2026-12-08, no device lent) for the next session's passes,
# hence the `s57` names.
# shellcheck shell=bash

# `s57a` (an H200 for the headline numbers; any card for the ratios): what the ceiling of
#   docs/speculative.md ("The 2.5x target at L = 3", `benchmarks/speedup_bound.py`) leaves open.
#   At L = 4 the MTP floor is 1.60 ms (full head) and 1.50 ms (16K-token map) against the 1.878 ms
#   that 2.5x needs on the H200; the rounds were last timed seven sessions of kernels ago (2.351
#   ms, forty-sixth pass), and never with a token map since the fifth pass. Batch 1, 1K / 128:
#   plain decode, MTP K = 3 with the full head and with a 16K map, DFlash K = 3 (the benches'
#   1-layer drafter) with both heads; plain and MTP again; then the ratios and the ceiling from
#   this call's plain step and bandwidth (EXPERTS: the verify's distinct experts per MoE layer,
#   11.9 unless lane `s57b` counted otherwise). The limits add up to 520 s.
lane0_s57a() {
  export TRITON_CACHE_DIR=/tmp/triton-s57a-$$
  _s38_dflash_config
  python -c "import torch; torch.save(torch.arange(16384), '$R/map16k.pt')"
  local run="$DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8 --warmup on"
  local mtp="--speculative-algorithm mtp --speculative-num-steps 3" map="--speculative-token-map $R/map16k.pt"
  local df="--speculative-algorithm dflash --speculative-num-steps 3 --speculative-draft-model-path $R/dflash-bench"
  step plain_1 80 $run --out "$R/json/plain_1.json"
  step mtp_1 65 $run $mtp --out "$R/json/mtp_1.json"
  step mtp_map_1 65 $run $mtp $map --out "$R/json/mtp_map_1.json"
  step df_1 65 $run $df --out "$R/json/df_1.json"
  step df_map_1 65 $run $df $map --out "$R/json/df_map_1.json"
  step plain_2 50 $run --out "$R/json/plain_2.json"
  step mtp_2 65 $run $mtp --out "$R/json/mtp_2.json"
  step mtp_map_2 65 $run $mtp $map --out "$R/json/mtp_map_2.json"
  python - "$R" "${EXPERTS:-11.9}" <<'PY'
import glob, json, statistics, subprocess, sys
r, experts = sys.argv[1], sys.argv[2]
def runs(tag):
    out = []
    for f in sorted(glob.glob(f"{r}/json/{tag}_[12].json")):
        with open(f) as fh:
            d = json.load(fh)
        out.append((d["rows"][0], d["meta"]))
    return out
def med(tag, key):
    vals = [row.get(key) for row, _ in runs(tag) if row.get(key) is not None]
    return statistics.median(vals) if vals else None
plain = med("plain", "step_ms")
for tag in ("mtp", "mtp_map", "df", "df_map"):
    rnd = med(tag, "round_ms")
    if plain and rnd:
        print(f"=== {tag}: round {rnd:.3f} ms against plain {plain:.3f}: {3 * plain / rnd:.2f}x at L = 3, {4 * plain / rnd:.2f}x at L = 4")
bws = [m.get("measured_bandwidth") for _, m in runs("plain") if m.get("measured_bandwidth")]
if plain and bws:
    subprocess.run([sys.executable, "benchmarks/speedup_bound.py", "--plain-step-ms", f"{plain:.4f}",
                    "--bandwidth-tbs", f"{statistics.median(bws) / 1e12:.4f}", "--verify-experts", experts], check=False)
else:
    print("=== no plain run finished: no ceiling")
PY
}

# `s57b` (any card, ~2 min): the distinct routed experts a batch-1 K = 3 verify touches per MoE
#   layer on the current dummy weights (last counted in the eighteenth pass: 11.9), for s57a's
#   EXPERTS. Eager forwards (hooks), so not a timing run.
lane0_s57b() {
  export TRITON_CACHE_DIR=/tmp/triton-s57b-$$
  step experts 150 $DECODE --model-path $INK --batch-sizes 1 --input-len 1024 --output-len 32 \
    --speculative-algorithm mtp --speculative-num-steps 3 --disable-cuda-graph --count-experts --out "$R/json/experts.json"
}
