"""The GRPO loop end to end on the tiny Inkling (MoE: rollouts return routed experts, the trainer
replays them): a smoke run writes metrics.jsonl and curves.png with a ~0 first-step train/rollout
KL; resuming from a checkpoint reproduces the next step exactly; LoRA mode runs; export_hf output
loads in kiln.Engine.

The random tiny model never answers arithmetic, so the run uses a text reward defined here
(vowel fraction of the completion) whose groups are rarely all-equal: every step trains.
"""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")

from kiln.rl import RLConfig, export_hf, run_grpo  # noqa: E402
from kiln.rl import loop as rl_loop  # noqa: E402


def vowel_reward(prompt: str, completion: str, sample: dict) -> float:
    return sum(c in "aeiouAEIOU" for c in completion) / max(1, len(completion))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from kiln.models.init_model import init_model

    d = str(tmp_path_factory.mktemp("inkling_tiny"))
    init_model("inkling", "tiny", d, seed=0)
    return d


ENGINE = {"max_total_tokens": 4096, "max_running_requests": 8, "chunked_prefill_size": 1024,
          "max_prefill_tokens": 2048}


def _cfg(model: str, out: str, **kw) -> RLConfig:
    base = dict(model_path=model, reward=f"{os.path.abspath(__file__)}:vowel_reward", num_steps=3,
                prompts_per_step=2, samples_per_prompt=2, max_new_tokens=8, lr=1e-3, seed=0,
                out_dir=out, progress=False, save_every=2, engine=ENGINE)
    base.update(kw)
    return RLConfig(**base)


def _read(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def test_smoke_resume_and_export(tiny_model, tmp_path):
    out = str(tmp_path / "run")
    ms = run_grpo(_cfg(tiny_model, out))
    assert [m["step"] for m in ms] == [0, 1, 2]
    lines = _read(os.path.join(out, "metrics.jsonl"))
    assert [m["step"] for m in lines] == [0, 1, 2]
    assert os.path.getsize(os.path.join(out, "curves.png")) > 1000
    first = ms[0]
    # Before any update the trainer reproduces the engine's logprobs (same weights, same routing).
    assert first["train_rollout_kl"] <= 1e-6
    assert first["train_rollout_logprob_abs_diff"] < 1e-3
    for key in ("reward_mean", "loss", "clip_frac", "entropy", "response_len_mean", "time_rollout_s", "time_train_s",
                "time_sync_s", "rollout_tok_s"):
        assert key in first, key
    assert any(m.get("grad_norm", 0) > 0 for m in ms), "no step trained"
    assert os.path.exists(os.path.join(out, "ckpt-2", "model.safetensors"))
    assert os.path.exists(os.path.join(out, "ckpt-3", "optimizer.pt"))

    # Resume from ckpt-2: step 2 must come out exactly as in the uninterrupted run.
    resumed = run_grpo(_cfg(tiny_model, out, resume=os.path.join(out, "ckpt-2")))
    assert [m["step"] for m in resumed] == [2]
    for key in ("reward_mean", "train_rollout_kl", "train_rollout_logprob_abs_diff", "loss", "entropy",
                "response_len_mean"):
        assert resumed[0][key] == ms[2][key], (key, resumed[0][key], ms[2][key])
    assert [m["step"] for m in _read(os.path.join(out, "metrics.jsonl"))] == [0, 1, 2]

    # export_hf from the resumed trainer: a servable directory whose greedy outputs match the trainer.
    trainer, _ = run_grpo.last
    hf = export_hf(trainer, str(tmp_path / "hf"))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(hf))
    from kiln import Engine, SamplingParams

    with Engine(hf, log_level="warning", **ENGINE) as llm:
        out_ = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0, logprobs=0),
                            use_tqdm=False)[0].outputs[0]
    lp = trainer.sequence_logprobs([{"prompt_ids": [1, 2, 3, 4], "output_ids": out_.token_ids}])[0]
    assert torch.allclose(lp.detach(), torch.tensor([x[0] for x in out_.logprobs]), atol=1e-3)


def test_lora_mode_runs_and_exports(tiny_model, tmp_path):
    out = str(tmp_path / "lora")
    ms = run_grpo(_cfg(tiny_model, out, num_steps=2, lora_rank=4, lora_alpha=8, lr=1e-2, save_every=0))
    assert len(ms) == 2 and ms[0]["train_rollout_kl"] <= 1e-6
    assert os.path.exists(os.path.join(out, "ckpt-2", "adapter", "adapter_model.safetensors"))
    # After a LoRA update the engine serves the merged adapter: the mismatch stays small.
    assert ms[1]["train_rollout_logprob_abs_diff"] < 1e-2
    trainer, _ = run_grpo.last
    hf = export_hf(trainer, str(tmp_path / "lora_hf"))
    from kiln import Engine

    with Engine(hf, log_level="warning", **ENGINE) as llm:
        assert llm.generate([[1, 2, 3]], use_tqdm=False)[0].outputs


def test_config_file_and_overrides(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"num_steps": 7, "loss": {"eps_clip_high": 0.3}}))
    cfg = RLConfig.from_file(str(p), ["--lr", "2e-5", "--loss.use_tis", "false", "--chat-template=false",
                                      "--engine", '{"cpu_kv_cache_gb": 0.1}'])
    assert (cfg.num_steps, cfg.lr, cfg.chat_template) == (7, 2e-5, False)
    assert cfg.loss == {"eps_clip_high": 0.3, "use_tis": False}
    assert cfg.engine == {"cpu_kv_cache_gb": 0.1}
    with pytest.raises(ValueError):
        RLConfig.from_file(str(p), ["--no-such-key", "1"])
    assert rl_loop._rollout_seed(cfg, 1, 0) != rl_loop._rollout_seed(cfg, 0, cfg.prompts_per_step - 1)


def test_colocated_engine_is_sized_for_one_steps_sequences():
    from kiln.rl.config import RLConfig

    cfg = RLConfig(prompts_per_step=3, samples_per_prompt=5, seed=7)
    opts = rl_loop.colocated_engine_options(cfg, moe=True)
    assert opts["max_running_requests"] == 15 and opts["seed"] == 7
    assert opts["enable_return_routed_experts"] is True
    assert "enable_return_routed_experts" not in rl_loop.colocated_engine_options(cfg, moe=False)
    mine = RLConfig(prompts_per_step=3, samples_per_prompt=5, engine={"max_running_requests": 64})
    assert rl_loop.colocated_engine_options(mine, moe=False)["max_running_requests"] == 64  # the user's wins
