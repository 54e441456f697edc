"""MiniMax-M3 against MODELS.md 3: an independent reference forward written here from the on-disk
tensors (plain loops for block selection and routing), dense-attention equivalences, chunked
prefill + decode through a cache backend, packing, routing replay and checkpoint round trips."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kiln.engine.batch import ForwardBatch, ForwardMode
from kiln.engine.cache.components import ComponentKind
from kiln.layers.attention import PackedAttentionBackend
from kiln.loader import init_dummy_weights
from kiln.models.minimax_m3 import MiniMaxM3ForCausalLM
from kiln.models.minimax_m3_config import MiniMaxM3Config
from kiln.models.reference import packed_forward
from kiln.ops.attention import packed_attention
from kiln.ops.msa import select, sparse_attention

TINY = dict(model_type="minimax_m3", vocab_size=512, hidden_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, index_head_dim=16,
            index_block_size=8, index_topk_blocks=4, intermediate_size=128, first_k_dense_layers=1,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, routed_scaling_factor=2.0,
            rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _model(seed=0, **over) -> MiniMaxM3ForCausalLM:
    model = MiniMaxM3ForCausalLM(MiniMaxM3Config.from_dict({**TINY, **over}), max_positions=256)
    init_dummy_weights(model, seed)
    with torch.no_grad():
        # N(0, 0.02) leaves a 64-wide model nearly linear and the indexer scores nearly tied;
        # std 0.2 makes attention, selection and routing all matter.
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(10.0)
        g = torch.Generator().manual_seed(seed)
        for layer in model.model.layers[model.config.first_k_dense_layers:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.1)
    return model.eval()


def _tokens(n, seed=0):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def _train_batch(seqs, backend=None):
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    return ForwardBatch(ForwardMode.TRAIN, ids, pos, [0] * len(seqs), [len(s) for s in seqs],
                        torch.arange(len(ids)), backend=backend or PackedAttentionBackend())


class DenseBackend:
    """msa_attention as plain causal attention (what MSA must equal when nothing is dropped)."""

    def msa_attention(self, layer, q, k, v, qI, kI, batch):
        return packed_attention(q, k, v, batch.extend_lens, layer.scale)


class ListCacheBackend:
    """The engine's contract in miniature, for one sequence: store K, V and kI of every new token
    per layer, then select and attend over all cached positions with the reference ops."""

    def __init__(self):
        self.k, self.v, self.ki = {}, {}, {}

    def msa_attention(self, layer, q, k, v, qI, kI, batch):
        assert batch.batch_size == 1
        i = layer.layer_id
        for store, new in ((self.k, k), (self.v, v), (self.ki, kI)):
            store[i] = torch.cat([store[i], new]) if i in store else new
        assert self.k[i].shape[0] == batch.prefix_lens[0] + batch.extend_lens[0]
        k_pos = torch.arange(self.k[i].shape[0])
        sel = select(qI, self.ki[i], batch.positions, k_pos, layer.block_size, layer.topk_blocks)
        return sparse_attention(q, self.k[i], self.v[i], batch.positions, k_pos, sel, layer.block_size, layer.scale)


# --- an independent reference of MODELS.md 3, from the checkpoint tensors, in fp64 ----------------

def _rms(x, w, eps=1e-6):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta=10000.0):
    d = x.shape[-1]
    ang = pos[:, None].double() * (1.0 / theta ** (torch.arange(0, d, 2).double() / d))[None]
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def _oracle_blocks(qI, kI, bsz, big_n):
    """Sel[g][i] as a set, by loops over MODELS.md 3.1."""
    n, g, di = qI.shape
    logits = (torch.einsum("igd,tgd->git", qI, kI) / math.sqrt(di)).tolist()
    out = []
    for h in range(g):
        rows = []
        for i in range(n):
            n_i = i // bsz + 1
            if n_i <= big_n:
                rows.append(set(range(n_i)))
                continue
            score = {b: max(logits[h][i][t] for t in range(b * bsz, min(b * bsz + bsz, i + 1)))
                     for b in range(n_i - 1)}
            best = sorted(score, key=lambda b: (-score[b], b))[: big_n - 1]
            rows.append(set(best) | {n_i - 1})
        out.append(rows)
    return out


def _swiglu(x, sd, prefix):
    return (F.silu(x @ sd[prefix + "gate_proj.weight"].T) * (x @ sd[prefix + "up_proj.weight"].T)) @ \
        sd[prefix + "down_proj.weight"].T


def reference_logits(sd, cfg, tokens):
    """Logits [n, V] of one sequence, every step of MODELS.md 3 written out."""
    sd = {k: v.double() for k, v in sd.items()}
    n, d, hq, g = len(tokens), cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    pos = torch.arange(n)
    h = sd["model.embed_tokens.weight"][tokens]
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        a = _rms(h, sd[p + "input_layernorm.weight"])
        proj = lambda name, heads: (a @ sd[p + f"self_attn.{name}.weight"].T).view(n, heads, -1)  # noqa: E731
        q = _rope(_rms(proj("q_proj", hq), sd[p + "self_attn.q_norm.weight"]), pos)
        k = _rope(_rms(proj("k_proj", g), sd[p + "self_attn.k_norm.weight"]), pos)
        v = proj("v_proj", g)
        qi = _rope(proj("indexer.q_proj", g), pos)
        ki = _rope(proj("indexer.k_proj", g), pos)
        sel = _oracle_blocks(qi, ki, cfg.index_block_size, cfg.index_topk_blocks)
        o = torch.zeros(n, hq, d, dtype=torch.float64)
        for grp in range(g):
            for i in range(n):
                keys = [t for t in range(i + 1) if t // cfg.index_block_size in sel[grp][i]]
                heads = slice(grp * (hq // g), (grp + 1) * (hq // g))
                w = torch.softmax(q[i, heads] @ k[keys, grp].T / math.sqrt(d), -1)
                o[i, heads] = w @ v[keys, grp]
        h = h + o.reshape(n, -1) @ sd[p + "self_attn.o_proj.weight"].T
        m = _rms(h, sd[p + "post_attention_layernorm.weight"])
        if layer < cfg.first_k_dense_layers:
            h = h + _swiglu(m, sd, p + "mlp.")
            continue
        s = torch.sigmoid(m @ sd[p + "mlp.gate.weight"].T)
        bias = sd[p + "mlp.gate.e_score_correction_bias"]
        f = _swiglu(m, sd, p + "mlp.shared_experts.")
        for t in range(n):
            key = [(-(s[t, e] + bias[e]).item(), e) for e in range(cfg.num_experts)]
            top = [e for _, e in sorted(key)[: cfg.num_experts_per_tok]]
            for e in top:
                w = s[t, e] / s[t, top].sum() * cfg.routed_scaling_factor
                f[t] += w * _swiglu(m[t], sd, p + f"mlp.experts.{e}.")
        h = h + f
    head = sd["model.embed_tokens.weight"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
    return _rms(h, sd["model.norm.weight"]) @ head.T


def _logits(model, seqs, backend=None):
    batch = _train_batch(seqs, backend)
    with torch.no_grad():
        return model.compute_logits(model(batch), batch)


@pytest.mark.parametrize("tie", [False, True])
def test_model_equals_the_written_out_reference(tie):
    model = _model(seed=1, tie_word_embeddings=tie)
    tokens = _tokens(70, seed=1)  # 9 blocks of 8 > N = 4: selection is active from token 32 on
    want = reference_logits(model.checkpoint_state_dict(), model.config, tokens)
    got = _logits(model, [tokens])
    torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=1e-4)


def test_up_to_n_times_b_tokens_equals_dense_attention():
    model = _model(seed=2)
    tokens = _tokens(32, seed=2)  # N * B = 4 * 8: every causal block is selected
    torch.testing.assert_close(_logits(model, [tokens]), _logits(model, [tokens], DenseBackend()),
                               atol=1e-5, rtol=1e-5)


def test_huge_topk_equals_dense_and_small_topk_does_not():
    tokens = _tokens(70, seed=3)
    wide = _model(seed=3, index_topk_blocks=1000)
    torch.testing.assert_close(_logits(wide, [tokens]), _logits(wide, [tokens], DenseBackend()),
                               atol=1e-5, rtol=1e-5)
    sparse = _model(seed=3)
    diff = (_logits(sparse, [tokens]) - _logits(sparse, [tokens], DenseBackend())).abs().amax(-1)
    assert diff[:32].max() < 1e-5 and diff[32:].min() > 1e-3  # selection acts from token 32 on


def test_chunked_prefill_and_decode_equal_the_whole_sequence():
    """The backend contract (store K, V, kI per token; select over all cached positions) gives
    the packed forward's hidden states for prefill chunks and single-token decodes."""
    model = _model(seed=4)
    tokens = _tokens(75, seed=4)
    whole = model(_train_batch([tokens]))
    backend = ListCacheBackend()
    cuts = [0, 30, 47, 70] + list(range(71, 76))  # three prefill chunks, then five decodes
    for s, e in zip(cuts, cuts[1:]):
        mode = ForwardMode.DECODE if e - s == 1 else ForwardMode.EXTEND
        batch = ForwardBatch(mode, tokens[s:e], torch.arange(s, e), [s], [e - s], torch.tensor([e - s - 1]),
                             backend=backend)
        with torch.no_grad():
            torch.testing.assert_close(model(batch), whole[s:e], atol=1e-5, rtol=1e-5)


