"""The GRPO loop: rollouts in a colocated `kiln.Engine` (or remote `kiln serve`s, `rollout_urls`),
training in `PolicyTrainer` (one process, or FSDP2 ranks under torchrun: kiln.rl.fsdp).

One step (DESIGN.md section 7):

    prompts (PromptIterator) -> engine.generate(n samples each, logprobs=0, routed experts on MoE)
      -> rewards -> group advantages (+ dynamic sampling drops all-equal groups)   [rank 0]
      -> (FSDP: broadcast the batch to every rank)
      -> (colocated on CUDA: the engine releases its KV cache and weights)
      -> trainer: recompute logprobs and entropy (routing replay); old_logp = that pass, detached
      -> policy loss with TIS against the rollout logprobs -> optimizer step
      -> (the engine resumes its memory)
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
import os
import random
import sys
import time
from typing import Any, Callable, Optional

import torch

from kiln.rl.checkpoint import _ckpt_dirs, load_checkpoint_state, load_checkpoint_weights, save_checkpoint
from kiln.rl.config import RLConfig
from kiln.rl.plots import plot_curves

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


def rollout_and_score(cfg: RLConfig, step: int, engine: Any, iterator: Any, reward_fn: Callable,
                      loss_cfg: Any, routed: bool, lora: Optional[str]
                      ) -> tuple[list[dict], torch.Tensor, torch.Tensor, dict]:
    """The rollout side of a step (rank 0 only under FSDP): sample the next prompts' groups,
    score them, GRPO advantages and the dynamic-sampling keep mask.

    Returns (samples, advantages [n], keep bool [n], metrics)."""
    from kiln.rl.loss import dynamic_sampling_mask, group_advantages

    batch = iterator.next_batch()
    samples = rollout(engine, cfg, step, batch, routed, lora)
    n_tokens = sum(len(s["output_ids"]) for s in samples)
    rewards = torch.tensor([float(reward_fn(s["prompt"], s["text"], s["record"])) for s in samples])
    grouped = rewards.view(len(batch), cfg.samples_per_prompt)
    adv = group_advantages(grouped, **_adv_kwargs(loss_cfg)).reshape(-1)
    keep_groups = dynamic_sampling_mask(grouped) if cfg.dynamic_sampling else torch.ones(len(batch), dtype=torch.bool)
    keep = keep_groups.repeat_interleave(cfg.samples_per_prompt)
    m = dict(reward_mean=rewards.mean().item(), reward_std=rewards.std(unbiased=False).item(),
             groups_kept=int(keep_groups.sum()), response_len_mean=n_tokens / len(samples),
             truncated_frac=sum(s["finish_reason"] == "length" for s in samples) / len(samples),
             rollout_tokens=n_tokens)
    return samples, adv, keep, m


def micro_batches(mine: range, size: int, n: int, world: int) -> list[slice]:
    """This rank's samples `mine` (of `n` over `world` ranks) in parts of at most `size` (0: one
    part). Every rank makes as many parts as the smallest share needs: FSDP reduces the gradients
    at each backward, a collective every rank must join, so with uneven shares a part of the
    larger ones holds one sample more than `size`. The parts are as even as can be."""
    if size <= 0 or not len(mine):
        return [slice(mine.start, mine.stop)]
    smallest = n // world  # kiln.rl.fsdp.shard_range: the shares differ by at most one
    count = max(1, -(-max(smallest, 1) // size))
    bounds = [mine.start + len(mine) * i // count for i in range(count + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def train_on_batch(trainer: Any, samples: list[dict], adv: torch.Tensor, keep: torch.Tensor, loss_cfg: Any,
                   temperature: float, replay: bool, dp: Any = None, micro_batch: int = 0) -> tuple[dict, bool]:
    """The trainer side of a step, on every rank: recompute the logprobs (and the entropy) of the
    samples, the policy loss with TIS against the rollout logprobs, one optimizer step.

    One process: all samples. Under FSDP (`dp`, kiln.rl.fsdp) each rank recomputes its contiguous
    share. `micro_batch` > 0 recomputes and back-propagates at most that many samples at a time
    (`micro_batches`) and steps once after the last (gradient accumulation: the activations of one
    micro-batch alive at a time).
    Each part's loss is scaled by its share of the whole batch's denominator (tokens for
    token-mean, rows for sequence-mean; times the ranks under FSDP, whose gradient average divides
    by them), so the summed gradient is the whole batch's. The detached logprobs are all-gathered
    so that every metric is over the whole batch, exactly as in one process. Returns (metrics,
    whether an optimizer step was taken)."""
    from kiln.rl.fsdp import loss_scale
    from kiln.rl.loss import masked_aggregate, mismatch_metrics, policy_loss

    n = len(samples)
    if dp is not None:
        from kiln.rl.fsdp import shard_range

        mine = shard_range(n, dp.rank, dp.world_size)
    else:
        mine = range(n)
    world = 1 if dp is None else dp.world_size
    want_entropy_grad = loss_cfg.entropy_coef != 0
    width = max(1, max(len(s["output_ids"]) for s in samples))
    rollout_all = _pad([torch.tensor(s["rollout_logp"], dtype=torch.float32) for s in samples], width)
    mask_all = _pad([torch.ones(len(s["output_ids"])) for s in samples], width)
    train_mask_all = mask_all * keep[:, None].float()
    # No sample with a nonzero advantage (e.g. every group all-wrong): no gradient signal, so skip
    # the optimizer step and the sync (AdamW momentum alone would still move the weights). Every
    # rank holds the whole batch, so every rank takes the same decision; the recompute then only
    # measures (no graph).
    signal = bool(train_mask_all.sum() > 0) and bool((adv[keep] != 0).any())
    global_den = train_mask_all.sum() if loss_cfg.loss_agg == "token" else n  # "sequence": rows
    lp_rows: list[torch.Tensor] = []
    ent_rows: list[torch.Tensor] = []
    for sl in micro_batches(mine, micro_batch, n, world):
        try:
            with torch.set_grad_enabled(signal):
                logps, ents = trainer.sequence_logprobs_and_entropy(samples[sl], temperature, replay,
                                                                    entropy_grad=want_entropy_grad and signal)
        except torch.OutOfMemoryError as e:
            raise torch.OutOfMemoryError(
                f"the trainer ran out of memory recomputing {sl.stop - sl.start} samples at once; train in "
                f"smaller parts with micro_batch_size (--micro-batch-size, now {micro_batch}): {e}") from e
        lp_rows += [t.detach().float().cpu() for t in logps]
        ent_rows += [t.detach().float().cpu() for t in ents]
        if signal:
            logp = _pad_grad(list(logps), width)
            dev = logp.device
            loss, _ = policy_loss(logp, logp.detach(), rollout_all[sl].to(dev), adv[sl].to(dev),
                                  train_mask_all[sl].to(dev), loss_cfg,
                                  entropy=_pad_grad(list(ents), width) if want_entropy_grad else None)
            local_den = train_mask_all[sl].sum() if loss_cfg.loss_agg == "token" else sl.stop - sl.start
            (loss * loss_scale(local_den, global_den, world)).backward()
    if dp is not None:  # every rank gets every sample's logprobs / entropies, in sample order
        import torch.distributed as dist

        parts: list = [None] * dp.world_size
        dist.all_gather_object(parts, (lp_rows, ent_rows))
        lp_rows = [r for p in parts for r in p[0]]
        ent_rows = [r for p in parts for r in p[1]]
    old_all, ent_all = _pad(lp_rows, width), _pad(ent_rows, width)
    m: dict = {k: _f(v) for k, v in mismatch_metrics(old_all, rollout_all, mask_all).items()}
    # Mean per-token entropy of softmax(logits / T) on every sampled token, before the update.
    m["entropy"] = _f(masked_aggregate(ent_all, mask_all, "token"))
    if not signal:
        m["loss"] = 0.0
        return m, False
    # The loss and its metrics over the whole batch (logp == old_logp before the step).
    full_loss, lm = policy_loss(old_all, old_all, rollout_all, adv, train_mask_all, loss_cfg,
                                entropy=ent_all if want_entropy_grad else None)
    m["loss"] = _f(full_loss)
    stats = trainer.step()  # the gradients are accumulated above
    m.update({k: _f(v) for k, v in lm.items() if k not in ("loss", "entropy")})
    if isinstance(stats, dict):
        m.update({k: _f(v) for k, v in stats.items()})
    return m, True


def grpo_step(cfg: RLConfig, step: int, engine: Any, trainer: Any, iterator: Any, reward_fn: Callable,
              loss_cfg: Any, routed: bool, lora: Optional[str], dp: Any = None,
              release: bool = False) -> dict:
    """One GRPO step. `engine` is the rollout backend (None on FSDP ranks other than 0); with
    `release` the colocated engine frees its KV cache and weights while the trainer runs."""
    main = dp is None or dp.is_main
    m: dict = {"step": step}
    # 1. Rollouts, rewards, advantages (rank 0), then every trainer rank gets the batch.
    t0 = time.perf_counter()
    payload = None
    if main:
        samples, adv, keep, rm = rollout_and_score(cfg, step, engine, iterator, reward_fn, loss_cfg, routed, lora)
        m.update(rm)
        payload = (samples, adv, keep)
    t_rollout = time.perf_counter() - t0
    if dp is not None:
        payload = dp.broadcast(payload)
    samples, adv, keep = payload

    # 2. Free the engine's memory for training (colocated on one GPU).
    t_release = t_resume = 0.0
    if release and main:
        t = time.perf_counter()
        freed = engine.release_memory()
        t_release = time.perf_counter() - t
        m["released_kv_bytes"] = int(freed.get("kv_cache_bytes", 0))

    # 3. Train: one recompute (with grad); old_logp is its detached copy.
    t1 = time.perf_counter()
    tm, updated = train_on_batch(trainer, samples, adv, keep, loss_cfg, cfg.temperature,
                                 cfg.routing_replay and routed, dp, cfg.micro_batch_size)
    m.update(tm)
    t_train = time.perf_counter() - t1

    if release and main:
        t = time.perf_counter()
        engine.resume_memory()
        t_resume = time.perf_counter() - t

    # 4. Weight sync (under FSDP every rank joins the gather; rank 0 pushes).
    t2 = time.perf_counter()
    if updated:
        with trainer.gathered():
            if main:
                m["sync_bytes"] = sync_weights(trainer, engine, lora)
    t_sync = time.perf_counter() - t2
    n_tokens = m.get("rollout_tokens", 0)
    m.update(time_rollout_s=t_rollout, time_train_s=t_train, time_sync_s=t_sync,
             time_step_s=t_rollout + t_release + t_train + t_resume + t_sync,
             rollout_tok_s=n_tokens / max(t_rollout, 1e-9))
    if release:
        m.update(time_release_s=t_release, time_resume_s=t_resume)
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


# ---- the loop --------------------------------------------------------------------------------
def build(cfg: RLConfig, dp: Any = None) -> tuple[Any, Any, Optional[str], bool]:
    """The trainer (LoRA applied when asked; not yet sharded) and the rollout backend: a colocated
    engine, or the `kiln serve` instances of `cfg.rollout_urls` (kiln.rl.rollout). Under FSDP only
    rank 0 has a rollout backend (None elsewhere)."""
    from kiln.rl.rollout import ColocatedRollout, RemoteRollout
    from kiln.rl.trainer import PolicyTrainer

    trainer = _make_trainer(PolicyTrainer, cfg, dp)
    moe = _moe_model_dir(cfg.model_path)
    engine: Any = None
    if dp is not None and not dp.is_main:
        pass
    elif cfg.rollout_urls:
        engine = RemoteRollout(cfg.rollout_urls, cfg.model_path, weight_sync=cfg.weight_sync,
                               weight_sync_master=cfg.weight_sync_master)
    else:
        from kiln.offline import Engine

        engine = ColocatedRollout(Engine(cfg.model_path, **colocated_engine_options(cfg, moe)))
    lora = None
    if cfg.lora_rank > 0:
        lora = LORA_NAME
    return trainer, engine, lora, moe and cfg.routing_replay


def colocated_engine_options(cfg: RLConfig, moe: bool) -> dict:
    """The colocated `Engine`'s options: `cfg.engine`, plus defaults for what the loop needs.

    `max_running_requests` defaults to one step's sequences (prompts x samples), the most the
    loop ever runs at once: the engine's per-request state (sliding-window and convolution spaces
    hold a full window for each of them) and its CUDA graphs (captured up to that batch, again
    after every memory release) are then sized for the rollout, not for the serving default of 256.
    """
    opts = dict(cfg.engine)
    opts.setdefault("seed", cfg.seed)
    opts.setdefault("log_level", "warning")
    opts.setdefault("max_running_requests", cfg.prompts_per_step * cfg.samples_per_prompt)
    if moe and cfg.routing_replay:
        opts["enable_return_routed_experts"] = True
    return opts


def trainer_device(cfg: RLConfig, dp: Any = None) -> str:
    """Where the trainer runs: the FSDP rank's device, else `cfg.trainer_device` ('auto': cuda
    when available, else cpu)."""
    if dp is not None:
        return str(dp.device)
    if cfg.trainer_device != "auto":
        return cfg.trainer_device
    return "cuda" if torch.cuda.is_available() else "cpu"


def trainer_dtype(cfg: RLConfig, device: str) -> torch.dtype:
    """The trainer's dtype: `cfg.trainer_dtype`, whose 'auto' follows the colocated engine's dtype
    (so that a weight sync copies bf16 into bf16 and the recompute sees the rollout's weights),
    and whose engine 'auto' is bf16 on CUDA, fp32 on CPU."""
    name = cfg.trainer_dtype
    if name == "auto" and not cfg.rollout_urls:
        name = cfg.engine.get("dtype", "auto")
    if name == "auto":
        name = "bfloat16" if torch.device(device).type == "cuda" else "float32"
    return getattr(torch, name)


def _make_trainer(cls: Any, cfg: RLConfig, dp: Any = None) -> Any:
    device = trainer_device(cfg, dp)
    trainer = cls(cfg.model_path, lr=cfg.lr, weight_decay=cfg.weight_decay, max_grad_norm=cfg.grad_clip,
                  device=device, dtype=trainer_dtype(cfg, device), master_weights=cfg.master_weights)
    if cfg.lora_rank > 0:
        trainer.enable_lora(cfg.lora_rank, cfg.lora_alpha, seed=cfg.seed)
    return trainer


def _release_engine_memory(cfg: RLConfig, engine: Any) -> bool:
    """Whether the loop frees the rollout engine's memory while the trainer runs: `cfg`'s choice,
    or by default only for a colocated engine on CUDA (on CPU there is no device memory to share)."""
    if engine is None:
        return False
    if cfg.release_engine_memory is not None:
        return bool(cfg.release_engine_memory)
    return not cfg.rollout_urls and getattr(engine, "device_type", "cpu") == "cuda"


def run_grpo(cfg: RLConfig) -> list[dict]:
    """Run GRPO for `cfg.num_steps` steps; returns the metrics of the steps run in this call.

    Under torchrun (WORLD_SIZE > 1) every process calls this: the trainer is FSDP2-sharded over
    the ranks and rank 0 owns the rollouts (kiln.rl.fsdp); every rank returns the same metrics."""
    from kiln.rl.data import PromptIterator
    from kiln.rl.fsdp import DataParallel
    from kiln.rl.loss import LossConfig

    dp = DataParallel.from_env(None if cfg.trainer_device == "auto" else cfg.trainer_device)
    main = dp is None or dp.is_main
    if main:
        os.makedirs(cfg.out_dir, exist_ok=True)
    _seed_all(cfg.seed)
    loss_cfg = LossConfig(**cfg.loss)
    reward_fn = _reward_fn(cfg)
    iterator = PromptIterator(_load_prompts(cfg), cfg.prompts_per_step, seed=cfg.seed)
    trainer = engine = None
    try:
        trainer, engine, lora, routed = build(cfg, dp)
        release = _release_engine_memory(cfg, engine)
        metrics_path = os.path.join(cfg.out_dir, METRICS_FILE)
        start = 0
        history: list[dict] = []
        resume = cfg.resume
        if resume == "auto":
            found = _ckpt_dirs(cfg.out_dir)
            resume = found[-1][1] if found else None
        if resume:  # weights before sharding, optimizer state after (it holds the shards)
            load_checkpoint_weights(resume, trainer, cfg)
        if dp is not None:
            trainer.shard()
        if resume:
            start = load_checkpoint_state(resume, trainer, iterator, dp)
            logger.info("Resumed from %s at step %d", resume, start)
            if os.path.exists(metrics_path):  # keep the lines of the steps before the checkpoint
                with open(metrics_path) as fh:
                    history = [h for h in (json.loads(line) for line in fh if line.strip()) if h["step"] < start]
        if main:
            with open(metrics_path, "w") as fh:
                for h in history:
                    fh.write(json.dumps(h) + "\n")
        # The engine must start from the trainer's weights (remote servers may hold anything).
        if resume or lora is not None or cfg.rollout_urls:
            with trainer.gathered():
                if main:
                    sync_weights(trainer, engine, lora)
        bar = None
        if cfg.progress and main:
            from tqdm import tqdm

            bar = tqdm(total=cfg.num_steps, initial=start, desc="GRPO", unit="step")
        ran: list[dict] = []
        for step in range(start, cfg.num_steps):
            m = grpo_step(cfg, step, engine, trainer, iterator, reward_fn, loss_cfg, routed, lora, dp, release)
            if dp is not None:  # rank 0 has the rollout-side metrics and timings
                m = dp.broadcast(m)
            history.append(m)
            ran.append(m)
            done = step + 1
            if main:
                with open(metrics_path, "a") as fh:
                    fh.write(json.dumps(m) + "\n")
            if (cfg.save_every and done % cfg.save_every == 0) or (cfg.save_final and done == cfg.num_steps):
                save_checkpoint(os.path.join(cfg.out_dir, f"ckpt-{done}"), done, trainer, iterator, cfg, dp)
            if main and cfg.plot_every and done % cfg.plot_every == 0:
                plot_curves(history, os.path.join(cfg.out_dir, CURVES_FILE))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{m['reward_mean']:.3f}", kl=f"{m.get('train_rollout_kl', 0):.1e}",
                                len=f"{m['response_len_mean']:.1f}")
        if bar is not None:
            bar.close()
        if main:
            plot_curves(history, os.path.join(cfg.out_dir, CURVES_FILE))
        if dp is None:  # for export_hf after a run (an FSDP trainer is freed with its process group)
            run_grpo.last = (trainer, getattr(engine, "engine", engine))  # type: ignore[attr-defined]
        return ran
    finally:
        if engine is not None:
            engine.shutdown()
        if dp is not None:
            trainer = engine = None  # DataParallel.close: free the sharded model before leaving
            dp.close(barrier=sys.exc_info()[0] is None)
