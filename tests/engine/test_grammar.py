"""Structured output (`kiln.engine.grammar`): a random-weight model (tiny Inkling, SmolLM2's
tokenizer) whose outputs match their regex, JSON schema or EBNF grammar only because the mask
makes them; the errors a user can cause; the same under speculative decoding, where a verify's
rows are masked after the drafts before them (greedy output token-identical to the constrained
target alone, with drafts accepted and rejected). On a GPU the same runs with overlap scheduling on."""

from __future__ import annotations

import json
import os
import random
import re

import pytest

from kiln.engine.grammar import response_format_grammar

pytest.importorskip("xgrammar")

REGEX = r"[a-c]{3}-[0-9]{2}"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "color", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kiln.models.init_model import init_model

    d = str(tmp_path_factory.mktemp("grammar") / "m")
    # GPU machines have no embedded SmolLM2: point KILN_TEST_TOKENIZER_PATH at its tokenizer files
    # there (lane s56a carries them); None takes the embedded model's
    init_model("inkling", "tiny", d, seed=0, tokenizer_path=os.environ.get("KILN_TEST_TOKENIZER_PATH"))
    return d


def check_outputs(llm, prompts):
    from kiln import SamplingParams

    sampled = dict(temperature=1.0, seed=3, n=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, regex=REGEX, **sampled), use_tqdm=False)
    texts = [c for o in outs for c in o.outputs]
    assert all(re.fullmatch(REGEX, c.text) and c.finish_reason == "stop" for c in texts), [c.text for c in texts]
    assert len({c.text for c in texts}) > 1  # sampled within the constraint, not one forced string
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, json_schema=json.dumps(SCHEMA)),
                        use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        value = json.loads(c.text)
        assert set(value) == {"ok", "color", "n"} and isinstance(value["ok"], bool)
        assert value["color"] in ("red", "green", "blue") and 0 <= value["n"] <= 99
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=1.0, seed=0, ebnf='root ::= "yes" | "no"'),
                        use_tqdm=False)
    assert all(o.outputs[0].text in ("yes", "no") for o in outs)
    # ignore_eos: the grammar's end still ends the output
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=1.0, seed=1, regex=REGEX, ignore_eos=True),
                        use_tqdm=False)
    assert all(re.fullmatch(REGEX, o.outputs[0].text) and o.outputs[0].finish_reason == "stop" for o in outs)
    # an unconstrained request in the same batch as constrained ones is left alone
    mixed = llm.generate(prompts[:2], [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                                       SamplingParams(max_tokens=24, temperature=0.0, regex=REGEX)], use_tqdm=False)
    alone = llm.generate(prompts[:1], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert re.fullmatch(REGEX, mixed[1].outputs[0].text)


def test_constrained_outputs_on_a_random_model(model_dir):
    from kiln import Engine

    with Engine(model_dir, device="cpu", max_total_tokens=4096) as llm:
        check_outputs(llm, PROMPTS)


def test_errors_a_user_can_cause(model_dir):
    from kiln import Engine, SamplingParams
    from kiln.engine.request import SamplingParamsError

    with pytest.raises(SamplingParamsError, match="at most one of json_schema, regex and ebnf"):
        SamplingParams(regex="a", ebnf='root ::= "a"').validate()
    with pytest.raises(SamplingParamsError, match="min_tokens cannot be combined with regex"):
        SamplingParams(regex="a", min_tokens=2, max_tokens=4).validate()
    with Engine(model_dir, device="cpu", max_total_tokens=4096) as llm:
        for params, match in [(dict(regex="(unclosed"), r"regex does not compile: .*parenthesis"),
                              (dict(json_schema="{not json"), "json_schema does not compile"),
                              (dict(ebnf="root ::= "), "ebnf does not compile")]:
            with pytest.raises(ValueError, match=match):
                llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, **params), use_tqdm=False)


PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]


