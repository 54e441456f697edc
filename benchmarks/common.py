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


PRESET_PREFIX = "preset:"
_preset_dirs: dict[str, str] = {}


def resolve_model_path(model_path: str) -> str:
    """`preset:ARCH/PRESET` (e.g. `preset:inkling/bench`, `preset:minimax_m3/tiny`) -> a temporary
    directory holding that preset's config.json from `kiln.models.presets` (named `ARCH-PRESET`,
    removed at exit); any other path is returned unchanged. Presets have no weights: run them with
    `--load-format dummy` (the benchmarks' default)."""
    if not str(model_path).startswith(PRESET_PREFIX):
        return model_path
    spec = str(model_path)[len(PRESET_PREFIX):]
    if spec in _preset_dirs:
        return _preset_dirs[spec]
    arch, sep, preset = spec.partition("/")
    if not sep:
        raise ValueError(f"--model-path {model_path!r}: expected preset:ARCH/PRESET, e.g. preset:inkling/bench")
    import atexit
    import shutil
    import tempfile

    from kiln.models.presets import get_preset

    cfg = get_preset(arch, preset)
    root = tempfile.mkdtemp(prefix="kiln-bench-preset-")
    atexit.register(shutil.rmtree, root, True)
    path = os.path.join(root, f"{arch}-{preset}")
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


def _param_seed(seed: int, name: str) -> int:
    import zlib

    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def device_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Kiln's dummy-weight recipe (norm gains and scalars 1, everything else N(0, 0.02), one
    generator per parameter seeded by `seed` and its name) drawn on the parameters' own device:
    seconds instead of minutes for a multi-billion-parameter model on a GPU. Same distribution
    as `kiln.loader.init_dummy_weights`, not the same values (that one draws on the CPU)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 0 or (param.dim() == 1 and "norm" in name.lower() and name.endswith("weight")):
                param.fill_(1.0)
                continue
            gen = torch.Generator(device=param.device)
            gen.manual_seed(_param_seed(seed, name))
            param.normal_(0.0, 0.02, generator=gen)


@contextlib.contextmanager
def _dummy_init_on_device():
    import kiln.engine.runner as runner_mod

    original = getattr(runner_mod, "init_dummy_weights", None)
    if original is None:
        yield
        return
    runner_mod.init_dummy_weights = device_dummy_weights
    try:
        yield
    finally:
        runner_mod.init_dummy_weights = original


def resolve_dummy_init(choice: str, device: str) -> str:
    """`--dummy-init auto`: on the device for CUDA, Kiln's own CPU-drawn init elsewhere."""
    if choice == "auto":
        return "device" if str(device).startswith("cuda") else "kiln"
    return choice


def build_core(config: EngineConfig, hf_model: Optional[torch.nn.Module] = None, dummy_init: str = "kiln"):
    """An `EngineCore` for `config`; with `hf_model`, Kiln's weights are that model's tensors.
    Without it and with dummy weights, `dummy_init="device"` draws them on the device
    (`device_dummy_weights`) instead of Kiln's CPU init."""
    from kiln.engine.core import EngineCore

    t0 = time.perf_counter()
    if hf_model is None:
        on_device = (dummy_init == "device" and config.load_format == "dummy" and config.tp_size == 1)
        with (_dummy_init_on_device() if on_device else contextlib.nullcontext()):
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


# ---- roofline from an instantiated Kiln model (any architecture) ---------------------------

EXPERTS_ASSUMPTION = ("each token picks k of E routed experts uniformly and independently of the other "
                      "tokens, so a step at batch B reads E*(1-(1-k/E)^B) distinct experts per MoE layer "
                      "(exactly k at batch 1)")


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """E * (1 - (1 - k/E)^B): distinct experts a decode step of B tokens hits in one MoE layer
    under uniform independent routing (`EXPERTS_ASSUMPTION`); exactly k at B = 1."""
    if batch <= 0:
        return 0.0
    if batch == 1:
        return float(top_k)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def meta_model(path_or_dict: Any, dtype: Any = torch.bfloat16) -> torch.nn.Module:
    """Kiln's model class for a config dir / config.json / dict, built on the meta device (shapes
    and dtypes, no memory, no init) with parameters in `dtype` as the runner serves them, buffers
    left as built. Single rank (no tensor parallelism)."""
    from kiln.models.registry import get_model_class, parse_model_config

    if isinstance(path_or_dict, dict):
        d = path_or_dict
    else:
        path = str(path_or_dict)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            d = json.load(f)
    cfg = parse_model_config(d)
    dt = dtype if isinstance(dtype, torch.dtype) else ({"auto": torch.bfloat16}.get(dtype) or getattr(torch, dtype))
    with torch.device("meta"):
        model = get_model_class(cfg.model_type)(cfg)
    for p in model.parameters():
        p.data = p.data.to(dt)
    return model


