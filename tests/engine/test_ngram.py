"""Prompt lookup (`--speculative-algorithm ngram`): the match against a brute-force reference, and
the engine's rounds with it on the CPU in fp32 (tiny Llama and tiny Inkling).

The targets are the "copy" construction of test_speculative (`copy_drafter`, small alpha): the
next token depends mostly on the current one, so a prompt that holds the text the model is about
to write (the prompt, then its own greedy output, then the prompt again) gives long accepted runs,
while random prompts give matches that the target rejects. Greedy output must equal plain greedy
decoding, and every emitted token's logits a fresh reference prefill (1e-4): rollback is exact.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from kiln.engine.request import SamplingParams
from kiln.engine.spec.ngram_drafter import FALLBACK_SCAN, MAX_CANDIDATES, NgramDrafter, NgramIndex
from tests.engine.test_hybrid_engine import assert_reference, make_core, prompts
from tests.engine.test_speculative import (SPEC_ARCHS, assert_abort_frees_every_page,
                                           assert_seeded_output_alone_equals_batched, copy_drafter, run_plain, run_spec)


# ---- the match ----------------------------------------------------------------------------
def reference_propose(toks: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The rule of `NgramIndex`, by brute force: among the latest MAX_CANDIDATES earlier ends
    whose `lo` tokens before them equal the sequence's last `lo`, the one matching the most
    tokens (up to `hi`), then the latest; drafts copy on from there, reading their own output
    past the end."""
    T = len(toks)
    ends = [e for e in range(lo, T) if toks[e - lo:e] == toks[T - lo:]] if T > lo else []
    best_e, best_n = -1, 0
    for e in reversed(ends[-MAX_CANDIDATES:]):
        n = max(m for m in range(lo, hi + 1) if m <= e and toks[e - m:e] == toks[T - m:])
        if n > best_n:
            best_e, best_n = e, n
    if best_e < 0:
        return []
    seq = list(toks)
    for i in range(k):
        seq.append(seq[best_e + i])
    return seq[T:]


@pytest.mark.parametrize("lo,hi", [(1, 1), (1, 4), (2, 6), (3, 3)])
def test_index_matches_brute_force_as_tokens_arrive(lo, hi):
    rng = random.Random(lo * 10 + hi)
    for trial in range(40):
        vocab = rng.choice([2, 3, 5, 20])  # small vocabularies: many matches, periodic runs
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(1, 120))]
        index, fed = NgramIndex(lo, hi), 0
        while fed < len(seq):  # tokens arrive in chunks, as a prompt and then rounds commit them
            step = rng.randrange(1, 9)
            index.extend(seq[fed:fed + step])
            fed = min(fed + step, len(seq))
            k = rng.randrange(1, 9)
            assert index.propose(k) == reference_propose(seq[:fed], k, lo, hi), (seq[:fed], k)


def test_copy_past_the_end_repeats_the_period():
    index = NgramIndex(1, 4)
    index.extend([9, 1, 2, 3, 1, 2, 3, 1])
    # the suffix [1, 2, 3, 1] occurred ending at 5 (the longest, 4 tokens): copy 2, 3, 1, then the copy itself
    assert index.match() == (5, 4)
    assert index.propose(7) == [2, 3, 1, 2, 3, 1, 2]
    fresh = NgramIndex(2, 4)
    fresh.extend([5, 6, 7])
    assert fresh.propose(3) == [] and fresh.match() == (-1, 0)


def test_the_latest_of_equally_long_matches_wins():
    index = NgramIndex(2, 8)
    index.extend([1, 2, 10, 1, 2, 20, 1, 2])
    assert index.propose(2) == [20, 1]


def test_fallback_copies_after_the_last_token_or_repeats_it():
    index = NgramIndex(3, 4)
    index.extend([4, 7, 8, 5, 7])
    assert index.propose(3) == []
    assert index.fallback(3) == [8, 5, 7]
    alone = NgramIndex(3, 4)
    alone.extend([1, 2, 3])
    assert alone.fallback(2) == [3, 3]
    far = NgramIndex(3, 4)  # the last token's only earlier occurrence is beyond the scan
    far.extend([5, 6] + list(range(100, 100 + FALLBACK_SCAN)) + [5])
    assert far.fallback(2) == [5, 5]


