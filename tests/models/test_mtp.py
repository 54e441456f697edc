"""MTP chains on packed sequences, for Inkling and for a Llama with `num_mtp_layers`: masks,
alignment (row i of layer k sees tokens up to t_{i+k}), packing, state specs, checkpoint names."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.engine.cache.components import ComponentKind
from kiln.loader import init_dummy_weights
from kiln.models.reference import packed_batch, packed_forward
from kiln.models.registry import get_model_class, parse_model_config
from tests.models.test_inkling import tiny_inkling

LLAMA_MTP = dict(model_type="llama", vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=96, tie_word_embeddings=True,
                 num_mtp_layers=3, mtp_sliding_window=16)


def tiny_llama_mtp(seed: int = 0, **overrides):
    model = get_model_class("llama")(parse_model_config({**LLAMA_MTP, **overrides}), max_positions=256)
    init_dummy_weights(model, seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # N(0, 1/fan_in): every part of the chain moves the logits
                p.mul_(1.0 / (0.02 * math.sqrt(p.shape[-1])))
    return model.eval()


MODELS = {"inkling": lambda: tiny_inkling(seed=11, num_mtp_layers=3), "llama": lambda: tiny_llama_mtp(seed=11)}


def _mtp(model, ids, lens):
    with torch.no_grad():
        hidden = model(packed_batch(ids, lens))
        return model.forward_mtp_reference(ids, lens, hidden)


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_mtp_chain_shapes_packing_and_causality(arch):
    model = MODELS[arch]()
    assert [m.block.self_attn.attn.key_gap for m in model.mtp] == [0, 1, 2]
    assert [m.block.self_attn.attn.cache_offset for m in model.mtp] == [1, 2, 3]
    assert all(m.block.self_attn.attn.sliding_window == 16 for m in model.mtp)
    lens = [30, 3, 19]
    ids = torch.randint(0, 512, (sum(lens),), generator=torch.Generator().manual_seed(12))
    out = _mtp(model, ids, lens)
    assert [o.shape[0] for o in out] == [sum(max(n - k, 0) for n in lens) for k in (1, 2, 3)]
    assert out[0].std() > 0.1
    # Packed == each sequence alone.
    start, rows = 0, [0, 0, 0]
    for n in lens:
        alone = _mtp(model, ids[start:start + n], [n])
        for k in range(3):
            m = max(n - k - 1, 0)
            torch.testing.assert_close(out[k][rows[k]:rows[k] + m], alone[k], atol=2e-5, rtol=2e-5)
            rows[k] += m
        start += n
    # Row i of layer k depends on t_0 .. t_{i+k} only: change every token after t_{i+k}.
    seq = ids[:30]
    base = _mtp(model, seq, [30])
    for k in (1, 2, 3):
        for i in (4, 17):
            changed = seq.clone()
            changed[i + k + 1:] = (changed[i + k + 1:] + 1) % 512
            got = _mtp(model, changed, [30])[k - 1]
            torch.testing.assert_close(got[:i + 1], base[k - 1][:i + 1], atol=2e-5, rtol=2e-5)
            # ... and does depend on t_{i+k} itself.
            changed = seq.clone()
            changed[i + k] = (changed[i + k] + 1) % 512
            assert not torch.allclose(_mtp(model, changed, [30])[k - 1][i], base[k - 1][i])


def test_llama_mtp_state_specs_and_sizes():
    model = tiny_llama_mtp(mtp_intermediate_size=40)
    assert model.mtp[0].block.mlp.down_proj.weight.shape == (64, 40)
    assert model.state_specs() == model.state_specs(num_mtp=0)
    full, swa, conv = model.state_specs(num_mtp=2)
    assert (full.kind, full.layer_ids, full.window) == (ComponentKind.FULL_KV, [0, 1], None)
    assert (swa.kind, swa.layer_ids, swa.shape, swa.window) == (ComponentKind.SWA_KV, [2, 3], (2, 16), 16)
    assert (conv.kind, conv.layer_ids, conv.shape, conv.window) == (ComponentKind.CONV, [0, 1], (64,), 1)
    assert [model.mtp_hidden_site(k) for k in range(2)] == [0, 1]
    with pytest.raises(ValueError, match="the checkpoint has 3"):
        model.state_specs(num_mtp=4)


def test_inkling_mtp_joins_the_sliding_window_space():
    model = tiny_inkling(num_mtp_layers=2)
    specs = model.state_specs(num_mtp=2)
    (swa,) = [s for s in specs if s.kind == ComponentKind.SWA_KV]
    assert swa.layer_ids == [0, 1, 2, 3, 4, 6, 7]
    sites = [s for s in specs if s.kind == ComponentKind.CONV and s.window == 1]
    assert sites[0].layer_ids == [model.num_conv_sites, model.num_conv_sites + 1]


def test_llama_mtp_checkpoint_names_round_trip_and_main_logits_unchanged():
    from kiln.rl.sync import checkpoint_views

    model = tiny_llama_mtp(seed=3)
    disk = dict(checkpoint_views(model))
    assert "mtp.1.eh_proj.weight" in disk and "mtp.3.block.self_attn.q_proj.weight" in disk
    assert "mtp.3.block.mlp.gate_proj.weight" in disk and not any(n.startswith("mtp.0.") for n in disk)
    fresh = tiny_llama_mtp(seed=4)
    fresh.load_weights(iter(disk.items()))
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    with pytest.raises(KeyError, match="the config has 3 MTP layers"):
        fresh.load_weights([("mtp.4.enorm.weight", torch.ones(64))], strict=False)
    with pytest.raises(ValueError, match="missing"):
        fresh.load_weights((n, t) for n, t in disk.items() if not n.startswith("mtp.2."))
    # The MTP layers do not touch the main forward: same logits as the model without them.
    plain = get_model_class("llama")(parse_model_config({**LLAMA_MTP, "num_mtp_layers": 0}), max_positions=256)
    plain.load_weights((n, t) for n, t in disk.items() if not n.startswith("mtp."))
    ids = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(packed_forward(model, ids, [20])[0], packed_forward(plain, ids, [20])[0])
