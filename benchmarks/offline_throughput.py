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
import dataclasses
import os
import random
import sys
import time
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import log  # noqa: E402

from kiln.engine.request import SamplingParams  # noqa: E402

# perf-anchors.md section 4: the transformers continuous-batching baseline recipe for CUDA.
HF_CB_PRESETS = {
    "recipe": dict(use_cuda_graph=True, use_async_batching=True, default_compile_level=1,
                   max_batch_tokens=16384),
    "auto-cuda": dict(max_batch_tokens=16384),  # Kiln's --max-prefill-tokens default
    "default": {},
}

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
    p.add_argument("--num-runs", type=int, default=1, help="Kiln measurements; the median is reported.")
    p.add_argument("--time-limit", type=float, default=None,
                   help="Seconds per measured run (each engine); unfinished requests are aborted and "
                        "the row is marked incomplete (throughput over the time run; input_tokens then "
                        "counts only the prompts of the `started` requests, those that produced a token).")
    common.add_bench_args(p)  # --threads, --quick (8 requests of 16..64 tokens), --out, --no-progress
    common.add_hf_args(p)
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

def run_kiln(core, prompts, out_lens, args) -> tuple[dict, list[dict]]:
    warm = [([1 + i for i in range(16)], SamplingParams(max_tokens=16, temperature=args.temperature,
                                                        ignore_eos=True))]
    t0 = time.perf_counter()
    common.run_requests(core, warm, tag="warmup", progress=False)
    log(f"Kiln warm-up request done in {time.perf_counter() - t0:.2f}s")
    reqs = [(p, SamplingParams(max_tokens=n, temperature=args.temperature, ignore_eos=True))
            for p, n in zip(prompts, out_lens)]
    runs = []
    for i in range(args.num_runs):
        if not core.flush_cache():  # identical prompts would otherwise hit the prefix cache
            log("warning: could not flush Kiln's prefix cache between runs")
        log(f"Kiln run {i + 1}/{args.num_runs}: {len(reqs)} requests, {sum(out_lens)} output tokens")
        res = common.run_requests(core, reqs, tag=f"run{i}-", progress=not args.no_progress,
                                  time_limit=args.time_limit)
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

