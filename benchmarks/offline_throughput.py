"""Offline throughput: nano-vllm's `bench.py` workload through Kiln, and through Hugging Face
transformers' continuous batching on the same weights.

Workload (nano-vllm): 256 requests whose prompt lengths and output lengths are each uniform in
[100, 1024]; prompts are random token ids; every request generates exactly its output length
(`ignore_eos`), sampling at temperature 0.6. Everything is submitted at once; throughput is
output tokens / wall time, after a one-request warm-up.

    python benchmarks/offline_throughput.py                       # Qwen3-0.6B shape, defaults
    python benchmarks/offline_throughput.py --model-path benchmarks/configs/llama-3.1-8b --dtype bfloat16
    python benchmarks/offline_throughput.py --quick --hf --device cpu   # CPU smoke run

On CUDA the transformers comparison runs by default (`--no-hf` skips it); on CPU pass `--hf`.
`--model-path preset:inkling/bench` (or `preset:minimax_m3/tiny`, ...) runs a `kiln init-model`
preset with dummy weights; transformers has no such architecture, so its row says "skipped".
transformers runs `init_continuous_batching` + per-request `add_request(max_new_tokens=...)`,
because `generate_batch` takes a single `max_new_tokens` for all requests.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import hf_baseline  # noqa: E402
from common import log  # noqa: E402

from kiln.engine.request import SamplingParams  # noqa: E402

COLUMNS = ["engine", "requests", "started", "input_tokens", "output_tokens", "wall_s", "output_tok_s",
           "total_tok_s", "runs", "complete", "note"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_engine_args(p)
    p.add_argument("--num-requests", type=int, default=None, help="Requests (default 256; --quick 8).")
    p.add_argument("--min-len", type=int, default=None, help="Shortest prompt/output (default 100; --quick 16).")
    p.add_argument("--max-len", type=int, default=None, help="Longest prompt/output (default 1024; --quick 64).")
    p.add_argument("--max-input-len", type=int, default=None, help="Longest prompt (default --max-len).")
    p.add_argument("--max-output-len", type=int, default=None, help="Longest output (default --max-len).")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--step-stats", action="store_true",
                   help="Print where Kiln's wall time went: steps that prefill (with their prompt tokens) "
                        "against decode-only steps, by batch size (time per step and tokens/s).")
    p.add_argument("--profile-prefill", action="store_true",
                   help="With the step stats, profile the host (cProfile) in the first run's steps that "
                        "prefill and print what took longest in the three slowest (Triton compiles, "
                        "host waits, Python work).")
    p.add_argument("--num-runs", type=int, default=1, help="Kiln measurements; the median is reported.")
    p.add_argument("--time-limit", type=float, default=None,
                   help="Seconds per measured run (each engine); unfinished requests are aborted and "
                        "the row is marked incomplete (throughput over the time run; input_tokens then "
                        "counts only the prompts of the `started` requests, those that produced a token).")
    common.add_bench_args(p)  # --threads, --quick (8 requests of 16..64 tokens), --out, --no-progress
    hf_baseline.add_hf_args(p)
    p.add_argument("--hf-cb-config", choices=["auto", "recipe", "default"], default="auto",
                   help="transformers ContinuousBatchingConfig. 'default': transformers' defaults (with "
                        "paged SDPA they leave CUDA graphs, async batching and compile off). 'recipe': "
                        "perf-anchors section 4 (CUDA graphs, async batching, compile level 1, 16384 batch "
                        "tokens; the warm-up captures graphs at the largest padded sizes, which can take "
                        "long with SDPA's explicit masks). 'auto': defaults plus max_batch_tokens=16384 on "
                        "CUDA, defaults on CPU. If 'recipe' raises, 'default' is tried.")
    return p


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    quick = args.quick
    if args.num_requests is None:
        args.num_requests = 8 if quick else 256
    if args.min_len is None:
        args.min_len = 16 if quick else 100
    if args.max_len is None:
        args.max_len = 64 if quick else 1024
    args.max_input_len = args.max_input_len or args.max_len
    args.max_output_len = args.max_output_len or args.max_len
    return args


def make_workload(seed: int, n: int, min_len: int, max_in: int, max_out: int, vocab: int):
    """nano-vllm's bench.py: all prompts first (lengths then ids, randint inclusive, ids in
    [0, 10000]), then all output lengths, from one seeded generator."""
    rng = random.Random(seed)
    top = min(10000, vocab - 1)
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(min_len, max_in))] for _ in range(n)]
    out_lens = [rng.randint(min_len, max_out) for _ in range(n)]
    return prompts, out_lens


def _row(engine: str, prompts, produced: int, wall: float, runs: int, complete: bool, note: str = "",
         started: Optional[list[bool]] = None) -> dict:
    """A table row. For a run stopped by the time limit, pass `started` (per request: produced a
    token, i.e. its prompt was prefilled): input_tokens then counts only those prompts (a lower
    bound: a prompt whose prefill was under way at the limit is left out) and `started` says how
    many requests that is."""
    if complete or started is None:
        inp, n_started = sum(len(p) for p in prompts), len(prompts)
    else:
        inp = sum(len(p) for p, s in zip(prompts, started) if s)
        n_started = sum(bool(s) for s in started)
    return {"engine": engine, "requests": len(prompts), "started": n_started, "input_tokens": inp,
            "output_tokens": produced,
            "wall_s": wall, "output_tok_s": produced / wall if wall > 0 else float("nan"),
            "total_tok_s": (inp + produced) / wall if wall > 0 else float("nan"),
            "runs": runs, "complete": complete, "note": note}


# ---- Kiln --------------------------------------------------------------------------------

class StepStats:
    """Per-step composition and wall time of a Kiln run (`--step-stats`): wraps the core's `step`
    and its scheduler's `_forward` (which sees each step's plan) until `report`."""

    BUCKETS = (1, 8, 32, 64, 128, 192, 256, 1 << 30)

    def __init__(self, core, profile_prefill: bool = False):
        self.core, self.rows, self.plan = core, [], None
        self.profiles: list[tuple[float, object]] = []  # (wall s, cProfile) of each prefill step
        sched = core.scheduler
        self._forward, self._step = sched._forward, core.step

        def forward(plan):
            self.plan = (sum(e - s for _, s, e in plan if e - s > 1), sum(1 for _, s, e in plan if e - s == 1))
            return self._forward(plan)

        def step():
            self.plan, t0 = (0, 0), time.perf_counter()
            # only steps that may prefill (requests waiting): cProfile slows every step it sees
            prof = cProfile.Profile() if profile_prefill and self.core.scheduler.waiting else None
            out = self._step() if prof is None else prof.runcall(self._step)
            wall = time.perf_counter() - t0
            self.rows.append((*self.plan, wall))
            if prof is not None and self.plan[0] > 0:
                self.profiles.append((wall, prof))
            return out

        sched._forward, core.step = forward, step

    def report(self) -> None:
        self.core.scheduler._forward, self.core.step = self._forward, self._step
        pre = [r for r in self.rows if r[0] > 0]
        log(f"step stats: {len(self.rows)} steps, {sum(r[2] for r in self.rows):.2f}s; "
            f"{len(pre)} steps with prefill ({sum(r[0] for r in pre)} prompt tokens) took "
            f"{sum(r[2] for r in pre):.2f}s: " + ", ".join(f"{r[0]}+{r[1]}d {r[2] * 1e3:.0f} ms" for r in pre[:12]))
        lo = 0
        for hi in self.BUCKETS[1:]:
            dec = [r for r in self.rows if r[0] == 0 and lo < r[1] <= hi]
            if dec:
                t = sum(r[2] for r in dec)
                log(f"  decode-only steps, batch {lo + 1}..{min(hi, 4096)}: {len(dec)} steps, {t:.2f}s, "
                    f"{t / len(dec) * 1e3:.2f} ms/step, {sum(r[1] for r in dec) / t:.0f} tok/s")
            lo = hi
        for wall, prof in sorted(self.profiles, key=lambda x: -x[0])[:3]:
            log(f"  prefill step of {wall * 1e3:.0f} ms (cProfile, inflated): largest inclusive times below the step")
            for name, cum in top_inner(prof, wall, 12):
                log(f"    {cum * 1e3:8.1f} ms  {name}")


def top_inner(prof, wall: float, n: int) -> list[tuple[str, float]]:
    """The n functions of a profiled step with the largest inclusive time, without the call chain
    that wraps the whole step (inclusive time above 90% of it): where a slow step went (a Triton
    compile, a host wait, Python work)."""
    stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, ncalls, tottime, cumtime, callers)}
    total = max(v[3] for v in stats.values())
    rows = [(f"{os.path.basename(f)}:{line} {name}", v[3]) for (f, line, name), v in stats.items()
            if v[3] < 0.9 * total]
    return sorted(rows, key=lambda x: -x[1])[:n]


def run_kiln(core, prompts, out_lens, args) -> tuple[dict, list[dict]]:
    # Warm-up: a short request, then (CUDA) enough prompts of the longest length to fill more than
    # one forward's token budget, so that Triton compiles the kernels' prefill-shaped variants
    # (full budget and a ragged remainder) here rather than inside the measured run.
    longest = max(len(p) for p in prompts)
    fill = -(-core.config.max_prefill_tokens // longest) + 1 if core.runner.device.type == "cuda" else 0
    warm = [([1 + i for i in range(16)], SamplingParams(max_tokens=16, temperature=args.temperature,
                                                        ignore_eos=True))]
    warm += [([1 + (j + i) % 1000 for j in range(longest)], SamplingParams(max_tokens=4, temperature=args.temperature,
                                                                          ignore_eos=True)) for i in range(fill)]
    t0 = time.perf_counter()
    common.run_requests(core, warm, tag="warmup", progress=False)
    log(f"Kiln warm-up ({len(warm)} requests) done in {time.perf_counter() - t0:.2f}s")
    reqs = [(p, SamplingParams(max_tokens=n, temperature=args.temperature, ignore_eos=True))
            for p, n in zip(prompts, out_lens)]
    runs = []
    for i in range(args.num_runs):
        if not core.flush_cache():  # identical prompts would otherwise hit the prefix cache
            log("warning: could not flush Kiln's prefix cache between runs")
        log(f"Kiln run {i + 1}/{args.num_runs}: {len(reqs)} requests, {sum(out_lens)} output tokens")
        stats = StepStats(core, args.profile_prefill and i == 0) if args.step_stats or args.profile_prefill else None
        res = common.run_requests(core, reqs, tag=f"run{i}-", progress=not args.no_progress,
                                  time_limit=args.time_limit)
        if stats is not None:
            stats.report()
        produced = res.output_tokens
        if res.complete:
            bad = [r.rid for r, n in zip(res.requests, out_lens) if len(r.output_ids) != n]
            if bad:
                raise RuntimeError(f"Kiln produced the wrong number of tokens for {bad[:4]}")
        row = _row("kiln", prompts, produced, res.wall, 1, res.complete,
                   "" if res.complete else "time limit: partial",
                   started=[r.first_token_time is not None for r in res.requests])
        row.update(steps=res.steps, ttft_p50_s=common.median(
            r.first_token_time - res.start for r in res.requests if r.first_token_time is not None))
        log(f"Kiln run {i + 1}: {produced} tokens in {res.wall:.2f}s = {row['output_tok_s']:.1f} tok/s"
            + ("" if res.complete else " (time limit: incomplete)"))
        runs.append(row)
    med = dict(runs[0])
    if len(runs) > 1:
        med["wall_s"] = common.median(r["wall_s"] for r in runs)
        if all(r["complete"] for r in runs):  # same tokens every run: rates from the median wall time
            med["output_tok_s"] = med["output_tokens"] / med["wall_s"]
            med["total_tok_s"] = (med["input_tokens"] + med["output_tokens"]) / med["wall_s"]
        else:
            med["output_tokens"] = int(common.median(r["output_tokens"] for r in runs))
            med["input_tokens"] = int(common.median(r["input_tokens"] for r in runs))
            med["started"] = int(common.median(r["started"] for r in runs))
            med["output_tok_s"] = common.median(r["output_tok_s"] for r in runs)
            med["total_tok_s"] = common.median(r["total_tok_s"] for r in runs)
        med["note"] = f"median of {len(runs)} runs " + "/".join(f"{r['output_tok_s']:.4g}" for r in runs)
    med["runs"] = len(runs)
    med["complete"] = all(r["complete"] for r in runs)
    return med, runs


# ---- transformers continuous batching -----------------------------------------------------

def run_hf(model, prompts, out_lens, args, device: str) -> dict:
    """transformers continuous batching (`hf_baseline.continuous_batching`) as a table row."""
    res = hf_baseline.continuous_batching(model, prompts, out_lens, device, args.hf_cb_config, args.temperature,
                                          args.time_limit, progress=not args.no_progress)
    row = _row("transformers", prompts, res.output_tokens, res.wall, 1, res.complete, res.note, started=res.started)
    log(f"transformers: {res.output_tokens} tokens in {res.wall:.2f}s = {row['output_tok_s']:.1f} tok/s")
    return row


# ---- main --------------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> dict:
    args = resolve_args(build_parser().parse_args(argv))
    config, device, dtype, mc = common.setup(args)
    prompts, out_lens = make_workload(args.seed, args.num_requests, args.min_len, args.max_input_len,
                                      args.max_output_len, mc.vocab_size)
    total_tokens = sum(len(p) for p in prompts) + sum(out_lens)
    if config.max_total_tokens is None and device == "cpu":
        # CPU pools default to 1 GB; size it to the whole workload so nothing is retracted.
        config.max_total_tokens = total_tokens + args.num_requests * config.page_size + 256
    hw = common.hardware_description(device)
    log(f"{hw}")
    log(f"model {config.model_path} ({mc.model_type}), {args.num_requests} requests, prompts "
        f"{args.min_len}..{args.max_input_len}, outputs {args.min_len}..{args.max_output_len}: "
        f"{sum(len(p) for p in prompts)} input + {sum(out_lens)} output tokens")
    dummy_init = common.resolve_dummy_init(args.dummy_init, device)

    kiln_runs: list[dict] = []

    def kiln(core) -> dict:
        row, runs = run_kiln(core, prompts, out_lens, args)
        kiln_runs.extend(runs)
        return row

    cmp = hf_baseline.kiln_vs_transformers(
        args, config, device, dtype, dummy_init, COLUMNS, run_kiln=kiln,
        run_hf=lambda model: run_hf(model, prompts, out_lens, args, device),
        ratio_row=lambda kiln, hf: {"engine": "kiln/transformers", "output_tok_s": kiln["output_tok_s"] / hf["output_tok_s"],
                                    "total_tok_s": kiln["total_tok_s"] / hf["total_tok_s"],
                                    "note": "throughput ratio"})

    title = (f"Offline throughput: {common.model_name(config.model_path)}, {dtype}, {device}, "
             f"{args.num_requests} requests, "
             f"in/out {args.min_len}..{args.max_input_len}/{args.min_len}..{args.max_output_len}, "
             f"T={args.temperature}")
    meta = common.run_meta("offline_throughput", argv, hw, config, dtype, device,
                           num_requests=args.num_requests, kiln_runs=kiln_runs, dummy_init=cmp.weights,
                           hf_error=cmp.hf_error)
    return common.report(cmp.rows, COLUMNS, title, hw, meta, args.out)


if __name__ == "__main__":
    main()
