"""The RL trainer's recompute and backward on one micro-batch, timed and (with `--profile`) broken
down by op: where a colocated GRPO step's training time goes (docs/rl.md).

    python benchmarks/trainer_profile.py --dtype bfloat16 --device cuda [--model-path preset:inkling/bench]
        [--samples 8] [--prompt-len 256] [--new-tokens 128] [--repeats 3] [--profile] [--rows 25]
    python benchmarks/trainer_profile.py --quick      # CPU smoke: preset:inkling/tiny

Random prompt and output ids, and on MoE models random routed experts to replay (the trainer's
routing replay, as the loop runs it). Each repeat: `PolicyTrainer.sequence_logprobs` under grad
("recompute"), then the backward of the summed log-probabilities ("backward"; no optimizer step).
Prints the medians after one warm-up repeat, and with `--profile` the top ops of one more repeat by
device time (CPU time off CUDA).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Optional

import torch

import common  # noqa: F401  (puts the repository root on sys.path)
from common import (add_bench_args, add_engine_args, log, median, resolve_dummy_init, save_json, setup,
                    synchronize)
from rl_step import dummy_init, is_moe


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    add_bench_args(p)
    p.set_defaults(model_path="preset:inkling/bench")
    p.add_argument("--samples", type=int, default=8, help="Samples in the micro-batch.")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--rows", type=int, default=25, help="Profile rows.")
    args = p.parse_args(argv)
    if args.quick:
        args.model_path = "preset:inkling/tiny" if args.model_path == "preset:inkling/bench" else args.model_path
        args.device = "cpu" if args.device == "auto" else args.device
        args.samples, args.prompt_len, args.new_tokens, args.repeats = 2, 16, 8, 1

    from kiln.engine.routing import moe_shape
    from kiln.layers.moe import Experts
    from kiln.rl.trainer import PolicyTrainer

    config, device, dtype, mc = setup(args)
    with dummy_init(resolve_dummy_init(args.dummy_init, device)):
        trainer = PolicyTrainer(config.model_path, device=device, dtype=dtype, load_format="dummy", seed=0)
    routed = is_moe(config.model_path)
    layers, k = moe_shape(trainer.model)
    experts = next((m.num_experts for m in trainer.model.modules() if isinstance(m, Experts)), 0)
    rng = random.Random(0)
    n = args.prompt_len + args.new_tokens - 1
    samples = []
    for _ in range(args.samples):
        s = {"prompt_ids": [rng.randrange(mc.vocab_size) for _ in range(args.prompt_len)],
             "output_ids": [rng.randrange(mc.vocab_size) for _ in range(args.new_tokens)]}
        if routed:  # k distinct experts per token and layer
            s["routed_experts"] = torch.stack([torch.randperm(experts)[:k] for _ in range(n * layers)]).view(
                n, layers, k).int().numpy()
        samples.append(s)

    def once() -> tuple[float, float]:
        synchronize(device)
        t0 = time.perf_counter()
        logps = trainer.sequence_logprobs(samples, 1.0, replay=routed)
        synchronize(device)
        t1 = time.perf_counter()
        torch.stack([lp.sum() for lp in logps]).sum().backward()
        synchronize(device)
        t2 = time.perf_counter()
        for q in trainer.model.parameters():
            q.grad = None
        return t1 - t0, t2 - t1

    once()  # warm-up: compiles, allocator
    times = [once() for _ in range(args.repeats)]
    rec, bwd = median(t[0] for t in times), median(t[1] for t in times)
    tokens = args.samples * (args.prompt_len + args.new_tokens)
    log(f"{config.model_path}: {args.samples} samples x {args.prompt_len}+{args.new_tokens} tokens, routing replay "
        f"{routed}: recompute {rec:.3f} s, backward {bwd:.3f} s ({tokens / (rec + bwd):.0f} tokens/s), median of "
        f"{args.repeats}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if str(device).startswith("cuda") else [])
        with profile(activities=acts) as prof:
            once()
        key = "self_cuda_time_total" if str(device).startswith("cuda") else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=args.rows, max_name_column_width=60))
    result = {"recompute_s": rec, "backward_s": bwd, "tokens": tokens, "samples": args.samples,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats}
    save_json(args.out, [result], {"benchmark": "trainer_profile", "model_path": config.model_path,
                                   "device": str(device), "dtype": str(dtype), "routing_replay": routed})
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
