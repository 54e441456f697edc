"""A tiny random Inkling: packing, the per-position attention scale, state specs, checkpoint I/O."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kiln.engine.cache.components import ComponentKind
from kiln.loader import init_dummy_weights
from kiln.models.config import ModelConfig
from kiln.models.inkling import InklingForCausalLM
from kiln.models.inkling_config import InklingConfig
from kiln.models.reference import packed_forward
from kiln.models.registry import get_config_class, get_model_class

TINY = dict(model_type="inkling", vocab_size=512, hidden_size=64, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
            num_experts=8, num_experts_per_tok=2, num_shared_experts=2, moe_intermediate_size=32,
            first_k_dense_layers=1, shortconv_kernel_size=4, sliding_window=16, rel_dim=8,
            rel_extent=24, attn_scale_beta=0.5, attn_scale_floor=8, route_scale=1.25,
            num_mtp_layers=2)


def tiny_inkling(seed: int = 0, **overrides) -> InklingForCausalLM:
    cfg = get_config_class("inkling").from_dict({**TINY, **overrides})
    model = get_model_class("inkling")(cfg, max_positions=256)
    init_dummy_weights(model, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # N(0, 0.02) -> N(0, 1/fan_in): activations stay O(1) through layers
                p.mul_(1.0 / (0.02 * math.sqrt(p.shape[-1])))
        for layer in model.model.layers:
            if layer.is_moe:
                layer.mlp.router.expert_bias.copy_(torch.randn(8, generator=g) * 0.05)
    return model.eval()


@pytest.fixture(scope="module")
def model():
    return tiny_inkling()


def test_config_defaults_and_runner_path():
    cfg = InklingConfig.from_dict({k: v for k, v in TINY.items() if k not in ("rel_dim", "rel_extent")})
    assert cfg.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert (cfg.rel_dim, cfg.rel_extent, cfg.num_shared_experts, cfg.tie_word_embeddings) == (32, 1024, 2, False)
    # The runner parses with ModelConfig, then builds the registered class with it.
    m = get_model_class("inkling")(ModelConfig.from_dict(TINY), max_positions=64)
    assert isinstance(m.config, InklingConfig) and m.config.attn_scale_floor == 8
    with pytest.raises(ValueError, match="layer_types"):
        InklingConfig.from_dict({**TINY, "layer_types": ["full_attention"]})


def test_state_specs(model):
    specs = {(s.kind, s.shape): s for s in model.state_specs()}
    full = specs[(ComponentKind.FULL_KV, (2, 16))]
    swa = specs[(ComponentKind.SWA_KV, (2, 16))]
    assert full.layer_ids == [5] and full.window is None
    assert swa.layer_ids == [0, 1, 2, 3, 4] and swa.window == 16
    kv_conv = specs[(ComponentKind.CONV, (32,))]
    h_conv = specs[(ComponentKind.CONV, (64,))]
    assert kv_conv.layer_ids == [4 * l + j for l in range(6) for j in (0, 1)]
    assert h_conv.layer_ids == [4 * l + j for l in range(6) for j in (2, 3)]
    assert kv_conv.window == h_conv.window == 3
    assert kv_conv.bytes_per_token(torch.float32) == 12 * 32 * 4
    assert h_conv.bytes_per_request(torch.float32) == 3 * 12 * 64 * 4
    assert full.bytes_per_token(torch.bfloat16) == 2 * 2 * 16 * 2
    sites = sorted(i for s in model.state_specs() if s.kind == ComponentKind.CONV for i in s.layer_ids)
    assert sites == list(range(model.num_conv_sites))


def test_packed_sequences_equal_each_alone(model):
    """Three sequences, two longer than W=16 and R=24: nothing crosses a sequence start."""
    g = torch.Generator().manual_seed(1)
    lens = [41, 5, 30]
    ids = torch.randint(0, 512, (sum(lens),), generator=g)
    with torch.no_grad():
        logits, routed = packed_forward(model, ids, lens)
        assert sorted(routed) == [0, 1, 2, 3, 4]  # MoE layers 1..5
        assert all(r.shape == (sum(lens), 2) and r.dtype == torch.int32 for r in routed.values())
        assert logits.std() > 0.1  # weights large enough that the test means something
        start = 0
        for n in lens:
            alone, routed_alone = packed_forward(model, ids[start:start + n], [n])
            torch.testing.assert_close(logits[start:start + n], alone, atol=2e-5, rtol=2e-5)
            for i in routed:
                assert torch.equal(routed[i][start:start + n], routed_alone[i])
            start += n
        # Replaying the captured routing reproduces the logits.
        replayed, _ = packed_forward(model, ids, lens, replay={i: r.long() for i, r in routed.items()})
        torch.testing.assert_close(replayed, logits, atol=0, rtol=0)


def _conv_oracle(x, w):
    return F.conv1d(F.pad(x.T[None], (w.shape[1] - 1, 0)), w[:, None, :], groups=x.shape[1])[0].T + x


def _rms(x, w, eps=1e-6):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _attention_row(attn, x, i, lam_formula):
    """Layer attention output (before o_proj) for query i of one sequence, from the formulas."""
    x = x.double()
    w = {k: v.double() for k, v in attn.state_dict().items()}
    hq, hkv, d, dr, r_ext = 4, 2, 16, 8, 24
    q, k, v, r = (x @ w["qkvr_proj.weight"].T).split([hq * d, hkv * d, hkv * d, hq * dr], dim=-1)
    k, v = _conv_oracle(k, w["k_conv.weight"]), _conv_oracle(v, w["v_conv.weight"])
    q = _rms(q.reshape(-1, hq, d), w["q_norm.weight"])
    k = _rms(k.reshape(-1, hkv, d), w["k_norm.weight"])
    v = v.reshape(-1, hkv, d)
    rel = r.reshape(-1, hq, dr) @ w["rel_proj.weight"].T  # [T, Hq, R]
    lam = lam_formula(i)
    window = attn.attn.sliding_window
    out = []
    for h in range(hq):
        g = h // 2
        js = [j for j in range(i + 1) if window is None or i - j < window]
        logits = torch.stack([(lam * q[i, h]) @ k[j, g] / math.sqrt(d)
                              + (lam * rel[i, h, i - j] if i - j < r_ext else 0.0) for j in js])
        p = torch.softmax(logits, 0)
        out.append(sum(p[a] * v[j, g] for a, j in enumerate(js)))
    return torch.cat(out)


@pytest.mark.parametrize("layer", [1, 5])  # a sliding MoE layer and the full layer
def test_attention_rows_follow_the_formula_at_absolute_positions(model, layer):
    attn = model.model.layers[layer].self_attn
    seen = {}
    h1 = attn.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].detach().clone()))
    h2 = attn.o_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("o", a[0].detach().clone()))
    try:
        ids = torch.randint(0, 512, (60,), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            packed_forward(model, ids, [60])
    finally:
        h1.remove()
        h2.remove()
    full = layer == 5
    beta, floor_scale = 0.5, 8
    lam = (lambda i: 1 + beta * math.log(math.floor((i + 1) / floor_scale) + 1)) if full else (lambda i: 1.0)
    for i in (3, 20, 59):  # lam = 1, 1 + 0.5 ln 3, 1 + 0.5 ln 8 on the full layer
        want = _attention_row(attn, seen["x"], i, lam)
        torch.testing.assert_close(seen["o"][i].double(), want, atol=1e-5, rtol=1e-5)
        if full and i >= 7:  # the scale matters: without it the row differs
            assert not torch.allclose(seen["o"][i].double(), _attention_row(attn, seen["x"], i, lambda _: 1.0),
                                      atol=1e-3)


@pytest.mark.parametrize("tie", [False, True])
def test_checkpoint_round_trip(tmp_path, tie):
    from safetensors.torch import load_file, save_file

    src = tiny_inkling(seed=3, tie_word_embeddings=tie)
    sd = src.checkpoint_state_dict()
    # MODELS.md names and shapes.
    assert sd["model.layers.0.self_attn.qkvr_proj.weight"].shape == (4 * 16 + 2 * 2 * 16 + 4 * 8, 64)
    assert sd["model.layers.0.self_attn.k_conv.weight"].shape == (32, 4)
    assert sd["model.layers.0.self_attn.o_conv.weight"].shape == (64, 4)
    assert sd["model.layers.0.self_attn.rel_proj.weight"].shape == (24, 8)
    assert sd["model.layers.0.mlp.out_conv.weight"].shape == (64, 4)
    assert sd["model.layers.0.mlp.gate_proj.weight"].shape == (96, 64)
    assert sd["model.layers.1.mlp.router.weight"].shape == (10, 64)
    assert sd["model.layers.1.mlp.router.expert_bias"].shape == (8,)
    assert sd["model.layers.1.mlp.router.global_scale"].shape == ()
    assert sd["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    assert sd["model.layers.1.mlp.shared_experts.1.up_proj.weight"].shape == (32, 64)
    assert sd["mtp.1.eh_proj.weight"].shape == (64, 128)
    assert "mtp.2.block.self_attn.qkvr_proj.weight" in sd and "mtp.2.final_norm.weight" in sd
    assert not any(k.startswith("mtp.0.") or "conv" in k for k in sd if k.startswith("mtp."))
    assert ("lm_head.weight" in sd) != tie
    save_file(sd, str(tmp_path / "model.safetensors"))

    dst = tiny_inkling(seed=4, tie_word_embeddings=tie)
    dst.load_weights(load_file(str(tmp_path / "model.safetensors")).items())
    back = dst.checkpoint_state_dict()
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    ids = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(packed_forward(dst, ids, [12, 8])[0], packed_forward(src, ids, [12, 8])[0],
                                   atol=0, rtol=0)
    with pytest.raises(ValueError, match="missing"):
        tiny_inkling().load_weights((k, v) for k, v in sd.items() if "experts.3." not in k or "shared" in k)


def test_one_attn_scale_per_forward(monkeypatch):
    """The full layers share one lam per forward (computed by InklingModel from the positions),
    and no later forward can see it: the logits equal per-layer computation's, and the batch
    keeps no lam afterwards."""
    import kiln.models.inkling as inkling
    from kiln.models.reference import packed_batch

    model = tiny_inkling(seed=3, num_hidden_layers=12)  # two full layers (5 and 11)
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(2))
    calls = []
    real = inkling.attn_scale
    monkeypatch.setattr(inkling, "attn_scale", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        batch = packed_batch(ids, [40])
        shared = model.compute_logits(model(batch), batch)
        assert len(calls) == 1 and inkling.ATTN_SCALE not in batch.extras
        monkeypatch.setattr(inkling.InklingModel, "forward", _forward_without_shared_lam)
        alone = packed_forward(model, ids, [40])[0]
    assert len(calls) == 3  # one per full layer without the shared value
    torch.testing.assert_close(shared, alone, atol=0, rtol=0)


def _forward_without_shared_lam(self, batch):
    h, residual = self.embed_tokens(batch.input_ids), None
    for layer in self.layers:
        h, residual = layer(h, batch, residual)
    return self.norm(h, batch, residual)[0]
