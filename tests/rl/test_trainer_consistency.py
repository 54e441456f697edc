"""The RL correctness claims of the trainer/engine pair (CPU, fp32).

1. The trainer recomputes the engine's rollout logprobs: k3 train-rollout KL <= 1e-6 (SmolLM2,
   tiny Inkling, tiny MiniMax-M3; MoE models with routing replay, which is never worse than
   without it).
2. After a full weight sync (model to model, or checkpoint tensors in buckets; in place) the
   engine samples from the trainer's new weights, and its prefix cache was flushed.
3. After an adapter-only LoRA sync (merged in the engine, from PEFT tensors or from the trainer's
   model, to the same weights) the same holds; unloading restores the original logprobs.
4. Adapters round-trip through PEFT's file format with PEFT's names.

Metrics are those of Miles (`train_rollout_kl`, `train_rollout_logprob_abs_diff`): with
d = lt - lr per sampled token, k3 = exp(d) - 1 - d, token-masked means over all samples.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from kiln.engine.request import SamplingParams
from kiln.offline import Engine
from kiln.rl.lora import lora_state_dict, load_adapter, save_adapter
from kiln.rl.sync import sync_full, sync_lora
from kiln.rl.trainer import PolicyTrainer

KL_MAX = 1e-6
MAX_TOKENS = 16


def mismatch(train: list[torch.Tensor], rollout: list[list[float]]) -> tuple[float, float]:
    """(k3 KL, mean |lt - lr|) over every output token."""
    lt = torch.cat([t.detach().double() for t in train])
    lr = torch.tensor([x for r in rollout for x in r], dtype=torch.float64)
    d = lt - lr
    k3 = (torch.exp(d) - 1 - d).clamp(-10, 10)
    return float(k3.mean()), float(d.abs().mean())


def rollout(llm: Engine, prompts: list[list[int]], routed: bool, n: int = 2, seed: int = 0) -> list[dict]:
    params = SamplingParams(n=n, temperature=1.0, seed=seed, logprobs=0, max_tokens=MAX_TOKENS,
                            ignore_eos=True)
    outs = llm.generate(prompts, params, return_routed_experts=routed, use_tqdm=False)
    samples = []
    for prompt, res in zip(prompts, outs):
        for o in res.outputs:
            samples.append({"prompt_ids": list(prompt), "output_ids": list(o.token_ids),
                            "logprobs": [lp for lp, _ in o.logprobs],
                            "routed_experts": o.routed_experts if routed else None})
    return samples


def score(trainer: PolicyTrainer, samples: list[dict], replay: bool = True) -> tuple[float, float]:
    with torch.no_grad():
        lps = trainer.sequence_logprobs(samples, temperature=1.0, replay=replay)
    return mismatch(lps, [s["logprobs"] for s in samples])


def perturb(trainer: PolicyTrainer, samples: list[dict]) -> None:
    """One optimizer step on a dummy loss (raise the sampled tokens' logprobs)."""
    lps = trainer.sequence_logprobs(samples, temperature=1.0)
    trainer.step(-torch.cat(lps).mean())


class World:
    def __init__(self, arch: str, model_dir, routed: bool, prompts: list[list[int]]):
        self.arch, self.routed, self.prompts = arch, routed, prompts
        self.llm = Engine(model_path=model_dir, max_total_tokens=2048, seed=0,
                          enable_return_routed_experts=routed, skip_tokenizer_init=True)
        self.trainer = PolicyTrainer(model_dir, lr=1e-3)

    def rollout(self, seed: int = 0) -> list[dict]:
        return rollout(self.llm, self.prompts, self.routed, seed=seed)


def _random_prompts(vocab: int, seed: int, lens=(41, 47)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module", params=["smollm2", "inkling", "minimax_m3"])
def world(request, tmp_path_factory):
    if request.param == "smollm2":
        from kiln.loader import resolve_model

        src = resolve_model(None)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(src.model_dir)
        prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):")]
        w = World("smollm2", src.model_dir, False, prompts)
    else:
        from kiln.models.init_model import init_model

        d = str(tmp_path_factory.mktemp(request.param))
        cfg = init_model(request.param, "tiny", d)
        w = World(request.param, d, True, _random_prompts(cfg["vocab_size"], seed=1))
    yield w
    w.llm.shutdown()


def test_trainer_recomputes_rollout_logprobs(world):
    samples = world.rollout()
    assert all(len(s["output_ids"]) == MAX_TOKENS for s in samples)
    kl, diff = score(world.trainer, samples, replay=True)
    print(f"\n[{world.arch}] train-rollout k3 KL = {kl:.3e}, mean |diff| = {diff:.3e}"
          + (" (routing replay)" if world.routed else ""))
    assert kl <= KL_MAX and diff < 1e-4
    if world.routed:
        kl_free, diff_free = score(world.trainer, samples, replay=False)
        print(f"[{world.arch}] without replay:  k3 KL = {kl_free:.3e}, mean |diff| = {diff_free:.3e}")
        assert kl_free >= kl


class _CheckpointNamesOnly:
    """An engine seen through its checkpoint-name methods alone (as across processes): sync_full
    then sends checkpoint tensors in buckets, and sync_lora PEFT tensors, instead of going model
    to model."""

    def __init__(self, llm: Engine):
        self.update_weights_from_tensor = llm.update_weights_from_tensor
        self.load_lora_adapter = llm.load_lora_adapter


@pytest.mark.parametrize("path", ["model", "checkpoint"])
def test_full_sync_makes_engine_match_trainer(world, path):
    samples = world.rollout()
    assert world.llm.core.cache.used_tokens() > 0  # the prefix cache holds the prompts
    before = [t.detach() for t in world.trainer.sequence_logprobs(samples)]
    perturb(world.trainer, samples)
    with torch.no_grad():
        after = world.trainer.sequence_logprobs(samples)
    moved = float((torch.cat(after) - torch.cat(before)).abs().mean())
    assert moved > 1e-3, "the optimizer step should change the policy"
    target = world.llm if path == "model" else _CheckpointNamesOnly(world.llm)
    stats = sync_full(world.trainer, target, bucket_bytes=4 * 1024**2)
    assert stats["path"] == path and (stats["buckets"] == 0) == (path == "model")
    print(f"\n[{world.arch}] full sync ({path}): {stats['bytes'] / 1e6:.1f} MB in {stats['buckets']} buckets, "
          f"{stats['seconds'] * 1e3:.0f} ms; policy moved {moved:.3e}")
    assert world.llm.core.cache.used_tokens() == 0  # flushed: its KV came from the old weights
    fresh = world.rollout(seed=1)
    kl, diff = score(world.trainer, fresh)
    print(f"[{world.arch}] after full sync: k3 KL = {kl:.3e}, mean |diff| = {diff:.3e}")
    assert kl <= KL_MAX and diff < 1e-4


def test_lora_sync_and_unload(world):
    base_samples = world.rollout(seed=2)
    world.trainer.enable_lora(rank=8, alpha=16, seed=0)
    perturb(world.trainer, base_samples)  # B != 0 after one AdamW step
    with torch.no_grad():
        lora_lps = world.trainer.sequence_logprobs(base_samples)
    moved, _ = mismatch(lora_lps, [s["logprobs"] for s in base_samples])
    assert moved > 1e-6, "the LoRA step should change the policy"
    stats = sync_lora(world.trainer, _CheckpointNamesOnly(world.llm), "policy")
    assert stats["path"] == "checkpoint"
    full = sum(t.numel() * t.element_size() for _, t in world.trainer.named_weights_for_sync())
    print(f"\n[{world.arch}] LoRA sync: {stats['bytes'] / 1e6:.2f} MB ({stats['tensors']} tensors) "
          f"vs {full / 1e6:.1f} MB full, {stats['seconds'] * 1e3:.0f} ms")
    assert world.llm.core.cache.used_tokens() == 0
    fresh = world.rollout(seed=3)
    kl, diff = score(world.trainer, fresh)
    print(f"[{world.arch}] after LoRA sync: k3 KL = {kl:.3e}, mean |diff| = {diff:.3e}")
    assert kl <= KL_MAX and diff < 1e-4
    # The same adapter from the trainer's model, by stacked tensor: the same merged weights (the
    # engine restores the base first).
    params = dict(world.llm.core.runner.model.named_parameters())
    by_checkpoint = {n: p.detach().clone() for n, p in params.items()}
    assert sync_lora(world.trainer, world.llm, "policy")["path"] == "model"
    for n, p in params.items():
        torch.testing.assert_close(p, by_checkpoint[n], atol=1e-6, rtol=1e-6, msg=n)
    # A second version of the same adapter replaces the first (base restored, then merged).
    perturb(world.trainer, fresh)
    sync_lora(world.trainer, world.llm, "policy")
    kl2, _ = score(world.trainer, world.rollout(seed=4))
    assert kl2 <= KL_MAX
    world.llm.unload_lora_adapter("policy")
    again = world.rollout(seed=2)
    assert [s["output_ids"] for s in again] == [s["output_ids"] for s in base_samples]
    err = max(abs(a - b) for s, t in zip(again, base_samples) for a, b in zip(s["logprobs"], t["logprobs"]))
    assert err < 1e-5, f"unload should restore the base logprobs (max |diff| {err:.2e})"


PEFT_NAME = re.compile(r"^base_model\.model\.model\.layers\.\d+\."
                       r"(self_attn\.(q|k|v|o|qkvr)_proj|mlp\.(gate|up|down)_proj|"
                       r"mlp\.experts\.\d+\.(gate|up|down)_proj)\.lora_[AB]\.weight$")


@pytest.mark.parametrize("arch", ["inkling", "minimax_m3"])
def test_peft_adapter_round_trip(arch, tmp_path):
    from kiln.models.init_model import init_model

    init_model(arch, "tiny", str(tmp_path / "model"))
    trainer = PolicyTrainer(str(tmp_path / "model"))
    trainer.enable_lora(rank=4, alpha=8, seed=0)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if ".lora_B" in name:
                p.normal_()
    save_adapter(trainer.model, str(tmp_path / "adapter"))
    state = lora_state_dict(trainer.model)
    assert state and all(PEFT_NAME.match(k) for k in state), [k for k in state if not PEFT_NAME.match(k)][:4]
    assert any(".experts." in k for k in state)
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8
    assert {"o_proj", "gate_proj", "up_proj", "down_proj"} <= set(cfg["target_modules"])
    if arch == "minimax_m3":  # stacked q/k/v: one A copied to each projection, B split by rows
        pre = "base_model.model.model.layers.0.self_attn."
        assert torch.equal(state[pre + "q_proj.lora_A.weight"], state[pre + "k_proj.lora_A.weight"])
        assert sum(state[pre + f"{p}_proj.lora_B.weight"].shape[0] for p in "qkv") == \
            trainer.model.model.layers[0].self_attn.qkv_proj.weight.shape[0]

    other = PolicyTrainer(str(tmp_path / "model"))
    other.enable_lora(rank=4, alpha=8, seed=1)
    load_adapter(other.model, str(tmp_path / "adapter"))
    loaded = lora_state_dict(other.model)
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
