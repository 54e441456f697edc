"""Colocated memory release around training: the engine frees its KV cache (and, on CUDA, moves
its weights to CPU) while the trainer runs and resumes before the weight sync.

On CPU the KV pools are really freed and re-allocated (the weights part is a no-op there: there
is no device memory to give back), so these tests exercise the loop's path and check that it
changes nothing the engine computes."""

from __future__ import annotations

import os

import pytest
import torch

from kiln import Engine, SamplingParams
from kiln.rl import RLConfig, run_grpo
from kiln.rl import loop as rl_loop
from kiln.rl.rollout import ColocatedRollout

ENGINE = {"max_total_tokens": 4096, "max_running_requests": 8, "chunked_prefill_size": 1024,
          "max_prefill_tokens": 2048}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from kiln.models.init_model import init_model

    d = str(tmp_path_factory.mktemp("inkling_tiny"))
    init_model("inkling", "tiny", d, seed=0)
    return d


def _outputs(llm: Engine) -> list[tuple[list[int], list[float]]]:
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    params = [SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True),
              SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=7, logprobs=0, ignore_eos=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.token_ids), [lp[0] for lp in o.logprobs]) for out in outs for o in out.outputs]


def test_release_resume_keeps_engine_outputs(tiny_model):
    with Engine(tiny_model, log_level="warning", seed=0, **ENGINE) as llm:
        backend = ColocatedRollout(llm)
        assert backend.device_type == "cpu"
        before = _outputs(llm)
        assert llm.core.cache.used_tokens() > 0  # the prompts sit in the prefix cache
        info = backend.release_memory()
        runner = llm.core.runner
        assert info["kv_cache_bytes"] > 0 and runner.kv_released
        assert llm.core.cache.used_tokens() == 0  # flushed: the pages are gone
        backend.resume_memory()
        assert not runner.kv_released
        after = _outputs(llm)
    assert [t for t, _ in after] == [t for t, _ in before]
    for (_, a), (_, b) in zip(after, before):
        assert torch.equal(torch.tensor(a), torch.tensor(b))


def vowel_reward(prompt: str, completion: str, sample: dict) -> float:
    return sum(c in "aeiouAEIOU" for c in completion) / max(1, len(completion))


def _cfg(model: str, out: str, **kw) -> RLConfig:
    return RLConfig(model_path=model, reward=f"{os.path.abspath(__file__)}:vowel_reward", num_steps=2,
                    prompts_per_step=2, samples_per_prompt=2, max_new_tokens=8, lr=1e-3, seed=0, out_dir=out,
                    progress=False, save_every=0, save_final=False, engine=ENGINE, **kw)


def test_loop_with_release_matches_loop_without(tiny_model, tmp_path):
    plain = run_grpo(_cfg(tiny_model, str(tmp_path / "plain")))
    freed = run_grpo(_cfg(tiny_model, str(tmp_path / "freed"), release_engine_memory=True))
    assert "time_release_s" not in plain[0]  # auto: off on CPU
    for p, f in zip(plain, freed):
        assert f["time_release_s"] >= 0 and f["time_resume_s"] >= 0 and f["released_kv_bytes"] > 0
        assert f["time_step_s"] >= f["time_rollout_s"] + f["time_train_s"] + f["time_sync_s"]
        # Released and resumed every step, then synced: the engine samples exactly as without it.
        for key in ("reward_mean", "response_len_mean", "train_rollout_kl", "train_rollout_logprob_abs_diff",
                    "loss", "entropy", "grad_norm"):
            assert f[key] == p[key], (key, f[key], p[key])
    assert freed[1]["train_rollout_kl"] <= 1e-6  # after the sync into the resumed engine


class _FakeBackend:
    def __init__(self, device_type: str):
        self.device_type = device_type


def test_release_default_only_for_colocated_cuda():
    cfg = RLConfig()
    assert rl_loop._release_engine_memory(cfg, _FakeBackend("cuda"))
    assert not rl_loop._release_engine_memory(cfg, _FakeBackend("cpu"))
    assert not rl_loop._release_engine_memory(cfg, None)  # FSDP ranks other than 0
    assert not rl_loop._release_engine_memory(RLConfig(rollout_urls=["http://x:1"]), _FakeBackend("cuda"))
    assert rl_loop._release_engine_memory(RLConfig(release_engine_memory=True), _FakeBackend("cpu"))
    assert not rl_loop._release_engine_memory(RLConfig(release_engine_memory=False), _FakeBackend("cuda"))