def hf_cb_config(kind: str, device: str, seq_lens: list[int]):
    """(ContinuousBatchingConfig, the non-default fields set). On CPU the paged cache and the batch
    are sized to the workload: by default transformers sizes them from free memory, which on a CPU
    host means zero-filling tens of GB before the first request. On CUDA transformers' own memory
    solver sizes the cache (it accounts for the SDPA mask, max_batch_tokens x cache tokens)."""
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    kw = {k: v for k, v in HF_CB_PRESETS[kind].items() if k in fields}
    if device == "cpu" and "num_blocks" in fields:
        probe = ContinuousBatchingConfig()
        block = getattr(probe, "page_size", None) or getattr(probe, "block_size", None) or 256
        kw["num_blocks"] = sum(-(-n // block) for n in seq_lens) + 8
        # With num_blocks fixed, transformers 5.17 solves for the largest max_batch_tokens that fits
        # in host memory (~68K), and zero-fills an SDPA mask of max_batch_tokens x cache tokens.
        kw.setdefault("max_batch_tokens", 2048)
    return ContinuousBatchingConfig(**kw), kw


def run_hf(model, prompts, out_lens, args, device: str) -> dict:
    kind = args.hf_cb_config
    if kind == "auto":
        kind = "auto-cuda" if device == "cuda" else "default"
    try:
        return _run_hf_once(model, prompts, out_lens, args, device, kind)
    except Exception as e:  # noqa: BLE001
        if kind != "recipe":
            raise
        import traceback

        traceback.print_exc(file=sys.stderr)
        log(f"transformers with the recipe config failed ({type(e).__name__}: {e}); retrying with defaults")
        _reset_hf_model(model)
        row = _run_hf_once(model, prompts, out_lens, args, device, "default")
        row["note"] = (f"recipe failed: {type(e).__name__}; " + row["note"])[:200]
        return row


def _reset_hf_model(model) -> None:
    destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
    if destroy is not None:
        try:
            destroy()
        except Exception:  # noqa: BLE001
            pass
    common.release_memory()


def _run_hf_once(model, prompts, out_lens, args, device: str, kind: str) -> dict:
    from transformers import GenerationConfig

    cb, kw = hf_cb_config(kind, device, [len(p) + n for p, n in zip(prompts, out_lens)])
    sample = args.temperature > 0
    gen = GenerationConfig(max_new_tokens=max(out_lens), do_sample=sample,
                           temperature=args.temperature if sample else None, top_k=0, top_p=1.0,
                           eos_token_id=None, pad_token_id=0)
    hints = None
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompts),
                              max_generated_length=max(out_lens), num_requests=len(prompts))
    except ImportError:
        pass
    t0 = time.perf_counter()
    kwargs = dict(generation_config=gen, continuous_batching_config=cb)
    if hints is not None:
        kwargs["workload_hints"] = hints
    manager = model.init_continuous_batching(**kwargs)
    attn = model.config._attn_implementation
    log(f"transformers continuous batching: config {kind} {kw or ''}, attention {attn}")
    try:
        if device == "cuda" and hasattr(manager, "warmup"):
            manager.warmup()  # CUDA graph capture (and compile) before timing
        manager.start()
        warm_ids = [1 + i for i in range(16)]
        rid = manager.add_request(warm_ids, request_id="warmup", max_new_tokens=16, eos_token_id=-1)
        _collect(manager, {rid: 16}, None, progress=False)
        warmup_s = time.perf_counter() - t0
        log(f"transformers warm-up (manager init, graphs/compile, one request) took {warmup_s:.1f}s")

        expected = {}
        start = time.perf_counter()
        for i, (p, n) in enumerate(zip(prompts, out_lens)):
            rid = manager.add_request(p, request_id=f"hf{i}", max_new_tokens=n, eos_token_id=-1)
            expected[rid] = n
        produced, complete, wall, count_note = _collect(manager, expected, args.time_limit,
                                                        progress=not args.no_progress, start=start)
    finally:
        try:
            manager.stop(block=True, timeout=30)
        except Exception as e:  # noqa: BLE001
            log(f"transformers manager.stop: {e}")
        try:
            manager.destroy()
        except Exception:  # noqa: BLE001
            pass
    total = sum(produced.values())
    if complete:
        bad = [r for r, n in expected.items() if produced.get(r) != n]
        if bad:
            raise RuntimeError(f"transformers produced the wrong number of tokens for {bad[:4]}: "
                               f"{[(produced.get(r), expected[r]) for r in bad[:4]]}")
    note = f"{attn}, cb={kind}, warmup {warmup_s:.0f}s" + ("" if complete else f", time limit: {count_note}")
    row = _row("transformers", prompts, total, wall, 1, complete, note,
               started=[produced.get(f"hf{i}", 0) > 0 for i in range(len(prompts))])
    log(f"transformers: {total} tokens in {wall:.2f}s = {row['output_tok_s']:.1f} tok/s")
    return row


