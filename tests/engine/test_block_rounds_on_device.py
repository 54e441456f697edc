"""Block drafters (DFlash, DSpark) on the device round (`SpecDecoder._device_round`): the verify's
samples feed the paged block pass on the device (`PagedBlockPass.run_after_verify`: each block's
anchor token and position come from the acceptance counts), and the next verify is queued behind
that pass (`verify_ahead`). On the CPU: Triton's interpreter for the kernels and a capturer that
re-runs the captured function for the CUDA graphs (tests/engine/test_graph_buffers.py), with the
verify queued ahead forced on (the default on CUDA); the `gpu` variant runs real graphs.

Random drafters accept nothing, so the drafts are replaced by the target's greedy continuation
with some positions corrupted (an oracle, as in tests/engine/test_block_drafter.py), on the device
for device rounds: the anchors then move on by 1 .. K + 1, and every block after an acceptance
starts inside the previous block's rows. What must hold: greedy output equals plain decoding,
every emitted token's logits the packed reference forward, every block's draft logits the
reference block forward over fresh context features, and the integrity check after the run."""

from __future__ import annotations

import pytest
import torch

from kiln.engine.request import SamplingParams
from tests.engine.test_block_drafter import (assert_block_reference, fresh_context, make_target, oracle, outputs,
                                             plain_core, spec_core, truth)
from tests.engine.test_hybrid_engine import assert_reference, prompts
from tests.engine.test_speculative import run_plain, run_spec
from tests.engine.test_verify_ahead import record_taken, stand_in_graphs

pytest.importorskip("triton")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
STOP_AT = 4  # on Llama, the batch's last request stops at its output token this far in


