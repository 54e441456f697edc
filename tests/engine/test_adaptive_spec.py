"""`--speculative-adaptive`: each round's draft length chosen from measured step times and
acceptance (`kiln.engine.spec.adaptive`).

The controller is tested on simulated steps (a step-cost model and per-position acceptance draws
on a fake clock): it must find the draft length with the most tokens per second, per batch-size
bucket, and keep probing the others. In the engine (CPU, fp32, tiny Inkling and Llama) a clock that
charges each step by its draft length makes the length change every few steps, mid-request, down
to plain decode rows and back: greedy output must stay token-identical to plain decoding and every
emitted token's logits equal a fresh prefill (the rollback and the MTP catch-up stay exact across
changes of K).
"""

from __future__ import annotations

import random

import pytest

from kiln.config import EngineConfig
from kiln.engine.spec.adaptive import AdaptiveDraftLength, adaptive_steps, bucket
from tests.engine.test_hybrid_engine import assert_reference, prompts
from tests.engine.test_speculative import (assert_mtp_reference, model_dir, plain_core, run_plain,  # noqa: F401
                                          run_spec, spec_core)


def test_candidates_are_zero_the_powers_of_two_below_k_and_k():
    assert adaptive_steps(1) == [0, 1]
    assert adaptive_steps(3) == [0, 1, 2, 3]
    assert adaptive_steps(4) == [0, 1, 2, 4]
    assert adaptive_steps(8) == [0, 1, 2, 4, 8]
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 64, 65)] == [1, 2, 4, 4, 8, 64, 128]


def test_expected_tokens_follow_the_conditional_rates():
    ctl = AdaptiveDraftLength(4)
    assert ctl.expected_tokens(0) == 1.0
    assert ctl.expected_tokens(2) == pytest.approx(1 + 0.5 + 0.25)  # the prior: one half-accepted offer
    ctl.DECAY = 1.0
    for _ in range(99):  # position 1 accepted 3 times in 4, position 2 once in 3 of those
        ctl.observe_round(4, 4, 0)
    for _ in range(99):
        ctl.observe_round(4, 4, 1)
    for _ in range(198):
        ctl.observe_round(4, 4, 2)
    r1, r2 = (297 + 0.5) / (396 + 1), (198 + 0.5) / (297 + 1)
    assert ctl.rate(1) == pytest.approx(r1) and ctl.rate(2) == pytest.approx(r2)
    assert ctl.expected_tokens(2) == pytest.approx(1 + r1 + r1 * r2)
    # a request offered 4 drafts that proposed 1 (accepted) fails at position 2
    before = ctl.offered[1]
    ctl.observe_round(4, 1, 1)
    assert ctl.offered[1] == before + 1 and ctl.accepted[1] == pytest.approx(198)
    ctl.DECAY = 0.5  # the counts decay once per step that observed them
    ctl.step_done(1, None)
    assert ctl.offered[1] == (before + 1) / 2 and ctl.accepted[1] == pytest.approx(99)
    ctl.observe_round(1, 1, 0)  # position 1 only: position 2 keeps its counts (no news)
    ctl.step_done(1, None)
    assert ctl.offered[1] == (before + 1) / 2 and ctl.accepted[1] == pytest.approx(99)
    assert ctl.offered[0] == pytest.approx((396 + 1) / 4 + 0.5)


def simulate(ctl, steps: int, batch_size: int, cost, accept: float, rng: random.Random):
    """Run `steps` simulated steady steps; returns (the draft length of each, tokens emitted per
    unit of time after the first 100 steps)."""
    t, used, tokens, t0 = [0.0], [], 0, 0.0
    ctl.clock = lambda: t[0]
    for step in range(steps):
        if step == 100:
            tokens, t0 = 0, t[0]
        k = ctl.choose(batch_size)
        used.append(k)
        for _ in range(batch_size):
            n = 0
            while n < k and rng.random() < accept:
                n += 1
            if k:
                ctl.observe_round(k, k, n)
            tokens += n + 1
        t[0] += cost(k)
        ctl.step_done(batch_size, k)
    return used, tokens / (t[0] - t0)


