"""Would prompt lookup gain from a GRPO group's sibling samples? A simulation on real outputs.

    python benchmarks/ngram_siblings.py --num-prompts 32 --samples 4 --temperature 0.7

With point-mass verification the engine's output distribution does not depend on the drafts, so
a round's accepted drafts are exactly those that match the continuation the target samples. This
generates `--samples` sampled continuations of each held-out chat prompt with the embedded
SmolLM2 (no speculation), then replays each one as rounds of K drafts: drafts from the sample's
own prompt + output (what `--speculative-algorithm ngram` does), or from that and its siblings'
outputs (a cache shared by a group, as SGLang's NGRAM shares one across requests), the longest
match winning: siblings in step (their outputs up to the same index: concurrent samples, a lower
bound) or finished (their whole outputs: samples written before, an upper bound). Prints output
tokens per target forward for each.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def replay(prompt: list[int], out: list[int], siblings: list[list[int]], k: int, lo: int, hi: int,
           finished: bool = False) -> int:
    """Target forwards to produce `out` with rounds of k drafts (the prefill gives the first token).
    Siblings are read up to the same output index (in step), or whole (`finished`: written before)."""
    from kiln.engine.spec.ngram_drafter import NgramIndex

    own = NgramIndex(lo, hi)
    own.extend(prompt + out[:1])
    others = [NgramIndex(lo, hi) for _ in siblings]
    for idx in others:
        idx.extend(prompt)
    pos, forwards = 1, 1
    while pos < len(out):
        e, n = own.match()
        drafts = own.continuation(e, k) if e >= 0 else []
        for idx, sib in zip(others, siblings):
            idx.extend(sib[len(idx.tokens) - len(prompt):None if finished else pos])
            se, sn = idx.match(own.tokens)
            if sn > n:
                e, n, drafts = se, sn, idx.continuation(se, k)
        accepted = 0
        while accepted < len(drafts) and pos + accepted < len(out) and drafts[accepted] == out[pos + accepted]:
            accepted += 1
        step = min(accepted + 1, len(out) - pos)
        own.extend(out[pos:pos + step])
        pos += step
        forwards += 1
    return forwards


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4, help="Samples per prompt (the group).")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4, help="Draft length K.")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model-path", default=None, help="Default: the embedded SmolLM2.")
    args = ap.parse_args(argv)

    import torch

    from kiln.engine.request import SamplingParams
    from kiln.offline import Engine
    from kiln.spec_train.data import builtin_prompts

    torch.set_num_threads(args.threads)
    with Engine(args.model_path, device="cpu", log_level="warning", seed=0) as llm:
        ids = [llm.apply_chat_template([{"role": "user", "content": p}])
               for p in builtin_prompts("eval")[:args.num_prompts]]
        t0 = time.time()
        outs = llm.generate(ids, SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature,
                                                n=args.samples, seed=1), use_tqdm=False)
        print(f"{len(outs) * args.samples} samples generated in {time.time() - t0:.0f}s")
    result = {}
    for mode in ("own", "siblings in step", "siblings finished"):
        forwards = tokens = 0
        for prompt, o in zip(ids, outs):
            seqs = [c.token_ids for c in o.outputs]
            for i, s in enumerate(seqs):
                sibs = [x for j, x in enumerate(seqs) if j != i] if mode != "own" else []
                forwards += replay(prompt, s, sibs, args.steps, 1, 12, finished=mode.endswith("finished"))
                tokens += len(s)
        result[mode] = tokens / forwards
        print(f"drafts from {mode}: {result[mode]:.3f} tokens per forward ({tokens} tokens, K = {args.steps})")
    return result


if __name__ == "__main__":
    main()
