"""Acceptance of a trained drafter on held-out prompts (offline engine, real tokenizer).

    python benchmarks/spec_acceptance.py --model-path DIR --steps 1,2,3 --temperature 0 --check-greedy
    python benchmarks/spec_acceptance.py --model-path DIR --steps 3 --temperature 0.7
    python benchmarks/spec_acceptance.py --speculative-algorithm dflash --speculative-draft-model-path DRAFT \
        --steps 1,3,7 --temperature 0 --check-greedy     # target: the embedded SmolLM2 (no --model-path)

Prompts: the held-out split of `kiln train-draft`'s built-in set (`builtin_prompts("eval")`: topics
and numbers the training prompts do not have), as chat turns. For each draft length K the engine
generates with `--speculative-algorithm` (default mtp) and prints the acceptance length (accepted
drafts + 1 per verify step), the per-position acceptance rates and the wall time. Without
--model-path the target is the embedded SmolLM2-135M-Instruct; a block drafter (dflash) comes from
--speculative-draft-model-path. `--check-greedy` (temperature 0) also generates without
speculation and checks that the tokens are identical.
Sampled runs verify with the engine's current rule (each row sampled from the target, drafts as
point masses; docs/speculative.md).

`--workload edit` turns each prompt into an editing task whose answer mostly copies its input
(the model's own greedy answer to the chat prompt, given back with "rewrite it, fixing any
errors"): where prompt lookup (`--speculative-algorithm ngram`) is meant to win. Besides the
acceptance length (over rounds that had drafts) each run prints the output tokens per target
forward, rounds without drafts included: what bounds the speedup of a drafter that often drafts
nothing (ngram without a match).

    python benchmarks/spec_acceptance.py --speculative-algorithm ngram --steps 2,4,8 --workload edit --check-greedy

`--adaptive both` runs each K fixed and with `--speculative-adaptive` (the draft length chosen per
step from measured step times and acceptance), and prints how many steps ran at each length.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None, help="The target (default: the embedded SmolLM2).")
    ap.add_argument("--speculative-algorithm", default="mtp")
    ap.add_argument("--speculative-draft-model-path", default=None, help="The drafter's directory (dflash).")
    ap.add_argument("--speculative-token-map", default=None,
                    help="Draft from these token ids only (docs/speculative.md, FR-Spec).")
    ap.add_argument("--steps", default="1,2,3", help="Draft lengths K to measure, comma-separated.")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--check-greedy", action="store_true", help="Also run without speculation and compare.")
    ap.add_argument("--workload", choices=["chat", "edit"], default="chat",
                    help="chat: the held-out prompts; edit: rewrite the model's own answers to them.")
    ap.add_argument("--adaptive", choices=["off", "on", "both"], default="off",
                    help="--speculative-adaptive for each K: off, on, or both (fixed K, then adaptive).")
    ap.add_argument("--engine", default="{}", help="Extra kiln.Engine options (JSON).")
    ap.add_argument("--out", default=None, help="Write the results as JSON here.")
    args = ap.parse_args()

    import torch

    from kiln.engine.request import SamplingParams
    from kiln.offline import Engine
    from kiln.spec_train.data import builtin_prompts

    torch.set_num_threads(args.threads)
    prompts = builtin_prompts("eval")[:args.num_prompts]
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed if args.temperature > 0 else None)
    opts = {"log_level": "warning", "device": "cpu", "seed": args.seed, **json.loads(args.engine)}
    results, ids = [], None

    def run(**spec):
        nonlocal ids
        with Engine(args.model_path, **opts, **spec) as llm:
            if ids is None:
                ids = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in task_prompts(llm)]
            before = llm.stats().spec  # the edit workload's answers may have run on this engine
            t0 = time.time()
            outs = llm.generate(ids, params, use_tqdm=False)
            wall = time.time() - t0
            return [o.outputs[0].token_ids for o in outs], since(llm.stats().spec, before), wall

    def since(now, before):
        """The speculative counters of the timed run only."""
        if now is None or before is None:
            return now
        d = now.copy()
        d.verify_steps -= before.verify_steps
        d.proposed = [a - b for a, b in zip(d.proposed, before.proposed + [0] * len(d.proposed))]
        d.accepted = [a - b for a, b in zip(d.accepted, before.accepted + [0] * len(d.accepted))]
        d.steps_by_length = [a - b for a, b in zip(d.steps_by_length, before.steps_by_length + [0] * len(d.steps_by_length))]
        return d

    def task_prompts(llm) -> list[str]:
        if args.workload == "chat":
            return prompts
        chat = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        greedy = SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0)
        answers = [o.outputs[0].text.strip() for o in llm.generate(chat, greedy, use_tqdm=False)]
        return [f"Here is a paragraph:\n\n{a}\n\nRewrite the paragraph above, fixing any errors. "
                "Reply with the paragraph only." for a in answers]

    plain = None
    if args.check_greedy:
        plain, _, wall = run()
        n = sum(len(t) for t in plain)
        print(f"no speculation: {n} tokens in {wall:.1f}s ({n / wall:.1f} tok/s, {1e3 * wall / n:.2f} ms a token)")
        results.append({"K": 0, "tokens": n, "wall_s": wall})
    draft = {}
    if args.speculative_draft_model_path:
        draft["speculative_draft_model_path"] = args.speculative_draft_model_path
    if args.speculative_token_map:  # a speculative option: not for the --check-greedy baseline
        draft["speculative_token_map"] = args.speculative_token_map
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.adaptive]
    for k, adaptive in [(int(x), a) for x in args.steps.split(",") for a in modes]:
        toks, spec, wall = run(speculative_algorithm=args.speculative_algorithm, speculative_num_steps=k,
                               speculative_adaptive=adaptive, **draft)
        n = sum(len(t) for t in toks)
        # A round emits accepted + 1 tokens in one forward, any other token took a forward of its
        # own (the prefill's first token, decodes without drafts): forwards = tokens - accepted.
        per_forward = n / max(n - spec.accepted_tokens, 1)
        row = {"K": k, "adaptive": adaptive, "steps_by_length": spec.steps_by_length,
               "accept_length": spec.accept_length, "accept_rate_per_position": spec.accept_rate_per_position,
               "verify_steps": spec.verify_steps, "tokens": n, "tokens_per_forward": per_forward, "wall_s": wall,
               "ms_per_round": 1e3 * wall / max(spec.verify_steps, 1)}
        if plain is not None:
            row["greedy_identical"] = toks == plain
            # tokens/s against the plain run's: below 1 when a round costs more than L plain steps
            row["speedup"] = (n / wall) / (results[0]["tokens"] / results[0]["wall_s"])
        results.append(row)
        rates = " ".join(f"{r:.3f}" for r in spec.accept_rate_per_position)
        by_len = ", ".join(f"{i}: {c}" for i, c in enumerate(spec.steps_by_length) if c)
        print(f"K={k}{' adaptive' if adaptive else ''}: acceptance length {spec.accept_length:.3f}, "
              f"per position [{rates}], steps by draft length {{{by_len}}}, "
              f"{spec.verify_steps} verify steps, {per_forward:.3f} tokens per forward, "
              f"{n} tokens in {wall:.1f}s ({n / wall:.1f} tok/s, "
              f"{row['ms_per_round']:.2f} ms a round)"
              + (f", {row['speedup']:.2f}x plain, greedy identical: {row['greedy_identical']}"
                 if plain is not None else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
