"""Block drafters on the engine's kernel path: `PagedBlockPass` (kiln/engine/spec/block_pass.py).

The block rows' K/V go into the drafter's paged pool after the context's and the decode attention
kernel serves them (Triton's interpreter on the CPU; its graphs stood in for by a capturer that
re-runs the pass). What must hold beyond tests/engine/test_block_drafter.py's checks (plain greedy
output, reference logit rows, reference drafts): which requests the paged pass drafts and which
the padded pass (sampled drafts, requests short of pages), the pages admission keeps for a block,
accepted drafts landing inside the previous block's rows, and graph replays that write nowhere
but their live blocks and the scratch slot.
"""

from __future__ import annotations

import dataclasses

import pytest

from kiln.engine.request import SamplingParams
from tests.engine.test_block_drafter import (B, assert_block_reference, make_target, oracle, outputs, plain_core,
                                             spec_core, truth)
from tests.engine.test_hybrid_engine import assert_reference, prompts
from tests.engine.test_speculative import run_plain, run_spec


def count_paged_passes(core) -> list[int]:
    """Wrap the drafter's paged pass: the list gets each pass's request count (stays empty
    without a paged pass)."""
    paged, calls = core.scheduler.spec.drafter.paged, []
    if paged is None:
        return calls
    run = paged.run
    paged.run = lambda reqs: (calls.append(len(reqs)), run(reqs))[1]
    return calls


@pytest.mark.parametrize("name", ["llama", "llama_dflash2", "minimax_m3"])  # DFlash, its selector, DSpark
def test_kernel_path_drafts_over_the_paged_context(name, tmp_path_factory):
    # On the engine's kernel path (Triton's interpreter here) the context K/V go through the
    # one-launch cache write (kernels/kv_store.py) and the blocks run `PagedBlockPass`: their own
    # K/V written into the pool after the context's, then the decode attention kernel. Drafts
    # equal to the fresh reference mean both stored every row where it belongs and read exactly
    # the block's context. DFlash2's candidate selector keeps the padded reference pass.
    pytest.importorskip("triton")
    target = make_target(name, tmp_path_factory)
    kw = dict(page_size=4, chunked_prefill_size=16, max_prefill_tokens=40)
    ps = prompts(2, seed=29, lo=10, hi=30)
    core = spec_core(target, 3, kernel_backend="triton", **kw)
    assert core.runner.use_kernels
    calls = count_paged_passes(core)
    res, drafts, _ = run_spec(core, ps, max_tokens=4)
    assert outputs(res) == run_plain(plain_core(target, **kw), ps, max_tokens=4)
    assert assert_block_reference(core, res, drafts) > 0
    # the blocks' anchors (run_spec records anchor - 1) sit at every offset of a page
    offsets = {rid: [(n + 1) % kw["page_size"] for n, _, _ in d] for rid, d in drafts.items()}
    assert set().union(*offsets.values()) == set(range(kw["page_size"])), offsets
    selector = core.runner.draft_model.candidate_selector is not None
    assert (not calls) if selector else calls, calls


def test_kernel_path_drafts_sampled_requests_on_the_paged_pass(tmp_path_factory):
    # Under exact verification a sampled request drafts on the paged pass with the greedy request
    # of the same step (until the tenth session it went to the padded pass), its drafts drawn
    # from q over the pass's logits: the greedy output is plain greedy, every emitted token's
    # logit row is the reference's, the q rows are the processing of the pass's draft logits.
    pytest.importorskip("triton")
    from tests.engine.test_spec_sampled import FLAGS, assert_q_rows_are_processed_draft_logits, mixed_params, watch

    target = make_target("llama", tmp_path_factory)
    kw = dict(page_size=4)  # the kernel path for the spec core; plain greedy from the default (reference) path
    # a penalised sampled request (every kind of processing) and a greedy one
    ps = prompts(2, seed=21, lo=12, hi=20)
    # the sampled r0 (12 tokens, some of its drafts accepted) is in every round of the greedy r1 (5 tokens)
    params = [dataclasses.replace(p, max_tokens=m) for p, m in ((mixed_params()[1], 12), (mixed_params()[2], 5))]
    core = spec_core(target, 3, kernel_backend="triton", **kw, **FLAGS["tokenwise"])
    drafter = core.scheduler.spec.drafter
    steps = []  # per drafter step: (rids of its paged pass, rids of its padded passes)
    run, paged_run, padded = drafter.run, drafter.paged.run, drafter._draft

    def step(reqs, num_drafts):
        steps.append(([], []))
        run(reqs, num_drafts)

    drafter.run = step
    drafter.paged.run = lambda reqs: (steps[-1][0].extend(r.rid for r in reqs), paged_run(reqs))[1]
    drafter._draft = lambda reqs, ks: (steps[-1][1].extend(r.rid for r in reqs), padded(reqs, ks))[1]
    passes, _ = watch(core)
    res, _, _ = run_spec(core, ps, params=params)
    both = [s for s in steps if s == (["r0", "r1"], [])]
    assert len(both) >= 3, steps  # steps that drafted the sampled r0 and the greedy r1 in one paged pass
    assert not any(padded for _, padded in steps), steps
    assert res["r1"][1] == run_plain(plain_core(target, **kw), [ps[1]], max_tokens=5)["r0"]
    assert_reference(core, res)
    assert_q_rows_are_processed_draft_logits(passes, min_rows=4)


