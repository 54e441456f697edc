"""The packed reference forward on the Llama family, and Inkling under training (autograd + replay)."""

from __future__ import annotations

import pytest
import torch

from kiln.loader import init_dummy_weights
from kiln.models.config import ModelConfig
from kiln.models.reference import packed_forward
from kiln.models.registry import get_model_class

from tests.models.test_inkling import tiny_inkling


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_llama_packed_equals_each_alone(model_type):
    cfg = ModelConfig.from_dict(dict(model_type=model_type, vocab_size=128, hidden_size=32,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=64))
    model = get_model_class(model_type)(cfg, max_positions=64)
    init_dummy_weights(model, 0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(10)
    lens = [9, 4, 13]
    ids = torch.randint(0, 128, (sum(lens),), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, routed = packed_forward(model, ids, lens)
        assert routed == {} and logits.shape == (26, 128) and logits.dtype == torch.float32
        start = 0
        for n in lens:
            torch.testing.assert_close(logits[start:start + n], packed_forward(model, ids[start:start + n], [n])[0],
                                       atol=1e-5, rtol=1e-5)
            start += n


def test_llama_layers_are_called_as_modules():
    """The model's loop calls each decoder layer as a module, so its hooks run (FSDP2 all-gathers a
    layer's shards in them: tests/rl/test_fsdp.py), with the norm that reads its output."""
    cfg = ModelConfig.from_dict(dict(model_type="llama", vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=64))
    model = get_model_class("llama")(cfg, max_positions=64)
    init_dummy_weights(model, 0)
    seen = []
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda m, args, i=i: seen.append((i, args[5])))
    with torch.no_grad():
        packed_forward(model, torch.arange(5), [5])
    layers = model.model.layers
    assert seen == [(0, layers[1].input_layernorm), (1, model.model.norm)]


def test_inkling_trains_through_the_reference_forward_with_replay():
    """Gradients reach qkvr, every ShortConv, the routers and experts under routing replay."""
    model = tiny_inkling(seed=7)
    for name, p in model.named_parameters():
        p.requires_grad_(not any(f in name for f in model.frozen_in_training))
    lens = [20, 11]
    ids = torch.randint(0, 512, (31,), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        _, routed = packed_forward(model, ids, lens)
    logits, replayed = packed_forward(model, ids, lens, replay={i: r.long() for i, r in routed.items()})
    assert all(torch.equal(replayed[i], routed[i]) for i in routed)
    torch.nn.functional.cross_entropy(logits[:-1], ids[1:]).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    for name in ("model.layers.5.self_attn.qkvr_proj.weight", "model.layers.0.self_attn.k_conv.weight",
                 "model.layers.3.self_attn.o_conv.weight", "model.layers.2.mlp.out_conv.weight",
                 "model.layers.1.mlp.router.weight", "model.layers.1.mlp.router.global_scale",
                 "model.layers.4.mlp.experts.w13", "model.layers.4.mlp.shared_experts.w2"):
        assert grads[name] is not None and grads[name].abs().sum() > 0, name
    assert model.model.layers[0].self_attn.rel_proj.weight.grad is None  # frozen in RL
