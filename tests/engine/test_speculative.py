"""Speculative decoding with an MTP chain (`--speculative-algorithm mtp`), on the CPU in fp32, for
both model families that have one: tiny Inkling, and a tiny Llama with `num_mtp_layers` (MTP blocks
are RoPE decoder layers with a sliding window there; the main layers have no window state at all).

What must hold, whatever the draft length, the acceptance, the batching, prefix hits and
retraction (the integrity check runs after every scheduler step):
- greedy output with speculation is token-identical to greedy output without it;
- every logit row a token was taken from equals the packed reference forward over the committed
  tokens (1e-4): the state the rejected positions touched was rolled back;
- every MTP draft computed from committed inputs equals the teacher-forced MTP reference
  (`forward_mtp_reference`, 1e-4): the MTP caches were caught up exactly.

Two drafters: the checkpoint's random MTP weights (almost every draft is rejected), and a
"copy" construction whose MTP layers predict what the target would if its layers added nothing
(`copy_drafter`): with alpha = 0 the drafts are always accepted (the bonus path), with a small
alpha the target's own layers make it disagree now and then (partial acceptance).
"""

from __future__ import annotations

import json

import pytest
import torch

from kiln.engine.io import GenerateReq
from kiln.engine.request import SamplingParams
from kiln.models.mtp import forward_mtp_reference
from kiln.models.reference import packed_batch
from tests.engine.test_hybrid_engine import INKLING, MINIMAX, assert_reference, make_core, prompts

SPEC_INKLING = {**INKLING, "num_mtp_layers": 4}
# Tiny Llama with MTP: window 16 so that prefix hits land inside and beyond the MTP window.
SPEC_LLAMA = dict(model_type="llama", vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=96, max_position_embeddings=512,
                  tie_word_embeddings=False, num_mtp_layers=4, mtp_sliding_window=16, mtp_intermediate_size=80)
SPEC_ARCHS = {"inkling": SPEC_INKLING, "llama": SPEC_LLAMA}


@pytest.fixture(scope="module", params=sorted(SPEC_ARCHS))
def model_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"{request.param}_mtp")
    (d / "config.json").write_text(json.dumps(SPEC_ARCHS[request.param]))
    return str(d)


def copy_drafter(core, alpha: float) -> None:
    """Scale every output projection of the main layers and of the MTP blocks, and the hidden
    half of each MTP `eh_proj`, by alpha; make the token half the identity (enorm = 1) and each
    MTP final norm the main model's. Then h^0 = norm(Emb(t_i)) + O(alpha) and layer k's draft is
    lm_head(norm(Emb(t_{i+k}))) + O(alpha): exactly the target's argmax when alpha = 0 (the two
    logit vectors differ by a positive scale), mostly so for a small alpha, while every part of
    the chain (attention masks, cached keys, hidden states carried between layers) still moves
    the logits far beyond the tests' 1e-4."""
    model = core.runner.model
    with torch.no_grad():
        for name, p in model.model.layers.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.w2")):
                p.mul_(alpha)
        h = model.config.hidden_size
        for layer in model.mtp:
            layer.enorm.weight.fill_(1.0)
            layer.eh_proj.weight[:, h:] *= alpha
            layer.eh_proj.weight[:, :h] = torch.eye(h)
            layer.block.self_attn.o_proj.weight.mul_(alpha)
            layer.block.mlp.down_proj.weight.mul_(alpha)
            layer.final_norm.weight.copy_(model.model.norm.weight)


def spec_core(model_dir, k: int, alpha=None, **kw):
    core = make_core(model_dir, speculative_algorithm="mtp", speculative_num_steps=k, **kw)
    if alpha is not None:
        copy_drafter(core, alpha)
    return core


def plain_core(model_dir, alpha=None, **kw):
    core = make_core(model_dir, **kw)
    if alpha is not None:
        copy_drafter(core, alpha)
    return core


def peek_drafts(state) -> list[int]:
    """A request's drafts without reading them back through `DraftState.drafts`: drafts still on
    the device (`in_flight`) stay there, so the next verify gathers them on the device as it does
    when nobody looks."""
    if state.in_flight is not None:
        flight, row = state.in_flight
        return flight.tokens[row, :state.num_drafts].tolist()
    return list(state.drafts)


