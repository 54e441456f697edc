"""Speculative decoding with block drafters (`--speculative-algorithm dflash|dspark`), CPU, fp32.

Targets: tiny Llama and tiny Inkling with a random-weight DFlash drafter (its own directory), tiny
MiniMax-M3 with its DSpark drafter (`dspark_config`). What must hold, whatever the draft length,
the acceptance, the batching, prefix hits, retraction and abort (integrity check every step):
- greedy output with speculation is token-identical to greedy output without it;
- every emitted token's logit row equals the packed reference forward over the committed tokens
  (1e-4): the target state that rejected positions touched was rolled back;
- every draft's logits equal the reference block forward (`BlockDrafter.draft_hidden`) on context
  features freshly computed from the committed tokens (1e-4), and the kept context K/V equal a
  fresh computation: the drafter's context cache was rolled back and survives prefix hits.
Random drafters are almost always rejected; an oracle (the real block forward runs, then its
drafts are replaced by the target's own greedy continuation, optionally corrupted at one
position) forces full and partial acceptance, so the bonus path and pages past a fully accepted
round are exercised.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from kiln.engine.request import SamplingParams
from kiln.models.reference import packed_batch
from tests.engine.test_hybrid_engine import INKLING, MINIMAX, assert_reference, make_core, prompts
from tests.engine.test_speculative import (assert_abort_frees_every_page, assert_logits_match,
                                           assert_seeded_output_alone_equals_batched, prefix_hit_prompts, run_plain,
                                           run_spec)

LLAMA = dict(model_type="llama", vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=512,
             tie_word_embeddings=True)
B = 6  # block size of the test drafters
DFLASH = dict(model_type="dflash", num_layers=2, block_size=B, mask_token_id=511, hidden_size=64,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, rope_theta=10000.0)
DSPARK = dict(target_layer_ids=[0, 2], num_layers=2, block_size=B, mask_token_id=511, intermediate_size=96)
# DFlash2 (kiln/models/dflash2.py): the conv around each sublayer, the candidate selector, and
# z-lab's draft-logit scaling and soft cap
DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4,
               output_multiplier=0.5, final_logit_softcapping=20.0)
TARGETS = {  # name: (target config, algorithm, target layers tapped, extra drafter fields)
    "llama": (LLAMA, "dflash", [0, 2], {}),
    "llama_dflash2": (LLAMA, "dflash", [0, 2], DFLASH2),
    "inkling": (INKLING, "dflash", [1, 3, 5], {}),
    "minimax_m3": ({**MINIMAX, "dspark_config": DSPARK}, "dspark", None, {}),
}


def make_target(name: str, tmp_path_factory):
    """(target dir, engine options for speculation) of TARGETS[name]."""
    cfg, algo, taps, extra = TARGETS[name]
    d = tmp_path_factory.mktemp(name)
    (d / "config.json").write_text(json.dumps(cfg))
    opts = {"speculative_algorithm": algo}
    if algo == "dflash":
        draft = tmp_path_factory.mktemp(name + "_dflash")
        (draft / "config.json").write_text(json.dumps({**DFLASH, "target_layer_ids": taps, **extra}))
        opts["speculative_draft_model_path"] = str(draft)
    return str(d), opts


@pytest.fixture(scope="module", params=sorted(TARGETS))
def target(request, tmp_path_factory):
    """(target dir, engine options for speculation)."""
    return make_target(request.param, tmp_path_factory)


def spec_core(target, k, **kw):
    model_dir, opts = target
    core = make_core(model_dir, speculative_num_steps=k, **opts, **kw)
    drafter = core.runner.draft_model
    if drafter is not getattr(core.runner.model, "dspark", None):
        with torch.no_grad():  # a DFlash drafter is not part of the model make_core scaled: N(0, 1/fan_in)
            for p in drafter.parameters():
                if p.dim() >= 2:
                    p.mul_(1.0 / (0.02 * math.sqrt(p.shape[-1])))
    return core


def plain_core(target, **kw):
    return make_core(target[0], **kw)


def fresh_context(core, ids: list[int]) -> torch.Tensor:
    """Context features c_j of every position of `ids`, from a packed target forward."""
    target, drafter = core.runner.model, core.runner.draft_model
    with torch.no_grad():
        batch = packed_batch(torch.tensor(ids, device=core.runner.device), [len(ids)])
        batch.capture_layers = tuple(drafter.config.target_layer_ids)
        target(batch)
        return drafter.context_features(batch.taps())


def assert_block_reference(core, res, drafts, token_map=None) -> int:
    """Every draft's logits equal the reference block forward on freshly computed context
    features (with `token_map`: on the map, and -inf off it; DFlash2: scaled and soft-capped, then
    the candidate selector's greedy walk from the anchor, `reference_walk`). Returns how many
    blocks were compared."""
    from tests.models.test_dflash2 import reference_walk

    target, drafter, dev = core.runner.model, core.runner.draft_model, core.runner.device
    mask, checked = drafter.config.mask_token_id, 0
    for rid, (prompt, output, _, _) in res.items():
        ids = prompt + output
        c = fresh_context(core, ids)
        for n, ds, logits in drafts.get(rid, []):
            a = n + 1  # run_spec records seq_len - 2; the block's anchor is position seq_len - 1
            with torch.no_grad():
                block = target.model.embed_tokens(torch.tensor([ids[a]] + [mask] * (B - 1), device=dev))
                h = drafter.draft_hidden(block, a, c[:a], torch.arange(a, device=dev))
                ref = drafter.process_logits(target.lm_head.compute_logits(h[1:len(ds) + 1]).float())
                if token_map is not None:
                    ref = torch.full_like(ref, float("-inf")).index_copy(1, torch.tensor(token_map, device=dev), ref[:, token_map])
                if drafter.candidate_selector is not None:
                    _, ref = reference_walk(drafter.candidate_selector, h[1:len(ds) + 1], ref, ids[a])
            assert_logits_match(torch.stack(logits), ref, f"{rid}: block at anchor {a}")
            checked += 1
    return checked


def assert_selector_rows_of_sampled_drafts(core, passes) -> int:
    """DFlash2: a sampled request's kept draft logits are the selector's scores at each position
    given the token drawn before it (the anchor, then d_1..d_{i-1}; `reference_scores`) on the
    reference block. Returns how many rows were compared."""
    from tests.models.test_dflash2 import reference_scores

    target, drafter = core.runner.model, core.runner.draft_model
    mask, checked = drafter.config.mask_token_id, 0
    for r, out, drafts, logits, q in passes:
        if r.params.greedy:
            continue
        ids = r.prompt_ids + out
        a = len(ids) - 1  # the anchor: the last committed token
        c = fresh_context(core, ids)
        with torch.no_grad():
            block = target.model.embed_tokens(torch.tensor([ids[a]] + [mask] * (B - 1)))
            h = drafter.draft_hidden(block, a, c[:a], torch.arange(a))[1:len(drafts) + 1]
            u = drafter.process_logits(target.lm_head.compute_logits(h).float())
        for i in range(len(drafts)):
            want = reference_scores(drafter.candidate_selector, h[i], u[i], drafts[i - 1] if i else ids[a])
            assert_logits_match(logits[i][None], want[None], f"{r.rid}: sampled draft {i} at anchor {a}")
            checked += 1
    return checked


def outputs(res) -> dict:
    return {rid: r[1] for rid, r in res.items()}


@pytest.mark.parametrize("k", [1, 3, B - 1])
def test_random_drafter_matches_plain_greedy_and_reference(target, k):
    ps = prompts(3, seed=21, lo=10, hi=60)
    kw = dict(page_size=4, chunked_prefill_size=16, max_prefill_tokens=40)
    core = spec_core(target, k, **kw)
    res, drafts, _ = run_spec(core, ps, max_tokens=20)
    assert outputs(res) == run_plain(plain_core(target, **kw), ps, max_tokens=20)
    counts = core.stats().spec
    assert counts.verify_steps > 0 and len(counts.proposed) == k
    assert_reference(core, res)
    assert assert_block_reference(core, res, drafts) >= counts.verify_steps


def test_context_cache_equals_fresh_computation_after_rejections(target):
    # Checked before every drafter pass: the kept K/V of every committed position equal the drafter's
    # projections of freshly computed context features (rejected rows were written, then rolled back).
    core = spec_core(target, 3, page_size=4)
    runner = core.scheduler.spec.drafter
    run_pass, seen = runner.run, []

    def checked(reqs, num_drafts):
        for r in reqs:
            n = r.num_computed
            c = fresh_context(core, r.all_ids[:n])
            with torch.no_grad():
                want = core.runner.draft_model.context_kv(c, torch.arange(n))
            for (k, v), (wk, wv) in zip(runner.context_kv(r), want):
                assert (k - wk).abs().max() <= 1e-4 and (v - wv).abs().max() <= 1e-4, f"{r.rid} at {n}"
            seen.append(n)
        run_pass(reqs, num_drafts)

    runner.run = checked
    ps = prompts(2, seed=22, lo=20, hi=40)
    res, _, _ = run_spec(core, ps, max_tokens=12)
    runner.run = run_pass
    assert len(seen) > 10
    counts = core.stats().spec
    assert counts.accepted_tokens < sum(counts.proposed), "expected rejections"
    assert_reference(core, res)


def truth(ps, plain) -> dict:
    return {f"r{i}": p + plain[f"r{i}"] for i, p in enumerate(ps)}


def oracle(core, truth: dict, corrupt: float = 0.0, seed: int = 0, method: str = "_draft") -> None:
    """Replace the drafts (after the real block forward ran: `method` is the reference pass
    `_draft` or the kernel path's `_draft_paged`) by the target's greedy continuation `truth[rid]`
    (prompt + plain greedy output), one position corrupted with probability `corrupt`."""
    runner = core.scheduler.spec.drafter
    draft, rng = getattr(runner, method), random.Random(seed)

    def rigged(reqs, ks):
        draft(reqs, ks)
        for r, k in zip(reqs, ks):
            full = truth[r.rid]
            ds = (full[r.seq_len:r.seq_len + k] + [0] * k)[:k]
            if rng.random() < corrupt:
                j = rng.randrange(k)
                ds[j] = (ds[j] + 1) % 512
            r.spec.drafts = ds

    setattr(runner, method, rigged)


def test_oracle_full_acceptance_takes_the_bonus_path(target):
    k = 3
    ps = prompts(2, seed=23, lo=20, hi=40)
    plain = run_plain(plain_core(target, page_size=4), ps, max_tokens=17)
    core = spec_core(target, k, page_size=4)
    oracle(core, truth(ps, plain))
    res, drafts, last = run_spec(core, ps, max_tokens=17)
    assert outputs(res) == plain
    counts = core.stats().spec
    # 1 token from the prefill, then 16 = 4 rounds of k + 1 tokens, every draft accepted
    assert counts.verify_steps == 8 and counts.accepted == [8, 8, 8] and counts.accept_length == k + 1
    for o in last.values():
        assert o.spec.verify_steps == 4 and o.spec.accept_rate_per_position == [1.0, 1.0, 1.0]
    assert_reference(core, res)
    assert assert_block_reference(core, res, drafts) == 8


@pytest.mark.parametrize("k", [2, B - 1])
def test_oracle_partial_acceptance_batches(target, k):
    ps = prompts(4, seed=24, lo=10, hi=70)
    kw = dict(page_size=4, chunked_prefill_size=16, max_prefill_tokens=24)
    plain = run_plain(plain_core(target, **kw), ps, max_tokens=24)
    core = spec_core(target, k, **kw)
    oracle(core, truth(ps, plain), corrupt=0.5)
    res, drafts, _ = run_spec(core, ps, max_tokens=24)
    assert outputs(res) == plain
    counts = core.stats().spec
    assert 0 < counts.accepted_tokens < sum(counts.proposed), "want both acceptances and rejections"
    assert 1.0 < counts.accept_length < k + 1
    assert_reference(core, res)
    assert assert_block_reference(core, res, drafts) > 0


def adaptive_oracle_core(target, seed: int, max_tokens: int):
    """Three prompts, their plain greedy output, and a --speculative-adaptive engine (K = 3) whose
    block drafts are the oracle's (some corrupted)."""
    ps = prompts(3, seed=seed, lo=10, hi=50)
    kw = dict(page_size=4, chunked_prefill_size=16, max_prefill_tokens=24)
    plain = run_plain(plain_core(target, **kw), ps, max_tokens=max_tokens)
    core = spec_core(target, 3, speculative_adaptive=True, **kw)
    oracle(core, truth(ps, plain), corrupt=0.3)
    return ps, plain, core


def test_adaptive_lengths_with_a_block_drafter(target):
    # --speculative-adaptive (tests/engine/test_adaptive_spec.py) with a block drafter: a fake clock
    # moves the length between 0, K and the lengths between, mid-request; the block pass drafts K
    # and hands over the first k. Greedy output equals plain, the drafts the fresh block forward.
    from tests.engine.test_adaptive_spec import charge_by_length

    ps, plain, core = adaptive_oracle_core(target, seed=26, max_tokens=40)
    chosen = charge_by_length(core, 0.05)
    res, drafts, _ = run_spec(core, ps, max_tokens=40)
    assert outputs(res) == plain
    assert {0, 3} < set(chosen), chosen
    assert {len(d) for ds in drafts.values() for _, d, _ in ds} == set(chosen) - {0}
    assert_reference(core, res)
    assert assert_block_reference(core, res, drafts) > 0


def test_adaptive_plain_steps_overlap_with_a_block_drafter(target):
    # Plain steps between plain steps under overlap scheduling (forced on the CPU): the block
    # pass drafts nothing there, the context K/V of every row is still stored, and the drafts of
    # the rounds after a stretch of them equal the fresh block forward.
    from tests.engine.test_adaptive_plain_steps import count_overlapped

    ps, plain, core = adaptive_oracle_core(target, seed=27, max_tokens=60)
    overlapped = count_overlapped(core)
    calls = iter(([3] * 3 + [0] * 12) * 20)
    core.scheduler.spec.adaptive.choose = lambda n: next(calls, 0)
    res, drafts, _ = run_spec(core, ps, max_tokens=60)
    assert outputs(res) == plain
    assert_reference(core, res)
    assert assert_block_reference(core, res, drafts) > 0
    assert len(overlapped) > 20, overlapped


def test_prefix_hits_carry_the_drafter_context(target):
    # The drafter's context K/V ride in the cached pages: a request admitted with a matched prefix
    # drafts exactly what a fresh computation over its committed tokens gives.
    core = spec_core(target, 3, page_size=4)
    base = prompts(1, seed=25, lo=50, hi=51)[0]
    first, _, _ = run_spec(core, [base], tag="a")
    others = prefix_hit_prompts(base, first["a0"][1])
    second, drafts, _ = run_spec(core, others, tag="b")
    assert outputs(second) == run_plain(plain_core(target, page_size=4), others, tag="b")
    assert second["b2"][3] > 0 and second["b3"][3] > len(base), "prompts must hit the prefix cache"
    assert_reference(core, second)
    assert assert_block_reference(core, second, drafts) > 0


def test_retraction_with_a_block_drafter(target):
    kw = dict(page_size=4, max_total_tokens=160)
    ps = prompts(6, seed=26, lo=20, hi=40)
    plain = run_plain(plain_core(target, **kw), ps, max_tokens=40)
    core = spec_core(target, 3, **kw)
    oracle(core, truth(ps, plain), corrupt=0.3)
    res, drafts, _ = run_spec(core, ps, max_tokens=40)
    assert core.stats().num_retractions_total > 0
    assert outputs(res) == plain
    assert_reference(core, res)
    assert assert_block_reference(core, res, drafts) > 0


def test_abort_frees_every_page(target):
    assert_abort_frees_every_page(spec_core(target, 3, page_size=4), prompts(3, seed=27), 40)


def dflash_dirs(tmp_path, extra: dict | None = None):
    """A tiny Llama target directory and a DFlash drafter directory (config only: dummy weights;
    `extra` adds drafter fields, e.g. DFLASH2)."""
    model_dir, draft = tmp_path / "llama", tmp_path / "draft"
    model_dir.mkdir()
    draft.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA))
    (draft / "config.json").write_text(json.dumps({**DFLASH, "target_layer_ids": [0, 2], **(extra or {})}))
    return model_dir, draft


