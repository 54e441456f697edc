"""FSDP2 data-parallel training on CPU (gloo): two ranks under torchrun take the same two
optimizer steps as one process on the same batch (tiny SmolLM2-shaped Llama, dummy weights).

Checks the whole sharded path: fully_shard per decoder layer + root (tied embeddings in the root),
each rank recomputing its share of the samples with the loss scaled for FSDP's gradient average
(token-mean in step 1, sequence-mean in step 2), clip_grad_norm_ over DTensor grads, AdamW on the
shards, the optimizer state saved and reloaded per rank between the steps, and the
DTensor.full_tensor() gather that the weight sync and checkpoints use. "micro" does the same with
gradient accumulation over uneven shares (5 and 4 samples in micro-batches of at most 2: every
rank must run as many backwards, since FSDP reduces the gradients at each)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.rl.tiny import write_tiny_llama

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "rl", "fsdp_worker.py")


def _run(cmd: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:  # the ranks' own errors come before torchrun's long summary
        causes = [ln for ln in r.stderr.splitlines() if any(w in ln for w in ("Error", "error", "terminate", "abort"))]
        pytest.fail(f"{' '.join(cmd)} failed ({r.returncode}):\n" + "\n".join(causes[:40]) +
                    f"\n--- stdout ---\n{r.stdout[-3000:]}\n--- stderr ---\n{r.stderr[:6000]}")


CASES = [("full", "float32"), ("lora", "float32"), ("micro", "float32"), ("full", "bfloat16")]


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """Every case in one process, then under torchrun with two ranks: two launches in all (each
    pays seconds of imports and start-up). Returns (model dir, prefix of one, prefix of two)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    model = write_tiny_llama(str(tmp / "model"))
    one, two = str(tmp / "one"), str(tmp / "two")
    cases = ",".join(f"{mode}:{dtype}" for mode, dtype in CASES)
    _run([sys.executable, WORKER, model, one, cases])
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", WORKER,
          model, two, cases])
    return model, one, two


@pytest.mark.parametrize("mode, dtype", CASES)
def test_fsdp2_two_ranks_match_one_process(fsdp_runs, mode, dtype):
    """bf16: the parameters are bf16 DTensor shards stepped through fp32 master shards."""
    from tests.rl.fsdp_worker import case_path

    model, one, two = fsdp_runs
    a = torch.load(case_path(one, mode, dtype), weights_only=False)
    b = torch.load(case_path(two, mode, dtype), weights_only=False)
    assert (a["sharded"], a["world"]) == (False, 1) and (b["sharded"], b["world"]) == (True, 2)

    from tests.rl.tiny import tiny_trainer

    init = dict(tiny_trainer(model).named_weights_for_sync())
    assert a["weights"].keys() == b["weights"].keys()
    # bf16: the gradients are reduced in bf16 in different orders (relative error ~2^-8), so the
    # updates (~lr = 0.5 at most) differ by up to ~lr * 2^-8, and the weights may round an ulp apart
    rel, atol = (2.0 ** -7, 0.5 * 2.0 ** -8) if dtype == "bfloat16" else (0.0, 0.0)
    moved, worst = 0.0, 0.0
    for name, w in a["weights"].items():
        assert w.shape == b["weights"][name].shape, name
        w2 = b["weights"][name]
        worst = max(worst, float(((w - w2).abs() - atol - rel * torch.maximum(w.abs(), w2.abs())).max()))
        start = init[name] if name in init else torch.zeros_like(w) if ".lora_B" in name else None
        if start is not None:  # base weights (full mode) or LoRA B (zero at the start)
            moved = max(moved, float((w - start).abs().max()))
    print(f"\n[{mode}, {dtype}] max |one process - FSDP2 x2| beyond the tolerance = {worst:.2e}; "
          f"max weight change = {moved:.2e}")
    assert moved > 1e-4, "the two steps should move the weights"
    assert worst < 1e-6
    for ma, mb in zip(a["metrics"], b["metrics"]):
        for key in ("loss", "pg_loss", "grad_norm", "entropy", "train_rollout_kl", "tis_mean", "clip_frac"):
            assert ma[key] == pytest.approx(mb[key], rel=1e-5 if rel == 0 else 1e-3, abs=1e-7), (key, ma[key], mb[key])


