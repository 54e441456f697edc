"""Overlap scheduling: queuing step N+1 before reading step N's tokens back changes nothing a
request sees. The scheduler's overlap mode (on by default on CUDA) is forced on here on the CPU and
compared with the plain mode: greedy and seeded sampling with penalties, logprobs, EOS and length
stops, retraction under a small pool, and aborts; the integrity check runs after every step."""

from __future__ import annotations

from kiln.engine.io import GenerateReq
from kiln.engine.request import SamplingParams
from tests.engine.test_hybrid_engine import make_core, prompts


def _params(i: int) -> SamplingParams:
    kinds = [
        dict(temperature=0.0, max_tokens=9),
        dict(temperature=0.9, top_p=0.9, seed=11, max_tokens=7, logprobs=2),
        dict(temperature=0.7, top_k=20, seed=5, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=12),
        dict(temperature=0.0, max_tokens=4, logprobs=0),
        dict(temperature=1.0, min_p=0.1, seed=3, presence_penalty=0.7, max_tokens=10, min_tokens=3),
    ]
    return SamplingParams(**kinds[i % len(kinds)])


def _long_params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.8, seed=i, max_tokens=40, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def run(core, reqs, overlap: bool, abort_after: int = -1, params=_params):
    core.scheduler.overlap = overlap
    for i, ids in enumerate(reqs):
        core.add_request(GenerateReq(rid=f"r{i}", input_ids=ids, params=params(i)))
    out, lps, finish, steps = {}, {}, {}, 0
    while core.has_work():
        for o in core.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.new_logprobs:
                lps.setdefault(o.rid, []).extend(o.new_logprobs)
            if o.finished:
                finish[o.rid] = (o.finish_reason, o.completion_tokens)
        steps += 1
        if steps == abort_after:
            core.abort("r1")
            core.abort("r4")
    assert not core.scheduler.running and core.scheduler.pending is None
    core.check_integrity()
    return out, lps, finish


def _compare(a, b):
    out_a, lps_a, fin_a = a
    out_b, lps_b, fin_b = b
    assert out_a == out_b
    assert fin_a == fin_b
    assert lps_a.keys() == lps_b.keys()
    for rid in lps_a:
        for (x, tx), (y, ty) in zip(lps_a[rid], lps_b[rid]):
            assert abs(x - y) < 1e-5 and [t for t, _ in tx] == [t for t, _ in ty]


def test_overlap_equals_plain(arch_dir):
    reqs = prompts(10, seed=4, lo=10, hi=50)
    plain = run(make_core(arch_dir, page_size=4, chunked_prefill_size=32), reqs, overlap=False)
    overlap = run(make_core(arch_dir, page_size=4, chunked_prefill_size=32), reqs, overlap=True)
    _compare(plain, overlap)


def test_overlap_eos_and_abort(arch_dir):
    reqs = prompts(8, seed=5, lo=20, hi=40)
    plain_core, overlap_core = make_core(arch_dir, page_size=4), make_core(arch_dir, page_size=4)
    for core in (plain_core, overlap_core):
        core.scheduler.eos_token_ids = tuple(range(0, 512, 23))  # frequent EOS with random weights
    plain = run(plain_core, reqs, overlap=False, abort_after=6)
    overlap = run(overlap_core, reqs, overlap=True, abort_after=6)
    assert any(f[0] == "stop" for f in plain[2].values())
    # An abort lands a step later in a request's life in overlap mode, so only the requests that
    # were not aborted must agree exactly.
    for rid in ("r1", "r4"):
        for res in (plain, overlap):
            for d in res:
                d.pop(rid, None)
    _compare(plain, overlap)


def test_overlap_retraction(arch_dir):
    reqs = prompts(6, seed=6, lo=20, hi=30)
    # Room for about two requests' outputs: admission over-commits, decodes retract.
    kw = dict(page_size=4, chunked_prefill_size=16, max_total_tokens=160, max_running_requests=6)
    plain_core, overlap_core = make_core(arch_dir, **kw), make_core(arch_dir, **kw)
    plain = run(plain_core, reqs, overlap=False, params=_long_params)
    overlap = run(overlap_core, reqs, overlap=True, params=_long_params)
    assert plain_core.stats().num_retractions_total > 0 and overlap_core.stats().num_retractions_total > 0
    _compare(plain, overlap)