def run_spec(core, reqs, max_tokens=16, tag="r", params=None):
    """Run requests concurrently. Returns ({rid: (prompt, output, [logit rows of the emitted
    tokens], cached_tokens)}, {rid: [(anchor, drafts, [draft logits per layer])]}, final outputs)."""
    spec = core.scheduler.spec
    rows: dict[str, list[torch.Tensor]] = {}
    drafts: dict[str, list] = {}
    verify, run, device_round = spec._verify_and_commit, spec.drafter.run, spec._device_round
    overlapped = spec._overlapped_plain_step
    adopt = getattr(spec.drafter, "adopt_in_flight", None)
    spec.drafter.keep_logits = True

    def capture_verify(logits, rs, first_rows, ends, **kw):
        # (a copy: a verify queued ahead before the commit, `VerifyAhead.queue_host_drafted`, replays into
        # the same static logits)
        before = [(r, f, len(r.output_ids)) for r, f in zip(rs, first_rows) if not r.finished]
        logits = logits.clone()
        verify(logits, rs, first_rows, ends, **kw)
        for r, first, n in before:  # emitted token i was taken from row first + i
            rows.setdefault(r.rid, []).extend(logits[first:first + len(r.output_ids) - n].clone())

    def record_drafts(r):
        if r.spec.num_drafts:
            drafts.setdefault(r.rid, []).append((r.seq_len - 2, peek_drafts(r.spec),
                                                 [x.clone() for x in r.spec.draft_logits]))

    def capture_drafts(rs, num_drafts):
        run(rs, num_drafts)
        for r in rs:
            record_drafts(r)

    def capture_device_round(plan, logits, batch, row_starts):
        # verify rows of request i start at row_starts[i]; drafts are recorded as each request adopts them
        # (a copy: a verify queued ahead, `verify_ahead`, replays into the same static logits)
        before = [(r, start, len(r.output_ids)) for (r, _, _), start in zip(plan, row_starts)]
        seen = logits.clone()
        device_round(plan, logits, batch, row_starts)
        for r, first, n in before:
            rows.setdefault(r.rid, []).extend(seen[first:first + len(r.output_ids) - n])

    def capture_overlapped(plan, logits, sample_rows, batch, row_starts):
        # one sampled row per request, its token read back at the next step
        overlapped(plan, logits, sample_rows, batch, row_starts)
        for (r, _, _), i in zip(plan, sample_rows):
            if not r.finished:  # a request that finished at the last commit: its row is dropped
                rows.setdefault(r.rid, []).append(logits[i].clone())

    def capture_adopt(r, row, k):
        adopt(r, row, k)
        record_drafts(r)

    spec._verify_and_commit, spec.drafter.run, spec._device_round = capture_verify, capture_drafts, capture_device_round
    spec._overlapped_plain_step = capture_overlapped
    if adopt is not None:
        spec.drafter.adopt_in_flight = capture_adopt
    params = params or SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(reqs):  # params: one for all, or a list with one per request
        core.add_request(GenerateReq(rid=f"{tag}{i}", input_ids=ids,
                                     params=params[i] if isinstance(params, list) else params))
    out, cached, last = {}, {}, {}
    for _ in range(2000):  # a broken rollback can leave a request that is never scheduled again
        if not core.has_work():
            break
        for o in core.step():
            assert o.error is None, o.error
            out.setdefault(o.rid, []).extend(o.new_token_ids)
            cached[o.rid] = o.cached_tokens
            last[o.rid] = o
    spec._verify_and_commit, spec.drafter.run, spec._device_round = verify, run, device_round
    spec._overlapped_plain_step = overlapped
    if adopt is not None:
        spec.drafter.adopt_in_flight = adopt
    assert not core.has_work(), "requests still running after 2000 steps"
    core.check_integrity()
    res = {f"{tag}{i}": (ids, out[f"{tag}{i}"], rows[f"{tag}{i}"], cached[f"{tag}{i}"]) for i, ids in enumerate(reqs)}
    return res, drafts, last