def oracle_drafts(llm, truth: dict, corrupt: float, seed: int = 0) -> None:
    """After each real drafter pass, replace the drafts by the constrained target's greedy
    continuation `truth[prompt]` (prompt + output), with one position replaced by a random token
    (almost always one the grammar refuses) with probability `corrupt`."""
    drafter, rng = llm.core.scheduler.spec.drafter, random.Random(seed)
    run = drafter.run

    def rigged(reqs, num_drafts):
        run(reqs, num_drafts)
        for r in reqs:
            k = r.spec.num_drafts
            if not k:
                continue
            full = truth[tuple(r.prompt_ids)]
            ds = (full[r.seq_len:r.seq_len + k] + [0] * k)[:k]
            if rng.random() < corrupt:
                ds[rng.randrange(k)] = rng.randrange(llm.info.vocab_size)
            r.spec.drafts = ds

    drafter.run = rigged


@pytest.mark.parametrize("k", [1, 2])
def test_speculative_rounds_mask_each_row_after_its_drafts(model_dir, k):
    """Greedy constrained output with MTP and drafts that are mostly the constrained target's own
    tokens equals the constrained target alone, with drafts both accepted (the rows after them
    were masked in the state after them: masking every row with the round's first state fails)
    and rejected (a draft the grammar refuses)."""
    check_oracle_rounds(model_dir, k, "cpu")


def check_oracle_rounds(model_dir, k: int, device: str, **kw):
    from kiln import Engine, SamplingParams

    cases = [SamplingParams(max_tokens=24, temperature=0.0, regex=REGEX),
             SamplingParams(max_tokens=40, temperature=0.0, json_schema=json.dumps(SCHEMA))]
    with Engine(model_dir, device=device, max_total_tokens=4096, **kw) as llm:
        plain = [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, p, use_tqdm=False)] for p in cases]
    with Engine(model_dir, device=device, max_total_tokens=4096, speculative_algorithm="mtp",
                speculative_num_steps=k, **kw) as llm:
        for params, want in zip(cases, plain):
            oracle_drafts(llm, {tuple(p): p + w for p, w in zip(PROMPTS, want)}, corrupt=0.4, seed=k)
            got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            assert got == want
        counts = llm.stats().spec
        assert 0 < counts.accepted_tokens < sum(counts.proposed), (counts.accepted, counts.proposed)
        llm.core.check_integrity()


@pytest.mark.parametrize("verify", ["point", "rejection", "block"])
def test_constrained_outputs_with_speculative_decoding(model_dir, verify):
    """The whole check of `check_outputs` (sampled, greedy, EBNF, ignore_eos, a mixed batch) with
    the checkpoint's random MTP layers (nearly every draft refused by the target or the grammar),
    under each verification."""
    from kiln import Engine

    flags = {"point": {}, "rejection": dict(speculative_use_rejection_sampling=True),
             "block": dict(speculative_use_block_verification=True)}[verify]
    with Engine(model_dir, device="cpu", max_total_tokens=4096, speculative_algorithm="mtp",
                speculative_num_steps=2, **flags) as llm:
        check_outputs(llm, PROMPTS)
        assert llm.stats().spec.verify_steps > 0


def think_ids(model_dir) -> tuple[int, int]:
    from kiln.loader import load_tokenizer

    tok = load_tokenizer(model_dir, None)
    (start,), (end,) = (tok.encode(t, add_special_tokens=False) for t in ("<think>", "</think>"))
    return start, end


def check_reasoning_then_answer(llm, model_dir):
    """With `reasoning_token_ids` the block before the answer is free and the answer after its end
    matches: from inside the block (the prompt opened it; a +12 bias makes its end come soon), and
    from the first token (+100 on both tags: the first token opens the block, which then ends)."""
    from kiln import SamplingParams

    start, end = think_ids(model_dir)
    free = 0
    for opened, bias in ((True, {end: 12.0}), (False, {start: 100.0, end: 100.0})):
        params = SamplingParams(max_tokens=48, temperature=1.0, seed=5, n=3, regex=REGEX, logit_bias=bias,
                                reasoning_token_ids=(start, end), starts_in_reasoning=opened)
        for o in llm.generate(PROMPTS, params, use_tqdm=False):
            for c in o.outputs:
                ids = c.token_ids
                assert end in ids and c.finish_reason == "stop", (opened, c.text)
                cut = ids.index(end)
                assert opened or ids[0] == start
                answer = llm.tokenizer.decode(ids[cut + 1:], skip_special_tokens=True)
                assert re.fullmatch(REGEX, answer), (opened, c.text)
                free += opened and cut > 0 and not re.fullmatch(r"[a-c0-9-]*", llm.tokenizer.decode(ids[:cut]))
    assert free > 0  # some reasoning the grammar would not have allowed