def _read(path: str) -> list[dict]:
    import json

    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def test_kiln_rl_under_torchrun_matches_one_process_and_resumes(tmp_path):
    """`torchrun --nproc-per-node 2 -m kiln rl` end to end on the tiny Inkling (MoE, routing
    replay, frozen rel_proj weights, 0-dim router scales FSDP leaves replicated, unused MTP
    layers in the root unit): rank 0
    owns the engine; the first step equals the one-process run; after each sync the engine
    reproduces the trainer (KL ~0); a resume from ckpt-1 with per-rank optimizer shards
    reproduces step 1."""
    import json

    from kiln.models.init_model import init_model

    model = str(tmp_path / "model")
    init_model("inkling", "tiny", model, seed=0)
    base = {"model_path": model, "reward": os.path.join(REPO, "tests", "rl", "test_loop.py") + ":vowel_reward",
            "num_steps": 2, "prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 8, "lr": 1e-3,
            "seed": 0, "progress": False, "save_every": 1, "trainer_device": "cpu",
            "engine": {"max_total_tokens": 4096, "max_running_requests": 8}}
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(base))
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    _run([sys.executable, "-m", "kiln", "rl", "--config", str(cfg_path), "--out-dir", one])
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "kiln",
              "rl", "--config", str(cfg_path), "--out-dir", two]
    _run(launch)
    a, b = _read(os.path.join(one, "metrics.jsonl")), _read(os.path.join(two, "metrics.jsonl"))
    assert [m["step"] for m in b] == [0, 1]
    for key in ("reward_mean", "response_len_mean", "rollout_tokens"):
        assert a[0][key] == b[0][key], key
    # (the loss is a sum of advantages that cancel to ~1e-7: compared in absolute terms)
    for key, tol in (("train_rollout_kl", 1e-9), ("entropy", 1e-9), ("loss", 1e-6), ("grad_norm", 1e-9)):
        assert a[0][key] == pytest.approx(b[0][key], rel=1e-4, abs=tol), (key, a[0][key], b[0][key])
    assert all(m["train_rollout_kl"] <= 1e-6 for m in b)  # step 1 ran on the synced engine
    assert os.path.exists(os.path.join(two, "ckpt-1", "optimizer-rank1.pt"))
    assert json.load(open(os.path.join(two, "ckpt-1", "state.json")))["world_size"] == 2

    _run(launch + ["--resume", os.path.join(two, "ckpt-1")])
    resumed = _read(os.path.join(two, "metrics.jsonl"))
    assert [m["step"] for m in resumed] == [0, 1]
    for key in ("reward_mean", "train_rollout_kl", "loss", "entropy", "grad_norm"):
        assert resumed[1][key] == b[1][key], (key, resumed[1][key], b[1][key])


def test_num_gpus_relaunches_under_torchrun(monkeypatch):
    """`kiln rl --num-gpus 2 ...` runs the same command under torchrun with 2 ranks."""
    import kiln.cli

    calls: list = []
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(kiln.cli.subprocess, "call", lambda cmd: calls.append(cmd) or 7)
    with pytest.raises(SystemExit) as e:
        kiln.cli.main(["rl", "--num-gpus", "2", "--num-steps", "1", "--lr=1e-4"])
    assert e.value.code == 7
    (cmd,) = calls
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--nproc-per-node=2" in cmd
    assert cmd[cmd.index("kiln"):] == ["kiln", "rl", "--num-gpus", "2", "--num-steps", "1", "--lr=1e-4"]