def run_plain(core, reqs, max_tokens=16, tag="r"):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(reqs):
        core.add_request(GenerateReq(rid=f"{tag}{i}", input_ids=ids, params=params))
    out = {}
    while core.has_work():
        for o in core.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
    return out


def prefix_hit_prompts(base: list[int], base_output: list[int]) -> list[list[int]]:
    """Prompts that hit the prefix cache after `base` ran: shared prefixes below the conv window,
    inside and beyond the sliding window, and the whole first request (prompt + output) as the
    prefix of a new prompt."""
    return [base[:3] + base[10:30], base[:30] + [7, 8, 9], base, base + base_output + [5, 6]]


def assert_logits_match(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-4) -> None:
    """Draft logits equal their reference within `tol`, and -inf (off a token map) at the same
    entries."""
    assert torch.equal(torch.isinf(got), torch.isinf(want)), f"{what}: -inf pattern"
    err = (got - want)[torch.isfinite(want)].abs().max().item()
    assert err <= tol, f"{what} differs from the reference by {err:.2e}"


def assert_mtp_reference(core, res, drafts, reference=forward_mtp_reference) -> int:
    """Every draft whose inputs were committed tokens equals the teacher-forced MTP reference
    (`reference(model, ids, lens, hidden)` -> per-layer logits of every row; the trainer's forward
    in tests/spec_train). Returns how many (anchor, layer) pairs were compared."""
    model, checked = core.runner.model, 0
    for rid, (prompt, output, _, _) in res.items():
        ids = torch.tensor(prompt + output)
        n_tok = len(ids)
        with torch.no_grad():
            hidden = model(packed_batch(ids, [n_tok]))
            ref = reference(model, ids, [n_tok], hidden)
        for anchor, ds, logits in drafts.get(rid, []):
            for k in range(1, len(ds) + 1):
                teacher_forced = ds[:k - 1] == ids[anchor + 2:anchor + k + 1].tolist()
                if not teacher_forced or anchor > n_tok - 1 - k:
                    break
                assert_logits_match(logits[k - 1], ref[k - 1][anchor], f"{rid}: MTP layer {k} at anchor {anchor}")
                checked += 1
    return checked


@pytest.mark.parametrize("k", [1, 2, 4])
def test_random_mtp_rejections_match_plain_greedy_and_reference(model_dir, k):
    ps = prompts(3, seed=11, lo=20, hi=60)
    core = spec_core(model_dir, k, page_size=4)
    res, drafts, _ = run_spec(core, ps)
    plain = run_plain(plain_core(model_dir, page_size=4), ps)
    assert {rid: r[1] for rid, r in res.items()} == plain
    counts = core.stats().spec
    assert counts.verify_steps > 0 and counts.accepted_tokens < counts.verify_steps, "expected rejections"
    assert_reference(core, res)
    assert assert_mtp_reference(core, res, drafts) > 0


def test_forced_full_acceptance_takes_the_bonus_path(model_dir):
    k = 3
    ps = prompts(2, seed=12, lo=20, hi=40)
    core = spec_core(model_dir, k, alpha=0.0, page_size=4)
    res, drafts, last = run_spec(core, ps, max_tokens=17)
    assert {rid: r[1] for rid, r in res.items()} == run_plain(plain_core(model_dir, alpha=0.0, page_size=4), ps,
                                                              max_tokens=17)
    counts = core.stats().spec
    # 1 token from the prefill, then 16 = 4 rounds of k + 1 tokens, every draft accepted
    assert counts.verify_steps == 8 and counts.accepted == [8, 8, 8] and counts.accept_length == k + 1
    for o in last.values():
        assert o.spec.verify_steps == 4 and o.spec.accept_length == k + 1
        assert o.spec.accept_rate_per_position == [1.0, 1.0, 1.0]
    assert_reference(core, res)
    assert assert_mtp_reference(core, res, drafts) >= 2 * 4 * k


