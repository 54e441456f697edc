"""The GRPO loop: rollouts in a colocated `kiln.Engine` (or remote `kiln serve`s, `rollout_urls`),
training in `PolicyTrainer`.

One step (DESIGN.md section 7):

    prompts (PromptIterator) -> engine.generate(n samples each, logprobs=0, routed experts on MoE)
      -> rewards -> group advantages (+ dynamic sampling drops all-equal groups)
      -> trainer: recompute logprobs (routing replay); old_logp = that pass, detached
      -> policy loss with TIS against the rollout logprobs -> optimizer step
      -> weight sync into the engine (full weights, or the LoRA adapter) -> flush the prefix cache
      -> metrics: one JSON line in out_dir/metrics.jsonl, curves in out_dir/curves.png

Checkpoints (`ckpt-N/`) hold the trainer weights (engine checkpoint names, or the PEFT adapter),
the optimizer state, the prompt iterator, the RNG states and the step; resuming from one
reproduces the following steps exactly (rollout seeds derive from (seed, step, prompt index), and
the engine starts from the checkpoint's weights with an empty prefix cache).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import shutil
import time
from typing import Any, Callable, Optional

import torch

from kiln.rl.config import RLConfig

logger = logging.getLogger("kiln.rl")

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
LORA_NAME = "policy"


# ---- setup -----------------------------------------------------------------------------------
def _seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2 ** 32))
    except ImportError:
        pass


def _load_prompts(cfg: RLConfig) -> list[dict]:
    from kiln.rl.data import ArithmeticTask, load_jsonl_prompts

    if cfg.task == "arithmetic":
        # Enough distinct problems that a run rarely repeats one; the iterator reshuffles per epoch.
        return ArithmeticTask(cfg.seed, **cfg.task_options).sample(max(1024, cfg.num_steps * cfg.prompts_per_step))
    if os.path.exists(cfg.task):
        return load_jsonl_prompts(cfg.task)
    raise ValueError(f"task must be 'arithmetic' or a JSONL file of prompts; {cfg.task!r} is neither.")


def _reward_fn(cfg: RLConfig) -> Callable[[str, str, dict], float]:
    from kiln.rl.rewards import load_reward_fn

    return load_reward_fn(cfg.reward)  # fn(prompt, completion, prompt_record) -> float


def _moe_model_dir(model_path: Optional[str]) -> bool:
    """Whether the model's config.json describes an MoE (decides return_routed_experts up front)."""
    from kiln.loader.source import resolve_model

    try:
        cfg = resolve_model(model_path).config
    except Exception:  # noqa: BLE001 - the engine will raise the real error
        return False
    text_cfg = cfg.get("text_config", cfg)
    return any(text_cfg.get(k) for k in ("num_experts", "n_routed_experts", "num_local_experts",
                                          "moe_num_experts"))


# ---- rollouts --------------------------------------------------------------------------------
def _prompt_ids(engine: Any, prompt: str, chat: bool) -> list[int]:
    if chat:
        return engine.apply_chat_template([{"role": "user", "content": prompt}])
    return engine.tokenizer.encode(prompt)


def _rollout_seed(cfg: RLConfig, step: int, j: int) -> int:
    # expand_request gives sample i the seed base + i: keep (seed, step, prompt) bases n apart.
    return ((cfg.seed * 1_000_003 + step) * cfg.prompts_per_step + j) * cfg.samples_per_prompt


def rollout(engine: Any, cfg: RLConfig, step: int, batch: list[dict], routed: bool,
            lora: Optional[str] = None) -> list[dict]:
    """Generate `samples_per_prompt` samples per prompt; one dict per sample, grouped by prompt.

    `engine` is a rollout backend (`kiln.rl.rollout.ColocatedRollout` / `RemoteRollout`)."""
    from kiln.engine.request import SamplingParams

    ids = [_prompt_ids(engine, b["prompt"], cfg.chat_template) for b in batch]
    params = [SamplingParams(n=cfg.samples_per_prompt, max_tokens=cfg.max_new_tokens,
                             temperature=cfg.temperature, top_p=cfg.top_p, logprobs=0,
                             seed=_rollout_seed(cfg, step, j)) for j in range(len(batch))]
    outs = engine.generate(ids, params, routed)
    samples = []
    for j, (b, group) in enumerate(zip(batch, outs)):
        for s in group:
            samples.append({"group": j, "record": b, "prompt": b["prompt"], **s})
    return samples