def _param_bytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def _not_run_in_decode(module: torch.nn.Module) -> bool:
    """MTP layers and the DSpark drafter: loaded with the checkpoint, not run by a decode step."""
    from kiln.models.dspark import DSpark
    from kiln.models.inkling import InklingMTPLayer

    return isinstance(module, (InklingMTPLayer, DSpark))


def roofline_bytes(model: torch.nn.Module, batch_contexts: Sequence[float],
                   kv_dtype: Optional[torch.dtype] = None) -> dict:
    """Bytes one decode step must read, counted from an instantiated Kiln model (any device,
    `meta_model` included): every parameter once, except

    - the token embedding table: a step touches only B rows, counted as 0 (as `roofline` does),
      unless the table is tied to the LM head (then it is the LM head, read in full);
    - MTP layers and the DSpark drafter: not run by a decode step, not counted;
    - routed experts: only the experts hit are read, E*(1-(1-k/E)^B) of E per MoE layer at batch B
      (`EXPERTS_ASSUMPTION`; exactly k at batch 1). Shared experts and routers are always read.

    plus the state of each of the B sequences (`batch_contexts`: tokens attended over, the new
    one included), from `model.state_specs()` in `kv_dtype` (default: the parameters' dtype):
    full-attention K/V of the whole context; sliding-window K/V of min(ctx, W) tokens; ShortConv
    the K-1 previous inputs per site; MSA (MiniMax-M3) the indexer keys of the whole context plus
    K/V of only the N*B selected tokens (min with ctx). Writes of the new token are not counted.

    Returns weight_bytes (read at this batch), active_weight_bytes (batch 1: dense + shared + k/E
    of routed), kv_bytes, bytes_per_step, their breakdowns (`weights`, `kv`), parameter counts
    (`params`: decode_read at this batch, active at batch 1, total) and `kv_bytes_per_token`
    (the state that grows with the context, per token). For a Llama-family model every number
    equals `roofline`'s.
    """
    from kiln.engine.cache.components import ComponentKind
    from kiln.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from kiln.layers.moe import Experts, SharedExperts
    from kiln.layers.msa import MSAAttention

    contexts = [float(c) for c in batch_contexts]
    batch = len(contexts)

    # Classify each parameter tensor (by id: a tied tensor has two names but is read once).
    lm_head_ids, embed_ids, routed_ids, shared_ids = set(), set(), set(), set()
    experts: list[tuple[Experts, int]] = []  # (routed experts, top_k of the router beside them)
    skipped_prefixes = []
    for name, mod in model.named_modules():
        own = {id(p) for p in mod.parameters(recurse=False)}
        if isinstance(mod, ParallelLMHead):
            lm_head_ids |= own
        elif isinstance(mod, VocabParallelEmbedding):
            embed_ids |= own
        if name and _not_run_in_decode(mod):
            skipped_prefixes.append(name + ".")
        if isinstance(mod, SharedExperts):
            shared_ids |= {id(p) for p in mod.parameters()}
        if isinstance(mod, Experts):
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            top_k = next((m.top_k for m in parent.children() if hasattr(m, "top_k")), None)
            if top_k is None:
                raise ValueError(f"roofline_bytes: no router with top_k beside {name}")
            experts.append((mod, int(top_k)))
            routed_ids |= {id(p) for p in mod.parameters()}
    # A tensor reachable outside the MTP layers / drafter is run (a drafter may share some).
    run_ids = {id(p) for n, p in model.named_parameters(remove_duplicate=False)
               if not any(n.startswith(pre) for pre in skipped_prefixes)}

    counts = dict.fromkeys(("dense", "shared_experts", "lm_head", "routed", "embedding", "not_in_decode"), 0)
    nbytes = dict(counts)
    for p in model.parameters():  # each tensor once
        i = id(p)
        if i in lm_head_ids:
            kind = "lm_head"
        elif i in embed_ids:
            kind = "embedding"
        elif i not in run_ids:
            kind = "not_in_decode"
        elif i in routed_ids:
            kind = "routed"
        elif i in shared_ids:
            kind = "shared_experts"
        else:
            kind = "dense"
        counts[kind] += p.numel()
        nbytes[kind] += _param_bytes(p)

    always_bytes = nbytes["dense"] + nbytes["shared_experts"] + nbytes["lm_head"]
    always_count = counts["dense"] + counts["shared_experts"] + counts["lm_head"]
    routed_read = routed_read_b1 = routed_count = routed_count_b1 = 0.0
    moe = None
    for mod, k in experts:
        e = mod.num_experts
        per_bytes = sum(_param_bytes(p) for p in mod.parameters()) / e
        per_count = sum(p.numel() for p in mod.parameters()) / e
        hit = expected_distinct_experts(e, k, batch)
        routed_read += hit * per_bytes
        routed_count += hit * per_count
        routed_read_b1 += k * per_bytes
        routed_count_b1 += k * per_count
        moe = moe or {"experts": e, "top_k": k, "layers": 0, "expected_experts_hit": hit}
        moe["layers"] += 1

    def _num(x: float):  # ints stay ints (dense models: exact byte counts)
        return int(x) if float(x).is_integer() else x

    # Per-sequence state.
    dt = kv_dtype or next(iter(model.parameters())).dtype
    msa_tokens = {m.layer_id: m.block_size * m.topk_blocks for m in model.modules() if isinstance(m, MSAAttention)}
    kv = dict.fromkeys(("full_kv", "swa_kv", "conv", "index_k", "msa_kv"), 0.0)
    per_token = 0
    for spec in model.state_specs():
        per_layer = spec.bytes_per_token(dt) // len(spec.layer_ids)
        for layer in spec.layer_ids:
            msa = spec.kind is ComponentKind.FULL_KV and layer in msa_tokens
            if spec.kind is ComponentKind.INDEX_K or (spec.kind is ComponentKind.FULL_KV and not msa):
                per_token += per_layer
            for ctx in contexts:
                if msa:
                    kv["msa_kv"] += per_layer * min(ctx, msa_tokens[layer])
                elif spec.kind is ComponentKind.FULL_KV:
                    kv["full_kv"] += per_layer * ctx
                elif spec.kind is ComponentKind.INDEX_K:
                    kv["index_k"] += per_layer * ctx
                elif spec.kind is ComponentKind.SWA_KV:
                    kv["swa_kv"] += per_layer * min(ctx, spec.window)
                elif spec.kind is ComponentKind.CONV:
                    kv["conv"] += per_layer * spec.window  # the K-1 previous inputs
                else:
                    raise ValueError(f"roofline_bytes: no rule for state component {spec.kind}")
    kv = {k: _num(v) for k, v in kv.items()}
    kv_bytes = _num(sum(kv.values()))
    weight_bytes = _num(always_bytes + routed_read)

    params = {"total": sum(counts.values()), **counts,
              "decode_read": _num(always_count + routed_count), "active": _num(always_count + routed_count_b1),
              "tied": bool(embed_ids & lm_head_ids)}
    weights = {"dense": nbytes["dense"], "shared_experts": nbytes["shared_experts"], "lm_head": nbytes["lm_head"],
               "routed_read": _num(routed_read), "routed_all": nbytes["routed"],
               "embedding_not_read": nbytes["embedding"], "not_in_decode": nbytes["not_in_decode"]}
    return {"batch": batch, "contexts": contexts, "weight_bytes": weight_bytes,
            "active_weight_bytes": _num(always_bytes + routed_read_b1),
            "weight_bytes_all_params": sum(nbytes.values()), "weights": weights, "moe": moe,
            "experts_assumption": EXPERTS_ASSUMPTION if moe else None,
            "kv_bytes": kv_bytes, "kv": kv, "kv_bytes_per_token": per_token, "kv_dtype": str(dt),
            "bytes_per_step": _num(weight_bytes + kv_bytes), "params": params}


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


def want_hf(args: argparse.Namespace, device: str) -> bool:
    """The transformers comparison runs on CUDA by default, on CPU only with --hf."""
    if getattr(args, "no_hf", False):
        return False
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
