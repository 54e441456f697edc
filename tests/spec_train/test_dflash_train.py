"""DFlash training (`kiln.spec_train.dflash`): the training block forward is the serving one, the
loss falls on a tiny target's own greedy continuations, and the trained drafter, written with
`save_dflash` and served with `--speculative-algorithm dflash`, gets drafts accepted (greedy output
unchanged)."""

from __future__ import annotations

import json
import random

import torch

from kiln.models.block_drafter_config import BlockDrafterConfig
from kiln.models.dflash import save_dflash
from kiln.spec_train.dflash import block_logits, sample_anchors, target_taps, train_dflash
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
    drafter, _ = train_dflash(target, cfg, data[:4], steps=1)
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
