"""Multi-GPU / multi-node GRPO placement with Ray placement groups (optional: `pip install ray`).

    kiln rl --config examples/rl_arithmetic.json --launcher ray --ray.num_engines 2 --ray.trainer_gpus 4

    from kiln.rl.ray_launcher import RayPlacement, launch
    metrics = launch(cfg, RayPlacement(trainer_gpus=4, num_engines=2, gpus_per_engine=1))

What it does (the shape of Miles' placement, kept small):

1. `ray.init` (or joins `address`; a running cluster with `address="auto"`).
2. One placement group: bundle 0 = the trainer ({"GPU": trainer_gpus, "CPU": ...}; one bundle, so
   the trainer's GPUs are on one node, as torchrun needs), then one bundle per rollout engine
   ({"GPU": gpus_per_engine, "CPU": ...}). Strategy PACK by default (SPREAD puts bundles on
   different nodes when it can). With 0 GPUs the bundles hold CPUs only (tests).
3. Each engine is a Ray actor in its bundle that starts `kiln serve` as a subprocess (Ray sets
   CUDA_VISIBLE_DEVICES for the actor; the server inherits it) on a free port and reports
   `http://<node ip>:<port>` once /health answers.
4. The trainer is a Ray actor in bundle 0 that runs `run_grpo` with `rollout_urls` = those urls
   (the existing `RemoteRollout`: prompts over HTTP, weights pushed through
   /update_weights_from_tensor, LoRA through /load_lora_adapter, which needs a filesystem the
   servers share with the trainer). With trainer_gpus > 1 the actor runs `kiln rl` under torchrun
   (FSDP2 ranks, kiln.rl.fsdp) and reads back metrics.jsonl.
5. The servers are stopped and the placement group removed when the run ends or fails.

Nothing else in Kiln imports Ray; this module imports it only inside `launch`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from kiln.dist.net import free_port
from kiln.rl.config import RLConfig

RAY_MISSING = ("Ray placement needs the optional dependency Ray: `pip install ray` (or "
               "`pip install 'kiln[ray]'`); without Ray, use rollout_urls with `kiln serve`s you start, "
               "or torchrun for FSDP training.")


@dataclass
class RayPlacement:
    """Where the trainer and the rollout engines run (RLConfig.ray holds these keys)."""

    trainer_gpus: int = 1          # GPUs of the trainer (one node); 0 = CPU
    num_engines: int = 1           # `kiln serve` rollout engines
    gpus_per_engine: int = 1       # GPUs per engine (its tp size is an engine option); 0 = CPU
    cpus_per_bundle: int = 1
    strategy: str = "PACK"         # placement group strategy: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD
    address: Optional[str] = None  # ray.init address (None: a new local Ray, or the running one)
    serve_args: list[str] = field(default_factory=list)  # extra `kiln serve` flags
    startup_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.trainer_gpus < 0 or self.gpus_per_engine < 0 or self.num_engines < 1:
            raise ValueError(f"need trainer_gpus >= 0, gpus_per_engine >= 0 and num_engines >= 1, got {self}")
        if self.strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(f"strategy must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD, got {self.strategy!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "RayPlacement":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"Unknown ray option(s) {unknown}; valid options: {sorted(names)}")
        return cls(**d)

    def bundles(self) -> list[dict[str, float]]:
        """Bundle 0: the trainer; bundle 1 + i: engine i."""
        def bundle(gpus: int) -> dict[str, float]:
            b: dict[str, float] = {"CPU": float(self.cpus_per_bundle)}
            if gpus:
                b["GPU"] = float(gpus)
            return b

        return [bundle(self.trainer_gpus)] + [bundle(self.gpus_per_engine) for _ in range(self.num_engines)]


def require_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError(RAY_MISSING) from e
    return ray


def serve_command(cfg: RLConfig, port: int, extra: list[str], moe: bool) -> list[str]:
    """The `kiln serve` command line of one rollout engine: the policy's model, `cfg.engine`
    options as flags, routed experts returned on MoE models with routing replay."""
    from kiln.config import EngineConfig

    cmd = [sys.executable, "-m", "kiln", "serve", "--host", "0.0.0.0", "--port", str(port)]
    if cfg.model_path:
        cmd += ["--model-path", cfg.model_path]
    flags = {f.name: f.metadata.get("flag") or "--" + f.name.replace("_", "-")
             for f in dataclasses.fields(EngineConfig)}
    opts = dict(cfg.engine)
    opts.setdefault("seed", cfg.seed)
    if moe and cfg.routing_replay:
        opts["enable_return_routed_experts"] = True
    for key, value in opts.items():
        if key not in flags:
            raise ValueError(f"engine option {key!r} is not a `kiln serve` option (EngineConfig field)")
        if key in ("host", "port", "model_path"):
            continue
        if isinstance(value, bool):
            if value:
                cmd.append(flags[key])
        elif value is not None:
            cmd += [flags[key], str(value)]
    return cmd + list(extra)



class EngineServer:
    """A `kiln serve` subprocess owned by a Ray actor (wrapped with ray.remote in `launch`)."""

    def __init__(self, cmd_without_port: list[str], env: dict[str, str]):
        self.port = free_port("")
        cmd = list(cmd_without_port)
        cmd[cmd.index("--port") + 1] = str(self.port)
        self.log = tempfile.NamedTemporaryFile(prefix="kiln_serve_", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> str:
        """Block until /health answers; returns the url other nodes reach it at."""
        import httpx
        import ray

        deadline = time.time() + timeout
        local = f"http://127.0.0.1:{self.port}"
        while True:
            if self.proc.poll() is not None:
                with open(self.log.name) as fh:
                    raise RuntimeError(f"kiln serve exited with {self.proc.returncode}:\n{fh.read()[-4000:]}")
            try:
                if httpx.get(local + "/health", timeout=2).status_code == 200:
                    return f"http://{ray.util.get_node_ip_address()}:{self.port}"
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise TimeoutError(f"kiln serve did not answer /health within {timeout:.0f} s (log {self.log.name})")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class TrainerRunner:
    """Runs the GRPO loop against the engines' urls (wrapped with ray.remote in `launch`)."""

    def run(self, cfg_dict: dict, urls: list[str], trainer_gpus: int, env: dict[str, str]) -> list[dict]:
        cfg = RLConfig.from_dict({**cfg_dict, "rollout_urls": urls, "launcher": "local", "ray": {}})
        if trainer_gpus <= 1:
            from kiln.rl.loop import run_grpo

            return run_grpo(cfg)
        # FSDP2 over this actor's GPUs: the same run under torchrun, metrics read back from disk.
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
            json.dump(cfg.to_dict(), fh)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={trainer_gpus}",
               "-m", "kiln", "rl", "--config", fh.name]
        subprocess.run(cmd, env={**os.environ, **env}, check=True)
        with open(os.path.join(cfg.out_dir, "metrics.jsonl")) as mf:
            return [json.loads(line) for line in mf if line.strip()]


