"""`--speculative-adaptive`'s plain steps (draft length 0) in the engine: the MTP catch-up left for
one late pass (`MTPDrafter._may_wait`, `CATCH_UP_LAG`), and plain steps between plain steps under
overlap scheduling (`SpecDecoder._overlapped_plain_step`, forced on here: it is a CUDA default).

The lengths are scripted (`script_lengths`), so stretches of plain steps, rounds after them,
retraction, prefix hits, stop tokens and aborts land where the tests want them. What must hold:
greedy output equal to plain decoding, every emitted token's logits and every draft equal to the
fresh reference (the late catch-up read the right window state; overlapped steps stored the
drafter's state of their rows), seeded sampling equal to the host path, and prompt lookup's
shadow drafts scored against the right token.
"""

from __future__ import annotations

from tests.engine.test_hybrid_engine import assert_reference, prompts
from tests.engine.test_speculative import (assert_mtp_reference, model_dir, plain_core, run_plain,  # noqa: F401
                                          run_spec, spec_core)


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
    # For each step whose plan held a request that finished at the last commit: did it overlap?
    spec, with_finished = core.scheduler.spec, []
    overlaps = spec._plain_step_overlaps

    def recorded(plan, sample_reqs):
        verdict = overlaps(plan, sample_reqs)
        if any(r.finished for r, _, _ in plan):
            with_finished.append(verdict)
        return verdict

    spec._plain_step_overlaps = recorded
    script_lengths(core, ([3] * 3 + [0] * 40) * 20)
    got, reasons = run(core, abort_at=30)
    assert reasons["r1"] == "abort" and got["r1"] == want["r1"][:len(got["r1"])]
    assert {rid: o for rid, o in got.items() if rid != "r1"} == {rid: o for rid, o in want.items() if rid != "r1"}
    assert reasons["r0"] == "stop" and core.stats().num_retractions_total > 0
    assert len(overlapped) > 20, overlapped
    # such a step happened and still overlapped (the finished request left out)
    assert with_finished and any(with_finished), with_finished


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


def test_late_catch_up_replays_the_chain_graph(tmp_path):
    """With the drafter's pass on graphs (on the CPU a capturer that re-runs the captured pass, the
    kernels in Triton's interpreter), a late catch-up runs as one replay of the late catch-up
    graph, or (past its batch sizes; here every other late catch-up) as replays of the chain graph
    K + 1 rows each (`MTPChainGraph.catch_up`), not as one eager pass; one reached at the lag bound
    while nobody drafts takes every entry and no chain pass follows it. Drafts after it still equal
    the teacher-forced reference, and every emitted token's logits the reference forward's."""
    import json

    from kiln.engine.spec.mtp_drafter import CATCH_UP_LAG
    from tests.engine.test_graph_buffers import RecomputeCapturer
    from tests.engine.test_kernel_path import FEWER_LAYERS, INTERP_CONTEXT
    from tests.engine.test_speculative import SPEC_ARCHS

    (tmp_path / "config.json").write_text(json.dumps({**SPEC_ARCHS["inkling"], **FEWER_LAYERS["inkling"]}))
    K, kw = 3, dict(page_size=4, kernel_backend="triton", context_length=INTERP_CONTEXT)
    core = spec_core(str(tmp_path), K, alpha=0.01, speculative_adaptive=True, **kw)
    drafter = core.scheduler.spec.drafter
    drafter.use_graphs(2, RecomputeCapturer())
    # stretches of plain steps that reach the lag bound (the first and the last), or draft before it
    script_lengths(core, [K] * 2 + [0] * 18 + [K] + [0] * 7 + [K] + [0] * 18 + [K])
    calls, events, late_graph, graph = [], [], drafter.graph.late, drafter.graph
    catch_up, chain_pass, drafter_pass = graph.catch_up, graph.run, drafter.run
    assert late_graph.C == drafter.max_lag == CATCH_UP_LAG and not late_graph.drafts

    def counted(reqs, leave):  # (lag, leave, replays, on the late graph); alternately without and with it
        lag = max(r.seq_len - r.spec.frontier[0] for r in reqs)
        graph.late = late_graph if len(calls) % 2 else None
        calls.append((lag, leave, catch_up(reqs, leave), graph.late is not None))
        events.append(("catch_up", leave))
        return calls[-1][2]

    graph.catch_up = counted
    graph.run = lambda reqs: (events.append(("chain",)), chain_pass(reqs))[1]
    drafter.run = lambda reqs, num_drafts: (events.append(("pass",)), drafter_pass(reqs, num_drafts))[1]
    eager, forward_layer = [], drafter._forward_layer
    drafter._forward_layer = lambda k, layer, items, *a: (eager.append(max(len(it.catch_up) for it in items)),
                                                          forward_layer(k, layer, items, *a))[1]
    ps = prompts(2, seed=48, lo=24, hi=30)  # longer than a late catch-up: their first pass is eager
    res, drafts, _ = run_spec(core, ps, max_tokens=50)
    # greedy: every token the argmax of its logits, which equal the fresh reference's (so the
    # output is plain decoding's, without running it: the interpreter is slow)
    assert all(r[1] == [int(row.argmax()) for row in r[2]] for r in res.values())
    assert_reference(core, res)
    assert assert_mtp_reference(core, res, drafts) > 0
    # each late catch-up took ceil((lag - leave) / C) replays, C = 16 on the late graph and K + 1
    # on the chain graph; no eager pass caught up more rows than one pass's K + 1 and fewer than a
    # prompt's first pass (which is longer than any late catch-up)
    assert all(n == max(0, -(-(lag - leave) // (CATCH_UP_LAG if on_late else K + 1)))
               for lag, leave, n, on_late in calls), calls
    assert {on_late for lag, leave, n, on_late in calls if leave == 0} == {False, True}, calls
    assert any(leave and lag > leave for lag, leave, n, on_late in calls), calls
    # a catch-up at the lag bound is the whole pass: no chain pass in the same drafter pass
    assert all(events[i + 1] != ("chain",) for i, e in enumerate(events[:-1]) if e == ("catch_up", 0)), events
    assert max(lag for lag, *_ in calls) >= CATCH_UP_LAG and drafter.late_passes == sum(c[2] for c in calls) >= 4
    assert not [n for n in eager if K + 1 < n <= CATCH_UP_LAG + K + 1], eager
