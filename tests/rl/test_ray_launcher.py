"""kiln.rl.ray_launcher: Ray is optional. Without it the launcher says `pip install ray` and
nothing imports it; with it, a CPU placement group (trainer bundle + one engine bundle) runs two
GRPO steps against a `kiln serve` actor over HTTP."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kiln.rl import RLConfig
from kiln.rl.ray_launcher import RayPlacement, require_ray, serve_command

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_nothing_imports_ray_at_import_time():
    code = ("import sys, kiln, kiln.cli, kiln.rl, kiln.rl.loop, kiln.rl.ray_launcher, kiln.rl.fsdp\n"
            "assert 'ray' not in sys.modules, 'ray imported at module import time'\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_missing_ray_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ImportError, match="pip install ray"):
        require_ray()
    from kiln.cli import main

    with pytest.raises(SystemExit) as e:
        main(["rl", "--launcher", "ray", "--num-steps", "1"])
    assert e.value.code == 2


def test_placement_bundles_and_serve_command():
    p = RayPlacement(trainer_gpus=4, num_engines=2, gpus_per_engine=2, cpus_per_bundle=3)
    assert p.bundles() == [{"CPU": 3.0, "GPU": 4.0}, {"CPU": 3.0, "GPU": 2.0}, {"CPU": 3.0, "GPU": 2.0}]
    assert RayPlacement(trainer_gpus=0, gpus_per_engine=0).bundles() == [{"CPU": 1.0}, {"CPU": 1.0}]
    with pytest.raises(ValueError, match="Unknown ray option"):
        RayPlacement.from_dict({"engines": 2})
    cfg = RLConfig(model_path="/m", engine={"max_total_tokens": 4096, "disable_radix_cache": False}, seed=3)
    cmd = serve_command(cfg, 1234, ["--log-level", "warning"], moe=True)
    assert cmd[1:4] == ["-m", "kiln", "serve"]
    assert cmd[cmd.index("--model-path") + 1] == "/m" and cmd[cmd.index("--port") + 1] == "1234"
    assert cmd[cmd.index("--max-total-tokens") + 1] == "4096" and cmd[cmd.index("--seed") + 1] == "3"
    assert "--enable-return-routed-experts" in cmd and cmd[-2:] == ["--log-level", "warning"]
    with pytest.raises(ValueError, match="not a `kiln serve` option"):
        serve_command(RLConfig(engine={"no_such": 1}), 1, [], moe=False)


def vowel_reward(prompt: str, completion: str, sample: dict) -> float:
    return sum(c in "aeiouAEIOU" for c in completion) / max(1, len(completion))


def test_ray_placement_group_runs_grpo_on_cpu(tmp_path):
    ray = pytest.importorskip("ray")
    from kiln.models.init_model import init_model
    from kiln.rl.ray_launcher import launch

    model = str(tmp_path / "model")
    init_model("inkling", "tiny", model, seed=0)
    cfg = RLConfig(model_path=model, reward=f"{os.path.abspath(__file__)}:vowel_reward", num_steps=2,
                   prompts_per_step=2, samples_per_prompt=2, max_new_tokens=8, lr=1e-3, seed=0,
                   out_dir=str(tmp_path / "run"), progress=False, save_every=0, save_final=False,
                   trainer_device="cpu", engine={"max_total_tokens": 4096, "max_running_requests": 8})
    ray.init(num_cpus=2, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}})
    try:
        metrics = launch(cfg, RayPlacement(trainer_gpus=0, num_engines=1, gpus_per_engine=0,
                                           startup_timeout_s=300))
    finally:
        ray.shutdown()
    assert [m["step"] for m in metrics] == [0, 1]
    # The remote engine got the trainer's weights before step 0 and after step 0's update.
    assert all(m["train_rollout_kl"] <= 1e-6 for m in metrics), [m["train_rollout_kl"] for m in metrics]
    assert any(m.get("sync_bytes", 0) > 0 for m in metrics)
    assert os.path.exists(os.path.join(cfg.out_dir, "metrics.jsonl"))