def test_requests_short_of_pages_for_their_block_draft_on_the_padded_pass(tmp_path_factory):
    # The pool cannot give any request the pages its block needs (anchor + B positions) after
    # a verify, only its committed ones: the paged pass cannot run, and each request drafts on
    # the padded pass, which stores nothing past them, instead of drafting nothing that round.
    pytest.importorskip("triton")
    target = make_target("llama", tmp_path_factory)
    kw = dict(page_size=4)  # the kernel path for the spec core; plain greedy from the default (reference) path
    ps = prompts(2, seed=32, lo=12, hi=20)
    core = spec_core(target, 3, kernel_backend="triton", **kw)
    spec, cache = core.scheduler.spec, core.scheduler.cache
    grow, make_room, short = cache.grow, spec._make_room, [False]
    cache.grow = lambda r, n, *writes: not (short[0] and n > r.seq_len) and grow(r, n, *writes)

    ks = []  # drafts granted to each request ready to decode

    def short_of_pages(r, keep=0):
        short[0] = True
        try:
            k = make_room(r, keep)
        finally:
            short[0] = False
        if r.num_computed == r.seq_len - 1:
            ks.append(k)
        return k

    spec._make_room = short_of_pages
    padded, draft = [], spec.drafter._draft
    spec.drafter._draft = lambda reqs, k: (padded.append(len(reqs)), draft(reqs, k))[1]
    res, drafts, _ = run_spec(core, ps, max_tokens=6)
    assert outputs(res) == run_plain(plain_core(target, **kw), ps, max_tokens=6)
    assert len(ks) >= 8 and all(k == 3 for k in ks), ks
    assert padded
    assert assert_block_reference(core, res, drafts) > 0


