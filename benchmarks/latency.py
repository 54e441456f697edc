"""Batch-1 latency: time to first token and decode speed of one request, for Kiln and for Hugging
Face transformers (`generate` with a static cache and torch.compile) on the same weights, beside
the memory-bandwidth roofline.

    python benchmarks/latency.py                                   # Qwen3-0.6B shape, 1K context
    python benchmarks/latency.py --model-path benchmarks/configs/llama-3.1-8b --dtype bfloat16
    python benchmarks/latency.py --quick --hf --device cpu         # CPU smoke run

One request of `--input-len` random token ids generates exactly `--output-len` tokens (greedy by
default). TTFT = first token time - submit time; decode tok/s = (output_len - 1) / (last token
time - first token time). Each engine gets warm-up runs first; the median of `--num-runs` is kept.

transformers: `generate(cache_implementation="static")`. On CUDA, generate compiles its decode
step by itself when the cache is static (`compile_config`, torch.compile mode "reduce-overhead",
fullgraph), which is the v5 form of the `llm_optims` recipe; `--hf-compile forward` instead
compiles `model.forward` by hand as the older doc did (prefill gets compiled too). On CPU compile
is off unless `--hf-compile generate|forward`.

Roofline: one decode step reads every weight once plus the KV cache of the context, so
tok/s <= bandwidth / (weight bytes + KV bytes). Bandwidth is measured (a large device copy) and
also taken as the H200's nominal 4.8 TB/s; the fraction achieved is printed for both engines.
The bytes are counted from Kiln's model itself (`roofline.roofline_bytes`), so hybrid and MoE models
count what a step really reads: the k of E routed experts a token hits (plus shared experts),
no MTP layers or drafter, sliding-window / ShortConv / MSA state instead of full KV.

`--model-path preset:inkling/bench` (or `preset:minimax_m3/tiny`, ...) runs a `kiln init-model`
preset with dummy weights; transformers has no such architecture, so its row says "skipped".
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import hf_baseline  # noqa: E402
import roofline  # noqa: E402
from common import log  # noqa: E402

from kiln.engine.request import SamplingParams  # noqa: E402

COLUMNS = ["engine", "input_len", "output_len", "ttft_ms", "decode_tok_s", "ms_per_token",
           "roofline_tok_s", "frac_of_roofline", "nominal_roofline_tok_s", "frac_of_nominal", "runs", "note"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_engine_args(p)
    p.add_argument("--input-len", type=int, default=None, help="Prompt tokens (default 1024; --quick 32).")
    p.add_argument("--output-len", type=int, default=None, help="Generated tokens (default 128; --quick 8).")
    p.add_argument("--num-runs", type=int, default=3, help="Measured runs per engine (median reported).")
    p.add_argument("--warmup-runs", type=int, default=None,
                   help="Unmeasured runs first (default: Kiln 1; transformers 2 when compiling, else 1).")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default).")
    common.add_bench_args(p)  # --threads, --quick (32 in / 8 out), --out, --no-progress
    hf_baseline.add_hf_args(p)
    p.add_argument("--hf-compile", nargs="?", const="generate", default="auto",
                   choices=["auto", "generate", "forward", "off"],
                   help="transformers compile: 'generate' (also bare --hf-compile) = generate's own "
                        "decode-step compile with the static cache; 'forward' = model.forward = "
                        "torch.compile(model.forward, mode='reduce-overhead', fullgraph=True); "
                        "'auto' = generate on CUDA, off on CPU.")
    return p


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    if args.input_len is None:
        args.input_len = 32 if args.quick else 1024
    if args.output_len is None:
        args.output_len = 8 if args.quick else 128
    if args.output_len < 2:
        raise SystemExit("--output-len must be >= 2 to measure decode speed")
    return args


def _summarise(engine: str, runs: list[tuple[float, float]], args, note: str = "") -> dict:
    """runs: (ttft_s, decode_s) per measured run -> a row with medians."""
    ttft = common.median(r[0] for r in runs)
    decode_s = common.median(r[1] for r in runs)
    n = args.output_len - 1
    return {"engine": engine, "input_len": args.input_len, "output_len": args.output_len,
            "ttft_ms": ttft * 1e3, "decode_tok_s": n / decode_s if decode_s > 0 else float("nan"),
            "ms_per_token": decode_s / n * 1e3, "runs": len(runs), "note": note,
            "ttft_ms_all": [r[0] * 1e3 for r in runs],
            "decode_tok_s_all": [n / r[1] if r[1] > 0 else float("nan") for r in runs]}


# ---- Kiln --------------------------------------------------------------------------------

def run_kiln(core, prompt: list[int], args) -> dict:
    params = SamplingParams(max_tokens=args.output_len, temperature=args.temperature, ignore_eos=True)
    warmups = args.warmup_runs if args.warmup_runs is not None else 1
    results = []
    for i in range(warmups + args.num_runs):
        core.flush_cache()  # the same prompt every run: no prefix-cache hits
        res = common.run_requests(core, [(prompt, params)], tag=f"lat{i}-", progress=False)
        r = res.requests[0]
        if len(r.output_ids) != args.output_len:
            raise RuntimeError(f"Kiln generated {len(r.output_ids)} tokens, expected {args.output_len}")
        ttft = r.first_token_time - res.start
        decode = r.end_time - r.first_token_time
        measured = i >= warmups
        log(f"Kiln {'run' if measured else 'warm-up'} {i - warmups + 1 if measured else i + 1}: "
            f"TTFT {ttft * 1e3:.1f} ms, decode {(args.output_len - 1) / decode:.1f} tok/s")
        if measured:
            results.append((ttft, decode))
    return _summarise("kiln", results, args, f"{res.steps} steps")


# ---- transformers ------------------------------------------------------------------------

def run_hf(model, prompt: list[int], args, device: str) -> dict:
    """transformers `generate` with a static cache (`hf_baseline.generate_timings`)."""
    runs, note = hf_baseline.generate_timings(model, prompt, args.output_len, args.temperature, args.hf_compile,
                                              args.warmup_runs, args.num_runs, device)
    return _summarise("transformers", runs, args, note)


# ---- main --------------------------------------------------------------------------------

def roofline_lines(rl: dict, ctx: float, bw: Optional[float]) -> list[str]:
    """The '# roofline' comment lines above the table (one for dense models)."""
    p, kv = rl["params"], rl["kv"]
    tail = (f"bandwidth measured {(bw or float('nan')) / 1e12:.3f} TB/s, "
            f"nominal {roofline.H200_NOMINAL_BW / 1e12:.1f} TB/s")
    if rl.get("tp_size", 1) > 1:  # bytes are one rank's (roofline.per_gpu); the breakdowns are the model's
        tail += f"; per GPU: 1/{rl['tp_size']} of the model's bytes (tp {rl['tp_size']})"
    moe = rl.get("moe")
    if not moe and set(k for k, v in kv.items() if v) <= {"full_kv"}:  # dense full-attention (Llama family)
        return [f"# roofline: {rl['bytes_per_step'] / 1e9:.4f} GB/step = {rl['weight_bytes'] / 1e9:.4f} GB weights "
                f"({p['decode_read'] / 1e6:.0f}M params read per step; {p['total'] / 1e6:.0f}M "
                f"in all) + {rl['kv_bytes'] / 1e6:.2f} MB KV ({rl['kv_bytes_per_token']} B/token x {ctx:.0f}); "
                + tail]
    w, B, C = rl["weights"], common.fmt_bytes, common.fmt_count
    lines = [f"# roofline: {B(rl['bytes_per_step'])}/step = {B(rl['weight_bytes'])} weights "
             f"+ {B(rl['kv_bytes'])} state (ctx {ctx:.0f}); " + tail]
    if moe:
        lines.append(
            f"# active weights (batch 1): {C(p['active'])} of {C(p['total'])} params, {B(rl['active_weight_bytes'])} = "
            f"dense {B(w['dense'])} + LM head {B(w['lm_head'])} + shared experts {B(w['shared_experts'])} "
            f"+ routed {moe['top_k']}/{moe['experts']} of {B(w['routed_all'])} ({moe['layers']} MoE layers); "
            f"not read: embedding {B(w['embedding_not_read'])}, MTP/drafter {B(w['not_in_decode'])}")
    parts = [f"{name} {B(kv[key])}" for key, name in
             (("full_kv", "full-attention KV"), ("swa_kv", "sliding-window KV"), ("conv", "ShortConv inputs"),
              ("index_k", "MSA index keys"), ("msa_kv", "MSA selected K/V")) if kv[key]]
    lines.append(f"# state read per step: {', '.join(parts)}")
    return lines


def add_roofline(row: dict, bytes_per_step: int, bw: Optional[float]) -> None:
    if bw:
        row["roofline_tok_s"] = bw / bytes_per_step
        row["frac_of_roofline"] = row["decode_tok_s"] / row["roofline_tok_s"]
    row["nominal_roofline_tok_s"] = roofline.H200_NOMINAL_BW / bytes_per_step
    row["frac_of_nominal"] = row["decode_tok_s"] / row["nominal_roofline_tok_s"]


def main(argv: Optional[list[str]] = None) -> dict:
    args = resolve_args(build_parser().parse_args(argv))
    config, device, dtype, mc = common.setup(args)
    dummy_init = common.resolve_dummy_init(args.dummy_init, device)
    if config.max_total_tokens is None and device == "cpu":
        config.max_total_tokens = args.input_len + args.output_len + 4 * config.page_size
    prompt = common.random_token_ids(random.Random(args.seed), args.input_len, min(mc.vocab_size, 10001))
    hw = common.hardware_description(device)
    log(hw)

    # Roofline at the mean decode context (the first decode step sees input_len + 1 tokens).
    mean_ctx = args.input_len + args.output_len / 2
    rl = roofline.per_gpu(roofline.roofline_bytes(roofline.meta_model(config.model_path, dtype), [mean_ctx]),
                          config.tp_size)
    bw = roofline.measure_bandwidth(device)
    log(f"bytes per decode step: {rl['weight_bytes'] / 1e9:.3f} GB weights + {rl['kv_bytes'] / 1e9:.4f} GB KV "
        f"(ctx {mean_ctx:.0f}); measured copy bandwidth "
        f"{(bw or float('nan')) / 1e12:.3f} TB/s, nominal H200 {roofline.H200_NOMINAL_BW / 1e12:.1f} TB/s")

    def with_roofline(row: dict) -> dict:
        add_roofline(row, rl["bytes_per_step"], bw)
        return row

    cmp = hf_baseline.kiln_vs_transformers(
        args, config, device, dtype, dummy_init, COLUMNS,
        run_kiln=lambda core: with_roofline(run_kiln(core, prompt, args)),
        run_hf=lambda model: with_roofline(run_hf(model, prompt, args, device)),
        ratio_row=lambda kiln, hf: {"engine": "kiln/transformers", "ttft_ms": kiln["ttft_ms"] / hf["ttft_ms"],
                                    "decode_tok_s": kiln["decode_tok_s"] / hf["decode_tok_s"],
                                    "note": "ratios (ttft: lower is better)"})

    title = (f"Batch-1 latency: {common.model_name(config.model_path)}, {dtype}, {device}, input {args.input_len}, "
             f"output {args.output_len}, {'greedy' if args.temperature == 0 else f'T={args.temperature}'}")
    meta = common.run_meta("latency", argv, hw, config, dtype, device,
                           roofline={k: v for k, v in rl.items()}, mean_context=mean_ctx, dummy_init=cmp.weights,
                           measured_bandwidth=bw, nominal_bandwidth=roofline.H200_NOMINAL_BW, hf_error=cmp.hf_error)
    return common.report(cmp.rows, COLUMNS, title, hw, meta, args.out, roofline_lines(rl, mean_ctx, bw))


if __name__ == "__main__":
    main()
