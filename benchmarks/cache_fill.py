"""Offline generation in chunks until the prefix cache fills the pool: does throughput hold?

    python benchmarks/cache_fill.py [--chunks 5] [--prompts 2048] [--new-tokens 200]
                                    [--disable-radix-cache] [--mem-fraction-static 0.3] [--tokenizer-path DIR]

Every finished request leaves its tokens in the prefix cache, so a long offline run (the data
stage of `spec_train_gpu.py`, an RL rollout loop) fills the pool after a few chunks, and from then
on every page a running request grows must be evicted first. This runs SmolLM2-135M's shape
(`benchmarks/configs/smollm2-135m`, or `--model-path`) with dummy weights (`--load-format dummy`, no download) on chunks of `--prompts` prompts (30 shared
tokens, as a chat template's system turn, then 40 random ones), `--new-tokens` each with
`ignore_eos`, and prints each chunk's time and tokens/s. docs/serving.md ("Semantics worth
knowing") has the numbers before and after eviction in batches.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=os.path.join(common.CONFIGS_DIR, "smollm2-135m"),
                    help="A config-only model directory or preset:ARCH/PRESET (dummy weights).")
    ap.add_argument("--chunks", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=2048, help="Prompts per chunk.")
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--mem-fraction-static", type=float, default=0.3)
    ap.add_argument("--max-running-requests", type=int, default=512)
    ap.add_argument("--disable-radix-cache", action="store_true")
    ap.add_argument("--tokenizer-path", default=None,
                    help="Detokenize the outputs with this tokenizer (text, as an RL rollout returns it); default: ids only.")
    ap.add_argument("--out", default=None, help="Write the chunks' times as JSON here.")
    args = ap.parse_args(argv)

    from kiln.engine.request import SamplingParams
    from kiln.offline import Engine

    model = common.resolve_model_path(args.model_path)
    rng = random.Random(0)
    vocab = common.model_config_of(model).vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(30)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    text = dict(tokenizer_path=args.tokenizer_path) if args.tokenizer_path else dict(skip_tokenizer_init=True)
    opts = dict(device=args.device, load_format="dummy", log_level="warning", **text,
                max_running_requests=args.max_running_requests, cuda_graph_max_bs=args.max_running_requests,
                mem_fraction_static=args.mem_fraction_static, disable_radix_cache=args.disable_radix_cache)
    rows = []
    cache = "off" if args.disable_radix_cache else "on"
    with Engine(model_path=model, **opts) as llm:
        for i in range(args.chunks):
            prompts = [shared + [rng.randrange(3, vocab) for _ in range(40)] for _ in range(args.prompts)]
            t = time.time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            if args.tokenizer_path:
                assert all(o.outputs[0].text for o in outs), "detokenized outputs are empty"
            dt = time.time() - t
            rows.append(dict(chunk=i, tokens=n, seconds=dt, tok_per_s=n / dt))
            print(f"prefix cache {cache}, chunk {i}: {n} tokens in {dt:.1f} s ({n / dt:.0f} tokens/s)", flush=True)
    result = dict(args=vars(args), rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
