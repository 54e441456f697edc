"""OpenAI's logit_bias through the engine (tiny Inkling, random weights): a +100 bias forces its
token and a -100 bias bans one, in plain decoding and in speculative rounds (the verify samples
every row through the same sampler, so greedy and rejection-sampling verification both see it)."""

from __future__ import annotations

import pytest

PROMPTS = [[1, 2, 3, 4], [5, 6, 7]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kiln.models.init_model import init_model

    d = str(tmp_path_factory.mktemp("bias") / "m")
    init_model("inkling", "tiny", d, seed=0)
    return d


@pytest.mark.parametrize("spec", [{}, dict(speculative_algorithm="mtp", speculative_num_steps=2),
                                  dict(speculative_algorithm="mtp", speculative_num_steps=2,
                                       speculative_use_rejection_sampling=True)], ids=["plain", "mtp", "mtp-rs"])
def test_logit_bias_forces_and_bans(model_dir, spec):
    from kiln import Engine, SamplingParams

    with Engine(model_dir, device="cpu", max_total_tokens=4096, **spec) as llm:
        free = [o.outputs[0].token_ids for o in llm.generate(
            PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)]
        forced = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                      logit_bias={42: 100.0}), use_tqdm=False)
        assert all(o.outputs[0].token_ids == [42] * 12 for o in forced)
        banned = sorted({t for ids in free for t in ids})
        for temperature in (0.0, 1.0):
            outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=temperature, seed=4, ignore_eos=True,
                                                        logit_bias={t: -100.0 for t in banned}), use_tqdm=False)
            assert all(not set(o.outputs[0].token_ids) & set(banned) for o in outs)
        # a request without a bias in the same batch is unchanged
        mixed = llm.generate(PROMPTS, [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                                       SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                      logit_bias={42: 100.0})], use_tqdm=False)
        assert mixed[0].outputs[0].token_ids == free[0] and mixed[1].outputs[0].token_ids == [42] * 12


def test_logit_bias_out_of_vocabulary_is_refused(model_dir):
    from kiln import Engine, SamplingParams

    with Engine(model_dir, device="cpu", max_total_tokens=4096) as llm:
        with pytest.raises(ValueError, match="logit_bias keys must be token ids in"):
            llm.generate([[1, 2]], SamplingParams(max_tokens=2, logit_bias={10**7: 1.0}), use_tqdm=False)