@pytest.mark.parametrize("case", [
    # (acceptance per position, step cost for k drafts, the best k)
    (0.3, lambda k: 1.0 + k, 0),  # rows cost a decode row each, drafts rarely right: plain decode
    (0.8, lambda k: 1.0 + 0.01 * k, 4),  # rows nearly free, drafts mostly right: the longest
    (0.6, lambda k: 1.0 + 0.25 * k, 2),  # tokens per time: k=0 1.0, 1 1.28, 2 1.31, 4 1.15 (1 is close)
])
def test_the_controller_reaches_the_best_lengths_throughput_and_keeps_probing(case):
    accept, cost, best = case
    ctl = AdaptiveDraftLength(4, probe_every=32)
    used, rate = simulate(ctl, 600, 8, cost, accept, random.Random(0))
    expected = lambda k: 8 * sum(accept ** i for i in range(k + 1)) / cost(k)  # noqa: E731
    assert max(expected(k) for k in (0, 1, 2, 4)) == expected(best)
    assert rate >= 0.95 * expected(best), (rate, expected(best), {k: used[100:].count(k) for k in set(used)})
    tail = used[100:]
    if best != 2:  # a clear winner is chosen almost always (probes apart)
        assert tail.count(best) / len(tail) > 0.9, (best, {k: tail.count(k) for k in set(tail)})
    assert set(tail) - {best}, "the other lengths are probed again now and then"
    assert used[:6] == [4, 4, 4, 0, 0, 0], "K, then plain decode rows are timed first"


def test_buckets_choose_independently():
    # The same drafts: at batch 1 a verify row is free, at batch 64 it costs a decode row.
    ctl = AdaptiveDraftLength(4)
    rng = random.Random(1)
    small = big = None
    for _ in range(10):
        small = simulate(ctl, 40, 1, lambda k: 1.0, 0.5, rng)[0]
        big = simulate(ctl, 40, 64, lambda k: 64.0 * (1 + k), 0.5, rng)[0]
    assert small[-20:].count(4) >= 15 and big[-20:].count(0) >= 15, (small[-20:], big[-20:])


def test_untimed_lengths_are_estimated_on_a_line_and_from_the_nearest_bucket():
    ctl = AdaptiveDraftLength(4)
    assert ctl._profile(8) == {}  # nothing timed anywhere: explore
    t = [0.0]
    ctl.clock = lambda: t[0]
    for b, k, dt in [(8, 0, 2.0), (8, 4, 6.0), (1, 4, 3.0), (2, 0, 5.0)]:
        for _ in range(2):  # the first step after a switch is not timed
            t[0] += dt
            ctl.step_done(b, k)
    assert ctl._profile(8) == {0: 2.0, 1: 3.0, 2: 4.0, 4: 6.0}  # the line through k = 0 and 4
    assert ctl._profile(16) == {0: 2.0, 1: 3.0, 2: 4.0, 4: 6.0}  # nothing timed: bucket 8's, as is
    assert ctl._profile(1) == {0: 1.0, 1: 1.5, 2: 2.0, 4: 3.0}  # bucket 8's line, scaled to k = 4
    assert ctl._profile(2) == {0: 5.0, 1: 7.5, 2: 10.0, 4: 15.0}  # the nearest with a line: 8 (1 has one)


def test_steps_are_timed_when_steady_after_a_steady_step_and_outliers_do_not_count():
    # A step is timed only when it and the step before it were steady with the same bucket and k;
    # a length's time is the least of its last 3 (noise only adds).
    ctl = AdaptiveDraftLength(2)
    t = [0.0]
    ctl.clock = lambda: t[0]
    for k, dt in [(2, 1.0), (None, 5.0), (2, 1.0), (0, 9.0), (0, 2.0), (0, 7.0), (0, 2.5)]:
        t[0] += dt
        ctl.step_done(4, k)
    assert set(ctl.timings) == {(4, 0)} and list(ctl.timings[(4, 0)].recent) == [2.0, 7.0, 2.5]  # not the 9.0
    assert ctl.timings[(4, 0)].seconds == 2.0
    t[0] += 3.0
    ctl.step_done(4, 0)
    assert ctl.timings[(4, 0)].seconds == 2.5  # the window moves on (the context grows)