def test_packed_sequences_equal_each_alone():
    model = _model(seed=5)
    seqs = [_tokens(n, seed=n) for n in (70, 5, 41)]
    with torch.no_grad():
        packed, _ = packed_forward(model, torch.cat(seqs), [len(s) for s in seqs])
    start = 0
    for s in seqs:
        torch.testing.assert_close(packed[start:start + len(s)], _logits(model, [s]), atol=1e-5, rtol=1e-5)
        start += len(s)


def test_routing_capture_and_replay():
    model = _model(seed=6)
    tokens = _tokens(40, seed=6)
    with torch.no_grad():
        logits, routed = packed_forward(model, tokens, [40])
        assert sorted(routed) == [0, 1, 2]  # moe_index counts MoE layers only
        assert all(r.dtype == torch.int32 and r.shape == (40, 2) for r in routed.values())
        assert torch.equal(packed_forward(model, tokens, [40], replay=routed)[0], logits)
        other = {i: (r + 1) % 8 for i, r in routed.items()}
        assert (packed_forward(model, tokens, [40], replay=other)[0] - logits).abs().max() > 1e-3


def test_training_gradients_skip_the_frozen_indexer():
    model = _model(seed=7)
    for p in model.parameters():
        p.requires_grad_(True)
    batch = _train_batch([_tokens(45, seed=7), _tokens(12, seed=8)])
    logits = model.compute_logits(model(batch), batch)
    F.cross_entropy(logits[:-1], batch.input_ids[1:]).backward()
    attn = model.model.layers[2].self_attn
    assert attn.qkv_proj.weight.grad.abs().sum() > 0
    assert model.model.layers[2].mlp.gate.weight.grad.abs().sum() > 0
    assert attn.indexer.qk_proj.weight.grad is None


