"""The block drafter (MODELS.md 4; DSpark 3.3) as a module: the batched engine path equals the
readable per-block reference, the DFlash directory round-trips, configs are checked, and the
target taps follow the input-of-layer convention on every architecture."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kiln.loader import init_dummy_weights
from kiln.models.block_drafter import BlockDrafter
from kiln.models.block_drafter_config import BlockDrafterConfig
from kiln.models.config import ModelConfig
from kiln.models.dflash import load_dflash, read_dflash_config, save_dflash
from kiln.models.reference import packed_batch
from kiln.models.registry import get_model_class, parse_model_config
from tests.engine.test_hybrid_engine import INKLING, MINIMAX

LLAMA = dict(model_type="llama", vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=512)
DRAFT = dict(model_type="dflash", target_layer_ids=[0, 2], num_layers=2, block_size=8, mask_token_id=511,
             hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96)


def drafter(seed=0, **over) -> BlockDrafter:
    cfg = BlockDrafterConfig.from_dict({**DRAFT, **over}, ModelConfig.from_dict(LLAMA), where="test")
    model = BlockDrafter(cfg, max_positions=256)
    init_dummy_weights(model, seed)
    with torch.no_grad():  # N(0, 1/fan_in): attention and the MLP matter
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(1.0 / (0.02 * math.sqrt(p.shape[-1])))
    return model.eval()


DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)


@pytest.mark.parametrize("over", [{}, DFLASH2], ids=["dflash", "dflash2"])
def test_batched_blocks_equal_the_reference_block(over):
    # Blocks of different context lengths (one without context) in one padded batch. DFlash2's
    # conv runs along each block's rows: batched blocks must not leak into each other.
    model = drafter(**over)
    g = torch.Generator().manual_seed(0)
    lens = [0, 5, 23, 40]
    ctx = [torch.randn(n, 64, generator=g) for n in lens]
    blocks = torch.randn(len(lens), 8, 64, generator=g)
    C = max(lens)
    with torch.no_grad():
        kv = [model.context_kv(c, torch.arange(len(c))) for c in ctx]
        padded = []
        for layer in range(2):
            k = torch.zeros(len(lens), C, 2, 16)
            v = torch.zeros(len(lens), C, 2, 16)
            for i, n in enumerate(lens):
                k[i, :n], v[i, :n] = kv[i][layer]
            padded.append((k, v))
        mask = torch.arange(C)[None] < torch.tensor(lens)[:, None]
        got = model.forward_blocks(blocks, torch.tensor(lens), padded, mask)
        for i, n in enumerate(lens):
            ref = model.draft_hidden(blocks[i], n, ctx[i], torch.arange(n))
            assert (got[i] - ref).abs().max() <= 1e-5, i
        # the context matters: a different context changes the block
        other = model.draft_hidden(blocks[3], 40, ctx[3] + 0.1, torch.arange(40))
        assert (other - got[3]).abs().max() > 1e-3


def test_dflash_directory_round_trip(tmp_path):
    src = drafter(seed=3)
    save_dflash(src, str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "dflash" and cfg["target_layer_ids"] == [0, 2] and cfg["block_size"] == 8
    dst = load_dflash(str(tmp_path), ModelConfig.from_dict(LLAMA), 256, "cpu", torch.float32)
    for (a, x), (b, y) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert a == b and torch.equal(x, y), a
    names = set(src.checkpoint_state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.mlp.gate_proj.weight",
            "layers.0.self_attn.k_norm.weight"} <= names and not any("gate_up" in n for n in names)
    with pytest.raises(KeyError, match="nonsense"):
        dst.load_weights([("layers.0.nonsense.weight", torch.zeros(1))])


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama"}, "is not a DFlash drafter"),
    ({"hidden_size": 32}, r"hidden_size \(32\) must equal the target's hidden_size \(64\)"),
    ({"target_layer_ids": [0, 3]}, r"target_layer_ids \[3\] are not layers of the target"),
    ({"target_layer_ids": []}, "needs target_layer_ids"),
    ({"mask_token_id": None}, "needs mask_token_id"),
    ({"mask_token_id": 512}, "mask_token_id 512 is not a token"),
    ({"block_size": 1}, "block_size must be >= 2"),
])
def test_dflash_config_errors(tmp_path, change, message):
    (tmp_path / "config.json").write_text(json.dumps({**DRAFT, **change}))
    with pytest.raises(ValueError, match=message):
        read_dflash_config(str(tmp_path), ModelConfig.from_dict(LLAMA))


def test_dflash_directory_errors(tmp_path):
    target = ModelConfig.from_dict(LLAMA)
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        read_dflash_config(None, target)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        read_dflash_config(str(tmp_path / "nowhere"), target)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        read_dflash_config(str(tmp_path), target)
    (tmp_path / "config.json").write_text(json.dumps(DRAFT))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        load_dflash(str(tmp_path), target, 256, "cpu", torch.float32)
    assert load_dflash(str(tmp_path), target, 256, "cpu", torch.float32, dummy_seed=0).config.num_layers == 2


def test_defaults_come_from_the_target():
    cfg = BlockDrafterConfig.from_dict({"target_layer_ids": [1], "mask_token_id": 3}, ModelConfig.from_dict(LLAMA))
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 4, 2, 16)
    assert (cfg.num_layers, cfg.block_size, cfg.intermediate_size) == (1, 16, 128)


@pytest.mark.parametrize("cfg", [LLAMA, INKLING, MINIMAX], ids=["llama", "inkling", "minimax_m3"])
def test_taps_are_the_residual_entering_each_layer(cfg):
    config = parse_model_config(cfg)
    model = get_model_class(cfg["model_type"])(config, max_positions=128)
    init_dummy_weights(model, 0)
    model.eval()
    ids = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(1))
    layers = list(range(cfg["num_hidden_layers"]))
    with torch.no_grad():
        plain = model(packed_batch(ids, [20]))
        batch = packed_batch(ids, [20])
        batch.capture_layers = tuple(reversed(layers))
        out = model(batch)
        assert torch.equal(out, plain), "capturing must not change the forward"
        assert torch.equal(batch.captured[0], model.model.embed_tokens(ids))
        h, residual = model.model.embed_tokens(ids), None
        for i, layer in enumerate(model.model.layers):  # the residual stream entering layer i
            assert torch.equal(batch.captured[i], h if residual is None else h + residual), i
            probe = packed_batch(ids, [20])
            h, residual = layer(probe.positions, h, probe, residual) if cfg["model_type"] != "inkling" \
                else layer(h, probe, residual)
        taps = batch.taps()
    assert taps.shape == (20, 64 * len(layers))
    assert torch.equal(taps[:, :64], batch.captured[layers[-1]])  # in capture_layers order
