"""The Hugging Face transformers twin of a benchmark's dummy model: building it with seeded
random weights and loading those same tensors into Kiln (`make_hf_model`, `load_hf_weights`),
deciding whether it runs (`hf_plan`), the Kiln-then-transformers sequence both scripts share
(`kiln_vs_transformers`), and its two runners: batch-1 `generate` with a static cache
(`generate_timings`, for latency.py) and continuous batching (`continuous_batching`, for
offline_throughput.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Callable, Optional

import torch

import common
from common import log

# perf-anchors.md section 4: the transformers continuous-batching baseline recipe for CUDA.
HF_CB_PRESETS = {
    "recipe": dict(use_cuda_graph=True, use_async_batching=True, default_compile_level=1,
                   max_batch_tokens=16384),
    "auto-cuda": dict(max_batch_tokens=16384),  # Kiln's --max-prefill-tokens default
    "default": {},
}


# ---- the twin ------------------------------------------------------------------------------

def load_hf_weights(core, hf_model: torch.nn.Module) -> None:
    """Copy a transformers model's state dict into Kiln's model (q/k/v and gate/up get stacked
    by Kiln's checkpoint loader, exactly as for a safetensors checkpoint)."""
    with torch.no_grad():
        core.runner.model.load_weights(hf_model.state_dict().items())


def make_hf_model(config_dir: str, dtype: torch.dtype, device: str, seed: int,
                  attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A transformers model of `config_dir`'s architecture with seeded random weights
    (transformers' own init: N(0, initializer_range), norms 1), in eval mode on `device`.
    Pass it to `build_core(config, hf_model=...)` so that Kiln runs the same weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.perf_counter()
    cfg = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(seed)
    if str(device).startswith("cuda"):
        torch.cuda.manual_seed_all(seed)
    with torch.device(device):  # initialise on the device: fast even for 8B models
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
    model = model.to(device=device, dtype=dtype).eval()
    n = sum(p.numel() for p in model.parameters())
    log(f"transformers {type(model).__name__} ({n / 1e6:.0f}M params, {dtype}, {device}) "
        f"built in {time.perf_counter() - t0:.1f}s")
    return model


def want_hf(args: argparse.Namespace, device: str) -> bool:
    """The transformers comparison runs on CUDA by default, on CPU only with --hf."""
    if getattr(args, "no_hf", False) or getattr(args, "tp_size", 1) > 1:
        return False  # tensor-parallel runs are compared with the one-GPU table
    return bool(getattr(args, "hf", False)) or device == "cuda"


def hf_unsupported_reason(model_path: str) -> Optional[str]:
    """Why transformers cannot build `model_path`'s architecture (its model_type is not one
    transformers knows, e.g. Kiln's own inkling / minimax_m3), or None when it can."""
    path = os.path.join(model_path, "config.json") if os.path.isdir(model_path) else model_path
    with open(path) as f:
        model_type = json.load(f).get("model_type")
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:
        return "transformers is not installed"
    if model_type not in CONFIG_MAPPING:
        return f"transformers has no model_type {model_type!r}"
    return None


def hf_plan(args: argparse.Namespace, device: str, model_path: str) -> tuple[bool, Optional[dict]]:
    """(run the transformers comparison?, a table row noting why it was skipped or None).
    Skipping an architecture transformers lacks is not an error."""
    if not want_hf(args, device):
        return False, None
    reason = hf_unsupported_reason(model_path)
    if reason is None:
        return True, None
    log(f"transformers comparison skipped: {reason}")
    return False, {"engine": "transformers", "note": f"skipped: {reason} (Kiln only)"}


def add_hf_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf", action="store_true",
                        help="Also run Hugging Face transformers on the same weights (default on CUDA).")
    parser.add_argument("--no-hf", action="store_true", help="Skip the transformers comparison.")


# ---- Kiln, then transformers on the same weights --------------------------------------------

@dataclasses.dataclass
class Comparison:
    rows: list  # Kiln's row, then transformers' row and the ratio row (or a failed / skipped note)
    hf_error: Optional[str]
    weights: str  # how the weights were made: the dummy init used, or "transformers twin"


def kiln_vs_transformers(args: argparse.Namespace, config, device: str, dtype: torch.dtype, dummy_init: str,
                         columns, run_kiln: Callable[[Any], dict], run_hf: Callable[[Any], dict],
                         ratio_row: Callable[[dict, dict], dict]) -> Comparison:
    """Build the transformers twin when it runs (`hf_plan`), Kiln on its weights (or dummy ones),
    `run_kiln(core)` -> Kiln's row (shown on stderr at once), free Kiln, then
    `run_hf(hf_model)` -> transformers' row, guarded so that a failure is a row, not a crash."""
    do_hf, hf_skipped = hf_plan(args, device, config.model_path)
    hf_model = make_hf_model(config.model_path, dtype, device, args.seed) if do_hf else None
    core = common.build_core(config, hf_model=hf_model, dummy_init=dummy_init)
    kiln_row = run_kiln(core)
    rows = [kiln_row]
    common.print_table(rows, columns, title="Kiln (before the transformers run)", file=sys.stderr)
    del core
    common.release_memory()

    hf_error = None
    if do_hf:
        hf_row, hf_error = common.run_guarded("transformers", lambda: run_hf(hf_model))
        if hf_row is not None:
            rows.append(hf_row)
            rows.append(ratio_row(kiln_row, hf_row))
        else:
            rows.append({"engine": "transformers", "note": f"failed: {hf_error}"[:120]})
    elif hf_skipped:
        rows.append(hf_skipped)
    return Comparison(rows, hf_error, dummy_init if hf_model is None else "transformers twin")


# ---- batch-1 generate (latency.py) --------------------------------------------------------

def _timing_streamer(device: str):
    from transformers.generation.streamers import BaseStreamer

    class TimingStreamer(BaseStreamer):
        """Records when each generated token reaches the host (the first put is the prompt)."""

        def __init__(self):
            self.times: list[float] = []
            self.count = 0
            self._prompt_seen = False

        def put(self, value):
            if not self._prompt_seen:
                self._prompt_seen = True
                return
            if device == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            self.count += int(value.numel()) if hasattr(value, "numel") else 1

        def end(self):
            pass

    return TimingStreamer()


def generate_timings(model, prompt: list[int], output_len: int, temperature: float, compile_mode: str,
                     warmup_runs: Optional[int], num_runs: int, device: str) -> tuple[list[tuple[float, float]], str]:
    """Batch-1 `generate(cache_implementation="static")` of exactly `output_len` tokens, timed by a
    streamer: ([(ttft_s, decode_s) per measured run], a note). `compile_mode`: 'generate' =
    generate's own decode-step compile (CompileConfig, reduce-overhead, fullgraph); 'forward' =
    `model.forward` compiled by hand; 'off'; 'auto' = generate on CUDA, off elsewhere."""
    from transformers import CompileConfig

    mode = compile_mode
    if mode == "auto":
        mode = "generate" if device == "cuda" else "off"
    gen_kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len,
                      cache_implementation="static", pad_token_id=0)
    if temperature > 0:
        gen_kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        gen_kwargs.update(do_sample=False)
    original_forward = None
    if mode == "generate":
        cc = CompileConfig(fullgraph=True, mode="reduce-overhead")
        if device != "cuda":
            cc._compile_all_devices = True
        gen_kwargs["compile_config"] = cc
    else:
        gen_kwargs["disable_compile"] = True  # no auto-compile: either off, or compiled by hand below
        if mode == "forward":
            original_forward = model.forward
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.tensor([prompt], device=device)
    mask = torch.ones_like(ids)
    warmups = warmup_runs if warmup_runs is not None else (2 if mode != "off" else 1)
    results = []
    try:
        for i in range(warmups + num_runs):
            streamer = _timing_streamer(device)
            common.synchronize(device)
            t0 = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, streamer=streamer, **gen_kwargs)
            common.synchronize(device)
            t_end = time.perf_counter()
            n_out = out.shape[1] - ids.shape[1]
            if n_out != output_len or len(streamer.times) != output_len:
                raise RuntimeError(f"transformers generated {n_out} tokens ({len(streamer.times)} streamed), "
                                   f"expected {output_len}")
            ttft = streamer.times[0] - t0
            decode = streamer.times[-1] - streamer.times[0]
            measured = i >= warmups
            log(f"transformers {'run' if measured else 'warm-up'} {i - warmups + 1 if measured else i + 1}: "
                f"TTFT {ttft * 1e3:.1f} ms, decode {(output_len - 1) / decode:.1f} tok/s, "
                f"total {t_end - t0:.2f}s")
            if measured:
                results.append((ttft, decode))
    finally:
        if original_forward is not None:
            model.forward = original_forward
    attn = getattr(model.config, "_attn_implementation", "?")
    return results, f"static cache, compile={mode}, {attn}"


