"""Time the parts of one GRPO step (DESIGN.md section 7) with dummy weights and no tokenizer.

One process, colocated (as `kiln.rl.loop`): a `kiln.Engine` (token ids only, routed experts
recorded on MoE models) and a `PolicyTrainer`, both built from a config-only model directory
with dummy weights drawn from the same seed, so they start from identical tensors (checked; if
they ever differ the trainer's weights are synced into the engine once, untimed).

Each step of a phase:

    rollout   engine.generate: --prompts random-token prompts x --samples samples each,
              temperature 1, seeded, logprobs, --max-new-tokens (ignore_eos: fixed lengths)
    train     trainer.sequence_logprobs (routing replay on MoE) = "recompute", then the GRPO
              policy loss on random rewards (fixed seed) -> backward, clip, AdamW = "backward+step"
    sync      full phase: sync_full (every weight, bucketed, in place in the engine)
              LoRA phase: sync_lora (the adapter only; the engine merges it)

`--release-memory` adds the colocated loop's release of the engine's state pools and weights after
the rollout and their resume before the sync (`release_s`, `resume_s` = `resume_weights_s`, the
weights' copy back, + `resume_pools_s`, the pools and the CUDA graphs' capture; `freed_GB` from the
device's allocated bytes, `pools_GB` the state pools' share as the engine reports it).

Phase "full" trains every parameter; phase "lora" then calls `trainer.enable_lora(--lora-rank)`
and repeats. Each phase runs --steps steps; the first is warm-up and the table reports the median
of steps 2..N (one step: that step). `kl_first` is the train-rollout KL (k3, Miles' definition)
of the phase's first recompute: with identical weights it measures the engine-vs-trainer
numerics alone. Peak memory is the device's max allocated bytes during the phase.

Trainer precision: `--trainer-dtype auto` = the engine's dtype (bf16 on CUDA), as `kiln rl` runs
it: bf16 weights and gradients, AdamW over fp32 master copies (kiln.rl.optimizer).
`--no-master-weights` steps the bf16 weights directly with bf16 moments (the twenty-ninth pass and
before: half the optimizer memory, but a 1e-6 step mostly rounds away, so the later steps' KL is
no training signal); `--trainer-dtype float32` for fp32 weights.

    python benchmarks/rl_step.py --device cuda                     # preset:inkling/bench, bf16
    python benchmarks/rl_step.py --model-path preset:inkling/small --device cuda
    python benchmarks/rl_step.py --quick                           # CPU smoke: preset:inkling/tiny

Memory (Inkling bench, 5.76 B parameters, bf16): engine 11.5 GB (released to host memory during
training with --release-memory) + trainer 11.5 + grads 11.5 + fp32 masters 23 + AdamW moments 46
~ 92 GB plus activations and the KV pool (sized to the rollout by default, --max-total-tokens
overrides); without master weights 11.5 + 11.5 + 23; `--model-path preset:inkling/small` if that
does not fit.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time
from typing import Any, Optional

import torch

import common  # noqa: F401  (puts the repository root on sys.path)
from common import (add_bench_args, add_engine_args, fmt_bytes, hardware_description, log, median,
                    release_memory, report, resolve_dummy_init, run_meta, setup, synchronize)

DEFAULT_MODEL = "preset:inkling/bench"
COLUMNS = ["phase", "steps", "rollout_s", "rollout_tok_s", "recompute_s", "backward_step_s", "train_s",
           "sync_s", "sync_size", "release_s", "resume_s", "resume_weights_s", "resume_pools_s", "freed_GB",
           "pools_GB", "kl_first", "grad_norm", "peak_mem_GB"]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    add_bench_args(p)
    p.set_defaults(model_path=DEFAULT_MODEL, max_running_requests=None)
    p.add_argument("--trainer-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="PolicyTrainer parameter dtype (auto: the engine's; AdamW states follow it).")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4, help="Samples per prompt (the GRPO group).")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="Steps per phase; the first is warm-up.")
    p.add_argument("--lora-rank", type=int, default=16, help="0 skips the LoRA phase.")
    p.add_argument("--master-weights", action=argparse.BooleanOptionalAction, default=True,
                   help="A bf16 trainer's AdamW steps fp32 master copies (as kiln rl does).")
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--micro-batch", type=int, default=0,
                   help="Samples per recompute + backward (gradient accumulation, one optimizer step); "
                        "0 = the whole batch at once. Inkling bench on an H200: 16 (of 32) fits, 109 GB at "
                        "the peak; 32 does not.")
    p.add_argument("--no-full", action="store_true", help="Skip the full-weights phase.")
    p.add_argument("--release-memory", action="store_true",
                   help="As the colocated loop on CUDA: release the engine's KV pools and weights after the "
                        "rollout and resume them before the sync (timed as release_s / resume_s).")
    args = p.parse_args(argv)
    if args.quick:  # CPU smoke run
        args.model_path = "preset:inkling/tiny" if args.model_path == DEFAULT_MODEL else args.model_path
        args.device = "cpu" if args.device == "auto" else args.device
        args.prompts, args.samples, args.prompt_len, args.max_new_tokens = 2, 2, 16, 8
        args.steps = min(args.steps, 2)
    if args.max_running_requests is None:  # as the RL loop's colocated engine (colocated_engine_options)
        args.max_running_requests = args.prompts * args.samples
    if args.max_total_tokens is None:  # KV pool: the whole rollout twice over, not 85% of the GPU
        need = args.prompts * args.samples * (args.prompt_len + args.max_new_tokens)
        args.max_total_tokens = max(2 * need, 4096)
    return args


@contextlib.contextmanager
def dummy_init(kind: str):
    """`device`: engine and trainer both draw their dummy weights on the device
    (`common.device_dummy_weights`, seconds on a GPU) instead of Kiln's CPU-drawn init (minutes for
    billions of parameters). Either way both sides use the same function and seed."""
    if kind != "device":
        yield
        return
    import kiln.engine.runner as runner_mod
    import kiln.rl.trainer as trainer_mod

    saved = runner_mod.init_dummy_weights, trainer_mod.init_dummy_weights
    runner_mod.init_dummy_weights = trainer_mod.init_dummy_weights = common.device_dummy_weights
    try:
        yield
    finally:
        runner_mod.init_dummy_weights, trainer_mod.init_dummy_weights = saved


def is_moe(model_path: str) -> bool:
    """Whether config.json describes an MoE model (the keys `kiln.rl.loop` checks)."""
    import json
    import os

    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    return any(cfg.get(k) for k in ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"))


def same_weights(trainer: Any, engine: Any) -> bool:
    """Whether every checkpoint tensor of the trainer equals the engine's (names as on disk)."""
    from kiln.rl.sync import checkpoint_views

    theirs = dict(checkpoint_views(engine.core.runner.model))
    for name, t in trainer.named_weights_for_sync():
        e = theirs.get(name)
        if e is None or e.shape != t.shape or not torch.equal(e, t.to(e.dtype)):
            return False
    return True


