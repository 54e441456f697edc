"""Decode at fixed batch sizes: throughput per GPU, the roofline of each step, and (with
`--profile`) the GPU's idle fraction during steady decode.

    python benchmarks/decode_batch.py --model-path preset:inkling/bench --batch-sizes 8,32,64,128 \
        --input-len 8192 --output-len 1024 --dummy-init auto
    python benchmarks/decode_batch.py --model-path benchmarks/configs/llama-3.1-8b --batch-sizes 64 \
        --input-len 1024 --output-len 256 --profile
    python benchmarks/decode_batch.py --quick --device cpu --model-path preset:inkling/tiny   # CPU smoke run

For each batch size B, B requests of `--input-len` random tokens generate exactly `--output-len`
tokens each (ignore_eos; greedy, or sampled with `--temperature`), all submitted at once. Reported per B:
- `prefill_s`: until every request has its first token;
- `decode_tok_s`: B * (output_len - 1) / (time from the last first token to the end), the steady
  decode rate, and `step_ms` its time per step;
- `total_tok_s`: B * output_len / wall time, prefill included (throughput per GPU);
- `roofline_tok_s`: B / (bytes one step reads at the mean decode context / measured bandwidth),
  with `roofline.roofline_bytes` (weights read at this batch: for MoE the distinct experts hit,
  plus each sequence's state), and `frac_of_roofline` = decode_tok_s / roofline_tok_s.
- `round_ms`: decode time / scheduler steps in the decode phase (one speculative round each with
  `--speculative-algorithm`; = `step_ms` without), and `accept_len`: tokens per round per request
  (accepted drafts + 1, from the engine's speculative counters; None without speculation);
- with `--speculative-algorithm`: `round_bound_ms`, the bytes one round of K drafts must read
  (`roofline.round_bytes`: the verify at K + 1 rows per request, the drafter, its draft heads) at
  the measured bandwidth, and `frac_of_round_bound` = round_bound_ms / round_ms (with
  `--speculative-adaptive` the bound is a full-length round's: shorter rounds read less).
  `frac_of_roofline` stays the plain step's: above 1 when speculation beats it;
- `round_p50_ms` / `round_max_ms`: the median and the largest gap between two `core.step()`
  returns in the decode phase (the mean, `round_ms`, moves with a few stalls; the median does not),
  and the note names the step of the largest gap;
- with `--profile`: `gpu_idle_frac`, measured with torch.profiler over `--profile-steps` decode
  steps in the middle of the decode phase: 1 - (union of the GPU kernel and memcpy intervals) /
  (wall time from the first to the last GPU activity). A CUDA-graph replay appears as its kernels.
A batch whose contexts do not fit the KV pool at once (requests finished before the last one
started, or were retracted) did not run as B sequences per step: its row keeps `prefill_s` and
`total_tok_s`, leaves the per-step columns empty and says so in the note (on an 80 GB H100 the
Inkling `bench` pool holds 256K tokens, short of 32 x 9216; docs/benchmarks.md, forty-eighth pass).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import roofline  # noqa: E402
from common import log  # noqa: E402

from kiln.engine.io import GenerateReq  # noqa: E402
from kiln.engine.request import SamplingParams  # noqa: E402

COLUMNS = ["batch", "input_len", "output_len", "prefill_s", "step_ms", "round_ms", "round_p50_ms", "round_max_ms",
           "accept_len", "round_bound_ms", "frac_of_round_bound", "decode_tok_s",
           "total_tok_s", "roofline_tok_s", "frac_of_roofline", "gpu_idle_frac", "note"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_engine_args(p)
    p.add_argument("--batch-sizes", default=None, help="Comma-separated (default 8,32,64,128; --quick 2,4).")
    p.add_argument("--input-len", type=int, default=None, help="Prompt tokens (default 8192; --quick 32).")
    p.add_argument("--output-len", type=int, default=None, help="Generated tokens (default 1024; --quick 8).")
    p.add_argument("--profile", action="store_true", help="Measure the GPU idle fraction (CUDA).")
    p.add_argument("--profile-steps", type=int, default=20, help="Decode steps inside the profile window.")
    p.add_argument("--kernel-rows", type=int, default=12, help="With --profile: GPU activities listed per step.")
    p.add_argument("--count-experts", action="store_true",
                   help="Count the distinct routed experts each MoE layer's forward touches, by the forward's "
                        "rows (a verify of K + 1 rows reads their union; expert_spread.py). Needs "
                        "--disable-cuda-graph.")
    p.add_argument("--host-profile", action="store_true",
                   help="After the GPU profile window, profile the host (cProfile) over as many steps.")
    p.add_argument("--host-rows", type=int, default=15, help="With --host-profile: functions listed.")
    p.add_argument("--host-phases", action="store_true",
                   help="Time the host phases of --profile-steps steady decode steps, unprofiled (host_phases.py).")
    p.add_argument("--sync-audit", action="store_true",
                   help="After the profile windows, run --profile-steps decode steps under "
                        "torch.cuda.set_sync_debug_mode('warn') and print every host <- device wait with the "
                        "Python lines that made it (kiln.engine.host_sync_audit; CUDA).")
    p.add_argument("--trace", default=None,
                   help="With --profile: write the profile window's timeline (Chrome trace, .json.gz) to this "
                        "path and print its GPU gaps and the host's waits per step.")
    p.add_argument("--ngram-always-draft", action="store_true",
                   help="With --speculative-algorithm ngram: every decode round verifies K drafts, guesses "
                        "(`NgramIndex.fallback`) when nothing matches, so that random weights time full rounds "
                        "(their outputs rarely repeat the prompt).")
    p.add_argument("--time-limit", type=float, default=None, help="Abort a batch size after this many seconds.")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="Sampling temperature of every request (0: greedy). Sampled requests get seeds "
                        "(--seed + their index), so a sampled run repeats; with --speculative-use-rejection-sampling "
                        "or --speculative-use-block-verification their drafts are verified exactly.")
    p.add_argument("--top-p", type=float, default=1.0, help="Top-p of every request (with --temperature > 0).")
    p.add_argument("--top-k", type=int, default=0, help="Top-k of every request (0: off; with --temperature > 0).")
    p.add_argument("--min-p", type=float, default=0.0, help="Min-p of every request (0: off; with --temperature > 0).")
    p.add_argument("--refreeze-after-warmup", action="store_true",
                   help="After each warm-up, freeze the heap again (gc.freeze), as the core's build does: what "
                        "the warm-up made, its Triton compiles among it, is then out of the collector's walks.")
    p.add_argument("--warmup", choices=["auto", "on", "off"], default="auto",
                   help="Before each batch size, an unmeasured run of it (same input, 8 output tokens), so that "
                        "Triton compiles the eager paths' kernels outside the measurement. auto: on with "
                        "--speculative-algorithm (the draft passes run eagerly), off otherwise (decode replays "
                        "graphs warmed at capture).")
    common.add_bench_args(p)
    return p


def round_bytes(core, meta_model, contexts: list[float]) -> dict:
    """`roofline.round_bytes` for the engine's speculative rounds: its algorithm and K, its DFlash
    drafter (DSpark's is inside `meta_model`), and its token map's rows (`--speculative-token-map`)."""
    algo = core.config.speculative_algorithm
    vocab = getattr(core.scheduler.spec.drafter, "vocab", None)
    rows = len(vocab.ids) if vocab is not None and vocab.ids is not None else None
    return roofline.round_bytes(meta_model, contexts, core.runner.spec_steps, algo,
                                drafter=core.runner.draft_model if algo == "dflash" else None,
                                draft_head_rows=rows, tp_size=core.config.tp_size)


def always_draft(core) -> None:
    """`--ngram-always-draft`: every ready request's ngram pass drafts K (`NgramIndex.fallback` when
    nothing matches): the round's time without depending on what random weights generate."""
    if core.scheduler.spec is None or core.config.speculative_algorithm != "ngram":
        raise SystemExit("--ngram-always-draft needs --speculative-algorithm ngram")
    core.scheduler.spec.drafter.always = True


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def gpu_activity(prof) -> tuple[Optional[float], float, dict[str, tuple[float, int]]]:
    """From a torch.profiler trace: the GPU idle fraction 1 - busy / span over its activities
    (kernels, memcpy, memset; None when it recorded none), the busy microseconds, and per
    activity name its total microseconds and count."""
    intervals, by_name = [], {}
    for ev in prof.events():
        if ev.device_type is not None and "CUDA" in str(ev.device_type) and ev.time_range.elapsed_us() > 0:
            intervals.append((ev.time_range.start, ev.time_range.end))
            us, n = by_name.get(ev.name, (0.0, 0))
            by_name[ev.name] = (us + ev.time_range.elapsed_us(), n + 1)
    if not intervals:
        return None, 0.0, {}
    span = max(e for _, e in intervals) - min(s for s, _ in intervals)
    busy = _union_us(intervals)
    return (1.0 - busy / span if span > 0 else None), busy, by_name


