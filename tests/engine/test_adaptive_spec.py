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


def script_lengths(core, script: list[int]) -> list[tuple[int, int]]:
    """Make the engine's controller choose `script[i]` at its i-th choice (the last one after
    that) and record, per drafter pass, (how far the worst request's MTP state lagged its
    committed tokens before the pass, layer forwards the pass ran: eager ones, or K for a replay
    of the chain graph)."""
    spec = core.scheduler.spec
    calls = iter(script)
    spec.adaptive.choose = lambda n: next(calls, script[-1])
    drafter, passes = spec.drafter, []
    run, forward_layer = drafter.run, drafter._forward_layer
    layers = [0]

    def counted(*a, **kw):
        layers[0] += 1
        return forward_layer(*a, **kw)

    if drafter.graph is not None:
        replay = drafter.graph.run

        def replayed(*a, **kw):
            layers[0] += drafter.num_layers
            return replay(*a, **kw)

        drafter.graph.run = replayed

    def recorded(reqs, num_drafts):
        lag = max((r.seq_len - r.spec.complete for r in reqs), default=0)
        layers[0] = 0
        run(reqs, num_drafts)
        passes.append((lag, layers[0]))

    drafter.run, drafter._forward_layer = recorded, counted
    return passes


def lags_at(core, method: str) -> list[int]:
    """Record how far each request's MTP state lags its committed tokens when the scheduler's
    `method(r, ...)` is called for it (retraction, the end of a request)."""
    sched, lags = core.scheduler, []
    wrapped = getattr(sched, method)

    def recorded(r, *a, **kw):
        lags.append(r.num_computed - r.spec.complete)
        return wrapped(r, *a, **kw)

    setattr(sched, method, recorded)
    return lags


def test_plain_steps_leave_the_mtp_catch_up_for_one_late_pass(model_dir):  # noqa: F811
    """Passes that draft nothing skip the MTP layers until a request's state would lag
    CATCH_UP_LAG committed tokens; the late catch-up (one pass of many rows, on window state the
    spaces kept) leaves drafts equal to the teacher-forced reference, and output equal plain."""
    from kiln.engine.spec.mtp_drafter import CATCH_UP_LAG

    kw = dict(page_size=4, chunked_prefill_size=16, max_prefill_tokens=24)
    core = spec_core(model_dir, 4, alpha=0.01, speculative_adaptive=True, **kw)
    assert core.scheduler.spec.drafter.max_lag == CATCH_UP_LAG == core.runner.mtp_catch_up_lag
    plain_history = plain_core(model_dir, alpha=0.01, speculative_algorithm="mtp", **kw).runner.window_history
    assert core.runner.window_history == {c: h + CATCH_UP_LAG for c, h in plain_history.items()}
    script = [4] * 6 + [0] * 45 + [4] * 6 + [0] * 7 + [2] * 4 + [0] * 20 + [4]
    passes = script_lengths(core, script)
    ps = prompts(2, seed=44, lo=20, hi=36)
    res, drafts, _ = run_spec(core, ps, max_tokens=96)
    assert {rid: r[1] for rid, r in res.items()} == run_plain(plain_core(model_dir, alpha=0.01, **kw), ps,
                                                              max_tokens=96)
    assert_reference(core, res)
    assert assert_mtp_reference(core, res, drafts) > 0  # drafts after each late catch-up too
    # a skipped pass leaves the state one more token behind after the next commit: the bound is
    # reached, never passed
    assert max(lag + 1 for lag, n in passes if n == 0) == CATCH_UP_LAG, passes
    skipped = sum(n == 0 for _, n in passes)
    late = [i for i in range(1, len(passes)) if passes[i - 1][1] == 0 and passes[i][1]]  # catch-ups after skips
    assert skipped > 40 and len(late) >= 3 and max(passes[i][0] for i in late) == CATCH_UP_LAG, passes
    assert sum(n for _, n in passes) < len(passes) * 4 - 2 * skipped  # the layers ran far less than every pass


def test_without_the_flag_every_pass_catches_up(model_dir):  # noqa: F811
    kw = dict(page_size=4)
    core = spec_core(model_dir, 2, alpha=0.01, **kw)
    assert core.scheduler.spec.drafter.max_lag == 0 == core.runner.mtp_catch_up_lag


