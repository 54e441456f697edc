"""GRPO with rollouts on a remote `kiln serve` (tiny Inkling, MoE, fp32 CPU): the first step's
train/rollout KL is ~0 (routing replay from the server's routed experts), and after the steps'
weight syncs (over HTTP, or through a weight update group) the server's logprobs for a fixed
sample equal the trainer's."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from kiln.rl import RLConfig, run_grpo  # noqa: E402
from tests.kiln_server import free_port, kiln_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REWARD = os.path.join(ROOT, "tests", "rl", "test_loop.py") + ":vowel_reward"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from kiln.models.init_model import init_model

    d = str(tmp_path_factory.mktemp("inkling_remote"))
    init_model("inkling", "tiny", d, seed=0)
    return d


@pytest.fixture(scope="module")
def server(tiny_model):
    with kiln_server(["--model-path", tiny_model, "--device", "cpu", "--log-level", "warning",
                      "--max-total-tokens", "4096", "--max-running-requests", "8",
                      "--enable-return-routed-experts"], timeout=120, env={"OMP_NUM_THREADS": "1"}) as (url, _):
        yield url


@pytest.mark.parametrize("weight_sync", ["http", "distributed"])
def test_grpo_with_remote_rollouts(tiny_model, server, tmp_path, weight_sync):
    """Either sync ('distributed': a gloo weight update group from this CPU trainer) leaves the
    server with the trainer's weights."""
    from kiln.rl.loss import mismatch_metrics

    cfg = RLConfig(model_path=tiny_model, reward=REWARD, num_steps=2, prompts_per_step=2, samples_per_prompt=2,
                   max_new_tokens=8, lr=1e-3, seed=0, out_dir=str(tmp_path / "run"), progress=False,
                   save_final=False, plot_every=0, rollout_urls=[server], weight_sync=weight_sync)
    ms = run_grpo(cfg)
    assert [m["step"] for m in ms] == [0, 1]
    assert ms[0]["train_rollout_kl"] <= 1e-6, ms[0]
    assert any(m.get("sync_bytes", 0) > 0 for m in ms), "no step trained and synced"

    # The server now serves the trainer's weights: same logprobs for a fixed sample (routing replayed).
    trainer, _ = run_grpo.last
    r = httpx.post(server + "/generate", json={
        "input_ids": [1, 2, 3, 4, 5, 6], "return_logprob": True, "return_routed_experts": True,
        "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "seed": 7, "ignore_eos": True}}, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    served = torch.tensor([lp[0] for lp in out["meta_info"]["output_token_logprobs"]])
    sample = {"prompt_ids": [1, 2, 3, 4, 5, 6], "output_ids": out["output_ids"],
              "routed_experts": out["meta_info"]["routed_experts"]}
    with torch.no_grad():
        lp = trainer.sequence_logprobs([sample], 1.0, replay=True)[0].float()
    mm = mismatch_metrics(lp[None], served[None], torch.ones(1, lp.numel()))
    assert float(mm["train_rollout_kl"]) <= 1e-6, (lp, served)


def test_unreachable_server_is_a_clear_error(tiny_model):
    from kiln.rl.rollout import RemoteRollout, RemoteRolloutError

    with pytest.raises(RemoteRolloutError, match="unreachable"):
        RemoteRollout([f"http://127.0.0.1:{free_port()}"], tiny_model, timeout=2)
