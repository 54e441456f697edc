"""A SmolLM2-shaped Llama small enough for multi-process CPU tests (config only: load it with
load_format="dummy", the engine's seeded dummy init), and a fixed GRPO batch for it."""

from __future__ import annotations

import json
import os

import torch

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2,
}


def write_tiny_llama(d: str) -> str:
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as fh:
        json.dump(TINY_LLAMA, fh)
    return d


def tiny_trainer(d: str, **kw):
    from kiln.rl.trainer import PolicyTrainer

    kw.setdefault("lr", 1e-2)
    return PolicyTrainer(d, load_format="dummy", seed=0, **kw)


def fixed_batch(n_groups: int = 3, group: int = 2, seed: int = 0) -> tuple[list[dict], torch.Tensor, torch.Tensor]:
    """(samples, advantages [n], keep [n]): random prompts/outputs of varying lengths, rollout
    logprobs that are not the trainer's (so TIS weights differ from 1), the last group dropped."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n_groups * group):
        p, o = 3 + i % 4, 2 + (3 * i) % 5
        samples.append({
            "prompt_ids": torch.randint(3, 512, (p,), generator=g).tolist(),
            "output_ids": torch.randint(3, 512, (o,), generator=g).tolist(),
            "rollout_logp": (-6.2 + 0.3 * torch.randn(o, generator=g)).tolist(),
        })
    adv = torch.randn(n_groups * group, generator=g)
    keep = torch.ones(n_groups * group, dtype=torch.bool)
    keep[-group:] = False
    return samples, adv, keep
