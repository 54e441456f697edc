# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# twenty-sixth session (2026-12-04; not run in it, no device was lent): prompt lookup
# (`--speculative-algorithm ngram`) on the GPU. Its rounds are a verify forward and nothing else (no
# drafter weights, no draft pass), so they bound what speculation can gain on this engine;
# `--ngram-always-draft` makes random weights verify K drafts every round. MTP K = 3 rounds and plain
# decode in the same call, for the speedup at the acceptance lengths measured on SmolLM2
# (docs/speculative.md, "Prompt lookup"). Also: offline generation with its text decoded once per
# sequence (detok26), and seeded sampling's counter-based noise (noise26).
# shellcheck shell=bash

NGRAM26="--input-len 1024 --output-len 64 --cuda-graph-max-bs 32"

lane0_ngram26() {  # call 1: Inkling bench at batch 1/8/32: plain, ngram K = 3 / 4, MTP K = 3
  local b="--batch-sizes 1,8,32" ng="--speculative-algorithm ngram --ngram-always-draft"
  step ink_plain 120 $DECODE --model-path $INK $NGRAM26 $b --out "$R/json/ink_plain.json"
  step ink_ngram3 150 $DECODE --model-path $INK $NGRAM26 $b $ng --speculative-num-steps 3 --out "$R/json/ink_ngram3.json"
  step ink_ngram4 150 $DECODE --model-path $INK $NGRAM26 $b $ng --speculative-num-steps 4 --out "$R/json/ink_ngram4.json"
  step ink_mtp3 150 $DECODE --model-path $INK $NGRAM26 $b --speculative-algorithm mtp --speculative-num-steps 3 \
    --out "$R/json/ink_mtp3.json"
}

lane0_ngram26b() {  # call 2: batch 1 only: Inkling ngram K = 8, and K = 4 with the 5-row verify on the GEMV loops
  # (8 rows in one tile; the 4-row loops were measured in the nineteenth pass); the 8B, plain and ngram K = 3 / 4
  local ng="--speculative-algorithm ngram --ngram-always-draft" l8=benchmarks/configs/llama-3.1-8b
  step ink_plain_b1 90 $DECODE --model-path $INK $NGRAM26 --batch-sizes 1 --out "$R/json/ink_plain_b1.json"
  step ink_ngram8 120 $DECODE --model-path $INK $NGRAM26 --batch-sizes 1 $ng --speculative-num-steps 8 \
    --out "$R/json/ink_ngram8.json"
  step ink_ngram4_g8m8 120 $DECODE --model-path $INK $NGRAM26 --batch-sizes 1 $ng --speculative-num-steps 4 \
    --gemv-max-rows 8 --moe-gemv-max-tokens 8 --out "$R/json/ink_ngram4_g8m8.json"
  step l8_plain 90 $DECODE --model-path $l8 $NGRAM26 --batch-sizes 1 --out "$R/json/l8_plain.json"
  for k in 3 4; do
    step l8_ngram$k 90 $DECODE --model-path $l8 $NGRAM26 --batch-sizes 1 $ng --speculative-num-steps $k \
      --out "$R/json/l8_ngram$k.json"
  done
}

lane0_detok26() {  # call 3 (carry scratch/base26 = `git archive 2072b9f kiln benchmarks/*.py benchmarks/kernel_bench
  # benchmarks/configs`, the session's start, and scratch/smol_tok): offline generation with text (cache_fill with
  # SmolLM2's tokenizer, batch 512), which now decodes each sequence's text once at the end, against the start
  # (two Rust decodes per token), alternated
  for r in 1 2; do
    step fill_new_$r 150 python benchmarks/cache_fill.py --chunks 2 --tokenizer-path scratch/smol_tok \
      --out "$R/json/fill_new_$r.json"
    step fill_base_$r 150 python scratch/base26/benchmarks/cache_fill.py --chunks 2 --tokenizer-path scratch/smol_tok \
      --out "$R/json/fill_base_$r.json"
  done
}

lane0_noise26() {  # call 4: seeded sampling noise, a torch generator per row
  # against the counter-based streams in one op (benchmarks/sampling_noise.py, through the sampler's call), and the
  # GPU tests of the session's new parts (the streams on CPU and CUDA alike; ngram rounds on graphs)
  step noise 120 python benchmarks/sampling_noise.py --device cuda --batch-sizes 8,64,256,512
  step gpu_tests 300 python -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/engine/test_seeded_noise.py \
    tests/engine/test_cuda_graph.py tests/kernels/test_sampling_kernels.py tests/engine/test_sampler.py
}
