"""Shared helpers for Kiln's benchmarks: argument parsing, engine construction, the timed request
loop, the hardware string, and table / JSON output. The decode roofline and memory bandwidth are in
`roofline.py`, the transformers twin of a dummy model in `hf_baseline.py`.

Every benchmark runs a config-only model directory (`benchmarks/configs/<name>/config.json`) with
random ("dummy") weights, token ids in and out, so no checkpoint or tokenizer is needed. When a
benchmark compares against Hugging Face transformers, `hf_baseline.make_hf_model` builds the
transformers model with seeded random weights and `build_core(..., hf_model=...)` loads exactly
those tensors into Kiln through the model's own `load_weights` (the checkpoint path), so both
engines run the same weights.
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

from dummy_weights import device_dummy_weights, dummy_init_on_device, no_dummy_init, resolve_dummy_init  # noqa: F401,E402
from kiln.config import EngineConfig  # noqa: E402
from kiln.engine.io import GenerateReq  # noqa: E402
from kiln.engine.request import SamplingParams  # noqa: E402
from kiln.models.config import ModelConfig  # noqa: E402

CONFIGS_DIR = os.path.join(REPO_ROOT, "benchmarks", "configs")
DEFAULT_MODEL_PATH = os.path.join(CONFIGS_DIR, "qwen3-0.6b")


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


PRESET_PREFIX = "preset:"
_preset_dirs: dict[str, str] = {}


def resolve_model_path(model_path: str) -> str:
    """`preset:ARCH/PRESET` (e.g. `preset:inkling/bench`, `preset:minimax_m3/tiny`) -> a temporary
    directory holding that preset's config.json from `kiln.models.presets` (named `ARCH-PRESET`,
    removed at exit); any other path is returned unchanged. `preset:minimax_m3/PRESET+dspark` adds
    the preset's DSpark drafter (`presets.with_dspark`; `--speculative-algorithm dspark`). Presets
    have no weights: run them with `--load-format dummy` (the benchmarks' default)."""
    if not str(model_path).startswith(PRESET_PREFIX):
        return model_path
    spec = str(model_path)[len(PRESET_PREFIX):]
    if spec in _preset_dirs:
        return _preset_dirs[spec]
    from kiln.models.presets import DSPARK_SUFFIX, get_preset

    arch, sep, preset = spec.partition("/")
    if not sep:
        raise ValueError(f"--model-path {model_path!r}: expected preset:ARCH/PRESET, e.g. preset:inkling/bench")
    name, preset = preset, preset.removesuffix(DSPARK_SUFFIX)
    dspark = preset != name
    import atexit
    import shutil
    import tempfile

    cfg = get_preset(arch, preset, dspark=dspark)
    root = tempfile.mkdtemp(prefix="kiln-bench-preset-")
    atexit.register(shutil.rmtree, root, True)
    path = os.path.join(root, f"{arch}-{name}")
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    _preset_dirs[spec] = path
    log(f"{model_path}: config.json written to {path} (dummy weights)")
    return path


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """EngineConfig from the parsed flags; a `preset:ARCH/PRESET` model path becomes a config dir
    (`resolve_model_path`) loaded with dummy weights."""
    if str(args.model_path).startswith(PRESET_PREFIX):
        args.model_path = resolve_model_path(args.model_path)
        args.load_format = "dummy"
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


def build_core(config: EngineConfig, hf_model: Optional[torch.nn.Module] = None, dummy_init: str = "kiln"):
    """An `EngineCore` for `config`; with `hf_model`, Kiln's weights are that model's tensors.
    Without it and with dummy weights, `dummy_init="device"` draws them on the device
    (`device_dummy_weights`) instead of Kiln's CPU init."""
    from kiln.dist.init import from_torchrun_env
    from kiln.engine.core import EngineCore

    t0 = time.perf_counter()
    pc = from_torchrun_env(config.resolved_device()) if config.tp_size > 1 else None
    if pc is not None and pc.tp_size != config.tp_size:
        raise SystemExit(f"--tp-size {config.tp_size}: run under torchrun --nproc-per-node {config.tp_size}")
    if hf_model is None:
        on_device = dummy_init == "device" and config.load_format == "dummy"
        with (dummy_init_on_device() if on_device else contextlib.nullcontext()):
            core = EngineCore(config, pc=pc) if pc is not None else EngineCore(config)
    else:
        if config.tp_size != 1:
            raise ValueError("loading the transformers twin's weights needs --tp-size 1")
        from hf_baseline import load_hf_weights

        with no_dummy_init():
            core = EngineCore(config)
        load_hf_weights(core, hf_model)
    from kiln.engine.gc_tuning import tune_gc

    tune_gc()  # as the server's scheduler process does (release_memory unfreezes)
    log(f"Kiln core ready in {time.perf_counter() - t0:.1f}s "
        f"(KV pool {core.info.max_total_tokens} tokens, device {config.resolved_device()}, "
        f"dtype {config.resolved_dtype()})")
    return core


class GcTimer:
    """Counts the cyclic collector's runs and their time while open (`gc.callbacks`), so that a
    benchmark row can say whether collections ran inside its measurement."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = 0.0
        self._t0 = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self.collections[info["generation"]] += 1
            self._t0 = None

    def __enter__(self) -> "GcTimer":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def note(self) -> str:
        """"gc N (gen0/gen1/gen2) X ms; " or "" when nothing was collected."""
        n = sum(self.collections)
        return f"gc {n} ({'/'.join(map(str, self.collections))}) {self.seconds * 1e3:.1f} ms; " if n else ""


def release_memory() -> None:
    """After `del core` (or any large object): collect cycles and give cached device memory back,
    so the next engine starts with the GPU free (build_core froze the heap: unfrozen first, or
    the dropped core's reference cycles would outlive it)."""
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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


def fmt_bytes(n: float) -> str:
    """1.23 GB / 45.6 MB / 7.8 KB / 12 B (decimal units)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.{4 if unit == 'GB' else 2}f} {unit}"
    return f"{n:.0f} B"


def fmt_count(n: float) -> str:
    """Parameter counts: 5.75B / 812.3M / 6.6K."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.{2 if unit == 'B' else 1}f}{unit}"
    return f"{n:.0f}"


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
    parser.add_argument("--dummy-init", choices=["auto", "kiln", "device"], default="auto",
                        help="Dummy weights without the transformers twin: 'kiln' = Kiln's own init (drawn "
                             "on the CPU: minutes for billions of parameters), 'device' = the same "
                             "distribution drawn on the device, 'auto' = device on CUDA, kiln elsewhere.")


def apply_threads(args: argparse.Namespace) -> None:
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)


def setup(args: argparse.Namespace) -> tuple[EngineConfig, str, torch.dtype, ModelConfig]:
    """`--threads` applied, then (EngineConfig, its device, its dtype, the model's ModelConfig)."""
    apply_threads(args)
    config = engine_config(args)
    return config, config.resolved_device(), config.resolved_dtype(), model_config_of(config.model_path)


def model_name(model_path: str) -> str:
    """The model dir's name, for table titles (`qwen3-0.6b`, `inkling-tiny`)."""
    return os.path.basename(os.path.normpath(model_path))


def run_meta(benchmark: str, argv: Optional[list[str]], hardware: str, config: EngineConfig, dtype: Any,
             device: str, **extra: Any) -> dict:
    """The JSON metadata every benchmark saves, then `extra`."""
    return {"benchmark": benchmark, "argv": sys.argv if argv is None else argv, "hardware": hardware,
            "model_path": config.model_path, "dtype": str(dtype), "device": device, **extra}


def report(rows: list[dict], columns: Sequence[str], title: str, hardware: str, meta: dict,
           out: Optional[str], header_lines: Sequence[str] = ()) -> dict:
    """The final output: the hardware line, `header_lines`, the table on stdout; rows and `meta`
    to `out` as JSON. Returns {"rows", "meta"} (what each script's main returns). Under torchrun
    (tensor parallelism) only rank 0 reports: every rank ran the same workload."""
    if int(os.environ.get("RANK", "0")) != 0:
        return {"rows": rows, "meta": meta}
    print(f"\n# {hardware}")
    for line in header_lines:
        print(line)
    print_table(rows, columns, title=title)
    save_json(out, rows, meta)
    return {"rows": rows, "meta": meta}


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