@pytest.mark.parametrize("k", [2, 4])
def test_partial_acceptance_batches_match_plain_greedy(model_dir, k):
    # A small alpha: the target mostly agrees with the copy drafter, sometimes not (every
    # acceptance length shows up); requests of different lengths batch with prefill chunks.
    ps = prompts(4, seed=13, lo=10, hi=70)
    kw = dict(page_size=4, chunked_prefill_size=16, max_prefill_tokens=24)
    core = spec_core(model_dir, k, alpha=0.01, **kw)
    res, drafts, _ = run_spec(core, ps, max_tokens=24)
    assert {rid: r[1] for rid, r in res.items()} == run_plain(plain_core(model_dir, alpha=0.01, **kw), ps,
                                                              max_tokens=24)
    counts = core.stats().spec
    rates = counts.accept_rate_per_position
    assert 0 < counts.accepted_tokens < sum(counts.proposed), "want both acceptances and rejections"
    assert 1.0 < counts.accept_length < k + 1, rates
    assert_reference(core, res)
    assert assert_mtp_reference(core, res, drafts) > 0


def test_prefix_hits_with_speculation(model_dir):
    k = 3
    core = spec_core(model_dir, k, alpha=0.01, page_size=4)
    plain = plain_core(model_dir, alpha=0.01, page_size=4)
    base = prompts(1, seed=14, lo=50, hi=51)[0]
    first, d1, _ = run_spec(core, [base], tag="a")
    assert_reference(core, first)
    others = prefix_hit_prompts(base, first["a0"][1])
    second, d2, _ = run_spec(core, others, tag="b")
    assert {rid: r[1] for rid, r in second.items()} == run_plain(plain, others, tag="b")
    assert second["b2"][3] > 0 and second["b3"][3] > len(base), "prompts must hit the prefix cache"
    assert_reference(core, second)
    assert assert_mtp_reference(core, second, d2) > 0


def test_retraction_with_speculation(model_dir):
    kw = dict(page_size=4, max_total_tokens=160)
    ps = prompts(6, seed=15, lo=20, hi=40)
    core = spec_core(model_dir, 3, alpha=0.01, **kw)
    res, drafts, _ = run_spec(core, ps, max_tokens=48)
    assert core.stats().num_retractions_total > 0
    assert {rid: r[1] for rid, r in res.items()} == run_plain(plain_core(model_dir, alpha=0.01, **kw), ps,
                                                              max_tokens=48)
    assert_reference(core, res)
    assert assert_mtp_reference(core, res, drafts) > 0


def test_stop_token_inside_an_accepted_run_drops_the_rest(model_dir):
    core = spec_core(model_dir, 4, alpha=0.0, page_size=4)
    prompt = prompts(1, seed=16, lo=30, hi=31)[0]
    free = run_plain(plain_core(model_dir, alpha=0.0, page_size=4), [prompt], max_tokens=12)["r0"]
    stop = free[6]  # emitted in the middle of a fully accepted round
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop])
    res, _, last = run_spec(core, [prompt], params=params)
    out = res["r0"][1]
    assert out == free[:free.index(stop) + 1] and last["r0"].finish_reason == "stop"


def test_rounds_draft_k_up_to_the_last_token(model_dir):
    # max_tokens stops the commit, not the draft: the last round still verifies K drafts (a shorter
    # round would leave the verify's CUDA graph), and the output stops at max_tokens exactly.
    core = spec_core(model_dir, 3, alpha=0.0, page_size=4)
    prompt = prompts(1, seed=18, lo=20, hi=21)[0]
    res, drafts, last = run_spec(core, [prompt], max_tokens=6)
    assert res["r0"][1] == run_plain(plain_core(model_dir, alpha=0.0, page_size=4), [prompt], max_tokens=6)["r0"]
    assert last["r0"].finish_reason == "length"
    # after the prefill (token 1) and after round 1 (tokens 2-5): both passes draft 3
    assert [len(d) for _, d, _ in drafts["r0"]] == [3, 3]