class _Req:
    def __init__(self, rid, ids):
        self.rid, self.ids, self.spec = rid, ids, None

    @property
    def seq_len(self):
        return len(self.ids)

    def token_ids(self, a, b):
        return self.ids[a:b]


@pytest.mark.parametrize("uniform", [False, True])
def test_uniform_pads_requests_without_a_match(uniform):
    drafter = NgramDrafter(3, 2, 4, uniform=uniform)
    hit, miss, waiting = _Req("a", [1, 2, 3, 1, 2]), _Req("b", [5, 6, 7, 8]), _Req("c", [1, 2, 1, 2])
    for r in (hit, miss, waiting):
        r.spec = drafter.new_state(r)
    drafter.run([hit, miss, waiting], {"a": 3, "b": 3, "c": 0})
    assert hit.spec.drafts == [3, 1, 2] and waiting.spec.drafts == []
    assert miss.spec.drafts == ([8, 8, 8] if uniform else [])
    # nobody matches: nobody drafts, even when uniform (a plain decode step)
    drafter.run([miss], {"b": 3})
    assert miss.spec.drafts == []


# ---- the engine ---------------------------------------------------------------------------
@pytest.fixture(scope="module", params=sorted(SPEC_ARCHS))
def model_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"{request.param}_ngram")
    (d / "config.json").write_text(json.dumps(SPEC_ARCHS[request.param]))
    return str(d)


def ngram_core(model_dir, k, **kw):
    core = make_core(model_dir, speculative_algorithm="ngram", speculative_num_steps=k, **kw)
    copy_drafter(core, 0.01)
    return core


def copy_core(model_dir, **kw):
    core = make_core(model_dir, **kw)
    copy_drafter(core, 0.01)
    return core


def echo_prompts(model_dir, n, seed, max_tokens, **kw):
    """n prompts that hold the model's own greedy continuation of their start (prompt lookup hits),
    plus n random ones (misses and rejected matches)."""
    base = prompts(n, seed=seed, lo=12, hi=30)
    first = run_plain(copy_core(model_dir, **kw), base, max_tokens=max_tokens, tag="e")
    return [b + first[f"e{i}"] + b for i, b in enumerate(base)] + prompts(n, seed=seed + 1, lo=12, hi=40)


@pytest.mark.parametrize("k", [2, 4])
def test_ngram_rounds_match_plain_greedy_and_reference(model_dir, k):
    kw = dict(page_size=4, chunked_prefill_size=32, max_prefill_tokens=48)
    ps = echo_prompts(model_dir, 2, seed=31, max_tokens=24, **kw)
    core = ngram_core(model_dir, k, **kw)
    res, drafts, _ = run_spec(core, ps, max_tokens=24)
    assert {rid: r[1] for rid, r in res.items()} == run_plain(copy_core(model_dir, **kw), ps, max_tokens=24)
    counts = core.stats().spec
    assert 0 < counts.accepted_tokens < sum(counts.proposed), "want both acceptances and rejections"
    assert counts.accept_length > 2.0, counts.accept_rate_per_position  # the echoed prompts copy well
    assert all(len(d) == k for ds in drafts.values() for _, d, _ in ds)
    assert_reference(core, res)


def test_uniform_drafts_keep_every_round_the_same_length(model_dir, monkeypatch):
    # What a CUDA-graph engine does (`uniform`), forced on the CPU: whenever one request drafts,
    # every ready one drafts K, guesses included; greedy output is still exact.
    kw = dict(page_size=4)
    ps = echo_prompts(model_dir, 2, seed=33, max_tokens=16, **kw)
    core = ngram_core(model_dir, 3, **kw)
    drafter = core.scheduler.spec.drafter
    drafter.uniform = True
    lengths = []
    run = drafter.run
    monkeypatch.setattr(drafter, "run", lambda reqs, num: (run(reqs, num), lengths.append(
        {r.spec.num_drafts for r in reqs if num.get(r.rid)}))[0])
    res, _, _ = run_spec(core, ps, max_tokens=16)
    assert {rid: r[1] for rid, r in res.items()} == run_plain(copy_core(model_dir, **kw), ps, max_tokens=16)
    assert lengths and all(s <= {3} or s == {0} for s in lengths), lengths
    assert_reference(core, res)


