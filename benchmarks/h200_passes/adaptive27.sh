# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# twenty-seventh session (2026-12-05; not run in it, no device was lent): `--speculative-adaptive`
# on the GPU. Random MTP weights accept almost nothing, so the adaptive engine should find plain
# decode rows best at every batch size (a probe of each length now and then) and run as fast as plain
# decode, where fixed K = 3 rounds pay K + 1 rows and the MTP pass for ~1 token. `--ngram-always-draft`
# rounds (guesses, ~0 accepted) the same without a draft pass. Plus the GPU tests of the session
# (a verify graph per candidate length, the length changing mid-request).
# shellcheck shell=bash

AD27="--model-path $INK --input-len 1024 --output-len 128 --cuda-graph-max-bs 64 --batch-sizes 1,8,32,64"

lane0_adaptive27() {  # call 1: the session's GPU test; Inkling bench: plain, MTP K = 3 fixed and adaptive
  local mtp="--speculative-algorithm mtp --speculative-num-steps 3"
  step gpu_tests 120 python -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/engine/test_cuda_graph.py -k adaptive
  step ink_plain 100 $DECODE $AD27 --out "$R/json/ink_plain.json"
  step ink_mtp3 140 $DECODE $AD27 $mtp --out "$R/json/ink_mtp3.json"
  step ink_mtp3_adaptive 140 $DECODE $AD27 $mtp --speculative-adaptive --out "$R/json/ink_mtp3_adaptive.json"
}

lane0_adaptive27b() {  # call 2: Inkling bench: ngram K = 4 rounds (always drafting), fixed and adaptive
  local ng="--speculative-algorithm ngram --speculative-num-steps 4 --ngram-always-draft"
  step ink_ngram4 140 $DECODE $AD27 $ng --out "$R/json/ink_ngram4.json"
  step ink_ngram4_adaptive 140 $DECODE $AD27 $ng --speculative-adaptive --out "$R/json/ink_ngram4_adaptive.json"
}