def assert_abort_frees_every_page(core, prompt_ids: list[list[int]], max_tokens: int) -> None:
    """Abort one of several speculating requests mid-run; after the rest finish and the cache is
    flushed, every page of every space is free again (shared by the drafters' tests)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompt_ids):
        core.add_request(GenerateReq(rid=f"x{i}", input_ids=ids, params=params))
    for _ in range(4):
        core.step()
    core.abort("x1")
    while core.has_work():
        core.step()
    core.check_integrity()
    assert core.scheduler.flush_cache() and core.cache.allocator.num_free == core.cache.allocator.capacity
    for w in core.cache.windows.values():
        assert w.allocator.num_free == w.allocator.capacity


def test_abort_during_speculation_frees_everything(model_dir):
    assert_abort_frees_every_page(spec_core(model_dir, 3, alpha=0.01, page_size=4), prompts(3, seed=17), 50)


def test_seeded_sampling_is_exact_in_form_and_reproducible(model_dir):
    # Sampled requests verify by sampling every row from the target (drafts as point masses):
    # the same seed gives the same output, whatever else is batched.
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=5, ignore_eos=True)
    assert_seeded_output_alone_equals_batched(lambda: spec_core(model_dir, 3, alpha=0.01, page_size=4),
                                              prompts(2, seed=18), params)


def assert_seeded_output_alone_equals_batched(make_core, ps, params) -> None:
    """A seeded request's output is the same alone (ps[:1]) as next to another one (ps[:2]), each on a
    fresh core from `make_core()`, and every emitted token's logits equal a fresh prefill (shared by
    the drafters' tests)."""
    outs = []
    for n in (1, 2):
        core = make_core()
        res, _, _ = run_spec(core, ps[:n], params=params)
        outs.append(res["r0"][1])
        assert_reference(core, res)
    assert outs[0] == outs[1]


def test_bad_flags_have_clear_errors(tmp_path, model_dir):
    (tmp_path / "config.json").write_text(json.dumps(MINIMAX))
    with pytest.raises(ValueError, match="needs a model with MTP layers"):
        make_core(str(tmp_path), speculative_algorithm="mtp")
    with pytest.raises(ValueError, match=r"--speculative-num-steps must be in \[1, 4\]"):
        make_core(model_dir, speculative_algorithm="mtp", speculative_num_steps=5)


def test_finished_requests_cache_only_complete_mtp_state(model_dir):
    # A request that finishes on a verify has committed tokens whose MTP state was never caught
    # up (no pass runs for it); its pages past the MTP frontier must stay out of the prefix
    # cache, or a prompt extending it would read stale MTP entries and hidden states.
    ps_ = 4
    core = spec_core(model_dir, 4, alpha=0.01, page_size=ps_)
    ends = []
    end = core.scheduler._end

    def watch(r, reason):
        ends.append((r.num_computed, r.cache_limit))
        end(r, reason)

    core.scheduler._end = watch
    ps = prompts(8, seed=19, lo=20, hi=50)
    first, _, _ = run_spec(core, ps, max_tokens=13, tag="a")
    assert any(limit // ps_ < done // ps_ for done, limit in ends), "no request finished ahead of its MTP state"
    follow = [p + first[f"a{i}"][1] + [5, 6] for i, p in enumerate(ps)]
    second, drafts, _ = run_spec(core, follow, max_tokens=6, tag="b")
    assert all(r[3] > 0 for r in second.values())
    assert_reference(core, second)
    assert assert_mtp_reference(core, second, drafts) > 0


def test_acceptance_metrics_reach_outputs_and_prometheus(model_dir):
    from kiln.offline import Engine
    from kiln.server.app import EngineMetrics

    with Engine(model_path=model_dir, load_format="dummy", skip_tokenizer_init=True, max_total_tokens=1024,
                speculative_algorithm="mtp", speculative_num_steps=2) as llm:
        (res,) = llm.generate([list(range(20, 45))], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                              use_tqdm=False)
        stats = llm.stats()
    spec = res.outputs[0].spec
    assert spec.verify_steps >= 1 and len(spec.proposed) == 2 and spec.accept_length >= 1.0
    assert set(spec.to_dict()) == {"spec_verify_ct", "spec_accepted_tokens", "spec_accept_length",
                                   "spec_accept_rate_per_position"}
    assert stats.spec.verify_steps == spec.verify_steps
    assert stats.spec.steps_by_length == [0, 0, spec.verify_steps]  # every decode step offered K = 2
    metrics = EngineMetrics()
    metrics.update(stats)
    names = {m.name for m in metrics.collect()}
    assert {"kiln_spec_accept_length", "kiln_spec_accept_rate", "kiln_spec_verify_steps",
            "kiln_spec_steps_by_draft_length", "kiln_spec_verifies_queued_ahead"} <= names
