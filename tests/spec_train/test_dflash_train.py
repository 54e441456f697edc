"""DFlash training (`kiln.spec_train.dflash`): the training block forward is the serving one, the
loss falls on a tiny target's own greedy continuations, and the trained drafter, written with
`save_dflash` and served with `--speculative-algorithm dflash`, gets drafts accepted (greedy output
unchanged)."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from kiln.models.block_drafter_config import BlockDrafterConfig
from kiln.models.dflash import save_dflash
from kiln.spec_train.dflash import block_logits, dflash_loss, sample_anchors, target_taps, train_dflash
from tests.engine.test_hybrid_engine import make_core, prompts
from tests.engine.test_speculative import run_plain

LLAMA = dict(model_type="llama", vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=512,
             tie_word_embeddings=True)
DRAFT = dict(model_type="dflash", target_layer_ids=[0, 1, 2], num_layers=1, block_size=5, mask_token_id=511,
             intermediate_size=128)


def setup(tmp_path):
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA))
    core = make_core(str(d), page_size=4)
    ps = prompts(24, seed=40, lo=6, hi=12)
    out = run_plain(core, ps, max_tokens=40)
    data = [(p + out[f"r{i}"], len(p)) for i, p in enumerate(ps)]
    cfg = BlockDrafterConfig.from_dict(DRAFT, core.runner.model.config, where="test")
    return str(d), core, ps, data, cfg


def test_training_blocks_are_the_serving_blocks(tmp_path):
    _, core, _, data, cfg = setup(tmp_path)
    target = core.runner.model
    drafter, history = train_dflash(target, cfg, data[:4], steps=2, val_data=data[4:8], eval_every=1)
    # Validation before the first step and at every step (eval_every=1), over fixed anchors: the
    # last one is the returned drafter on those anchors.
    assert [h["step"] for h in history if "val_ce_k" in h] == [0, 1, 2]
    assert "ce_k" not in history[0] and len(history[-1]["val_acc_k"]) == cfg.block_size - 1
    vseqs = [ids for ids, _ in data[4:8]]
    vlens = [len(s) for s in vseqs]
    vids = torch.tensor([t for s in vseqs for t in s])
    vanchors = sample_anchors(vlens, [p for _, p in data[4:8]], 32, random.Random(1234))
    with torch.no_grad():
        vlogits = block_logits(target, drafter, vids, vlens, target_taps(target, vids, vlens, cfg.target_layer_ids),
                               vanchors)
    assert dflash_loss(vlogits, vids, vlens, vanchors, 7.0)[1] == pytest.approx(history[-1]["val_ce_k"], abs=1e-4)
    seqs = [torch.tensor(ids) for ids, _ in data[:3]]
    lens = [len(s) for s in seqs]
    ids = torch.cat(seqs)
    anchors = sample_anchors(lens, [p for _, p in data[:3]], 4, random.Random(0)) + [(1, 0)]
    with torch.no_grad():
        taps = target_taps(target, ids, lens, cfg.target_layer_ids)
        got = block_logits(target, drafter, ids, lens, taps, anchors)
        for i, (s, a) in enumerate(anchors):  # the reference block on this sequence's own context
            c = drafter.context_features(target_taps(target, seqs[s], [lens[s]], cfg.target_layer_ids))
            block = target.model.embed_tokens(torch.tensor([int(seqs[s][a])] + [511] * 4))
            ref = target.lm_head.compute_logits(drafter.draft_hidden(block, a, c[:a], torch.arange(a))[1:])
            assert (got[i] - ref).abs().max() <= 1e-4, (s, a)


def test_loss_falls_and_the_trained_drafter_is_accepted(tmp_path):
    model_dir, core, ps, data, cfg = setup(tmp_path)
    drafter, history = train_dflash(core.runner.model, cfg, data, steps=60, lr=3e-3, batch_seqs=8,
                                    anchors_per_seq=16, warmup_steps=5)
    first = sum(h["loss"] for h in history[:5]) / 5
    last = sum(h["loss"] for h in history[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    assert all(p.requires_grad is False for p in core.runner.model.parameters())
    save_dflash(drafter, str(tmp_path / "draft"))
    spec = make_core(model_dir, page_size=4, speculative_algorithm="dflash",
                     speculative_draft_model_path=str(tmp_path / "draft"))
    assert run_plain(spec, ps[:6], max_tokens=40) == run_plain(core, ps[:6], max_tokens=40)
    assert spec.stats().spec.accept_length > 1.5, spec.stats().spec


def test_a_fresh_drafter_starts_near_a_uniform_guess(tmp_path):
    """The untrained drafter's CE per block position is within a few nats of ln V, also when the
    target's embedding (its tied LM head) has a trained model's scale: large rows sharing a
    direction. Without `calibrate_output_gain` (the drafter's final norm gain at 1: a random output
    of norm sqrt(H) into that LM head) it starts at ~2 ln V here, ~6 ln V on SmolLM2-135M."""
    from kiln.spec_train.dflash import calibrate_output_gain, fresh_drafter

    _, core, _, data, cfg = setup(tmp_path)
    target = core.runner.model
    seqs = [torch.tensor(ids) for ids, _ in data[:6]]
    lens = [len(s) for s in seqs]
    ids = torch.cat(seqs)
    anchors = sample_anchors(lens, [p for _, p in data[:6]], 8, random.Random(0))
    ln_v = math.log(LLAMA["vocab_size"])

    def first_ce(calibrate: bool) -> tuple[list[float], float]:
        drafter = fresh_drafter(cfg, max(lens) + 1, seed=0, device="cpu")
        with torch.no_grad():
            taps = target_taps(target, ids, lens, cfg.target_layer_ids)
            factor = calibrate_output_gain(target, drafter, ids, lens, taps, anchors) if calibrate else 1.0
            ce = dflash_loss(block_logits(target, drafter, ids, lens, taps, anchors), ids, lens, anchors, 7.0)[1]
        return ce, factor

    assert first_ce(True)[1] > 0.9  # the dummy target's logits are about unit-scale already: gain kept
    with torch.no_grad():  # SmolLM2-like rows: norm ~3, cosine ~0.7 with a shared direction
        emb = target.model.embed_tokens.weight
        shared = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(0))
        emb.copy_(torch.nn.functional.normalize(emb, dim=-1) * 2.2 + 2.2 * shared / shared.norm())
    (calibrated, _), (raw, _) = first_ce(True), first_ce(False)
    assert max(calibrated) < ln_v + 1.0, (calibrated, ln_v)
    assert min(raw) > ln_v + 4.0, (raw, ln_v)  # what the bound catches


DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=8)


def test_a_fresh_dflash2_drafter_starts_as_plain_dflash(tmp_path):
    # Neutral start: the convs pass their input through and the selector adds nothing, so block
    # logits equal a plain drafter's of the same seed (Kiln's init is seeded by parameter name)
    # and the selector's greedy walk is the argmax.
    from kiln.spec_train.dflash import fresh_drafter

    _, core, _, data, cfg = setup(tmp_path)
    target = core.runner.model
    cfg2 = BlockDrafterConfig.from_dict({**DRAFT, **DFLASH2}, target.config, where="test")
    plain, d2 = fresh_drafter(cfg, 64, 0, "cpu"), fresh_drafter(cfg2, 64, 0, "cpu")
    seqs = [torch.tensor(ids) for ids, _ in data[:3]]
    lens = [len(s) for s in seqs]
    ids = torch.cat(seqs)
    anchors = sample_anchors(lens, [p for _, p in data[:3]], 4, random.Random(0))
    with torch.no_grad():
        taps = target_taps(target, ids, lens, cfg.target_layer_ids)
        want = block_logits(target, plain, ids, lens, taps, anchors)
        got, hid = block_logits(target, d2, ids, lens, taps, anchors, with_hidden=True)
        # any predecessors: the zero hidden projection cancels the pair term
        tokens, _ = d2.candidate_selector.walk(hid, got, torch.randint(0, 512, (len(anchors),)))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(tokens, got.argmax(-1))


def test_dflash2_trains_and_serves(tmp_path):
    # The selector's loss is in the history and falls; the trained DFlash2 drafter serves with
    # greedy output unchanged and drafts accepted.
    model_dir, core, ps, data, _ = setup(tmp_path)
    cfg2 = BlockDrafterConfig.from_dict({**DRAFT, **DFLASH2}, core.runner.model.config, where="test")
    drafter, history = train_dflash(core.runner.model, cfg2, data, steps=60, lr=3e-3, batch_seqs=8,
                                    anchors_per_seq=16, warmup_steps=5)
    sel = [h["selector_loss"] for h in history if "selector_loss" in h]
    assert len(sel) == 60 and sum(sel[-5:]) < sum(sel[:5]), (sel[:5], sel[-5:])
    assert any(p.abs().sum() > 0 for p in drafter.candidate_selector.hidden_projection.parameters())
    save_dflash(drafter, str(tmp_path / "draft2"))
    spec = make_core(model_dir, page_size=4, speculative_algorithm="dflash",
                     speculative_draft_model_path=str(tmp_path / "draft2"))
    assert spec.runner.draft_model.candidate_selector is not None
    assert run_plain(spec, ps[:6], max_tokens=40) == run_plain(core, ps[:6], max_tokens=40)
    assert spec.stats().spec.accept_length > 1.5, spec.stats().spec
