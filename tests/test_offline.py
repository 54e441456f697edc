"""kiln.Engine on the real default model (SmolLM2-135M, fp32 CPU): the offline API end to end."""

import asyncio

import pytest

from kiln import Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def idle(llm):
    """Nothing running or waiting (an aborted sequence's notice may still sit in the outbox)."""
    s = llm.stats()
    return s.num_running == 0 and s.num_waiting == 0


@pytest.fixture(scope="module")
def llm():
    with Engine(device="cpu") as engine:
        yield engine


def test_text_and_token_id_prompts_agree(llm):
    text = "The capital of France is"
    ids = llm.tokenizer.encode(text)
    by_text, by_ids = llm.generate([text, ids], GREEDY, use_tqdm=False)
    assert by_text.prompt == text and by_ids.prompt is None
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids == ids
    a, b = by_text.outputs[0], by_ids.outputs[0]
    assert a.token_ids == b.token_ids and a.text == b.text
    assert len(a.token_ids) <= 16 and a.finish_reason in ("stop", "length")
    assert a.text == llm.tokenizer.decode(a.token_ids, skip_special_tokens=True)
    # A single string, a single id list, and a list of id lists all work.
    assert len(llm.generate(text, GREEDY)) == 1
    assert len(llm.generate([ids, ids], GREEDY, use_tqdm=False)) == 2


def test_n_samples_and_seeds_reproducible(llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=1234)
    (first,) = llm.generate("Once upon a time", params)
    (again,) = llm.generate("Once upon a time", params)
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    # Sample i uses seed + i, so the samples differ from each other.
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1
    (other,) = llm.generate("Once upon a time", SamplingParams(max_tokens=12, temperature=1.0, seed=99))
    assert other.outputs[0].token_ids != first.outputs[0].token_ids


def test_stop_strings(llm):
    prompt = "Count to twenty: 1, 2, 3, 4, 5,"
    (full,) = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0))
    text = full.outputs[0].text
    assert " 8," in text, text
    (cut,) = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, stop=[" 8,", "never"]))
    out = cut.outputs[0]
    assert out.text == text[: text.index(" 8,")]
    assert out.finish_reason == "stop" and out.matched_stop == " 8,"
    assert len(out.token_ids) < len(full.outputs[0].token_ids)
    (kept,) = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, stop=[" 8,"],
                                                  include_stop_str_in_output=True))
    assert kept.outputs[0].text == text[: text.index(" 8,") + 3]
    assert idle(llm)  # the stopped sequence was aborted in the scheduler


def test_logprobs(llm):
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, prompt_logprobs=2)
    (out,) = llm.generate("Paris is the capital of", params)
    comp = out.outputs[0]
    assert len(comp.logprobs) == len(comp.token_ids)
    for tid, (lp, top) in zip(comp.token_ids, comp.logprobs):
        assert lp <= 0 and len(top) == 3
        assert top[0][0] == tid  # greedy: the chosen token is the most likely
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
    assert all(e[0] <= 0 and len(e[1]) == 2 for e in out.prompt_logprobs[1:])


def test_prefix_cache_reports_cached_tokens(llm):
    prompt = "Repeat after me: " + "the quick brown fox jumps over the lazy dog. " * 6
    llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0))
    (again,) = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0))
    assert again.num_cached_tokens >= 16


def test_chat_and_stream(llm):
    (out,) = llm.chat([{"role": "user", "content": "Say hello."}], GREEDY)
    assert out.outputs[0].text.strip()
    ids = llm.apply_chat_template([{"role": "user", "content": "Say hello."}])
    assert out.prompt_token_ids == ids
    streamed = "".join(llm.generate_stream(ids, GREEDY))
    assert streamed == out.outputs[0].text


def test_async_generate_batches_concurrent_calls(llm):
    running = []
    step = llm.core.step

    def spy():
        outs = step()
        running.append(llm.core.stats().num_running)
        return outs

    llm.core.step = spy
    try:
        async def main():
            params = [SamplingParams(max_tokens=10, temperature=0.8, seed=i) for i in range(4)]
            return await asyncio.gather(*[llm.async_generate(f"Story number {i}:", p) for i, p in enumerate(params)])

        results = asyncio.run(main())
    finally:
        llm.core.step = step
    assert [len(r) for r in results] == [1, 1, 1, 1]
    assert all(r[0].outputs[0].finish_reason for r in results)
    assert max(running) >= 2, "concurrent async_generate calls should share scheduler steps"
    # Seeded sampling does not depend on what else is in the batch.
    (alone,) = llm.generate("Story number 2:", SamplingParams(max_tokens=10, temperature=0.8, seed=2))
    assert alone.outputs[0].token_ids == results[2][0].outputs[0].token_ids


@pytest.mark.parametrize("prompt, params, match", [
    ("", GREEDY, "prompt is empty"),
    ([], GREEDY, "prompts must be"),
    ("hi", SamplingParams(top_p=1.5), "top_p"),
    ("hi", SamplingParams(max_tokens=0), "max_tokens"),
    ("hi", SamplingParams(logprobs=100), "logprobs"),
    ([[10**6]], GREEDY, r"token ids must be integers in \[0, 49152\)"),
    ("word " * 9000, GREEDY, "context length is 8192"),
])
def test_validation_errors_queue_nothing(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params)
    assert idle(llm)


def test_one_bad_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["fine", ""], GREEDY)
    assert idle(llm) and not llm._tracked


def test_core_failure_fails_waiters_instead_of_hanging(llm):
    step = llm.core.step

    def broken():
        raise RuntimeError("boom")

    llm.core.step = broken
    try:
        async def main():
            return await asyncio.wait_for(llm.async_generate("hi", GREEDY), timeout=60)

        with pytest.raises(ValueError, match="engine core failed.*boom"):
            asyncio.run(main())
    finally:
        llm.core.step = step
    assert llm.generate("hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    assert idle(llm)


def test_unknown_option():
    with pytest.raises(TypeError, match="Unknown engine option.*max_tokenz.*valid options"):
        Engine(max_tokenz=3)


def test_a_batch_checks_completion_per_output_not_per_request_per_step(llm, monkeypatch):
    """generate() with its progress bar reads a request's `done` only when an output for it
    arrives (twice: routing, completion), never all requests' every step: that scan cost ~1.5 ms
    a step at 2048 requests, a large share of a small model's GPU step."""
    from kiln.engine.frontend import RequestState

    reads, outputs, real_step = [0], [0], llm.core.step
    real_done = RequestState.done

    def counted(self):
        reads[0] += 1
        return real_done.fget(self)

    def step():
        outs = real_step()
        outputs[0] += len(outs)
        return outs

    monkeypatch.setattr(RequestState, "done", property(counted))
    monkeypatch.setattr(llm.core, "step", step)
    prompts = [f"Item {i}:" for i in range(24)]
    got = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=True)
    assert [len(o.outputs[0].token_ids) for o in got] == [6] * 24
    assert reads[0] <= 2 * outputs[0] + len(prompts), (reads[0], outputs[0])