def launch(cfg: RLConfig, placement: Optional[RayPlacement] = None) -> list[dict]:
    """Run `cfg` with its trainer and `kiln serve` engines placed by a Ray placement group.
    Returns the trainer's metrics (one dict per step)."""
    ray = require_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from kiln.rl.loop import _moe_model_dir

    p = placement or RayPlacement.from_dict(cfg.ray)
    if cfg.rollout_urls:
        raise ValueError("launcher 'ray' starts its own engines: leave rollout_urls empty")
    # Workers import the same Kiln as this process (a source checkout need not be installed).
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [_kiln_root(), os.environ.get("PYTHONPATH")]))}
    if not ray.is_initialized():
        ray.init(address=p.address, runtime_env={"env_vars": env}, include_dashboard=False,
                 log_to_driver=True)
    pg = placement_group(p.bundles(), strategy=p.strategy)
    engines: list[Any] = []
    try:
        ray.get(pg.ready(), timeout=p.startup_timeout_s)
        cmd = serve_command(cfg, 0, p.serve_args, _moe_model_dir(cfg.model_path))
        server_cls = ray.remote(EngineServer)
        for i in range(p.num_engines):
            engines.append(server_cls.options(
                num_cpus=p.cpus_per_bundle, num_gpus=p.gpus_per_engine,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=1 + i),
            ).remote(cmd, env))
        urls = ray.get([e.wait_ready.remote(p.startup_timeout_s) for e in engines])
        trainer = ray.remote(TrainerRunner).options(
            num_cpus=p.cpus_per_bundle, num_gpus=p.trainer_gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
        ).remote()
        return ray.get(trainer.run.remote(cfg.to_dict(), urls, p.trainer_gpus, env))
    finally:
        for e in engines:
            try:
                ray.get(e.stop.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - best effort: the actor may already be dead
                pass
        remove_placement_group(pg)


def _kiln_root() -> str:
    import kiln

    return os.path.dirname(os.path.dirname(os.path.abspath(kiln.__file__)))