def gpu_idle_fraction(prof) -> Optional[float]:
    """1 - busy / span over the GPU activities a torch.profiler trace recorded (None if none)."""
    return gpu_activity(prof)[0]


def print_kernel_table(by_name: dict[str, tuple[float, int]], steps: int, busy_us: float, top: int = 12) -> None:
    """The GPU activities that took the most time per decode step: where a step's time goes."""
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    log(f"GPU busy {busy_us / steps / 1e3:.3f} ms per step; top activities per step:")
    for name, (us, n) in rows:
        log(f"  {us / steps:9.1f} us  x{n / steps:6.1f}  {name[:110]}")


def print_timeline(prof, steps: int, path: str, gap_us: float = 20.0) -> None:
    """Write the profile window's Chrome trace (gzipped) and print, per decode step, the GPU's
    gaps longer than `gap_us` and the host's waits (CUDA runtime synchronisations and memcpys),
    which are what puts those gaps there."""
    import gzip
    import shutil

    raw = path[:-3] if path.endswith(".gz") else path
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)
    gpu, waits = [], {}
    for ev in prof.events():
        if ev.device_type is not None and "CUDA" in str(ev.device_type) and ev.time_range.elapsed_us() > 0:
            gpu.append((ev.time_range.start, ev.time_range.end))
        elif "Synchronize" in ev.name or "Memcpy" in ev.name:
            us, n = waits.get(ev.name, (0.0, 0))
            waits[ev.name] = (us + ev.time_range.elapsed_us(), n + 1)
    gaps, end = [], None
    for s, e in sorted(gpu):
        if end is not None and s - end > gap_us:
            gaps.append(s - end)
        end = e if end is None else max(end, e)
    log(f"timeline {raw}.gz: {len(gaps) / steps:.1f} GPU gaps > {gap_us:.0f} us per step, "
        f"{sum(gaps) / steps / 1e3:.3f} ms idle in them per step (largest {max(gaps, default=0):.0f} us)")
    for name, (us, n) in sorted(waits.items(), key=lambda kv: -kv[1][0]):
        log(f"  host {name}: x{n / steps:.1f} per step, {us / steps:.1f} us per step")