# ---- one step --------------------------------------------------------------------------------
def _pad(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


def _pad_grad(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    return torch.stack([torch.nn.functional.pad(r.float(), (0, width - r.numel())) for r in rows])


def grpo_step(cfg: RLConfig, step: int, engine: Any, trainer: Any, iterator: Any, reward_fn: Callable,
              loss_cfg: Any, routed: bool, lora: Optional[str]) -> dict:
    from kiln.rl.loss import dynamic_sampling_mask, group_advantages, mismatch_metrics, policy_loss

    m: dict = {"step": step}
    # 1. Rollouts.
    t0 = time.perf_counter()
    batch = iterator.next_batch()
    samples = rollout(engine, cfg, step, batch, routed, lora)
    t_rollout = time.perf_counter() - t0
    n_tokens = sum(len(s["output_ids"]) for s in samples)

    # 2. Rewards and advantages.
    rewards = torch.tensor([float(reward_fn(s["prompt"], s["text"], s["record"])) for s in samples])
    grouped = rewards.view(len(batch), cfg.samples_per_prompt)
    adv = group_advantages(grouped, **_adv_kwargs(loss_cfg)).reshape(-1)
    keep_groups = dynamic_sampling_mask(grouped) if cfg.dynamic_sampling else torch.ones(len(batch), dtype=torch.bool)
    keep = keep_groups.repeat_interleave(cfg.samples_per_prompt)
    m.update(reward_mean=rewards.mean().item(), reward_std=rewards.std(unbiased=False).item(),
             groups_kept=int(keep_groups.sum()), response_len_mean=n_tokens / len(samples),
             truncated_frac=sum(s["finish_reason"] == "length" for s in samples) / len(samples))

    # 3. Train: one recompute (with grad); old_logp is its detached copy.
    t1 = time.perf_counter()
    logps = trainer.sequence_logprobs(samples, cfg.temperature, replay=cfg.routing_replay and routed)
    width = max(1, max(len(s["output_ids"]) for s in samples))
    logp = _pad_grad(list(logps), width)
    rollout_logp = _pad([torch.tensor(s["rollout_logp"], dtype=torch.float32) for s in samples], width)
    mask = _pad([torch.ones(len(s["output_ids"])) for s in samples], width)
    old_logp = logp.detach()
    mm = mismatch_metrics(old_logp, rollout_logp, mask)
    m.update({k: _f(v) for k, v in mm.items()})
    # Entropy is not logged: the trainer returns only the sampled tokens' logprobs, and full-vocab
    # entropy would need the [tokens, vocab] logits kept alive (not cheap on a 49k vocab).
    train_mask = mask * keep[:, None].float()
    # No sample with a nonzero advantage (e.g. every group all-wrong): no gradient signal, so skip
    # the optimizer step and the sync (AdamW momentum alone would still move the weights).
    if train_mask.sum() > 0 and bool((adv[keep] != 0).any()):
        loss, lm = policy_loss(logp, old_logp, rollout_logp, adv, train_mask, loss_cfg)
        stats = trainer.step(loss)
        m["loss"] = _f(loss)
        m.update({k: _f(v) for k, v in lm.items() if k != "loss"})
        if isinstance(stats, dict):
            m.update({k: _f(v) for k, v in stats.items()})
        updated = True
    else:  # nothing to learn from: keep the weights
        m["loss"] = 0.0
        updated = False
    t_train = time.perf_counter() - t1

    # 4. Weight sync.
    t2 = time.perf_counter()
    if updated:
        m["sync_bytes"] = sync_weights(trainer, engine, lora)
    t_sync = time.perf_counter() - t2
    m.update(time_rollout_s=t_rollout, time_train_s=t_train, time_sync_s=t_sync,
             time_step_s=t_rollout + t_train + t_sync, rollout_tok_s=n_tokens / max(t_rollout, 1e-9),
             rollout_tokens=n_tokens)
    return m


def _adv_kwargs(loss_cfg: Any) -> dict:
    import inspect

    from kiln.rl.loss import group_advantages

    params = inspect.signature(group_advantages).parameters
    out = {}
    for name in params:
        if name != "rewards" and hasattr(loss_cfg, name):
            out[name] = getattr(loss_cfg, name)
    return out


def _f(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().float().item() if v.numel() == 1 else v.detach().float().mean().item()
    if isinstance(v, (int, float, bool)) or v is None:
        return v
    return float(v)


def sync_weights(trainer: Any, engine: Any, lora: Optional[str]) -> int:
    """Push the trainer's weights (or only its adapter) into the rollout backend; returns bytes sent.
    The backend flushes its prefix cache (cached prompt KV came from the old weights)."""
    return int(engine.sync_lora(trainer, lora) if lora is not None else engine.sync_full(trainer))


# ---- checkpoints -----------------------------------------------------------------------------
def _ckpt_dirs(out_dir: str) -> list[tuple[int, str]]:
    found = []
    if os.path.isdir(out_dir):
        for name in os.listdir(out_dir):
            mt = re.fullmatch(r"ckpt-(\d+)", name)
            if mt and os.path.exists(os.path.join(out_dir, name, "state.json")):
                found.append((int(mt.group(1)), os.path.join(out_dir, name)))
    return sorted(found)


def save_checkpoint(path: str, step: int, trainer: Any, iterator: Any, cfg: RLConfig) -> None:
    """Write ckpt-N/ atomically (a temp dir renamed into place)."""
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    if cfg.lora_rank > 0:
        from kiln.rl.lora import save_adapter

        save_adapter(trainer.model, os.path.join(tmp, "adapter"))
    else:
        from safetensors.torch import save_file

        state = {name: t.detach().to("cpu").contiguous() for name, t in trainer.named_weights_for_sync()}
        save_file(state, os.path.join(tmp, "model.safetensors"))
    torch.save(trainer.optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
    torch.save({"python": random.getstate(), "torch": torch.get_rng_state()}, os.path.join(tmp, "rng.pt"))
    with open(os.path.join(tmp, "state.json"), "w") as fh:
        json.dump({"step": step, "iterator": iterator.state_dict(), "config": cfg.to_dict()}, fh, indent=1)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def load_checkpoint(path: str, trainer: Any, iterator: Any, cfg: RLConfig) -> int:
    """Restore a ckpt-N/ into the trainer and iterator; returns the number of steps already done."""
    if cfg.lora_rank > 0:
        from kiln.rl.lora import load_adapter

        load_adapter(trainer.model, os.path.join(path, "adapter"))
    else:
        from safetensors.torch import load_file

        _load_full_weights(trainer, load_file(os.path.join(path, "model.safetensors")))
    trainer.optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), weights_only=False))
    rng = torch.load(os.path.join(path, "rng.pt"), weights_only=False)
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    with open(os.path.join(path, "state.json")) as fh:
        state = json.load(fh)
    iterator.load_state_dict(state["iterator"])
    return int(state["step"])


def _load_full_weights(trainer: Any, state: dict) -> None:
    """Copy engine-named (checkpoint-named) tensors back into the trainer's parameters."""
    with torch.no_grad():
        trainer.model.load_weights(iter(state.items()))


def export_hf(trainer: Any, out_dir: str, model_path: Optional[str] = None) -> str:
    """Write a servable HF directory: config.json, model.safetensors, tokenizer files.

    LoRA adapters are merged first when the trainer's `named_weights_for_sync` yields merged
    weights (it does for the engine's full sync). `kiln serve --model-path out_dir` serves it.
    """
    from safetensors.torch import save_file

    from kiln.loader.source import TOKENIZER_FILES, resolve_model

    src = resolve_model(model_path) if model_path is not None else trainer.source
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):
        if name.endswith(".safetensors") or name == "model.safetensors.index.json":
            os.remove(os.path.join(out_dir, name))
    shutil.copy(os.path.join(src.model_dir, "config.json"), os.path.join(out_dir, "config.json"))
    for name in TOKENIZER_FILES + ("generation_config.json",):
        p = os.path.join(src.model_dir, name)
        if os.path.exists(p):
            shutil.copy(p, os.path.join(out_dir, name))
    state = {name: t.detach().to("cpu").float().clone() for name, t in trainer.named_weights_for_sync()}
    if getattr(trainer, "uses_lora", False):  # merge the adapter: scale * B @ A onto the base
        from kiln.rl.lora import adapter_config, lora_state_dict, merged_delta, scaling_of

        delta = merged_delta(lora_state_dict(trainer.model), scaling_of(adapter_config(trainer.model)))
        for name, d in delta.items():
            state[name] = state[name] + d.to(state[name].dtype)
    dtype = next(iter(trainer.model.parameters())).dtype
    state = {k: v.to(dtype).contiguous() for k, v in state.items()}
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


