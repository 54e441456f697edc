"""DFlash2's additions to the block drafter (`kiln/models/dflash2.py`): the grouped dynamic conv
and the candidate selector against loop-by-loop references, their config fields, z-lab's
checkpoint layout, and the draft-logit scaling."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.models.config import ModelConfig
from kiln.models.dflash import load_dflash, read_dflash_config, save_dflash
from kiln.models.dflash2 import CandidateSelector, grouped_dynamic_conv
from tests.models.test_block_drafter import DFLASH2, DRAFT, LLAMA, drafter


@pytest.mark.parametrize("K", [1, 2, 3, 7])
def test_grouped_dynamic_conv_matches_its_formula(K):
    # K = 7 > B: the taps past the block's start read only zeros
    g = torch.Generator().manual_seed(K)
    R, B, H, gs = 2, 5, 12, 4
    x, base = torch.randn(R, B, H, generator=g), torch.randn(K, H, generator=g)
    dyn = torch.randn(R, B, K, H // gs, generator=g)
    y = grouped_dynamic_conv(x, dyn, base, gs)
    want = torch.zeros(R, B, H)
    for r in range(R):
        for t in range(B):
            for c in range(H):
                for o in range(K):
                    if t - o >= 0:  # taps never reach before the block's first row
                        want[r, t, c] += (base[o, c] + dyn[r, t, o, c // gs]) * x[r, t - o, c]
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)


def reference_scores(sel: CandidateSelector, h, u, prev: int) -> torch.Tensor:
    """One position's selector logits over the vocabulary, one candidate at a time:
    S(b) = U(b) + sum_r A[prev, r] * (P h)_r * Bc[b, r] on the top-k of U, -inf elsewhere."""
    P, A, Bc = (w.detach() for w in (sel.hidden_projection.weight, sel.predecessor_codebook.weight,
                                      sel.successor_codebook.weight))
    full = torch.full((u.shape[-1],), float("-inf"))
    ph = P.float() @ h.float()
    for b in torch.topk(u, sel.top_k).indices.tolist():
        full[b] = u[b] + float((A[prev].float() * ph * Bc[b].float()).sum())
    return full


def reference_walk(sel: CandidateSelector, hidden, logits, anchor: int):
    """The greedy walk over `reference_scores`, from the anchor (ties to the lower id)."""
    prev, tokens, rows = anchor, [], []
    for t in range(hidden.shape[0]):
        full = reference_scores(sel, hidden[t], logits[t], prev)
        top = torch.isfinite(full).nonzero()[:, 0].tolist()
        best = max(top, key=lambda b: (float(full[b]), -b))
        tokens.append(best)
        rows.append(full)
        prev = best
    return tokens, torch.stack(rows)


def test_selector_walk_matches_the_reference():
    model = drafter(**DFLASH2)
    sel = model.candidate_selector
    g = torch.Generator().manual_seed(1)
    hidden, logits = torch.randn(3, 5, 64, generator=g), torch.randn(3, 5, 512, generator=g) * 3
    anchors = torch.tensor([7, 100, 511])
    with torch.no_grad():
        tokens, rows = sel.walk(hidden, logits, anchors)
        for n in range(3):
            want_t, want_rows = reference_walk(sel, hidden[n], logits[n], int(anchors[n]))
            assert tokens[n].tolist() == want_t
            finite = torch.isfinite(want_rows)
            assert torch.equal(torch.isfinite(rows[n]), finite)
            torch.testing.assert_close(rows[n][finite], want_rows[finite], atol=1e-4, rtol=1e-4)
    # the predecessor matters: another anchor gives other scores
    with torch.no_grad():
        other = sel.walk(hidden[:1], logits[:1], torch.tensor([8]))[1]
    assert not torch.equal(other[0, 0], rows[0, 0])


def test_selector_loss_trains_the_selector_only():
    # Neither the draft logits nor the hidden states get gradients from it: the drafter's body
    # and head learn from the DFlash loss alone.
    model = drafter(**DFLASH2).train()
    sel = model.candidate_selector
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 4, 64, generator=g, requires_grad=True)
    logits = (torch.randn(2, 4, 512, generator=g) * 3).requires_grad_(True)
    labels = torch.topk(logits.detach(), 4).indices[..., 1]  # a candidate, not the argmax
    labels[0, 2] = int(torch.topk(logits.detach()[0, 2], 5).indices[4])  # not a candidate: excluded
    prev = torch.cat([torch.tensor([[3], [4]]), labels[:, :-1]], dim=1)
    valid = torch.ones(2, 4, dtype=torch.bool)
    loss = sel.loss(hidden, logits, prev, labels, valid)
    loss.backward()
    assert torch.isfinite(loss) and loss > 0
    assert logits.grad is None and hidden.grad is None
    assert sel.successor_codebook.weight.grad.abs().sum() > 0 and sel.hidden_projection.weight.grad.abs().sum() > 0
    # no usable position: zero, still differentiable
    none = sel.loss(hidden, logits, prev, labels, torch.zeros(2, 4, dtype=torch.bool))
    assert none.item() == 0.0


def test_draft_logits_are_scaled_and_softcapped():
    model = drafter(output_multiplier=0.5, final_logit_softcapping=4.0)
    x = torch.tensor([[-100.0, 0.0, 2.0, 100.0]])
    torch.testing.assert_close(model.process_logits(x), torch.tanh(x * 0.5 / 4.0) * 4.0)
    assert torch.equal(drafter().process_logits(x), x)


@pytest.mark.parametrize("change, message", [
    ({"conv_kernel_size": 2, "conv_group_size": 24}, "conv_group_size"),
    ({"selector_rank": 4, "selector_top_k": 0}, "selector_top_k"),
])
def test_dflash2_config_errors(tmp_path, change, message):
    (tmp_path / "config.json").write_text(json.dumps({**DRAFT, **change}))
    with pytest.raises(ValueError, match=message):
        read_dflash_config(str(tmp_path), ModelConfig.from_dict(LLAMA))


def test_z_lab_layout_loads(tmp_path):
    # z-lab's DFlash2 checkpoint: model_type of the body, the class in architectures, the drafter's
    # fields under dflash_config, and the selector's codebooks stored without ".weight".
    from safetensors.torch import save_file

    src = drafter(seed=3, **DFLASH2)
    body = {k: v for k, v in DRAFT.items() if k not in ("model_type", "target_layer_ids", "block_size",
                                                         "mask_token_id", "num_layers")}
    cfg = {"model_type": "qwen3", "architectures": ["DFlash2DraftModel"], "num_hidden_layers": 2, **body,
           "dflash_config": {"target_layer_ids": [0, 2], "block_size": 8, "mask_token_id": 511, **DFLASH2}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sd = src.checkpoint_state_dict()
    sd = {(k[:-len(".weight")] if k.endswith("_codebook.weight") else k): v for k, v in sd.items()}
    sd["embed_tokens.weight"] = torch.zeros(512, 64)  # a copy of the target's: not read
    save_file(sd, str(tmp_path / "model.safetensors"))
    got = load_dflash(str(tmp_path), ModelConfig.from_dict(LLAMA), 256, "cpu", torch.float32)
    assert got.config.selector_rank == 8 and got.config.conv_kernel_size == 2 and got.config.num_layers == 2
    for (name, a), (_, b) in zip(src.state_dict().items(), got.state_dict().items()):
        assert torch.equal(a, b), name
    # and Kiln writes DFlash2 drafters that read back the same
    save_dflash(got, str(tmp_path / "kiln"))
    back = load_dflash(str(tmp_path / "kiln"), ModelConfig.from_dict(LLAMA), 256, "cpu", torch.float32)
    assert json.loads((tmp_path / "kiln" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    for (name, a), (_, b) in zip(got.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name


def test_weights_that_do_not_fit_name_the_tensor(tmp_path):
    # e.g. a selector trained for another vocabulary than the target's
    from safetensors.torch import save_file

    src = drafter(seed=4, **DFLASH2)
    sd = src.checkpoint_state_dict()
    sd["candidate_selector.successor_codebook.weight"] = torch.zeros(1000, 8)
    (tmp_path / "config.json").write_text(json.dumps({**DRAFT, **DFLASH2}))
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="successor_codebook.*1000, 8.*512, 8"):
        load_dflash(str(tmp_path), ModelConfig.from_dict(LLAMA), 256, "cpu", torch.float32)
