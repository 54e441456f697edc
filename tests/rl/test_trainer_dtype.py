"""The RL loop's trainer dtype: by default the colocated engine's (bf16 on CUDA), stepping through
fp32 master weights, so that the recompute sees the rollout's weights and small updates still land.

Before this, `kiln rl` on CUDA trained fp32 weights against a bf16 engine (the first run on an H200
showed a train-rollout KL of ~2e-4 on the tiny Inkling, against ~1e-9 on the CPU in fp32)."""

from __future__ import annotations

import os

import pytest
import torch

from kiln.rl import RLConfig, run_grpo
from kiln.rl.loop import trainer_dtype
from tests.rl.test_loop import ENGINE, _cfg


@pytest.mark.parametrize("trainer, engine, urls, device, want", [
    ("auto", {}, [], "cpu", torch.float32),  # the engine's auto: fp32 on CPU ...
    ("auto", {}, [], "cuda", torch.bfloat16),  # ... bf16 on CUDA
    ("auto", {"dtype": "bfloat16"}, [], "cpu", torch.bfloat16),  # the colocated engine's dtype
    ("auto", {"dtype": "float32"}, [], "cuda", torch.float32),
    ("auto", {"dtype": "float32"}, ["http://h:1"], "cuda", torch.bfloat16),  # remote: by the device
    ("float32", {"dtype": "bfloat16"}, [], "cuda", torch.float32),  # asked for
])
def test_trainer_dtype_follows_the_engine(trainer, engine, urls, device, want):
    cfg = RLConfig(model_path="m", trainer_dtype=trainer, engine=engine, rollout_urls=urls)
    assert trainer_dtype(cfg, device) == want


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from kiln.models.init_model import init_model

    d = str(tmp_path_factory.mktemp("inkling_tiny"))
    init_model("inkling", "tiny", d, seed=0)
    return d


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_bf16_run_trains_through_masters(tiny_model, tmp_path, lora_rank):
    """A bf16 colocated run on the CPU: the trainer takes the engine's dtype, reproduces its
    logprobs before the first update (full weights: after a sync too), and its weights are its
    fp32 masters rounded (with LoRA: the adapters'). A merged adapter is not exact in bf16: the
    engine rounds W + s B A to bf16 where the trainer adds s (x A^T) B^T to x W^T (7.3e-3 at the
    second step here; fp32 gives ~1e-6)."""
    cfg = _cfg(tiny_model, str(tmp_path / "run"), engine={**ENGINE, "dtype": "bfloat16"}, num_steps=2,
               save_every=0, save_final=False, lora_rank=lora_rank)
    ms = run_grpo(cfg)
    trainer, _ = run_grpo.last
    opt = trainer.optimizer
    assert opt.masters and all(m.dtype == torch.float32 for m in opt.masters)
    assert all(p.dtype == torch.bfloat16 for p, _ in opt.pairs)
    for p, m in opt.pairs:
        assert torch.equal(p.detach(), m.to(torch.bfloat16))
    # The same ops in the same dtype: 0 on this CPU. An fp32 trainer against this bf16 engine
    # (trainer_dtype="float32") gives 7.6e-3.
    for m in ms if not lora_rank else ms[:1]:
        assert m["train_rollout_logprob_abs_diff"] <= 1e-3, m
    if lora_rank:
        assert all(".lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert any(m.get("grad_norm", 0) > 0 for m in ms)
    assert not os.path.exists(os.path.join(str(tmp_path / "run"), "ckpt-2"))


def test_rollouts_with_prompt_lookup_keep_the_trainers_logprobs(tiny_model, tmp_path):
    """Rollouts may speculate (`--engine.speculative_algorithm ngram`): sampled requests verify
    drafts as point masses, so the tokens are the target's draws and each one's logprob is the one
    the trainer recomputes (fp32 on the CPU: ~1e-6), with the experts the verify rows routed
    replayed. The random tiny model repeats itself rarely enough that its drafts are rejected
    here; rounds with accepted drafts are checked row by row in tests/engine/test_ngram.py."""
    cfg = _cfg(tiny_model, str(tmp_path / "run"), num_steps=2, max_new_tokens=48, temperature=0.3, save_every=0,
               save_final=False,
               engine={**ENGINE, "speculative_algorithm": "ngram", "speculative_num_steps": 3})
    ms = run_grpo(cfg)
    _, engine = run_grpo.last
    spec = engine.stats().spec
    assert spec.verify_steps > 0, spec  # rounds ran (and rolled back their rejected rows)
    for m in ms:
        assert m["train_rollout_logprob_abs_diff"] <= 1e-4, m