def _collect(manager, expected: dict, time_limit: Optional[float], progress: bool,
             start: Optional[float] = None) -> tuple[dict, bool, float, str]:
    """Wait for every request in `expected`.

    Returns (tokens per request, complete, wall seconds, how partial counts were taken). At the time
    limit, tokens of unfinished requests are read from the manager's scheduler state (no streaming,
    which would copy every request's token list every step); if that state is not where
    transformers 5.17-5.24 keep it, only finished requests count (a lower bound).
    """
    start = start or time.perf_counter()
    produced: dict[str, int] = {}
    finished: set[str] = set()
    last = start
    while len(finished) < len(expected):
        result = manager.get_result(timeout=1)
        now = time.perf_counter()
        if result is not None and result.request_id in expected:
            if getattr(result, "error", None):
                raise RuntimeError(f"transformers request {result.request_id} failed: {result.error}")
            produced[result.request_id] = len(result.generated_tokens)
            if result.is_finished():
                finished.add(result.request_id)
        elif result is None and not manager.is_running():
            raise RuntimeError("the transformers generation thread stopped before all requests finished")
        if progress and now - last >= 5.0:
            last = now
            log(f"  transformers: {len(finished)}/{len(expected)} done, {sum(produced.values())} output "
                f"tokens of finished requests after {now - start:.0f}s")
        if time_limit is not None and now - start > time_limit:
            running = _running_token_counts(manager)
            wall = time.perf_counter() - start
            note = "partial"
            if running is None:
                note = "partial, finished requests only (lower bound)"
            else:
                for rid, n in running.items():
                    if rid in expected and rid not in finished:
                        produced[rid] = n
            log(f"  transformers: time limit {time_limit:.0f}s reached ({note})")
            for rid in expected:
                if rid not in finished:
                    manager.cancel_request(rid)
            return produced, False, wall, note
    return produced, True, time.perf_counter() - start, ""


def _running_token_counts(manager) -> Optional[dict]:
    """Tokens generated so far by the requests transformers' scheduler still holds (best effort)."""
    try:
        sched = manager.batch_processor.scheduler
    except AttributeError:
        return None
    for _ in range(5):  # the generation thread may mutate the dicts while we copy them
        try:
            states = list(sched.active_requests.values()) + list(sched.waiting_requests.values())
            return {st.request_id: len(st.generated_tokens) for st in states}
        except (RuntimeError, AttributeError):
            time.sleep(0.001)
    return None


# ---- main --------------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> dict:
    args = resolve_args(build_parser().parse_args(argv))
    common.apply_threads(args)
    config = common.engine_config(args)
    device = config.resolved_device()
    dtype = config.resolved_dtype()
    mc = common.model_config_of(config.model_path)
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
    do_hf, hf_skipped = common.hf_plan(args, device, config.model_path)
    dummy_init = common.resolve_dummy_init(args.dummy_init, device)

    hf_model = None
    if do_hf:
        hf_model = common.make_hf_model(config.model_path, dtype, device, args.seed)
    core = common.build_core(config, hf_model=hf_model, dummy_init=dummy_init)
    kiln_row, kiln_runs = run_kiln(core, prompts, out_lens, args)
    rows = [kiln_row]
    common.print_table(rows, COLUMNS, title="Kiln (before the transformers run)", file=sys.stderr)
    del core
    common.release_memory()

    hf_error = None
    if do_hf:
        hf_row, hf_error = common.run_guarded("transformers", lambda: run_hf(hf_model, prompts, out_lens, args, device))
        if hf_row is not None:
            rows.append(hf_row)
            ratio = kiln_row["output_tok_s"] / hf_row["output_tok_s"]
            rows.append({"engine": "kiln/transformers", "output_tok_s": ratio,
                         "total_tok_s": kiln_row["total_tok_s"] / hf_row["total_tok_s"],
                         "note": "throughput ratio"})
        else:
            rows.append({"engine": "transformers", "note": f"failed: {hf_error}"[:120]})
    elif hf_skipped:
        rows.append(hf_skipped)

    name = os.path.basename(os.path.normpath(config.model_path))
    title = (f"Offline throughput: {name}, {dtype}, {device}, {args.num_requests} requests, "
             f"in/out {args.min_len}..{args.max_input_len}/{args.min_len}..{args.max_output_len}, "
             f"T={args.temperature}")
    print(f"\n# {hw}")
    common.print_table(rows, COLUMNS, title=title)
    meta = {"benchmark": "offline_throughput", "argv": sys.argv if argv is None else argv, "hardware": hw,
            "model_path": config.model_path, "dtype": str(dtype), "device": device,
            "num_requests": args.num_requests, "kiln_runs": kiln_runs,
            "dummy_init": dummy_init if hf_model is None else "transformers twin", "hf_error": hf_error}
    common.save_json(args.out, rows, meta)
    return {"rows": rows, "meta": meta}


if __name__ == "__main__":
    main()