def test_state_specs():
    specs = _model().state_specs()
    assert [(s.kind, s.layer_ids, s.shape) for s in specs] == [
        (ComponentKind.FULL_KV, [0, 1, 2, 3], (2, 16)), (ComponentKind.INDEX_K, [0, 1, 2, 3], (2, 16))]


DSPARK = dict(target_layer_ids=[0, 2], num_layers=2, block_size=4, mask_token_id=511)


@pytest.mark.parametrize("over", [{}, {"tie_word_embeddings": True}, {"dspark_config": DSPARK}])
def test_checkpoint_round_trip(tmp_path, over):
    from safetensors.torch import load_file, save_file

    src = _model(seed=8, **over)
    sd = src.checkpoint_state_dict()
    assert not any("qkv_proj" in k or "gate_up_proj" in k or k.endswith((".w13", ".w2")) for k in sd)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.indexer.k_proj.weight",
                 "model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
                 "model.layers.3.mlp.experts.7.down_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight"):
        assert name in sd, name
    assert ("lm_head.weight" in sd) != bool(over.get("tie_word_embeddings"))
    save_file(sd, tmp_path / "model.safetensors")
    dst = _model(seed=9, **over)
    dst.load_weights(load_file(tmp_path / "model.safetensors").items())
    tokens = _tokens(50, seed=8)
    assert torch.equal(_logits(dst, [tokens]), _logits(src, [tokens]))
    for (a, x), (b, y) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert a == b and torch.equal(x, y), a