def test_hicache_tiers_carry_the_drafter_context(tmp_path):
    # Prefixes evicted to host memory and disk come back with the drafter's context K/V (a
    # component of the main space): drafts after such hits equal the fresh reference.
    model_dir, draft = dflash_dirs(tmp_path)
    target = (str(model_dir), {"speculative_algorithm": "dflash", "speculative_draft_model_path": str(draft)})
    small = dict(page_size=4, max_total_tokens=128, max_running_requests=2, chunked_prefill_size=16,
                 max_prefill_tokens=32)
    g = torch.Generator().manual_seed(28)
    ctx = [torch.randint(0, 512, (90,), generator=g).tolist() for _ in range(3)]
    turns = [c[:40 + 12 * r] for r in range(3) for c in ctx]  # the working set outgrows the device pool
    plain = plain_core(target, **small)
    core = spec_core(target, 3, **small, enable_hierarchical_cache=True, hicache_ratio=0.5,
                     hicache_storage_backend="file", hicache_storage_dir=str(tmp_path / "store"))
    core.cache.deep_check = True  # device and host copies of every buffer, DRAFT_KV included, agree
    for i, prompt in enumerate(turns):
        res, drafts, _ = run_spec(core, [prompt], max_tokens=6, tag=f"t{i}_")
        assert outputs(res) == run_plain(plain, [prompt], max_tokens=6, tag=f"t{i}_")
        assert_reference(core, res)
        assert assert_block_reference(core, res, drafts) > 0
    s = core.stats()
    assert s.cached_tokens_host_total > 0 and s.cached_tokens_disk_total > 0, s