def print_host_profile(prof, steps: int, top: int = 15) -> None:
    """The host functions that took the most time per scheduler step (cProfile, own time)."""
    import pstats

    st = pstats.Stats(prof)
    total = sum(v[2] for v in st.stats.values())
    log(f"host time {total / steps * 1e3:.3f} ms per step (cProfile, inflated by the profiler); top own time:")
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (file, line, fn), (cc, nc, tt, ct, _) in rows:
        log(f"  {tt / steps * 1e6:9.1f} us  x{nc / steps:6.1f}  {os.path.basename(file)}:{line} {fn}")
    # inclusive time of Kiln's own functions: which of its calls the own times above belong to
    kiln_rows = sorted(((k, v) for k, v in st.stats.items() if f"{os.sep}kiln{os.sep}" in k[0]),
                       key=lambda kv: -kv[1][3])[:top]
    log("top inclusive time, Kiln's functions:")
    for (file, line, fn), (cc, nc, tt, ct, _) in kiln_rows:
        log(f"  {ct / steps * 1e6:9.1f} us  x{nc / steps:6.1f}  {file.split(os.sep + 'kiln' + os.sep)[-1]}:{line} {fn}")


def _spec_counts(core):
    """The engine's speculative counters so far (a copy), or None without speculation."""
    spec = core.stats().spec
    return spec.copy() if spec is not None else None