def test_late_mtp_catch_up_with_retraction_and_prefix_hits(model_dir):  # noqa: F811
    """Requests retracted, finished or cached while their MTP state lags: pages past the complete
    state are not cached, so a prefix hit restarts the MTP state from complete entries only."""
    from tests.engine.test_speculative import prefix_hit_prompts

    script = ([3] * 3 + [0] * 12) * 40
    kw = dict(page_size=4, max_total_tokens=200)
    core = spec_core(model_dir, 3, alpha=0.01, speculative_adaptive=True, **kw)
    passes = script_lengths(core, script)
    lags = lags_at(core, "_retract")
    ps = prompts(5, seed=45, lo=20, hi=40)
    res, drafts, _ = run_spec(core, ps, max_tokens=44)
    assert core.stats().num_retractions_total > 0 and max(lags) > 1, lags  # some retracted while lagging
    assert {rid: r[1] for rid, r in res.items()} == run_plain(plain_core(model_dir, alpha=0.01, **kw), ps,
                                                              max_tokens=44)
    assert_reference(core, res)
    assert assert_mtp_reference(core, res, drafts) > 0
    assert sum(n == 0 for _, n in passes) > 20, passes

    core = spec_core(model_dir, 3, alpha=0.01, speculative_adaptive=True, page_size=4)
    script_lengths(core, script)
    ended = lags_at(core, "_end")
    base = prompts(1, seed=14, lo=50, hi=51)[0]
    first, _, _ = run_spec(core, [base], tag="a", max_tokens=40)
    assert ended[0] > 3, ended  # it finished lagging past a round (K = 3): its last pages were not cached
    others = prefix_hit_prompts(base, first["a0"][1])
    second, d2, _ = run_spec(core, others, tag="b", max_tokens=30)
    assert {rid: r[1] for rid, r in second.items()} == run_plain(plain_core(model_dir, alpha=0.01, page_size=4),
                                                                 others, tag="b", max_tokens=30)
    assert second["b2"][3] > 0 and second["b3"][3] > len(base), "prompts must hit the prefix cache"
    assert_reference(core, second)
    assert assert_mtp_reference(core, second, d2) > 0


def count_overlapped(core) -> list[int]:
    """Run plain steps between plain steps under overlap scheduling (a CUDA default, forced here
    on the CPU) and record each such step's batch size (requests that had not finished)."""
    spec = core.scheduler.spec
    assert not spec.overlap_plain_steps  # off on the CPU
    spec.overlap_plain_steps = True
    sizes, step = [], spec._overlapped_plain_step
    spec._overlapped_plain_step = lambda plan, *a: (sizes.append(sum(not r.finished for r, _, _ in plan)),
                                                    step(plan, *a))[1]
    return sizes


def test_plain_steps_between_plain_steps_overlap(model_dir):  # noqa: F811
    """Plain steps that plain steps follow leave their tokens on the device (read back after the
    next forward is queued, as plain decode does under overlap scheduling): greedy output, every
    emitted token's logits and every MTP draft still equal plain decoding and the fresh reference."""
    kw = dict(page_size=4, chunked_prefill_size=16, max_prefill_tokens=24)
    core = spec_core(model_dir, 4, alpha=0.01, speculative_adaptive=True, **kw)
    overlapped = count_overlapped(core)
    script_lengths(core, [4] * 6 + [0] * 45 + [4] * 6 + [0] * 7 + [2] * 4 + [0] * 20 + [4])
    ps = prompts(3, seed=46, lo=20, hi=36)
    res, drafts, _ = run_spec(core, ps, max_tokens=96)
    assert {rid: r[1] for rid, r in res.items()} == run_plain(plain_core(model_dir, alpha=0.01, **kw), ps,
                                                              max_tokens=96)
    assert_reference(core, res)
    assert assert_mtp_reference(core, res, drafts) > 0
    assert len(overlapped) > 40 and max(overlapped) == 3, overlapped


def test_overlapped_plain_steps_sample_as_the_host_path_does(model_dir):  # noqa: F811
    """Seeded sampling, penalties and logprobs: the same tokens and logprobs with the plain
    steps overlapped as on the host path (the same lengths scripted in both runs)."""
    from kiln.engine.io import GenerateReq
    from kiln.engine.request import SamplingParams

    ps = prompts(3, seed=47, lo=20, hi=36)
    runs = []
    for overlap in (False, True):
        core = spec_core(model_dir, 3, alpha=0.01, speculative_adaptive=True, page_size=4)
        overlapped = count_overlapped(core) if overlap else []
        script_lengths(core, ([3] * 4 + [0] * 15) * 20)
        for i, ids in enumerate(ps):
            core.add_request(GenerateReq(rid=f"s{i}", input_ids=ids, params=SamplingParams(
                max_tokens=60, temperature=0.9, top_k=40, seed=100 + i, frequency_penalty=0.3, logprobs=2,
                ignore_eos=True)))
        out: dict = {}
        while core.has_work():
            for o in core.step():
                got = out.setdefault(o.rid, ([], []))
                got[0].extend(o.new_token_ids)
                got[1].extend(o.new_logprobs)
        runs.append(out)
        assert not overlap or len(overlapped) > 20, overlapped
    assert runs[0].keys() == runs[1].keys() and all(len(v[0]) == 60 for v in runs[0].values())
    for rid in runs[0]:
        assert runs[0][rid][0] == runs[1][rid][0], rid
        lp0, lp1 = runs[0][rid][1], runs[1][rid][1]
        assert len(lp0) == len(lp1) == 60 and repr(lp0) == repr(lp1), rid