def peak_reset(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def peak_gb(device: str) -> Optional[float]:
    if str(device).startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 1e9
    return None


def rollout(engine: Any, prompts: list[list[int]], args: argparse.Namespace, step: int, routed: bool) -> list[dict]:
    from kiln.engine.request import SamplingParams

    params = [SamplingParams(n=args.samples, max_tokens=args.max_new_tokens, temperature=1.0, logprobs=0,
                             ignore_eos=True, seed=args.seed * 1_000_003 + step * 1009 + j)
              for j in range(len(prompts))]
    outs = engine.generate(prompts, params, return_routed_experts=routed, use_tqdm=False)
    samples = []
    for j, out in enumerate(outs):
        for o in out.outputs:
            samples.append({"group": j, "prompt_ids": list(out.prompt_token_ids), "output_ids": list(o.token_ids),
                            "rollout_logp": [lp[0] for lp in (o.logprobs or [])],
                            "routed_experts": o.routed_experts if routed else None})
    return samples


def train(trainer: Any, samples: list[dict], args: argparse.Namespace, step: int, routed: bool,
          device: str) -> dict:
    """Recompute (with grad, routing replay) -> GRPO loss on seeded random rewards -> step."""
    from kiln.rl.loop import _pad, _pad_grad
    from kiln.rl.loss import LossConfig, group_advantages, mismatch_metrics, policy_loss

    gen = torch.Generator().manual_seed(args.seed * 7919 + step)
    rewards = torch.rand(args.prompts, args.samples, generator=gen)
    adv = group_advantages(rewards).reshape(-1)
    # Micro-batches of --micro-batch samples: recompute -> backward each (gradient accumulation),
    # the optimizer step after the last. The token-mean loss splits exactly: each micro-batch's
    # token mean weighted by its share of the batch's tokens.
    mb = args.micro_batch if args.micro_batch > 0 else len(samples)
    width = max(len(s["output_ids"]) for s in samples)
    n_total = sum(len(s["output_ids"]) for s in samples)
    t_rec, t_bwd, kl_num, diff_num, loss_sum = 0.0, 0.0, 0.0, 0.0, 0.0
    starts = list(range(0, len(samples), mb))
    stats: dict = {}
    for i in starts:
        chunk = samples[i:i + mb]
        t0 = time.perf_counter()
        logps = trainer.sequence_logprobs(chunk, 1.0, replay=routed)
        synchronize(device)
        t1 = time.perf_counter()
        logp = _pad_grad([lp.cpu() for lp in logps], width)
        rollout_logp = _pad([torch.tensor(s["rollout_logp"], dtype=torch.float32) for s in chunk], width)
        mask = _pad([torch.ones(len(s["output_ids"])) for s in chunk], width)
        old_logp = logp.detach()
        n_chunk = float(mask.sum())
        mm = mismatch_metrics(old_logp, rollout_logp, mask)
        kl_num += float(mm["train_rollout_kl"]) * n_chunk
        diff_num += float(mm["train_rollout_logprob_abs_diff"]) * n_chunk
        loss, _ = policy_loss(logp, old_logp, rollout_logp, adv[i:i + mb], mask, LossConfig())
        loss = loss * (n_chunk / n_total)
        loss_sum += float(loss.detach())
        if i == starts[-1]:
            stats = trainer.step(loss)  # backward, clip, AdamW, zero
        else:
            loss.backward()
        synchronize(device)
        t_rec += t1 - t0
        t_bwd += time.perf_counter() - t1
    return {"recompute_s": t_rec, "backward_step_s": t_bwd, "train_s": t_rec + t_bwd,
            "kl": kl_num / n_total, "logprob_abs_diff": diff_num / n_total, "micro_batches": len(starts),
            "loss": loss_sum, "grad_norm": float(stats["grad_norm"])}


def release(engine: Any, device: str) -> dict:
    """Release the engine's memory as the colocated loop does; time it and count what left the GPU."""
    synchronize(device)
    cuda = str(device).startswith("cuda")
    before = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
    info = engine.release_memory_occupation()  # every tag: the pools and the weights
    synchronize(device)
    out = {"release_s": time.perf_counter() - t0, "pools_GB": info.get("kv_cache_bytes", 0) / 1e9}
    if cuda:
        out["freed_GB"] = (before - torch.cuda.memory_allocated()) / 1e9
    return out


def run_phase(phase: str, engine: Any, trainer: Any, prompts: list[list[int]], args: argparse.Namespace,
              routed: bool, device: str, step0: int) -> tuple[dict, list[dict]]:
    from kiln.rl.sync import sync_full, sync_lora

    peak_reset(device)
    steps = []
    for i in range(args.steps):
        step = step0 + i
        synchronize(device)
        t0 = time.perf_counter()
        samples = rollout(engine, prompts, args, step, routed)
        synchronize(device)
        t_roll = time.perf_counter() - t0
        n_tok = sum(len(s["output_ids"]) for s in samples)
        m = {"phase": phase, "step": i + 1, "rollout_s": t_roll, "rollout_tokens": n_tok,
             "rollout_tok_s": n_tok / max(t_roll, 1e-9)}
        if args.release_memory:
            m.update(release(engine, device))
        m.update(train(trainer, samples, args, step, routed, device))
        if args.release_memory:
            # In two calls, as one would run them: the weights' copy back, then the pools (zeroed)
            # and the CUDA graphs' capture, which waits for both.
            t0 = time.perf_counter()
            engine.resume_memory_occupation(["weights"])
            synchronize(device)
            t1 = time.perf_counter()
            engine.resume_memory_occupation(["kv_cache"])
            synchronize(device)
            m.update(resume_s=time.perf_counter() - t0, resume_weights_s=t1 - t0,
                     resume_pools_s=time.perf_counter() - t1)
        t0 = time.perf_counter()
        info = sync_lora(trainer, engine, "policy") if phase == "lora" else sync_full(trainer, engine)
        engine.flush_cache()
        synchronize(device)
        m.update(sync_s=time.perf_counter() - t0, sync_bytes=int(info["bytes"]), sync_tensors=int(info["tensors"]))
        steps.append(m)
        log(f"{phase} step {i + 1}/{args.steps}: rollout {t_roll:.2f}s ({m['rollout_tok_s']:.0f} tok/s), "
            f"train {m['train_s']:.2f}s (recompute {m['recompute_s']:.2f}s), sync {m['sync_s']:.2f}s "
            f"({fmt_bytes(m['sync_bytes'])}), kl {m['kl']:.3g}")
    timed = steps[1:] or steps
    row = {"phase": phase, "steps": len(timed)}
    for k in ("rollout_s", "rollout_tok_s", "recompute_s", "backward_step_s", "train_s", "sync_s", "grad_norm",
              "release_s", "resume_s", "resume_weights_s", "resume_pools_s", "freed_GB", "pools_GB"):
        if k in timed[0]:
            row[k] = median(s[k] for s in timed)
    row["sync_bytes"] = timed[-1]["sync_bytes"]
    row["sync_size"] = fmt_bytes(row["sync_bytes"])
    row["kl_first"] = steps[0]["kl"]
    row["logprob_abs_diff_first"] = steps[0]["logprob_abs_diff"]
    row["peak_mem_GB"] = peak_gb(device)
    return row, steps


def _optimizer_note(masters: bool, trainer_dtype: torch.dtype) -> str:
    if masters:
        return " over fp32 masters"
    return "" if trainer_dtype == torch.float32 else ", no fp32 master"


def main(argv: Optional[list[str]] = None) -> dict:
    from kiln.offline import Engine
    from kiln.rl.sync import sync_full
    from kiln.rl.trainer import PolicyTrainer

    args = parse_args(argv)
    config, device, dtype, mc = setup(args)  # preset:ARCH/PRESET -> config dir, load_format dummy
    trainer_dtype = dtype if args.trainer_dtype == "auto" else getattr(torch, args.trainer_dtype)
    routed = is_moe(config.model_path)
    config.skip_tokenizer_init = True
    config.enable_return_routed_experts = routed
    init_kind = resolve_dummy_init(args.dummy_init, device)
    hardware = hardware_description(device)
    log(f"{config.model_path}: device {device}, engine {dtype}, trainer {trainer_dtype}, dummy init {init_kind}, "
        f"MoE routing replay {routed}, KV pool {config.max_total_tokens} tokens")

    t0 = time.perf_counter()
    with dummy_init(init_kind):
        opts = {k: getattr(config, k) for k in config.__dataclass_fields__ if k != "model_path"}
        engine = Engine(config.model_path, **opts)
        t_engine = time.perf_counter() - t0
        log(f"engine ready in {t_engine:.1f}s")
        t1 = time.perf_counter()
        trainer = PolicyTrainer(config.model_path, device=device, dtype=trainer_dtype, lr=args.lr,
                                load_format="dummy", seed=config.seed, master_weights=args.master_weights)
        t_trainer = time.perf_counter() - t1
    log(f"trainer ready in {t_trainer:.1f}s")
    meta_extra: dict = {"engine_build_s": t_engine, "trainer_build_s": t_trainer, "trainer_dtype": str(trainer_dtype),
                        "master_weights": bool(trainer.optimizer.masters),
                        "dummy_init": init_kind, "routing_replay": routed, "prompts": args.prompts,
                        "samples": args.samples, "prompt_len": args.prompt_len,
                        "max_new_tokens": args.max_new_tokens, "steps": args.steps, "lora_rank": args.lora_rank,
                        "lr": args.lr, "max_total_tokens": config.max_total_tokens, "seed": config.seed,
                        "num_params": sum(p.numel() for p in trainer.model.parameters())}
    try:
        identical = same_weights(trainer, engine)
        meta_extra["weights_identical_at_start"] = identical
        if not identical:
            log("engine and trainer dummy weights differ: syncing the trainer's into the engine (untimed)")
            sync_full(trainer, engine)
            engine.flush_cache()
        rng = random.Random(config.seed)
        prompts = [[rng.randrange(mc.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        rows, steps = [], []
        if not args.no_full:
            row, st = run_phase("full", engine, trainer, prompts, args, routed, device, 0)
            rows.append(row)
            steps += st
        if args.lora_rank > 0:
            names = trainer.enable_lora(args.lora_rank, args.lora_alpha, seed=config.seed)
            release_memory()  # the full-weights AdamW states are gone with the old optimizer
            meta_extra["lora_modules"] = len(names)
            meta_extra["lora_params"] = sum(p.numel() for p in trainer.trainable_parameters())
            row, st = run_phase("lora", engine, trainer, prompts, args, routed, device, 1000)
            rows.append(row)
            steps += st
    finally:
        engine.shutdown()
    meta = run_meta("rl_step", argv, hardware, config, dtype, device, per_step=steps, **meta_extra)
    header = [f"# {config.model_path.rstrip('/').rsplit('/', 1)[-1]}: {meta_extra['num_params'] / 1e9:.3f} B params, "
              f"engine {dtype}, trainer {trainer_dtype} "
              f"(AdamW{_optimizer_note(meta_extra['master_weights'], trainer_dtype)}), "
              f"{args.prompts} prompts x {args.samples} samples, prompt {args.prompt_len}, "
              f"new {args.max_new_tokens}; median of steps 2..{args.steps}",
              f"# build: engine {t_engine:.1f}s, trainer {t_trainer:.1f}s; weights identical at start: "
              f"{meta_extra['weights_identical_at_start']}"]
    return report(rows, COLUMNS, "GRPO step parts", hardware, meta, args.out, header)


if __name__ == "__main__":
    main()
    sys.exit(0)
