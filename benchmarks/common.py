"""Shared helpers for Kiln's benchmarks: engine construction, a timed request loop, the decode
roofline, memory bandwidth, the transformers twin of a dummy model, and table / JSON output.

Every benchmark runs a config-only model directory (`benchmarks/configs/<name>/config.json`) with
random ("dummy") weights, token ids in and out, so no checkpoint or tokenizer is needed. When a
benchmark compares against Hugging Face transformers, `make_hf_model` builds the transformers model
with seeded random weights and `build_core(..., hf_model=...)` loads exactly those tensors into
Kiln through the model's own `load_weights` (the checkpoint path), so both engines run the same
weights.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # `python benchmarks/x.py` from anywhere
    sys.path.insert(0, REPO_ROOT)

from kiln.config import EngineConfig  # noqa: E402
from kiln.engine.io import GenerateReq  # noqa: E402
from kiln.engine.request import SamplingParams  # noqa: E402
from kiln.models.config import ModelConfig  # noqa: E402

CONFIGS_DIR = os.path.join(REPO_ROOT, "benchmarks", "configs")
DEFAULT_MODEL_PATH = os.path.join(CONFIGS_DIR, "qwen3-0.6b")
H200_NOMINAL_BW = 4.8e12  # bytes/s, NVIDIA's HBM3e spec for the H200 SXM

_DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def log(msg: str) -> None:
    """Progress messages go to stderr so stdout stays the tables."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- engine construction -------------------------------------------------------------------

