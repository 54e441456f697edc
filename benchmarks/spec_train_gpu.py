"""Drafter self-distillation at scale on one GPU, inside one bounded command.

    python benchmarks/spec_train_gpu.py run --target SmolLM2-135M-Instruct.Q4_1.gguf --work /tmp/w \
        --export $OUT --budget-s 555
    python benchmarks/spec_train_gpu.py assemble --export DIR --out runs/smollm2-mtp-gpu    # on the CPU

`run` is `kiln train-draft --method mtp` with its data step sized by time instead of by count:
1. the target writes up to `--synthetic-prompts` user turns itself (Magpie, `synthesize_prompts`),
   for at most `--synth-share` of the budget;
2. it continues the built-in training prompts and then those, greedily, in chunks, until
   `--gen-share` of the budget is spent (one engine for both);
3. MTP layers train on what was generated (`train_mtp`, on the GPU, bf16 autocast), stopped early
   if the budget runs short, keeping the drafter of the lowest validation loss (`--keep-best`);
4. the MTP tensors go to `--export` at once (fp32, in files of at most 15 MiB: the device tool
   copies back 8 files of 16 MiB), then acceptance is measured on the GPU with
   `spec_acceptance.py`: greedy at K = 1, 2, 3 at batch 1 over `--b1-prompts` held-out prompts
   (its wall times give the speedup), then over 64 of them at once.
Everything small (summary.json with each stage's time and size, metrics.jsonl, loss.png,
config.json, the acceptance JSON, the synthetic prompts) is packed into `results.tar.gz`.

`assemble` rebuilds a servable checkpoint from the target (default: the embedded SmolLM2) and an
exported directory, so acceptance can be measured again on the CPU in fp32.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import logging
import os
import subprocess
import sys
import tarfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHUNK_BYTES = 15 * 2**20
HERE = os.path.dirname(os.path.abspath(__file__))


def _log(msg: str) -> None:
    print(f"[spec_train_gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def generate_data(cfg, n_synth: int, synth_seconds: float, gen_seconds: float, chunk: int, summary: dict):
    """(prompts used, synthetic prompts, samples): the target writes up to `n_synth` prompts in
    chunks of `chunk` until `synth_seconds` have passed; then the built-in prompts and those are
    continued in chunks of `chunk` while one as long as the last still ends within `gen_seconds`
    (both counted from before the engine starts; at least one chunk is continued whatever the
    clock)."""
    from kiln.spec_train.data import as_user_turns, base_prompts, continue_prompts, open_target, synthesize_prompts

    t0 = time.time()
    with open_target(cfg) as llm:
        summary["engine_start_s"] = round(time.time() - t0, 1)
        t1, synth, seen, asked = time.time(), [], set(), 0
        while asked < n_synth and time.time() - t0 < synth_seconds:
            n = min(chunk, n_synth - asked)
            # Seeds cfg.seed + asked .. + n - 1: the same draws as one call for all of them.
            for p in synthesize_prompts(dataclasses.replace(cfg, seed=cfg.seed + asked), n, llm):
                if p not in seen:
                    seen.add(p)
                    synth.append(p)
            asked += n
        summary.update(synthetic_asked=asked, synthetic_kept=len(synth), synth_s=round(time.time() - t1, 1))
        _log(f"{len(synth)} synthetic prompts of {asked} asked in {summary['synth_s']} s")
        prompts = base_prompts(cfg) + as_user_turns(synth)
        used, samples, t2, last_s = [], [], time.time(), 0.0
        for i in range(0, len(prompts), chunk):
            # At least one chunk, whatever the clock; after it, a chunk starts only if one as long
            # as the last still ends within the share (a chunk that ran past it left the twentieth
            # session's training 30 s: docs/speculative.md).
            if used and time.time() - t0 + last_s > gen_seconds:
                break
            part, t_chunk = prompts[i:i + chunk], time.time()
            samples += continue_prompts(llm, cfg, part)
            used += part
            last_s = time.time() - t_chunk
            n_out = sum(len(s.output_ids) for s in samples)
            _log(f"continued {len(used)} / {len(prompts)} prompts: {n_out} tokens, "
                 f"{n_out / (time.time() - t2):.0f} tok/s")
    summary.update(prompts_used=len(used), prompts_available=len(prompts),
                   continuation_tokens=sum(len(s.output_ids) for s in samples),
                   prompt_tokens=sum(len(s.prompt_ids) for s in samples),
                   gen_s=round(time.time() - t2, 1), gen_tok_per_s=round(
                       sum(len(s.output_ids) for s in samples) / max(time.time() - t2, 1e-9)))
    return used, synth, samples


def export_mtp(checkpoint: str, export: str) -> list[str]:
    """The checkpoint's mtp.* tensors (fp32) into export/mtp-NN.safetensors, each under
    CHUNK_BYTES; a tensor larger than that goes in row blocks named `NAME@i` (`load_export`
    joins them)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    parts, cur, size = [], {}, 0
    with safe_open(os.path.join(checkpoint, "model.safetensors"), "pt") as f:
        pieces = []
        for name in sorted(k for k in f.keys() if k.startswith("mtp.")):
            t = f.get_tensor(name).to(torch.float32).contiguous()
            row_bytes = max(t[0].numel() * 4, 1) if t.dim() else 4
            if t.numel() * 4 <= CHUNK_BYTES:
                pieces.append((name, t))
                continue
            rows = max(CHUNK_BYTES // row_bytes, 1)
            pieces += [(f"{name}@{i}", b.clone()) for i, b in enumerate(t.split(rows))]
        for name, t in pieces:
            nbytes = t.numel() * 4
            if cur and size + nbytes > CHUNK_BYTES:
                parts.append(cur)
                cur, size = {}, 0
            cur[name] = t
            size += nbytes
    if cur:
        parts.append(cur)
    paths = []
    for i, part in enumerate(parts):
        paths.append(os.path.join(export, f"mtp-{i:02d}.safetensors"))
        save_file(part, paths[-1])
    return paths


def pack_results(work: str, export: str, summary: dict) -> None:
    with open(os.path.join(work, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with tarfile.open(os.path.join(export, "results.tar.gz"), "w:gz") as tar:
        for name in ("summary.json", "metrics.jsonl", "loss.png", "config.json", "synthetic_prompts.jsonl",
                     "acc_greedy.json", "acc_b1.json"):
            p = os.path.join(work, name)
            if os.path.isfile(p):
                tar.add(p, arcname=name)


def acceptance(work: str, out_name: str, steps: str, num_prompts: int, engine: dict, timeout: float) -> None:
    cmd = [sys.executable, os.path.join(HERE, "spec_acceptance.py"), "--model-path", work, "--steps", steps,
           "--num-prompts", str(num_prompts), "--max-new-tokens", "128", "--temperature", "0", "--check-greedy",
           "--engine", json.dumps(engine), "--out", os.path.join(work, out_name)]
    _log("$ " + " ".join(cmd))
    timeout = max(timeout, 1.0)
    try:
        subprocess.run(cmd, check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        _log(f"{out_name}: stopped by the budget after {timeout:.0f} s")


def run(args) -> None:
    import torch

    from kiln.spec_train import TrainDraftConfig
    from kiln.spec_train.data import save_generations, write_prompt_file
    from kiln.spec_train.mtp import train_mtp

    t_start = time.time()
    deadline = t_start + args.budget_s
    os.makedirs(args.work, exist_ok=True)
    os.makedirs(args.export, exist_ok=True)
    engine = {"max_running_requests": args.max_running_requests, "cuda_graph_max_bs": args.max_running_requests,
              "mem_fraction_static": 0.3, **json.loads(args.engine)}
    cfg = TrainDraftConfig(target=args.target, method="mtp", out=args.work, device=args.device,
                           num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                           num_mtp_layers=args.num_mtp_layers, num_steps=args.num_steps,
                           batch_tokens=args.batch_tokens, lr=args.lr, warmup_steps=args.warmup_steps,
                           autocast_bf16=True, val_fraction=args.val_fraction, eval_every=args.eval_every,
                           progress=False, cache_hidden=False, keep_best=True, engine=engine, seed=args.seed)
    summary: dict = {"args": vars(args), "torch": torch.__version__,
                     "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    used, synth, samples = generate_data(cfg, args.synthetic_prompts, args.synth_share * args.budget_s,
                                         args.gen_share * args.budget_s, args.chunk, summary)
    write_prompt_file(os.path.join(args.work, "synthetic_prompts.jsonl"), synth)
    prompts_file = os.path.join(args.work, "prompts.jsonl")
    write_prompt_file(prompts_file, used)
    # The same run as `kiln train-draft --prompts prompts.jsonl`: its data cache now holds these.
    cfg = dataclasses.replace(cfg, prompts=prompts_file, num_prompts=len(used))
    save_generations(cfg, os.path.join(args.work, "data"), used, samples)
    del samples
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    # Steps may use what is left after the hidden-state pass (estimated) and before export and
    # acceptance (--reserve-s).
    tokens = summary["continuation_tokens"] + summary["prompt_tokens"]
    left = deadline - time.time() - args.reserve_s - tokens / args.hidden_tok_per_s
    cfg = dataclasses.replace(cfg, time_limit_s=max(left, 30.0))
    summary["train_time_limit_s"] = round(cfg.time_limit_s, 1)
    _log(f"training: {tokens} tokens, up to {cfg.num_steps} steps or {cfg.time_limit_s:.0f} s of steps")
    t3 = time.time()
    val = train_mtp(cfg)
    summary.update(train_s=round(time.time() - t3, 1), val=val)
    with open(os.path.join(args.work, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    summary["steps_done"] = max((r["step"] for r in rows), default=0)
    summary["train_tokens_seen"] = max((r.get("tokens", 0) for r in rows), default=0)
    if rows and rows[-1].get("elapsed_s"):
        summary["s_per_step"] = round(rows[-1]["elapsed_s"] / max(summary["steps_done"], 1), 4)
    _log(f"trained {summary['steps_done']} steps in {summary['train_s']} s; validation {val}")
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    summary["exported"] = [os.path.basename(p) for p in export_mtp(args.work, args.export)]
    pack_results(args.work, args.export, summary)
    # Batch 1 first: its wall times are the speedup; the CPU re-measures acceptance in fp32 anyway.
    # A fixed KV pool: this process still holds GPU memory, which a memory fraction would count.
    acc_engine = {"device": args.device, "max_total_tokens": 262_144, **json.loads(args.engine)}
    acceptance(args.work, "acc_b1.json", "1,2,3", args.b1_prompts, {**acc_engine, "max_running_requests": 1},
               deadline - time.time() - 60)
    pack_results(args.work, args.export, summary)
    acceptance(args.work, "acc_greedy.json", "1,2,3", args.acc_prompts, acc_engine, deadline - time.time() - 5)
    summary["total_s"] = round(time.time() - t_start, 1)
    pack_results(args.work, args.export, summary)
    _log(f"done in {summary['total_s']} s")


def load_export(export: str) -> dict:
    """The MTP tensors of an export directory, row blocks (`NAME@i`) joined again."""
    import torch
    from safetensors.torch import load_file

    flat = {}
    for p in sorted(glob.glob(os.path.join(export, "mtp-*.safetensors"))):
        flat.update(load_file(p))
    out, blocks = {}, {}
    for name, t in flat.items():
        if "@" in name:
            base, i = name.rsplit("@", 1)
            blocks.setdefault(base, {})[int(i)] = t
        else:
            out[name] = t
    for base, parts in blocks.items():
        assert sorted(parts) == list(range(len(parts))), (base, sorted(parts))
        out[base] = torch.cat([parts[i] for i in range(len(parts))])
    return out


def assemble(args) -> None:
    from kiln.loader import resolve_model
    from kiln.spec_train.data import target_path
    from kiln.spec_train.mtp import write_checkpoint

    mtp = load_export(args.export)
    if not mtp:
        raise SystemExit(f"no mtp-*.safetensors in {args.export}")
    with tarfile.open(os.path.join(args.export, "results.tar.gz")) as tar:
        config = json.load(tar.extractfile("config.json"))
    write_checkpoint(resolve_model(target_path(args.target)), mtp, config, args.out)
    _log(f"{args.out}: {len(mtp)} MTP tensors on {args.target}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="generate, train, export, measure (on the GPU)")
    r.add_argument("--target", required=True, help="The frozen target (HF directory or .gguf; 'embedded').")
    r.add_argument("--work", required=True, help="Working directory (the train-draft output directory).")
    r.add_argument("--export", required=True, help="Where the MTP tensors and results.tar.gz go.")
    r.add_argument("--device", default="cuda")
    r.add_argument("--budget-s", type=float, default=555.0, help="Wall-clock budget of the whole run.")
    r.add_argument("--synth-share", type=float, default=0.12, help="Share of the budget for synthetic prompts.")
    r.add_argument("--gen-share", type=float, default=0.4, help="Share of the budget for the data (prompts too).")
    r.add_argument("--reserve-s", type=float, default=170.0, help="Budget kept for export and acceptance.")
    r.add_argument("--hidden-tok-per-s", type=float, default=40_000.0,
                   help="Assumed speed of the target's hidden-state pass (sizes the training time).")
    r.add_argument("--synthetic-prompts", type=int, default=12000,
                   help="Most prompts the target writes first (on an H200: ~160 a second for SmolLM2, 78%% kept).")
    r.add_argument("--num-prompts", type=int, default=540, help="Built-in training prompts first.")
    r.add_argument("--chunk", type=int, default=2048, help="Prompts per generate call (the budget's grain).")
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--max-running-requests", type=int, default=512)
    r.add_argument("--num-mtp-layers", type=int, default=3)
    r.add_argument("--num-steps", type=int, default=1000)
    r.add_argument("--batch-tokens", type=int, default=16384)
    r.add_argument("--lr", type=float, default=1e-3)
    r.add_argument("--warmup-steps", type=int, default=30)
    r.add_argument("--val-fraction", type=float, default=0.02)
    r.add_argument("--eval-every", type=int, default=50, help="Validation every this many steps (the export "
                   "keeps the drafter of the lowest validation loss).")
    r.add_argument("--acc-prompts", type=int, default=64, help="Held-out prompts of the acceptance run.")
    r.add_argument("--b1-prompts", type=int, default=32, help="Held-out prompts of the batch-1 speed run.")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--engine", default="{}", help="Extra kiln.Engine options (JSON) for every engine.")
    a = sub.add_parser("assemble", help="a servable checkpoint from the target and an export directory")
    a.add_argument("--export", required=True)
    a.add_argument("--target", default="embedded")
    a.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run(args) if args.cmd == "run" else assemble(args)


if __name__ == "__main__":
    main()