def test_the_flag_needs_an_algorithm():
    with pytest.raises(ValueError, match="--speculative-adaptive needs --speculative-algorithm"):
        EngineConfig(speculative_adaptive=True)
    EngineConfig(speculative_algorithm="ngram", speculative_adaptive=True, tp_size=2)  # rank 0 chooses


# ---- the engine ---------------------------------------------------------------------------
def charge_by_length(core, seconds_per_draft: float, probe_every: int = 1) -> list[int]:
    """Make the engine's controller time each step as 1 + seconds_per_draft * k (a fake clock)
    and probe every few steps; returns the list the chosen lengths are appended to."""
    spec = core.scheduler.spec
    ctl = spec.adaptive
    t, chosen = [0.0], []

    def clock():
        t[0] += 1.0 + seconds_per_draft * spec.step_k
        return t[0]

    choose = ctl.choose
    ctl.clock, ctl.probe_every = clock, probe_every
    ctl.choose = lambda *a, **kw: (chosen.append(choose(*a, **kw)), chosen[-1])[1]
    return chosen


@pytest.mark.parametrize("per_draft", [0.02, 0.6])
def test_mtp_rounds_with_changing_lengths_match_plain_greedy_and_reference(model_dir, per_draft):  # noqa: F811
    ps = prompts(3, seed=41, lo=12, hi=40)
    kw = dict(page_size=4, chunked_prefill_size=16, max_prefill_tokens=24)
    core = spec_core(model_dir, 4, alpha=0.01, speculative_adaptive=True, **kw)
    chosen = charge_by_length(core, per_draft)
    res, drafts, _ = run_spec(core, ps, max_tokens=64)
    assert {rid: r[1] for rid, r in res.items()} == run_plain(plain_core(model_dir, alpha=0.01, **kw), ps,
                                                              max_tokens=64)
    assert {0, 4} < set(chosen), chosen  # plain rows, K and a length between
    lengths = {len(d) for ds in drafts.values() for _, d, _ in ds}
    assert lengths == set(chosen) - {0}, ("the passes draft what was chosen", lengths)
    assert_reference(core, res)
    assert assert_mtp_reference(core, res, drafts) > 0
    counts = core.stats().spec
    assert 0 < counts.accepted_tokens < sum(counts.proposed)


def test_ngram_rounds_with_changing_lengths_match_plain_greedy(model_dir):  # noqa: F811
    from tests.engine.test_ngram import copy_core, echo_prompts, ngram_core

    kw = dict(page_size=4, chunked_prefill_size=32, max_prefill_tokens=48)
    ps = echo_prompts(model_dir, 2, seed=43, max_tokens=24, **kw)
    core = ngram_core(model_dir, 4, speculative_adaptive=True, **kw)
    spec = core.scheduler.spec
    assert spec.drafter.shadow  # drafting is free: plain steps score position 1 too
    chosen = charge_by_length(core, 0.3)
    observed, observe = [], spec.adaptive.observe_round
    spec.adaptive.observe_round = lambda *a: (observed.append((spec.step_k, *a)), observe(*a))[1]
    shadows, run = [], spec.drafter.run  # (rid, seq_len, the first draft it would have proposed)

    def run_and_record(reqs, num_drafts):
        run(reqs, num_drafts)
        shadows.extend((r.rid, r.seq_len, r.spec.shadow) for r in reqs if r.spec.shadow is not None)

    spec.drafter.run = run_and_record
    res, drafts, _ = run_spec(core, ps, max_tokens=24)
    assert {rid: r[1] for rid, r in res.items()} == run_plain(copy_core(model_dir, **kw), ps, max_tokens=24)
    assert {0, 4} < set(chosen), chosen
    assert set(chosen) - {0} <= {len(d) for ds in drafts.values() for _, d, _ in ds}
    assert core.stats().spec.accepted_tokens > 0
    # every plain step scored each request's shadow against the token it then committed
    scored = [o[1:] for o in observed if o[0] == 0]  # (offered, proposed, accepted)
    full = {rid: prompt + out for rid, (prompt, out, _, _) in res.items()}
    want = [(1, len(d), int(d == full[rid][T:T + 1])) for rid, T, d in shadows if T < len(full[rid])]
    assert scored and sorted(scored) == sorted(want), (scored, want)
    assert_reference(core, res)