def test_drafter_weights_are_read_from_the_directory(tmp_path):
    from kiln.models.dflash import save_dflash

    model_dir, draft = dflash_dirs(tmp_path)
    made = spec_core((str(model_dir), {"speculative_algorithm": "dflash", "speculative_draft_model_path": str(draft)}), 2)
    save_dflash(made.runner.draft_model, str(tmp_path / "saved"))
    core = make_core(str(model_dir), speculative_algorithm="dflash", speculative_draft_model_path=str(tmp_path / "saved"))
    for (a, x), (b, y) in zip(made.runner.draft_model.state_dict().items(), core.runner.draft_model.state_dict().items()):
        assert a == b and torch.equal(x, y), a
    assert core.scheduler.spec.num_steps == B - 1  # default: the whole block


def test_bad_flags_have_clear_errors(tmp_path):
    def model(name, cfg):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        return str(tmp_path / name)

    llama, minimax, inkling = model("llama", LLAMA), model("minimax", MINIMAX), model("inkling", INKLING)
    good = model("good", {**DFLASH, "target_layer_ids": [0, 2]})
    wide = model("wide", {**DFLASH, "target_layer_ids": [0, 2], "hidden_size": 32})
    other = model("other", {**DFLASH, "target_layer_ids": [0, 2], "model_type": "qwen3"})
    dflash = dict(speculative_algorithm="dflash")
    with pytest.raises(ValueError, match="dspark needs a MiniMax-M3 checkpoint with dspark_config"):
        make_core(minimax, speculative_algorithm="dspark")
    with_dspark = model("dspark", {**MINIMAX, "dspark_config": DSPARK})
    with pytest.raises(ValueError, match="dspark drafts with the drafter inside the target's checkpoint"):
        make_core(with_dspark, speculative_algorithm="dspark", speculative_draft_model_path=good)
    with pytest.raises(ValueError, match="dflash needs --speculative-draft-model-path"):
        make_core(llama, **dflash)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        make_core(llama, **dflash, speculative_draft_model_path=str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        make_core(llama, **dflash, speculative_draft_model_path=str(tmp_path))
    with pytest.raises(ValueError, match="model_type 'qwen3' is not a DFlash drafter"):
        make_core(llama, **dflash, speculative_draft_model_path=other)
    with pytest.raises(ValueError, match=r"hidden_size \(32\) must equal the target's hidden_size \(64\)"):
        make_core(llama, **dflash, speculative_draft_model_path=wide)
    with pytest.raises(ValueError, match=r"--speculative-num-steps must be in \[1, 5\]"):
        make_core(llama, **dflash, speculative_draft_model_path=good, speculative_num_steps=B)
    with pytest.raises(ValueError, match="only read with --speculative-algorithm dflash"):
        make_core(inkling, speculative_algorithm="mtp", speculative_draft_model_path=good)
    with pytest.raises(ValueError, match=r"target_layer_ids \[3, 5\] are not layers"):
        make_core(llama, **dflash, speculative_draft_model_path=model("deep", {**DFLASH, "target_layer_ids": [3, 5]}))


def test_seeded_sampling_is_reproducible_whatever_is_batched(target):
    # Sampled requests verify by sampling every row from the target (greedy drafts act as point
    # masses): the same seed gives the same output alone or next to another request.
    params = SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=5, ignore_eos=True)
    assert_seeded_output_alone_equals_batched(lambda: spec_core(target, 3, page_size=4), prompts(2, seed=29), params)