# ---- metrics output --------------------------------------------------------------------------
def plot_curves(history: list[dict], path: str) -> None:
    """reward, train-rollout KL, response length and the step time split, one panel each."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'kiln[bench]'); skipping %s", path)
        return
    if not history:
        return
    steps = [h["step"] for h in history]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    ax = axes[0, 0]
    ax.plot(steps, [h.get("reward_mean", math.nan) for h in history], marker=".", label="reward mean")
    if len(history) >= 5:
        r = [h.get("reward_mean", math.nan) for h in history]
        ax.plot(steps[4:], [sum(r[i - 4:i + 1]) / 5 for i in range(4, len(r))], label="5-step avg")
    ax.set_title("reward")
    ax.legend()
    ax = axes[0, 1]
    kl = [max(h.get("train_rollout_kl", math.nan), 1e-12) for h in history]
    ax.plot(steps, kl, marker=".", label="train_rollout_kl")
    ax.plot(steps, [max(h.get("train_rollout_logprob_abs_diff", h.get("logprob_abs_diff", math.nan)), 1e-12)
                    for h in history], marker=".", label="|logprob diff|")
    ax.set_yscale("log")
    ax.set_title("train vs rollout mismatch")
    ax.legend()
    ax = axes[1, 0]
    ax.plot(steps, [h.get("response_len_mean", math.nan) for h in history], marker=".")
    ax.set_title("response length (tokens)")
    ax = axes[1, 1]
    bottom = [0.0] * len(steps)
    for key, label in (("time_rollout_s", "rollout"), ("time_train_s", "train"), ("time_sync_s", "sync")):
        vals = [h.get(key, 0.0) for h in history]
        ax.bar(steps, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_title("step time (s)")
    ax.legend()
    for a in axes.flat:
        a.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- the loop --------------------------------------------------------------------------------
def build(cfg: RLConfig) -> tuple[Any, Any, Optional[str], bool]:
    """The trainer (LoRA applied when asked) and the rollout backend: a colocated engine, or the
    `kiln serve` instances of `cfg.rollout_urls` (kiln.rl.rollout)."""
    from kiln.rl.rollout import ColocatedRollout, RemoteRollout
    from kiln.rl.trainer import PolicyTrainer

    trainer = _make_trainer(PolicyTrainer, cfg)
    moe = _moe_model_dir(cfg.model_path)
    if cfg.rollout_urls:
        engine: Any = RemoteRollout(cfg.rollout_urls, cfg.model_path)
    else:
        from kiln.offline import Engine

        engine_opts = dict(cfg.engine)
        engine_opts.setdefault("seed", cfg.seed)
        engine_opts.setdefault("log_level", "warning")
        if moe and cfg.routing_replay:
            engine_opts["enable_return_routed_experts"] = True
        engine = ColocatedRollout(Engine(cfg.model_path, **engine_opts))
    lora = None
    if cfg.lora_rank > 0:
        lora = LORA_NAME
    return trainer, engine, lora, moe and cfg.routing_replay


def _make_trainer(cls: Any, cfg: RLConfig) -> Any:
    trainer = cls(cfg.model_path, lr=cfg.lr, weight_decay=cfg.weight_decay, max_grad_norm=cfg.grad_clip)
    if cfg.lora_rank > 0:
        trainer.enable_lora(cfg.lora_rank, cfg.lora_alpha, seed=cfg.seed)
    return trainer


def run_grpo(cfg: RLConfig) -> list[dict]:
    """Run GRPO for `cfg.num_steps` steps; returns the metrics of the steps run in this call."""
    from kiln.rl.data import PromptIterator
    from kiln.rl.loss import LossConfig

    os.makedirs(cfg.out_dir, exist_ok=True)
    _seed_all(cfg.seed)
    loss_cfg = LossConfig(**cfg.loss)
    reward_fn = _reward_fn(cfg)
    iterator = PromptIterator(_load_prompts(cfg), cfg.prompts_per_step, seed=cfg.seed)
    trainer, engine, lora, routed = build(cfg)
    metrics_path = os.path.join(cfg.out_dir, METRICS_FILE)
    start = 0
    history: list[dict] = []
    try:
        resume = cfg.resume
        if resume == "auto":
            found = _ckpt_dirs(cfg.out_dir)
            resume = found[-1][1] if found else None
        if resume:
            start = load_checkpoint(resume, trainer, iterator, cfg)
            logger.info("Resumed from %s at step %d", resume, start)
            if os.path.exists(metrics_path):  # keep the lines of the steps before the checkpoint
                with open(metrics_path) as fh:
                    history = [h for h in (json.loads(line) for line in fh if line.strip()) if h["step"] < start]
        with open(metrics_path, "w") as fh:
            for h in history:
                fh.write(json.dumps(h) + "\n")
        # The engine must start from the trainer's weights (remote servers may hold anything).
        if resume or lora is not None or cfg.rollout_urls:
            sync_weights(trainer, engine, lora)
        bar = None
        if cfg.progress:
            from tqdm import tqdm

            bar = tqdm(total=cfg.num_steps, initial=start, desc="GRPO", unit="step")
        ran: list[dict] = []
        for step in range(start, cfg.num_steps):
            m = grpo_step(cfg, step, engine, trainer, iterator, reward_fn, loss_cfg, routed, lora)
            history.append(m)
            ran.append(m)
            with open(metrics_path, "a") as fh:
                fh.write(json.dumps(m) + "\n")
            done = step + 1
            if (cfg.save_every and done % cfg.save_every == 0) or (cfg.save_final and done == cfg.num_steps):
                save_checkpoint(os.path.join(cfg.out_dir, f"ckpt-{done}"), done, trainer, iterator, cfg)
            if cfg.plot_every and done % cfg.plot_every == 0:
                plot_curves(history, os.path.join(cfg.out_dir, CURVES_FILE))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{m['reward_mean']:.3f}", kl=f"{m.get('train_rollout_kl', 0):.1e}",
                                len=f"{m['response_len_mean']:.1f}")
        if bar is not None:
            bar.close()
        plot_curves(history, os.path.join(cfg.out_dir, CURVES_FILE))
        run_grpo.last = (trainer, getattr(engine, "engine", engine))  # type: ignore[attr-defined]  # for export_hf after a run
        return ran
    finally:
        engine.shutdown()
