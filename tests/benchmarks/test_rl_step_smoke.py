"""CPU smoke test of benchmarks/rl_step.py on preset:inkling/tiny (MoE: routing replay on): one
full-weights and one LoRA phase of two GRPO steps each, dummy weights, no tokenizer."""

from __future__ import annotations

import json
import math
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import rl_step  # noqa: E402


def test_rl_step_tiny_cpu(tmp_path):
    before = torch.get_num_threads()
    out = tmp_path / "rl.json"
    try:
        res = rl_step.main(["--model-path", "preset:inkling/tiny", "--device", "cpu", "--prompts", "2",
                            "--samples", "2", "--prompt-len", "16", "--max-new-tokens", "8", "--steps", "2",
                            "--lora-rank", "4", "--micro-batch", "3", "--threads", "1", "--release-memory",
                            "--out", str(out)])
    finally:
        torch.set_num_threads(before)
    rows = {r["phase"]: r for r in res["rows"]}
    assert set(rows) == {"full", "lora"}
    meta = res["meta"]
    assert meta["routing_replay"] is True  # Inkling is MoE: the recompute replays the rollout's experts
    assert meta["weights_identical_at_start"] is True  # engine and trainer: same dummy init, same seed
    assert len(meta["per_step"]) == 4
    for s in meta["per_step"]:
        assert s["rollout_tokens"] == 2 * 2 * 8  # ignore_eos: every sample runs to max_new_tokens
        for k in ("rollout_s", "rollout_tok_s", "recompute_s", "backward_step_s", "train_s", "sync_s"):
            assert math.isfinite(s[k]) and s[k] > 0, (k, s)
        assert math.isfinite(s["kl"]) and s["kl"] >= 0
        assert s["release_s"] >= 0 and s["resume_s"] >= 0 and s["pools_GB"] > 0  # released around training
    # Same weights, same fp32 numerics on the CPU: the first recompute matches the rollout.
    assert rows["full"]["kl_first"] < 1e-4
    # Every weight in fp32 (plus the few persistent buffers, e.g. router biases).
    assert abs(rows["full"]["sync_bytes"] - meta["num_params"] * 4) < 0.01 * meta["num_params"] * 4
    assert 0 < rows["lora"]["sync_bytes"] < rows["full"]["sync_bytes"] / 10  # the adapter only
    saved = json.loads(out.read_text())
    assert [r["phase"] for r in saved["rows"]] == ["full", "lora"]


def test_trainer_profile_quick(capsys, tmp_path):
    """benchmarks/trainer_profile.py on the CPU (tiny Inkling, routing replay): it times, profiles
    and writes its row to --out."""
    import json

    import trainer_profile

    out = tmp_path / "tp.json"
    r = trainer_profile.main(["--quick", "--profile", "--rows", "3", "--out", str(out)])
    assert r["recompute_s"] > 0 and r["backward_s"] > 0 and r["tokens"] == 2 * 24
    assert "Self CPU" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["rows"] == [r] and saved["meta"]["routing_replay"] is True