def test_admission_reserves_each_request_its_block_on_the_paged_pass(tmp_path_factory):
    # Admission keeps pages for what running requests will hold beyond their committed tokens:
    # the verify's K positions, or a block drafter's block (B - 1) on the paged pass.
    pytest.importorskip("triton")
    from kiln.engine.io import GenerateReq

    target = make_target("llama", tmp_path_factory)
    for backend, extra in (("triton", B - 1), ("reference", 2)):
        core = spec_core(target, 2, page_size=2, kernel_backend=backend)
        sched = core.scheduler
        core.add_request(GenerateReq(rid="a", input_ids=list(range(10)), params=SamplingParams(max_tokens=4)))
        core.step()  # the prompt in one chunk: nothing left to prefill
        sched.new_token_ratio = 0.0  # and no expected output: only the round's positions count
        assert sched._reserved_pages() == -(-extra // 2) + 1, backend


def test_oracle_acceptance_on_the_paged_pass(tmp_path_factory):
    # Accepted drafts on the kernel path: the next block's anchor then lands inside the previous
    # block's rows, whose K/V the pass wrote into the pool and the verify overwrote with context
    # K/V. Drafts (their logits: the real paged pass ran) equal the reference, the output plain greedy.
    pytest.importorskip("triton")
    target = make_target("llama", tmp_path_factory)
    kw = dict(page_size=4, chunked_prefill_size=16, max_prefill_tokens=40)
    ps = prompts(3, seed=24, lo=10, hi=40)
    plain = run_plain(plain_core(target, **kw), ps, max_tokens=6)  # the default (reference) path
    core = spec_core(target, 3, kernel_backend="triton", **kw)
    calls = count_paged_passes(core)
    oracle(core, truth(ps, plain), corrupt=0.5, method="_draft_paged")
    res, drafts, _ = run_spec(core, ps, max_tokens=6)
    assert outputs(res) == plain and calls
    counts = core.stats().spec
    assert 0 < counts.accepted_tokens < sum(counts.proposed), "want both acceptances and rejections"
    # a block anchored more than one position past the request's previous one: drafts were accepted
    # and the next block's anchor is inside the previous block's rows
    anchors = {rid: [n + 1 for n, _, _ in d] for rid, d in drafts.items()}
    assert any(b - a > 1 for a_s in anchors.values() for a, b in zip(a_s, a_s[1:])), anchors
    assert_reference(core, res)
    assert assert_block_reference(core, res, drafts) > 0


@pytest.mark.parametrize("name", ["llama", "minimax_m3"])  # DFlash; DSpark with MSA in the verify graphs
def test_paged_block_pass_replays_from_graphs(name, tmp_path_factory):
    # The paged pass captured per batch size (a capturer that re-runs the captured function
    # stands in for CUDA graphs, as in tests/engine/test_graph_buffers.py): Llama's 4 requests
    # replay the graph of 4, then 3 of them, whose padding request must write nowhere but the
    # scratch slot 0; the drafts stay on the device and the next verify gathers them there. The
    # target's verify forwards replay from their graphs too: on MiniMax-M3 (2 requests, graphs up
    # to 2) past MSA's selection start (32 tokens), where a graph batch must not size the
    # block-score grid from its placeholder host lengths.
    pytest.importorskip("triton")
    from kiln.engine.cuda_graph import graph_batch_sizes
    from tests.engine.test_graph_buffers import RecomputeCapturer

    target = make_target(name, tmp_path_factory)
    kw = dict(page_size=4, chunked_prefill_size=16, max_prefill_tokens=64)
    if name == "llama":  # a short prompt starts (and finishes) first: the graph of 4 runs 4, then 3 + padding
        ps, n, max_bs = [prompts(1, seed=30, lo=8, hi=9)[0]] + prompts(3, seed=31, lo=17, hi=25), 3, 4
    else:  # a short context keeps the graphs' whole-context score grid small under the interpreter
        ps, n, max_bs, kw["context_length"] = prompts(2, seed=31, lo=33, hi=38), 3, 2, 56
    core = spec_core(target, 3, kernel_backend="triton", cuda_graph_max_bs=max_bs, **kw)
    runner = core.runner
    runner.graphs = runner._new_graphs()
    runner.graphs.capture(RecomputeCapturer())
    verify_shapes = []
    replay = runner.graphs.replay
    runner.graphs.replay = lambda batch: (verify_shapes.append(runner.graphs.shape_of(batch)), replay(batch))[1]
    drafter, spec = core.scheduler.spec.drafter, core.scheduler.spec
    capturer = RecomputeCapturer()
    drafter.use_graphs(max_bs, capturer)
    assert sorted(drafter.paged.graphs) == graph_batch_sizes(max_bs)
    calls = count_paged_passes(core)
    gathered = []  # verify inputs whose drafts were still on the device
    draft_ids = spec.draft_ids
    spec.draft_ids = lambda r, k: (lambda out: (gathered.append(out[1] is not None), out)[1])(draft_ids(r, k))
    written = []  # DRAFT_KV slots each replay changed, against the live blocks' slots
    replay_of = {bs: replay for bs, (replay, _) in drafter.paged.graphs.items()}

    def checked_replay(bs):
        def replay():
            pool, paged, table = drafter.pool, drafter.paged, drafter.table
            before = pool.k[0].clone()
            replay_of[bs]()
            changed = set((pool.k[0] != before).flatten(1).any(1).nonzero().flatten().tolist())
            n = int(paged.live[:bs].sum())
            allowed = {0}
            for a, row in zip(paged.anchor_pos[:n].tolist(), paged.req_slots[:n].tolist()):
                allowed |= set(table[row, a:a + B].tolist())
            written.append((bs, n, changed <= allowed))
        return replay

    drafter.paged.graphs = {bs: (checked_replay(bs), out) for bs, (_, out) in drafter.paged.graphs.items()}
    res, drafts, _ = run_spec(core, ps, max_tokens=n)
    assert outputs(res) == run_plain(plain_core(target, **kw), ps, max_tokens=n)
    assert assert_block_reference(core, res, drafts) > 0
    assert capturer.replays > 0 and len(ps) in calls, calls
    if name == "llama":  # a padded replay after a full one of the same graph (stale inputs in the padding row)
        full = [i for i, (bs, n, _) in enumerate(written) if bs == n == 4]
        assert full and any(bs == 4 and n == 3 for bs, n, _ in written[full[0]:]), written
    assert all(ok for *_, ok in written), written
    assert any(gathered), "no verify read its drafts on the device"
    assert 4 in verify_shapes, "no verify forward replayed"  # K + 1 = 4 tokens per request
    core.check_integrity()