@pytest.mark.parametrize("spec", [{}, dict(speculative_algorithm="mtp", speculative_num_steps=2),
                                  dict(speculative_algorithm="mtp", speculative_num_steps=2,
                                       speculative_use_rejection_sampling=True)], ids=["plain", "mtp", "mtp-rs"])
def test_reasoning_block_is_free_and_the_answer_constrained(model_dir, spec):
    from kiln import Engine

    with Engine(model_dir, device="cpu", max_total_tokens=4096, **spec) as llm:
        check_reasoning_then_answer(llm, model_dir)


def test_speculative_rounds_across_the_reasoning_end(model_dir):
    """Greedy, drafts that are mostly the target's own tokens: rounds whose drafts cross the block's
    end (the phase moves and is rolled back with the matcher) give the target's output."""
    from kiln import Engine, SamplingParams

    start, end = think_ids(model_dir)
    params = SamplingParams(max_tokens=30, temperature=0.0, regex=REGEX, logit_bias={end: 4.0},
                            reasoning_token_ids=(start, end), starts_in_reasoning=True)
    with Engine(model_dir, device="cpu", max_total_tokens=4096) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert any(end in w and w.index(end) > 0 for w in want)  # a block with something in it
    with Engine(model_dir, device="cpu", max_total_tokens=4096, speculative_algorithm="mtp",
                speculative_num_steps=2) as llm:
        oracle_drafts(llm, {tuple(p): p + w for p, w in zip(PROMPTS, want)}, corrupt=0.3, seed=7)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == want
        assert llm.stats().spec.accepted_tokens > 0


def test_response_format():
    assert response_format_grammar(None) is None and response_format_grammar({"type": "text"}) is None
    assert response_format_grammar({"type": "json_object"}) == ("json_schema", '{"type": "object"}')
    assert response_format_grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}) == (
        "json_schema", json.dumps(SCHEMA))
    with pytest.raises(ValueError, match="needs"):
        response_format_grammar({"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(ValueError, match="'yaml' is not supported"):
        response_format_grammar({"type": "yaml"})


@pytest.mark.gpu
def test_constrained_outputs_on_cuda_with_overlap(model_dir):
    """CUDA: overlap scheduling and graphs on; a step with a constrained request is read back
    before the next is queued, so every mask follows the token before it."""
    from kiln import Engine

    with Engine(model_dir, device="cuda", dtype="float32", max_total_tokens=4096) as llm:
        assert llm.core.scheduler.overlap
        check_outputs(llm, PROMPTS)


@pytest.mark.gpu
def test_constrained_speculative_rounds_on_cuda(model_dir):
    """CUDA: MTP's chain graph and rounds on the device for unconstrained requests; a round with a
    constrained request takes the host path (its masks follow the drafts), greedy output equal to
    the constrained target alone, and the sampled checks under rejection sampling."""
    from kiln import Engine

    check_oracle_rounds(model_dir, 2, "cuda", dtype="float32")
    with Engine(model_dir, device="cuda", dtype="float32", max_total_tokens=4096, speculative_algorithm="mtp",
                speculative_num_steps=2, speculative_use_rejection_sampling=True) as llm:
        check_outputs(llm, PROMPTS)


def test_without_xgrammar_the_error_says_how_to_install(monkeypatch):
    import sys

    from kiln.engine.grammar import GrammarBackend

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` now raises ImportError
    with pytest.raises(ValueError, match="pip install xgrammar"):
        GrammarBackend(lambda: None, 64, [0]).matcher(("regex", "a"))