def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every EngineConfig flag (`--dtype`, `--device`, `--max-total-tokens`, `--page-size`, ...),
    with benchmark defaults: the Qwen3-0.6B config dir, dummy weights, no tokenizer.
    `--seed` seeds the weights and the workload."""
    EngineConfig.add_cli_args(parser)
    parser.set_defaults(model_path=DEFAULT_MODEL_PATH, load_format="dummy", skip_tokenizer_init=True,
                        log_level="warning")


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    config = EngineConfig.from_cli_args(args)
    for k, v in overrides.items():
        setattr(config, k, v)
    return config


def model_config_of(path_or_cfg: Any) -> ModelConfig:
    """A `ModelConfig` from a config dir, a config.json path, a dict or a ModelConfig."""
    if isinstance(path_or_cfg, ModelConfig):
        return path_or_cfg
    if isinstance(path_or_cfg, dict):
        return ModelConfig.from_dict(path_or_cfg)
    path = str(path_or_cfg)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        return ModelConfig.from_dict(json.load(f))


@contextlib.contextmanager
def _no_dummy_init():
    """Skip Kiln's dummy-weight fill while building a core whose weights are loaded right after.

    The fill draws every parameter on the CPU from a per-name generator (single-threaded; about
    2-3 minutes for an 8B model), which is wasted when the transformers twin's weights replace
    it. `load_weights` raises if any parameter is left unloaded, so nothing stays uninitialised.
    """
    import kiln.engine.runner as runner_mod

    original = getattr(runner_mod, "init_dummy_weights", None)
    if original is None:  # the runner changed: fall back to the normal (slower) path
        yield
        return
    runner_mod.init_dummy_weights = lambda model, seed: None
    try:
        yield
    finally:
        runner_mod.init_dummy_weights = original


def build_core(config: EngineConfig, hf_model: Optional[torch.nn.Module] = None):
    """An `EngineCore` for `config`; with `hf_model`, Kiln's weights are that model's tensors."""
    from kiln.engine.core import EngineCore

    t0 = time.perf_counter()
    if hf_model is None:
        core = EngineCore(config)
    else:
        if config.tp_size != 1:
            raise ValueError("loading the transformers twin's weights needs --tp-size 1")
        with _no_dummy_init():
            core = EngineCore(config)
        load_hf_weights(core, hf_model)
    log(f"Kiln core ready in {time.perf_counter() - t0:.1f}s "
        f"(KV pool {core.info.max_total_tokens} tokens, device {config.resolved_device()}, "
        f"dtype {config.resolved_dtype()})")
    return core


def load_hf_weights(core, hf_model: torch.nn.Module) -> None:
    """Copy a transformers model's state dict into Kiln's model (q/k/v and gate/up get stacked
    by Kiln's checkpoint loader, exactly as for a safetensors checkpoint)."""
    with torch.no_grad():
        core.runner.model.load_weights(hf_model.state_dict().items())


def release_memory() -> None:
    """After `del core` (or any large object): collect cycles and give cached device memory back,
    so the next engine starts with the GPU free."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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


def synchronize(device: Any) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


# ---- workloads -----------------------------------------------------------------------------

def random_token_ids(rng, n: int, vocab_size: int) -> list[int]:
    """`n` uniform token ids from a `random.Random`."""
    return [rng.randrange(vocab_size) for _ in range(n)]


@dataclass
class RequestTiming:
    rid: str
    prompt_len: int
    output_ids: list[int] = field(default_factory=list)
    first_token_time: Optional[float] = None  # perf_counter seconds
    token_times: list[float] = field(default_factory=list)  # one per output token (per step)
    end_time: Optional[float] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None


@dataclass
class RunResult:
    start: float
    end: float
    requests: list[RequestTiming]
    steps: int
    complete: bool  # False when the time limit aborted the run

    @property
    def wall(self) -> float:
        return self.end - self.start

    @property
    def output_tokens(self) -> int:
        return sum(len(r.output_ids) for r in self.requests)

    @property
    def input_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)


def run_requests(core, requests: Sequence[tuple[list[int], SamplingParams]], tag: str = "r",
                 progress: bool = True, time_limit: Optional[float] = None,
                 record_token_times: bool = False) -> RunResult:
    """Submit all requests at once, step the core until every one finishes, and time it.

    Times are `time.perf_counter()` taken right after the step that produced a token (the step
    copies sampled ids to the host, so device work is complete). With `time_limit` (seconds),
    requests still running after it are aborted and the result is marked incomplete.
    """
    timings = {}
    start = time.perf_counter()
    for i, (ids, params) in enumerate(requests):
        rid = f"{tag}{i}"
        timings[rid] = RequestTiming(rid=rid, prompt_len=len(ids))
        core.add_request(GenerateReq(rid=rid, input_ids=list(ids), params=params))
    total_out = sum(p.max_tokens for _, p in requests)
    done_out = finished = steps = 0
    complete = True
    last_report = start
    while core.has_work():
        outs = core.step()
        steps += 1
        now = time.perf_counter()
        for o in outs:
            t = timings.get(o.rid)
            if t is None:
                continue
            if o.new_token_ids:
                if t.first_token_time is None:
                    t.first_token_time = now
                t.output_ids.extend(o.new_token_ids)
                done_out += len(o.new_token_ids)
                if record_token_times:
                    t.token_times.extend([now] * len(o.new_token_ids))
            if o.error:
                t.error = o.error
            if o.finished:
                t.end_time = now
                t.finish_reason = o.finish_reason
                finished += 1
        if progress and now - last_report >= 5.0:
            last_report = now
            rate = done_out / max(now - start, 1e-9)
            log(f"  {tag}: {finished}/{len(requests)} done, {done_out}/{total_out} output tokens, "
                f"{rate:.0f} tok/s, {steps} steps")
        if time_limit is not None and now - start > time_limit and core.has_work():
            log(f"  {tag}: time limit {time_limit:.0f}s reached; aborting the remaining requests")
            complete = False
            for rid, t in timings.items():
                if t.end_time is None:
                    core.abort(rid)
            while core.has_work():
                core.step()
            break
    end = time.perf_counter()
    errors = [t for t in timings.values() if t.error]
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed, e.g. {errors[0].rid}: {errors[0].error}")
    return RunResult(start=start, end=end, requests=list(timings.values()), steps=steps, complete=complete)


# ---- roofline ------------------------------------------------------------------------------

def dtype_bytes(dtype: Any) -> int:
    if isinstance(dtype, str):
        dtype = {"auto": torch.bfloat16}.get(dtype) or getattr(torch, dtype)
    return _DTYPE_BYTES[dtype]


def param_counts(model_config: Any) -> dict:
    """Parameter counts of a Llama-family model computed from its config.

    `total` is every parameter (the embedding table once more when the head is untied).
    `decode_read` is what a decode step reads: every linear weight (and bias), every norm gain and
    the lm_head; the embedding lookup touches only B rows, so the table counts only when it *is*
    the lm_head (tied).
    """
    c = model_config_of(model_config)
    h, d, L = c.hidden_size, c.head_dim, c.num_hidden_layers
    q_out, kv_out = c.num_attention_heads * d, c.num_key_value_heads * d
    attn = h * (q_out + 2 * kv_out) + q_out * h
    if c.attention_bias:
        attn += q_out + 2 * kv_out
    mlp = 3 * h * c.intermediate_size + (2 * c.intermediate_size + h if c.mlp_bias else 0)
    norms = 2 * h + (2 * d if c.qk_norm else 0)
    per_layer = attn + mlp + norms
    embed = c.vocab_size * h
    layers = L * per_layer
    decode_read = layers + h + embed  # layers + final norm + lm_head
    total = decode_read + (0 if c.tie_word_embeddings else embed)
    return {"layers": layers, "embedding": embed, "lm_head": embed, "decode_read": decode_read,
            "total": total, "tied": c.tie_word_embeddings}


def kv_bytes_per_token(model_config: Any, dtype: Any) -> int:
    """2 (K and V) * layers * kv_heads * head_dim * dtype bytes."""
    c = model_config_of(model_config)
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * dtype_bytes(dtype)


def roofline(model_config: Any, dtype: Any, batch_contexts: Sequence[int]) -> dict:
    """Bytes one decode step must read: weights once + each sequence's KV cache.

    `batch_contexts` are the context lengths (tokens attended over) of the sequences decoding in
    the step. Returns weight_bytes, kv_bytes, bytes_per_step (and the parameter counts).
    """
    counts = param_counts(model_config)
    nb = dtype_bytes(dtype)
    weight_bytes = counts["decode_read"] * nb
    kv_tok = kv_bytes_per_token(model_config, dtype)
    kv_bytes = kv_tok * int(sum(batch_contexts))
    return {"weight_bytes": weight_bytes, "weight_bytes_all_params": counts["total"] * nb,
            "kv_bytes_per_token": kv_tok, "kv_bytes": kv_bytes,
            "bytes_per_step": weight_bytes + kv_bytes, "params": counts}


def measure_bandwidth(device: Any, nbytes: Optional[int] = None, iters: int = 20) -> Optional[float]:
    """Memory bandwidth in bytes/s from a large same-device copy: each copy reads and writes
    `nbytes`, so bandwidth = 2 * nbytes * iters / time. On CPU a smaller copy gives DRAM speed."""
    dev = torch.device(device)
    if dev.type == "cuda":
        nbytes = nbytes or (1 << 30)  # 1 GiB, far above L2
    else:
        nbytes = nbytes or (256 << 20)
        iters = min(iters, 5)
    try:
        src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).uniform_()
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                dst.copy_(src)
            stop.record()
            stop.synchronize()
            seconds = start.elapsed_time(stop) / 1e3
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                dst.copy_(src)
            seconds = time.perf_counter() - t0
        del src, dst
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        return 2 * nbytes * iters / seconds
    except Exception as e:  # a benchmark should not die for a side measurement
        log(f"bandwidth measurement failed: {e}")
        return None


# ---- hardware and output -------------------------------------------------------------------

def hardware_description(device: Any) -> str:
    dev = torch.device(device)
    parts = []
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        parts.append(f"{props.name} ({props.total_memory / 2**30:.0f} GiB)")
        cuda = getattr(torch.version, "cuda", None)
        if cuda:
            parts.append(f"CUDA {cuda}")
    else:
        parts.append(f"{_cpu_model()}, {torch.get_num_threads()} torch threads "
                     f"({os.cpu_count()} logical CPUs)")
    parts.append(f"torch {torch.__version__}")
    try:
        import transformers

        parts.append(f"transformers {transformers.__version__}")
    except ImportError:
        pass
    parts.append(f"Python {platform.python_version()}")
    return ", ".join(parts)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return "-" if v is None else str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        a = abs(v)
        if a >= 1e4:
            return f"{v:,.0f}"
        if a >= 100:
            return f"{v:.1f}"
        if a >= 1:
            return f"{v:.2f}"
        return f"{v:.4f}" if a >= 1e-3 or a == 0 else f"{v:.3g}"
    return str(v)


def format_table(rows: Sequence[dict], columns: Optional[Sequence[str]] = None) -> str:
    """An aligned text table of `rows` (dicts); columns default to the union of keys in order."""
    if not rows:
        return "(no rows)"
    if columns is None:
        columns = []
        for r in rows:
            for k in r:
                if k not in columns:
                    columns.append(k)
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]

    def line(vals: Sequence[str]) -> str:
        out = []
        for i, v in enumerate(vals):
            out.append(v.ljust(widths[i]) if i == 0 else v.rjust(widths[i]))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(list(columns)), sep] + [line(r) for r in cells])


def print_table(rows: Sequence[dict], columns: Optional[Sequence[str]] = None, title: Optional[str] = None,
                file: Any = None) -> None:
    file = file or sys.stdout
    if title:
        print(f"\n== {title} ==", file=file)
    print(format_table(rows, columns), file=file, flush=True)


def save_json(path: Optional[str], rows: Any, meta: Optional[dict] = None) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    payload = {"meta": meta or {}, "rows": rows}
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=_json_default)
    log(f"wrote {path}")


def _json_default(o: Any) -> Any:
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if isinstance(o, torch.dtype):
        return str(o)
    return str(o)


def median(xs: Iterable[float]) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's). On a busy small CPU host, 1 avoids "
                             "OpenMP spin-waits that make tiny ops take milliseconds.")
    parser.add_argument("--quick", action="store_true", help="Small CPU smoke run (see the script's doc).")
    parser.add_argument("--out", default=None, help="Write the rows and metadata as JSON here.")
    parser.add_argument("--no-progress", action="store_true", help="No periodic progress lines on stderr.")


def apply_threads(args: argparse.Namespace) -> None:
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)


def want_hf(args: argparse.Namespace, device: str) -> bool:
    """The transformers comparison runs on CUDA by default, on CPU only with --hf."""
    if getattr(args, "no_hf", False):
        return False
    return bool(getattr(args, "hf", False)) or device == "cuda"


def add_hf_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf", action="store_true",
                        help="Also run Hugging Face transformers on the same weights (default on CUDA).")
    parser.add_argument("--no-hf", action="store_true", help="Skip the transformers comparison.")


def run_guarded(name: str, fn: Callable[[], Any]) -> tuple[Any, Optional[str]]:
    """Run `fn`; on an exception log it and return (None, message) so other results survive."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - benchmarks report, they do not crash
        import traceback

        traceback.print_exc(file=sys.stderr)
        msg = f"{type(e).__name__}: {e}"
        log(f"{name} failed: {msg}")
        return None, msg[:300]
