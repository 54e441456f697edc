# Lane functions of `benchmarks/run_h200_x2.sh` (sourced by it; see its header for the phases):
# thirty-first session (2026-12-05). Rows older lanes left unrun, for a second call after `spec30a`
# (one H200): `spec29b`'s adaptive MTP rows (its plain steps skip the MTP layers and run under
# overlap scheduling) against plain decode, with a batch-1 host-phase run; `ngram26b`'s prompt
# lookup on the 8B shape at batch 1; `noise26`'s seeded-sampling noise benchmark; DFlash K = 3 rounds
# (a dummy 1-layer drafter), now on the device round with the next verify queued ahead, against the
# session's start (carry scratch/base31 = `git archive 9194ad5 kiln benchmarks/*.py benchmarks/configs`),
# whose DFlash rounds read the samples back between verify and draft. The thirty-second session added
# a row without the verify queued ahead after device rounds (`--speculative-verify-ahead prompt-lookup`).
# shellcheck shell=bash

dflash_bench_config() {  # a dummy 1-layer DFlash drafter for Inkling `bench` (block 8) in $R/dflash-bench
  mkdir -p "$R/dflash-bench"
  echo '{"model_type": "dflash", "num_layers": 1, "block_size": 8, "mask_token_id": 49215, "hidden_size": 2048,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
    "target_layer_ids": [1, 12, 22]}' > "$R/dflash-bench/config.json"
}

lane0_spec31a() {
  local mtp="--speculative-algorithm mtp --speculative-num-steps 3" l8=benchmarks/configs/llama-3.1-8b
  step ad_mtp3_adaptive 75 $DECODE $AD27 $mtp --speculative-adaptive --out "$R/json/ad_mtp3_adaptive.json"
  step ad_plain 50 $DECODE $AD27 --out "$R/json/ad_plain.json"
  step ad_mtp3_adaptive_phases 40 $DECODE --model-path $INK $NGRAM26 --batch-sizes 1 $mtp --speculative-adaptive \
    --host-phases --out "$R/json/ad_mtp3_adaptive_phases.json"
  step l8_plain 75 $DECODE --model-path $l8 $NGRAM26 --batch-sizes 1 --out "$R/json/l8_plain.json"
  step l8_ngram4 75 $DECODE --model-path $l8 $NGRAM26 --batch-sizes 1 --speculative-algorithm ngram \
    --ngram-always-draft --speculative-num-steps 4 --out "$R/json/l8_ngram4.json"
  dflash_bench_config
  local df="--model-path $INK $NGRAM26 --batch-sizes 1,8 --speculative-algorithm dflash
    --speculative-draft-model-path $R/dflash-bench --speculative-num-steps 3"
  step dflash3_new 50 $DECODE $df --out "$R/json/dflash3_new.json"
  step dflash3_prompt_lookup_only 50 $DECODE $df --speculative-verify-ahead prompt-lookup --out "$R/json/dflash3_pl_only.json"
  step dflash3_base 50 python scratch/base31/benchmarks/decode_batch.py $C $df --out "$R/json/dflash3_base.json"
  step noise 100 python benchmarks/sampling_noise.py --device cuda --batch-sizes 8,64,256,512
}