def test_load_rejects_unknown_and_missing_tensors():
    model = _model()
    sd = model.checkpoint_state_dict()
    with pytest.raises(KeyError, match="nonsense"):
        model.load_weights(list(sd.items()) + [("model.layers.0.nonsense.weight", torch.zeros(1))])
    del sd["model.layers.2.mlp.gate.weight"]
    with pytest.raises(ValueError, match="mlp.gate.weight"):
        model.load_weights(sd.items())


def test_dspark_weights_and_reference_block_forward():
    model = _model(seed=10, dspark_config=DSPARK)
    sd = model.checkpoint_state_dict()
    names = {k for k in sd if k.startswith("dspark.")}
    assert {"dspark.fc.weight", "dspark.hidden_norm.weight", "dspark.norm.weight",
            "dspark.layers.1.self_attn.k_norm.weight", "dspark.layers.0.self_attn.v_proj.weight",
            "dspark.layers.0.mlp.down_proj.weight"} <= names
    assert sd["dspark.fc.weight"].shape == (64, 128)
    taps = torch.randn(20, 128)
    ctx = model.dspark.context_features(taps)
    block = model.model.embed_tokens(torch.tensor([7] + [511] * 3))
    with torch.no_grad():
        out = model.dspark.draft_hidden(block, 20, ctx, torch.arange(20))
    assert out.shape == (4, 64) and torch.isfinite(out).all()


def test_config_defaults_and_validation():
    cfg = MiniMaxM3Config.from_dict({k: v for k, v in TINY.items()
                                     if k not in ("index_head_dim", "index_block_size", "index_topk_blocks",
                                                  "first_k_dense_layers", "routed_scaling_factor")})
    assert (cfg.index_head_dim, cfg.index_block_size, cfg.index_topk_blocks) == (128, 128, 16)
    assert (cfg.first_k_dense_layers, cfg.routed_scaling_factor, cfg.num_shared_experts) == (1, 1.0, 1)
    assert cfg.dspark_config is None and cfg.vision_config is None
    assert MiniMaxM3Config.coerce(SimpleNamespace(raw=TINY)).to_dict() == MiniMaxM3Config.from_dict(TINY).to_dict()
    again = MiniMaxM3Config.from_dict({**TINY, "dspark_config": DSPARK}).to_dict()
    assert MiniMaxM3Config.from_dict(again).to_dict() == again
    with pytest.raises(ValueError, match="num_experts"):
        MiniMaxM3Config.from_dict({k: v for k, v in TINY.items() if k != "num_experts"})
    with pytest.raises(ValueError, match="target_layer_ids"):
        MiniMaxM3Config.from_dict({**TINY, "dspark_config": {"target_layer_ids": [9]}})


def test_registered_for_config_json():
    from kiln.models.config import ModelConfig
    from kiln.models.registry import get_model_class, parse_model_config

    assert get_model_class("minimax_m3") is MiniMaxM3ForCausalLM
    assert isinstance(parse_model_config(TINY), MiniMaxM3Config)
    # The runner may parse with the generic ModelConfig first; the model re-parses its raw dict.
    model = MiniMaxM3ForCausalLM(ModelConfig.from_dict(TINY), max_positions=64)
    assert model.config.index_block_size == 8