def test_retraction_with_ngram(model_dir):
    kw = dict(page_size=4, max_total_tokens=200)
    ps = echo_prompts(model_dir, 3, seed=35, max_tokens=40, **kw)
    core = ngram_core(model_dir, 4, **kw)
    res, _, _ = run_spec(core, ps, max_tokens=40)
    assert core.stats().num_retractions_total > 0
    assert {rid: r[1] for rid, r in res.items()} == run_plain(copy_core(model_dir, **kw), ps, max_tokens=40)
    assert_reference(core, res)


def test_prefix_hits_with_ngram(model_dir):
    # The same prompts again: their pages come from the prefix cache, the index from the tokens.
    kw = dict(page_size=4)
    ps = echo_prompts(model_dir, 2, seed=36, max_tokens=24, **kw)
    core = ngram_core(model_dir, 3, **kw)
    first, _, _ = run_spec(core, ps, max_tokens=24)
    again, _, _ = run_spec(core, ps, max_tokens=24, tag="b")
    assert all(again[f"b{i}"][3] > 0 for i in range(len(ps)))
    want = run_plain(copy_core(model_dir, **kw), ps, max_tokens=24)
    assert [first[f"r{i}"][1] for i in range(len(ps))] == [again[f"b{i}"][1] for i in range(len(ps))] \
        == [want[f"r{i}"] for i in range(len(ps))]
    assert_reference(core, again)


def test_seeded_sampling_with_ngram_is_reproducible(model_dir):
    # Sampled requests verify ngram drafts as point masses (exact); the same seed gives the same
    # output whatever else is batched.
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=5, ignore_eos=True)
    assert_seeded_output_alone_equals_batched(lambda: ngram_core(model_dir, 3, page_size=4),
                                              echo_prompts(model_dir, 1, seed=37, max_tokens=16, page_size=4), params)


def test_abort_during_ngram_rounds_frees_everything(model_dir):
    ps = echo_prompts(model_dir, 2, seed=39, max_tokens=16, page_size=4)
    assert_abort_frees_every_page(ngram_core(model_dir, 3, page_size=4), ps[:3], 40)


def test_bad_ngram_flags_have_clear_errors(model_dir, tmp_path):
    with pytest.raises(ValueError, match="min-match-window-size .3. must be at least 1 and at most"):
        make_core(model_dir, speculative_algorithm="ngram", speculative_ngram_min_match_window_size=3,
                  speculative_ngram_max_match_window_size=2)
    torch.save([1, 2, 3], tmp_path / "map.pt")
    with pytest.raises(ValueError, match="ngram has none"):
        make_core(model_dir, speculative_algorithm="ngram", speculative_token_map=str(tmp_path / "map.pt"))
    with pytest.raises(ValueError, match="at least 1"):
        make_core(model_dir, speculative_algorithm="ngram", speculative_num_steps=0)


def test_matching_another_sequences_suffix():
    """`match(query)`: the longest, then latest, occurrence of the query's suffix in this index
    (how benchmarks/ngram_siblings.py looks in a sibling sample's text)."""
    rng = random.Random(5)
    for trial in range(200):
        vocab = rng.choice([2, 3, 5])
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        query = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        index = NgramIndex(2, 6)
        index.extend(seq)
        e, n = index.match(query)
        # brute force: every end e' < len(seq) whose 2 tokens before it equal the query's last 2
        ends = [x for x in range(2, len(seq)) if len(query) >= 2 and seq[x - 2:x] == query[-2:]][-MAX_CANDIDATES:]
        lengths = {x: max(m for m in range(2, 7) if m <= x and m <= len(query) and seq[x - m:x] == query[-m:])
                   for x in ends}
        want_n = max(lengths.values(), default=0)
        want_e = max((x for x in ends if lengths[x] == want_n), default=-1)
        assert (e, n) == (want_e, want_n), (seq, query)