def run_batch(core, bs: int, args, vocab: int, device: str) -> dict:
    """One batch size's measured run (`_run_batch`), its note saying how often the cyclic
    collector ran inside it."""
    with common.GcTimer() as gc_timer:
        return _run_batch(core, bs, args, vocab, device, gc_timer)


def _run_batch(core, bs: int, args, vocab: int, device: str, gc_timer) -> dict:
    rng = random.Random(args.seed + bs)
    core.flush_cache()
    retractions0 = core.stats().num_retractions_total
    first, done, steps = {}, {}, 0
    gaps = []  # seconds between consecutive step returns in the decode phase
    start = last = time.perf_counter()
    for i in range(bs):
        params = SamplingParams(max_tokens=args.output_len, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, seed=args.seed + i if args.temperature > 0 else None,
                                ignore_eos=True)
        core.add_request(GenerateReq(rid=f"b{bs}-{i}", input_ids=common.random_token_ids(rng, args.input_len, vocab),
                                     params=params))
    def close_profile(prof, n: int) -> Optional[float]:
        """End the profile window of n steps, print what it saw; returns the GPU idle fraction."""
        common.synchronize(device)
        prof.__exit__(None, None, None)
        idle, busy, by_name = gpu_activity(prof)
        log(f"batch {bs}: GPU idle {idle if idle is None else round(idle, 3)} over {n} steps")
        print_kernel_table(by_name, n, busy, args.kernel_rows)
        if args.trace:
            print_timeline(prof, n, args.trace.replace(".json", f"_bs{bs}.json"))
        return idle

    # Profile a window a quarter of the way into the decode phase (steady state, graphs warm).
    want_profile = args.profile and device == "cuda"
    decode_step = prof = prof_from = idle = host_prof = host_from = spec0 = audit = audit_from = None
    phases = phases_from = None
    note = ""
    while core.has_work():
        if want_profile and prof is None and decode_step is not None and \
                steps >= decode_step + max(2, (args.output_len - args.profile_steps) // 4):
            import torch.profiler as tp

            common.synchronize(device)
            prof = tp.profile(activities=[tp.ProfilerActivity.CPU, tp.ProfilerActivity.CUDA])
            prof.__enter__()
            prof_from = steps
        if args.host_phases and phases is None and decode_step is not None and steps >= decode_step + 2:
            from host_phases import HostPhases

            phases, phases_from = HostPhases(core).__enter__(), steps
        outs = core.step()
        steps += 1
        if phases_from is not None and steps - phases_from >= args.profile_steps:
            phases.__exit__(None, None, None)
            log(f"batch {bs}: host phases over {args.profile_steps} steps (inclusive, unprofiled):\n"
                f"{phases.report(args.profile_steps)}")
            phases_from = None
        now = time.perf_counter()
        if decode_step is not None:
            gaps.append(now - last)
        last = now
        for o in outs:
            if o.new_token_ids and o.rid not in first:
                first[o.rid] = now
            if o.finished:
                done[o.rid] = now
        if decode_step is None and len(first) == bs:
            decode_step = steps
            spec0 = _spec_counts(core)
        if prof_from is not None and steps - prof_from >= args.profile_steps:
            idle = close_profile(prof, steps - prof_from)
            prof_from = None
            note += f"idle over {args.profile_steps} steps; "
            if args.sync_audit:
                audit_from = steps
            if args.host_profile:
                import cProfile

                host_prof, host_from = cProfile.Profile(), steps
                host_prof.enable()
        if audit_from is not None and audit is None:
            from kiln.engine.host_sync_audit import HostSyncAudit

            audit = HostSyncAudit(frames=6).__enter__()
        elif audit is not None and steps - audit_from >= args.profile_steps:
            audit.__exit__(None, None, None)
            log(f"batch {bs}: host sync audit over {args.profile_steps} steps: {audit.report()}")
            audit_from, audit = None, None
        if host_from is not None and steps - host_from >= args.profile_steps:
            host_prof.disable()
            host_from = None
            print_host_profile(host_prof, args.profile_steps, args.host_rows)
        if args.time_limit and now - start > args.time_limit and core.has_work():
            for i in range(bs):
                core.abort(f"b{bs}-{i}")
            while core.has_work():
                core.step()
            note += "time limit: partial; "
            break
    end = time.perf_counter()
    note += gc_timer.note()
    if prof_from is not None:  # the decode ended inside the window (speculative rounds: fewer steps than tokens)
        idle = close_profile(prof, steps - prof_from)
        note += f"idle over the last {steps - prof_from} steps; "
    if phases_from is not None:  # the decode ended inside the window
        phases.__exit__(None, None, None)
        log(f"batch {bs}: host phases over {steps - phases_from} steps:\n{phases.report(steps - phases_from)}")
    if audit is not None:  # the decode ended inside the audit window
        audit.__exit__(None, None, None)
        log(f"batch {bs}: host sync audit over {steps - audit_from} steps: {audit.report()}")
    if len(first) < bs or not done:
        raise RuntimeError(f"batch {bs}: only {len(first)} requests reached decode, {len(done)} finished "
                           f"(raise --time-limit)")
    decode_start = max(first.values())
    decode_s = max(done.values()) - decode_start
    steps_decode = args.output_len - 1
    rounds = steps - decode_step
    spec1 = _spec_counts(core)
    accept_len = None
    if spec0 is not None and spec1 is not None and spec1.verify_steps > spec0.verify_steps:
        n = spec1.verify_steps - spec0.verify_steps
        accept_len = 1.0 + (spec1.accepted_tokens - spec0.accepted_tokens) / n
    if spec0 is not None and spec1 is not None and sum(spec1.steps_by_length[:-1]):  # --speculative-adaptive
        before = spec0.steps_by_length + [0] * len(spec1.steps_by_length)
        by_k = [(k, c - before[k]) for k, c in enumerate(spec1.steps_by_length)]
        note += "steps at k " + " ".join(f"{k}:{c}" for k, c in by_k if c) + "; "
    if spec0 is not None and spec1 is not None and spec1.verifies_queued_ahead > spec0.verifies_queued_ahead:
        note += f"{spec1.verifies_queued_ahead - spec0.verifies_queued_ahead} verifies queued ahead; "
    if gaps:
        worst = max(range(len(gaps)), key=gaps.__getitem__)
        note += f"largest gap at decode step {worst + 1} of {len(gaps)}; "
    row = {"batch": bs, "input_len": args.input_len, "output_len": args.output_len,
           "prefill_s": decode_start - start, "step_ms": decode_s / steps_decode * 1e3 if decode_s > 0 else None,
           "round_ms": decode_s / rounds * 1e3 if decode_s > 0 and rounds > 0 else None,
           "round_p50_ms": statistics.median(gaps) * 1e3 if gaps else None,
           "round_max_ms": max(gaps) * 1e3 if gaps else None, "accept_len": accept_len,
           "decode_tok_s": len(done) * steps_decode / decode_s if decode_s > 0 else None,
           "total_tok_s": len(done) * args.output_len / (end - start), "gpu_idle_frac": idle,
           "note": note + f"{steps} steps"}
    retracted = core.stats().num_retractions_total - retractions0
    waves = min(done.values()) < decode_start  # a request finished before the last one started decoding
    if waves or retracted:
        pool = core.stats().kv_total_tokens
        why = "ran in waves" if waves else f"{retracted} retractions"
        log(f"batch {bs}: did not fit the KV pool ({pool} tokens for {bs} x {args.input_len + args.output_len}; "
            f"{why}): no per-step numbers (lower the batch or raise --max-total-tokens / --mem-fraction-static)")
        row.update({k: None for k in ("step_ms", "round_ms", "round_p50_ms", "round_max_ms", "decode_tok_s")})
        row["note"] = f"did not fit the KV pool ({pool} tokens): {why}; " + row["note"]
    return row


def main(argv: Optional[list[str]] = None) -> dict:
    args = build_parser().parse_args(argv)
    args.batch_sizes = [int(b) for b in (args.batch_sizes or ("2,4" if args.quick else "8,32,64,128")).split(",")]
    args.input_len = args.input_len or (32 if args.quick else 8192)
    args.output_len = args.output_len or (8 if args.quick else 1024)
    args.profile = args.profile or args.sync_audit or bool(args.trace)  # both follow the profile window
    config, device, dtype, mc = common.setup(args)
    config.max_running_requests = max(config.max_running_requests, max(args.batch_sizes))
    if config.max_total_tokens is None and device == "cpu":
        config.max_total_tokens = max(args.batch_sizes) * (args.input_len + args.output_len + 2 * config.page_size)
    if args.count_experts and not config.disable_cuda_graph:
        raise SystemExit("--count-experts needs --disable-cuda-graph: a replayed CUDA graph runs no forward hooks")
    core = common.build_core(config, dummy_init=common.resolve_dummy_init(args.dummy_init, device))
    if args.ngram_always_draft:
        always_draft(core)
    spread = None
    if args.count_experts:
        from expert_spread import ExpertSpread
        spread = ExpertSpread(core.runner.model)
    hw = common.hardware_description(device)
    log(hw)
    bw = roofline.measure_bandwidth(device)
    meta_model = roofline.meta_model(config.model_path, dtype)
    rows = []
    warmup = args.warmup == "on" or (args.warmup == "auto" and config.speculative_algorithm is not None)
    for bs in args.batch_sizes:
        if warmup:
            warm = argparse.Namespace(**{**vars(args), "output_len": 8, "profile": False, "host_profile": False,
                                         "host_phases": False})
            common.run_guarded(f"batch {bs} warm-up", lambda: run_batch(core, bs, warm, min(mc.vocab_size, 10001), device))
            if args.refreeze_after_warmup:
                # what the warm-up made (its Triton compiles' objects among it) out of the collector's walks
                from kiln.engine.gc_tuning import tune_gc

                tune_gc()
        if spread is not None:
            spread.counts.clear()
        row, err = common.run_guarded(f"batch {bs}", lambda: run_batch(core, bs, args, min(mc.vocab_size, 10001), device))
        if spread is not None:
            log(f"batch {bs}: routed experts per forward\n{spread.report()}")
        if row is None:
            rows.append({"batch": bs, "note": f"failed: {err}"})
            continue
        rl = roofline.per_gpu(roofline.roofline_bytes(meta_model, [args.input_len + args.output_len / 2] * bs),
                              config.tp_size)
        if bw and row.get("decode_tok_s"):
            row["roofline_tok_s"] = bs * bw / rl["bytes_per_step"]
            row["frac_of_roofline"] = row["decode_tok_s"] / row["roofline_tok_s"]
        row["bytes_per_step"] = rl["bytes_per_step"]
        if config.speculative_algorithm and bw and row.get("round_ms"):
            rb = round_bytes(core, meta_model, [args.input_len + args.output_len / 2] * bs)
            row["bytes_per_round"] = rb["bytes_per_round"]
            row["round_bound_ms"] = rb["bytes_per_round"] / bw * 1e3
            row["frac_of_round_bound"] = row["round_bound_ms"] / row["round_ms"]
        log(f"batch {bs}: {common.format_table([row], COLUMNS)}")
        rows.append(row)
    title = (f"Decode at fixed batch: {common.model_name(config.model_path)}, {dtype}, {device}, "
             f"input {args.input_len}, output {args.output_len}, "
             + (f"temperature {args.temperature}" if args.temperature > 0 else "greedy"))
    meta = common.run_meta("decode_batch", argv, hw, config, dtype, device, measured_bandwidth=bw,
                           cuda_graphs=getattr(core.runner, "graphs", None) is not None,
                           kernels=getattr(core.runner, "use_kernels", False))
    lines = [f"# bandwidth measured {(bw or float('nan')) / 1e12:.3f} TB/s; kernels "
             f"{'on' if meta['kernels'] else 'off'}, CUDA graphs {'on' if meta['cuda_graphs'] else 'off'}"]
    return common.report(rows, COLUMNS, title, hw, meta, args.out, lines)


if __name__ == "__main__":
    main()