def device_oracle(core, truth: dict[str, list[int]]) -> list[tuple[list[str], torch.Tensor, dict]]:
    """Make the device round's block pass draft the target's greedy continuation (`truth`: rid ->
    prompt + plain greedy output) from each block's anchor, which only the device knows, with one
    position corrupted in every other block (by anchor, so that it is reproducible). Returns a list
    that gets each device pass's (request ids, anchor positions on the device, {row: the anchor
    the host puts that row's request at when it adopts the drafts after the commit}), for
    `assert_device_anchors`. Nothing here waits for the device (each request's row of the truth
    table is copied to it once), so the test's stream order is the engine's."""
    paged, calls = core.scheduler.spec.drafter.paged, []
    width = max(len(t) for t in truth.values()) + 16
    rows: dict[str, torch.Tensor] = {}
    run = paged.run_after_verify

    def rigged(reqs, samples, count, sampled=False):
        assert not sampled, "the oracle drafts greedy rounds"
        tokens, logits = run(reqs, samples, count)
        n, K = tokens.shape
        dev = tokens.device
        for r in reqs:
            if r.rid not in rows:
                rows[r.rid] = torch.tensor(truth[r.rid] + [0] * (width - len(truth[r.rid])), device=dev)
        table = torch.stack([rows[r.rid] for r in reqs])
        anchor = paged.anchor_pos[:n].clone()  # loaded from the counts on the device
        ds = table.gather(1, anchor[:, None] + 1 + torch.arange(K, device=dev))
        bad = (anchor // 2 + torch.arange(n, device=dev)) % 2 == 0  # then corrupt position anchor % K
        hit = bad[:, None] & (torch.arange(K, device=dev)[None, :] == (anchor % K)[:, None])
        ds = torch.where(hit, (ds + 1) % 512, ds)  # (no boolean indexing: it would wait for the device)
        tokens.copy_(ds)  # the graph's output: the round clones it into its `DraftsInFlight`
        calls.append(([r.rid for r in reqs], anchor, {}))
        return tokens, logits

    drafter = core.scheduler.spec.drafter
    adopt = drafter.adopt_in_flight

    def adopted(r, row, k):
        calls[-1][2][row] = r.seq_len - 1  # committed: the block's anchor is the last token
        adopt(r, row, k)

    paged.run_after_verify, drafter.adopt_in_flight = rigged, adopted
    return calls


def assert_device_anchors(calls) -> None:
    """Every block anchored on the device sits where the host puts that request once it has
    committed the round (requests that finished at the commit adopt nothing)."""
    assert any(adopted for *_, adopted in calls), "no drafts of a device round were adopted"
    for rids, anchor, adopted in calls:
        for row, a in adopted.items():
            assert anchor[row].item() == a, (rids[row], anchor[row].item(), a)


def block_graph_core(target, k: int, device: str, max_bs: int, **kw):
    """A block-drafter engine on graphs (verify, decode and the paged block pass; on the CPU stood in
    for by `RecomputeCapturer`) with verifies queued ahead."""
    if device == "cuda":
        core = spec_core(target, k, cuda_graph_max_bs=max_bs, device="cuda", dtype="float32",
                         speculative_verify_ahead="all", **kw)
        assert core.scheduler.spec.ahead.after_device_rounds
        return core
    return stand_in_graphs(spec_core(target, k, kernel_backend="triton", cuda_graph_max_bs=max_bs, **kw), max_bs)


def watch_released_slots(core, page_size: int) -> list[int]:
    """Slots on free pages that the drafter's context store writes (every forward row's context
    K/V, inside the forward: `ModelRunner.store_draft_context`): the list gets them."""
    runner, alloc = core.runner, core.cache.allocator
    store, stale = runner.store_draft_context, []

    def checked(batch):
        free = alloc.free_pages()
        stale.extend(s for s in batch.out_cache_loc.tolist() if s and s // page_size in free)
        store(batch)

    runner.store_draft_context = checked
    return stale


def test_context_cache_on_graphs_equals_fresh_computation(tmp_path_factory):
    """The drafter's context K/V stored inside the target forward (`ModelRunner.store_draft_context`)
    and so replayed with the forward's graphs (stood in for on the CPU by re-running it): before
    every pass of a round on the device, the kept K/V of every committed position equal the
    drafter's projections of freshly computed context features, after rounds with rejections."""
    target = make_target("llama", tmp_path_factory)
    core = block_graph_core(target, 3, "cpu", 2, page_size=4, chunked_prefill_size=16, max_prefill_tokens=64)
    drafter = core.scheduler.spec.drafter
    paged, seen = drafter.paged, []
    run_after_verify = paged.run_after_verify

    def checked(reqs, *a, **kw):
        for r in reqs:
            n = r.num_computed
            with torch.no_grad():
                want = core.runner.draft_model.context_kv(fresh_context(core, r.all_ids[:n]), torch.arange(n))
            for (k, v), (wk, wv) in zip(drafter.context_kv(r), want):
                assert (k - wk).abs().max() <= 1e-4 and (v - wv).abs().max() <= 1e-4, f"{r.rid} at {n}"
            seen.append(n)
        return run_after_verify(reqs, *a, **kw)

    paged.run_after_verify = checked
    run_spec(core, prompts(2, seed=43, lo=10, hi=20), max_tokens=10)
    assert len(seen) > 4, seen
    counts = core.stats().spec
    assert counts.accepted_tokens < sum(counts.proposed), "expected rejections"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["llama", "minimax_m3"])  # DFlash; DSpark, MSA in the verify graphs
def test_block_rounds_on_the_device_equal_plain_greedy(name, device, tmp_path_factory):
    """Also, on Llama: the batch's last request stops on a stop token while its rows are in a
    queued verify. The others verify over their own rows on the host path, and the drafter's
    context store after that forward writes none of the pages the stopped request released at the
    commit before (`run_queued` points its rows at the scratch slot)."""
    target = make_target(name, tmp_path_factory)
    kw = dict(page_size=4, chunked_prefill_size=16, max_prefill_tokens=64)
    if name == "llama":
        ps, n, max_bs = prompts(3, seed=41, lo=10, hi=30), 14, 4
    else:  # a short context keeps the graphs' whole-context score grid small under the interpreter
        ps, n, max_bs, kw["context_length"] = prompts(2, seed=31, lo=33, hi=38), 10, 2, 64
    plain = run_plain(plain_core(target, **kw, **({"device": "cuda", "dtype": "float32"} if device == "cuda" else {})),
                      ps, max_tokens=n)
    core = block_graph_core(target, 3, device, max_bs, **kw)
    spec = core.scheduler.spec
    want = truth(ps, plain)
    on_device = device_oracle(core, want)
    oracle(core, want, corrupt=0.5, seed=3, method="_draft_paged")  # passes on the host path (prefill, ...)
    taken, stale = record_taken(core), watch_released_slots(core, kw["page_size"])
    stop = plain["r2"][STOP_AT] if name == "llama" else None
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                             stop_token_ids=[stop] if i == 2 and stop is not None else None) for i in range(len(ps))]
    res, drafts, last = run_spec(core, ps, params=params)
    if stop is not None:
        assert last["r2"].finish_reason == "stop"
        plain["r2"] = plain["r2"][:plain["r2"].index(stop) + 1]
    assert outputs(res) == plain
    assert not stale, f"the context store wrote released slots {stale}"
    assert any(len(rids) == len(ps) for rids, *_ in on_device), on_device
    assert_device_anchors(on_device)
    counts = core.stats().spec
    assert 0 < counts.accepted_tokens < sum(counts.proposed), "want both acceptances and rejections"
    assert counts.verifies_queued_ahead > 0 and spec.ahead.queued is None
    # blocks anchored more than one position past the request's previous block: drafts accepted
    anchors = {rid: [a + 1 for a, _, _ in d] for rid, d in drafts.items()}
    assert any(b - a > 1 for a_s in anchors.values() for a, b in zip(a_s, a_s[1:])), anchors
    if device == "cpu":  # (fp32 on the GPU: acceptances, so where the stop lands, and logits may differ)
        if stop is not None:  # a queued verify taken with the stopped request (the batch's last) left out
            assert any(0 < alive < k and not last_alive for alive, k, last_alive in taken), taken
        assert_reference(core, res)
        assert assert_block_reference(core, res, drafts) > 0