def test_overlapped_plain_steps_with_stops_aborts_and_retraction(model_dir):  # noqa: F811
    """Under overlapped plain steps: a request stopping on a stop token while its next row is
    already in the next forward, one aborted mid-stretch with its token on the device, and
    retractions (a small pool); every step's integrity check passes and the others' output
    equals plain decoding."""
    from kiln.engine.io import GenerateReq
    from kiln.engine.request import SamplingParams

    kw = dict(page_size=4, max_total_tokens=160)
    ps = prompts(6, seed=48, lo=20, hi=40)
    free = run_plain(plain_core(model_dir, alpha=0.01, **kw), ps, max_tokens=48)
    stop = free["r0"][25]  # a stop token for r0 in the middle of its output
    params = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True,
                             stop_token_ids=[stop] if i == 0 else None) for i in range(len(ps))]

    def run(core, abort_at=None):
        for i, ids in enumerate(ps):
            core.add_request(GenerateReq(rid=f"r{i}", input_ids=ids, params=params[i]))
        out, reasons, steps = {}, {}, 0
        while core.has_work():
            pending = core.scheduler.pending is not None and "r1" in core.scheduler.pending.rows
            if abort_at is not None and steps >= abort_at and "r1" not in reasons and pending:
                core.abort("r1")  # its token still on the device
            for o in core.step():
                out.setdefault(o.rid, []).extend(o.new_token_ids)
                if o.finished:
                    reasons[o.rid] = o.finish_reason
            steps += 1
        return out, reasons

    want, want_reasons = run(plain_core(model_dir, alpha=0.01, **kw))
    assert want_reasons["r0"] == "stop" and len(want["r0"]) < 48
    core = spec_core(model_dir, 3, alpha=0.01, speculative_adaptive=True, **kw)
    core.scheduler.check_after_step = True
    overlapped = count_overlapped(core)
    spec, with_finished = core.scheduler.spec, []  # steps whose plan held a request finished at the last commit
    overlaps = spec._plain_step_overlaps
    spec._plain_step_overlaps = lambda plan, sr: (with_finished.append(overlaps(plan, sr)) if any(
        r.finished for r, _, _ in plan) else None, overlaps(plan, sr))[1]
    script_lengths(core, ([3] * 3 + [0] * 40) * 20)
    got, reasons = run(core, abort_at=30)
    assert reasons["r1"] == "abort" and got["r1"] == want["r1"][:len(got["r1"])]
    assert {rid: o for rid, o in got.items() if rid != "r1"} == {rid: o for rid, o in want.items() if rid != "r1"}
    assert reasons["r0"] == "stop" and core.stats().num_retractions_total > 0
    assert len(overlapped) > 20, overlapped
    assert True in with_finished, with_finished  # ...and still overlapped, without the finished one


def test_ngram_plain_steps_overlap_and_score_their_shadows(model_dir):  # noqa: F811
    """Prompt lookup's plain steps between plain steps overlap too: the shadow draft of the
    position still on the device is looked up from the committed tokens and scored once that
    token is committed, exactly as the lookup over the final sequence says."""
    from kiln.engine.spec.ngram_drafter import NgramIndex
    from tests.engine.test_ngram import copy_core, echo_prompts, ngram_core

    kw = dict(page_size=4, chunked_prefill_size=32, max_prefill_tokens=48)
    ps = echo_prompts(model_dir, 2, seed=49, max_tokens=24, **kw)
    core = ngram_core(model_dir, 4, speculative_adaptive=True, **kw)
    spec = core.scheduler.spec
    overlapped = count_overlapped(core)
    script = ([4] * 3 + [0] * 12) * 20
    calls = iter(script)
    spec.adaptive.choose = lambda n: next(calls, 0)
    scored, observe, score = [], spec.adaptive.observe_round, spec._score_committed_shadows

    def recorded(plan):  # (rid, position, shadow, what observe_round was told)
        looked = [(r.rid, r.spec.shadow_at, r.spec.shadow) for r, _, _ in plan if r.spec.shadow_at is not None]
        told = []
        spec.adaptive.observe_round = lambda *a: (told.append(a), observe(*a))[1]
        score(plan)
        spec.adaptive.observe_round = observe
        scored.extend((*x, t) for x, t in zip(looked, told))

    spec._score_committed_shadows = recorded
    res, drafts, _ = run_spec(core, ps, max_tokens=40)
    assert {rid: r[1] for rid, r in res.items()} == run_plain(copy_core(model_dir, **kw), ps, max_tokens=40)
    assert_reference(core, res)
    assert len(overlapped) > 20 and len(scored) > 20, (overlapped, scored)
    d = spec.drafter
    for rid, at, shadow, told in scored:
        full = res[rid][0] + res[rid][1]
        index = NgramIndex(d.min_n, d.max_n)
        index.extend(full[:at])
        assert shadow == index.propose(1), (rid, at)
        assert told == (1, len(shadow), int(shadow == full[at:at + 1])), (rid, at, shadow, told)
    assert any(t[2] for *_, t in scored) and not all(t[2] for *_, t in scored)  # hits and misses