@pytest.mark.parametrize("method", ["tokenwise", "block"])
def test_sampled_requests_draw_their_block_drafts_from_q(target, method):
    # Under exact verification a sampled request's drafts are draws from q, position i's block
    # logits processed like the target's rows with d_1..d_{i-1} counted as output; the verify
    # stays exact (every emitted token's logit row is the reference's), seeded requests are
    # reproducible whatever is batched, and a greedy request keeps argmax drafts and plain output.
    from tests.engine.test_spec_sampled import FLAGS, assert_q_rows_are_processed_draft_logits, mixed_params, watch

    ps, params = prompts(4, seed=21, lo=20, hi=50), mixed_params()
    core = spec_core(target, 3, page_size=4, **FLAGS[method])
    passes, _ = watch(core)
    res, _, last = run_spec(core, ps, params=params)
    assert_reference(core, res)
    assert all(last[rid].finished for rid in ("r0", "r1", "r3"))
    assert res["r2"][1] == run_plain(plain_core(target, page_size=4), [ps[2]], max_tokens=21)["r0"]
    assert_q_rows_are_processed_draft_logits(passes)
    if core.runner.draft_model.candidate_selector is not None:
        assert assert_selector_rows_of_sampled_drafts(core, passes) > 20
    again = spec_core(target, 3, page_size=4, **FLAGS[method])
    res2, _, _ = run_spec(again, [ps[1], ps[0]], params=[params[1], params[0]])
    assert res2["r0"][1] == res["r1"][1] and res2["r1"][1] == res["r0"][1]