# ---- continuous batching (offline_throughput.py) ------------------------------------------

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


@dataclasses.dataclass
class CBResult:
    output_tokens: int
    wall: float
    complete: bool
    note: str
    started: list  # per request: produced a token


def continuous_batching(model, prompts, out_lens, device: str, config_kind: str, temperature: float,
                        time_limit: Optional[float], progress: bool) -> CBResult:
    """All requests through `init_continuous_batching` + per-request `add_request(max_new_tokens=n)`,
    timed after a one-request warm-up. `config_kind`: a `HF_CB_PRESETS` key, or 'auto' ('auto-cuda'
    on CUDA, 'default' elsewhere); if 'recipe' raises, 'default' is tried."""
    kind = config_kind
    if kind == "auto":
        kind = "auto-cuda" if device == "cuda" else "default"
    try:
        return _cb_once(model, prompts, out_lens, device, kind, temperature, time_limit, progress)
    except Exception as e:  # noqa: BLE001
        if kind != "recipe":
            raise
        import traceback

        traceback.print_exc(file=sys.stderr)
        log(f"transformers with the recipe config failed ({type(e).__name__}: {e}); retrying with defaults")
        _reset_hf_model(model)
        res = _cb_once(model, prompts, out_lens, device, "default", temperature, time_limit, progress)
        res.note = (f"recipe failed: {type(e).__name__}; " + res.note)[:200]
        return res


def _reset_hf_model(model) -> None:
    destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
    if destroy is not None:
        try:
            destroy()
        except Exception:  # noqa: BLE001
            pass
    common.release_memory()


def _cb_once(model, prompts, out_lens, device: str, kind: str, temperature: float,
             time_limit: Optional[float], progress: bool) -> CBResult:
    from transformers import GenerationConfig

    cb, kw = hf_cb_config(kind, device, [len(p) + n for p, n in zip(prompts, out_lens)])
    sample = temperature > 0
    gen = GenerationConfig(max_new_tokens=max(out_lens), do_sample=sample,
                           temperature=temperature if sample else None, top_k=0, top_p=1.0,
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
        produced, complete, wall, count_note = _collect(manager, expected, time_limit,
                                                        progress=progress, start=start)
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
    return CBResult(total, wall, complete, note, [produced.get(f"hf{i}", 0) > 0 for i in range(len(prompts))])


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
