"""Kiln's engine against Hugging Face transformers on SmolLM2-135M-Instruct (fp32, greedy).

Every scenario must give token-identical greedy output and chosen-token logprobs within 1e-4,
with the pool integrity check run after every scheduler step.
"""

from __future__ import annotations

import pytest
import torch

from kiln.config import EngineConfig
from kiln.engine.core import EngineCore
from kiln.engine.io import GenerateReq
from kiln.engine.request import SamplingParams

NEW_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woodcutter and his three daughters. Every morning he",
    "List three prime numbers:",
    "Translate to German: 'The weather is nice today.'",
    "The quick brown fox jumps over the lazy dog. " * 6 + "What animal jumped?",
    "1, 2, 3, 4, 5,",
    "Question: Why is the sky blue?\nAnswer:",
]


@pytest.fixture(scope="module")
def prompt_ids(smollm2_hf):
    _, tok = smollm2_hf
    chat = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                    tokenize=True, return_dict=True)["input_ids"] for p in PROMPTS[:4]]
    plain = [tok(p)["input_ids"] for p in PROMPTS[4:]]
    return chat + plain


@pytest.fixture(scope="module")
def reference(smollm2_hf, prompt_ids):
    """Greedy tokens and chosen-token logprobs from transformers, one prompt at a time."""
    model, _ = smollm2_hf
    refs = []
    with torch.no_grad():
        for ids in prompt_ids:
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, output_scores=True,
                                 return_dict_in_generate=True)
            toks = out.sequences[0, len(ids):].tolist()
            lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, toks)]
            refs.append((toks, lps))
    return refs


def run(core: EngineCore, prompts: list[list[int]], tag: str = "r") -> dict[str, dict]:
    """Submit all prompts at once and step until done; integrity checked after every step."""
    core.scheduler.check_after_step = True
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    for i, ids in enumerate(prompts):
        core.add_request(GenerateReq(rid=f"{tag}{i}", input_ids=ids, params=params))
    res: dict[str, dict] = {}
    while core.has_work():
        for o in core.step():
            assert o.error is None, o.error
            r = res.setdefault(o.rid, {"ids": [], "lps": [], "cached": 0})
            r["ids"] += o.new_token_ids
            r["lps"] += [lp for lp, _ in o.new_logprobs]
            r["cached"] = o.cached_tokens
    core.check_integrity()
    return res


def assert_matches(res, reference, tag="r", idx=None):
    idx = idx if idx is not None else list(range(len(reference)))
    for j, i in enumerate(idx):
        got = res[f"{tag}{j}"]
        ref_ids, ref_lps = reference[i]
        assert got["ids"] == ref_ids, f"prompt {i}: tokens differ from transformers"
        assert max(abs(a - b) for a, b in zip(got["lps"], ref_lps)) <= 1e-4, f"prompt {i}: logprobs"


def make_core(source, **kw) -> EngineCore:
    kw.setdefault("max_total_tokens", 8192)
    return EngineCore(EngineConfig(**kw), source)


def test_one_request_at_a_time(smollm2_source, prompt_ids, reference):
    core = make_core(smollm2_source, max_running_requests=1)
    assert_matches(run(core, prompt_ids), reference)


def test_16_concurrent_mixed_lengths(smollm2_source, prompt_ids, reference):
    core = make_core(smollm2_source, disable_radix_cache=True)
    res = run(core, prompt_ids + prompt_ids[::-1])
    assert_matches(res, reference + reference[::-1], idx=list(range(8)) + list(range(7, -1, -1)))


def test_chunked_prefill_smaller_than_prompts(smollm2_source, prompt_ids, reference):
    # chunks of 7 tokens over pages of 4: chunk boundaries fall inside pages
    core = make_core(smollm2_source, chunked_prefill_size=7, page_size=4, max_prefill_tokens=24)
    assert_matches(run(core, prompt_ids), reference)


def test_warm_prefix_cache(smollm2_source, prompt_ids, reference):
    core = make_core(smollm2_source, page_size=4)
    assert_matches(run(core, prompt_ids, "a"), reference, "a")
    res = run(core, prompt_ids, "b")
    assert_matches(res, reference, "b")
    assert all(res[f"b{i}"]["cached"] > 0 for i in range(len(prompt_ids)))


def test_small_pool_retracts_and_completes(smollm2_source, prompt_ids, reference):
    # 8 requests needing ~540 tokens in a 320-token pool: decode must retract and recompute
    core = make_core(smollm2_source, max_total_tokens=320, page_size=4)
    res = run(core, prompt_ids)
    assert_matches(res, reference)
    assert core.stats().num_retractions_total > 0


def test_eviction_keeps_outputs(smollm2_source, prompt_ids, reference):
    # Sequential requests through a pool that holds about three of them: the cache must evict.
    core = make_core(smollm2_source, max_total_tokens=256, page_size=8, max_running_requests=1)
    res = run(core, prompt_ids)
    assert_matches(res, reference)
    assert core.cache.tree.num_pages * 8 <= 256
