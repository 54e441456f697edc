"""The decode roofline of Kiln's benchmarks: parameter and byte counts of a decode step (from a
Llama-family config, `roofline`, or from an instantiated Kiln model of any architecture,
`roofline_bytes`) and the device's measured memory bandwidth (`measure_bandwidth`).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional, Sequence

import torch

from common import log, model_config_of

H200_NOMINAL_BW = 4.8e12  # bytes/s, NVIDIA's HBM3e spec for the H200 SXM

_DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


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
    from kiln.models.block_drafter import BlockDrafter
    from kiln.models.mtp import MTPLayer

    return isinstance(module, (MTPLayer, BlockDrafter))


def roofline_bytes(model: torch.nn.Module, batch_contexts: Sequence[float],
                   kv_dtype: Optional[torch.dtype] = None, experts_hit: Optional[float] = None) -> dict:
    """Bytes one decode step must read, counted from an instantiated Kiln model (any device,
    `meta_model` included): every parameter once, except

    - the token embedding table: a step touches only B rows, counted as 0 (as `roofline` does),
      unless the table is tied to the LM head (then it is the LM head, read in full);
    - MTP layers and the DSpark drafter: not run by a decode step, not counted;
    - routed experts: only the experts hit are read, E*(1-(1-k/E)^B) of E per MoE layer at batch B
      (`EXPERTS_ASSUMPTION`; exactly k at batch 1), or `experts_hit` per MoE layer when given (a
      count measured with `decode_batch.py --count-experts`). Shared experts and routers are
      always read.

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
        hit = expected_distinct_experts(e, k, batch) if experts_hit is None else float(experts_hit)
        if batch and not k <= hit <= e:
            raise ValueError(f"{hit:g} experts hit per MoE layer: top-{k} of {e} experts hits between {k} and {e}")
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


def per_gpu(rl: dict, tp_size: int) -> dict:
    """`roofline_bytes` for one of `tp_size` tensor-parallel ranks: each reads 1/tp of the bytes
    (every linear layer, the vocabulary-parallel LM head and the KV heads are split; the replicated
    norms and router gates are a rounding error), so the per-GPU roofline is tp times higher."""
    if tp_size <= 1:
        return rl
    out = dict(rl, tp_size=tp_size)
    for key in ("weight_bytes", "active_weight_bytes", "kv_bytes", "bytes_per_step"):
        out[key] = rl[key] / tp_size
    return out


def _unique_bytes(modules: Sequence[torch.nn.Module]) -> int:
    """Parameter bytes of `modules`, each tensor once."""
    seen = {id(p): _param_bytes(p) for m in modules for p in m.parameters()}
    return sum(seen.values())


def round_bytes(model: torch.nn.Module, contexts: Sequence[float], num_steps: int, algorithm: str,
                drafter: Optional[torch.nn.Module] = None, draft_head_rows: Optional[int] = None,
                tp_size: int = 1, verify_experts_hit: Optional[float] = None) -> dict:
    """Bytes one speculative round must read with K = `num_steps` drafts for each of the B sequences
    of `contexts` (per GPU, as `per_gpu`):

    - the verify: the target's weights at B (K + 1) rows (`roofline_bytes`: for MoE the distinct
      experts those rows hit under uniform routing, or `verify_experts_hit` per MoE layer) and the
      state of the B sequences, once (a sequence's K + 1 rows share it);
    - the drafter: `mtp`, the first K MTP layers and K draft heads (the chain runs each layer and
      its head once per round); `dflash` / `dspark`, the block drafter (`drafter`: DFlash's own
      module; DSpark's is inside `model`) and one draft head for the K rows of a block; `ngram`,
      nothing. A draft head reads the LM head, or its `draft_head_rows` rows with a token map.
      The drafters' own caches (MTP windows, a block drafter's context K/V) are not counted.

    Returns verify_weight_bytes, kv_bytes, drafter_bytes, draft_head_bytes and bytes_per_round. The
    drafter is replicated under tensor parallelism, so only the target's parts are divided.
    """
    from kiln.models.block_drafter import BlockDrafter
    from kiln.models.mtp import MTPLayer

    assert num_steps >= 1, num_steps
    verify = per_gpu(roofline_bytes(model, [c for c in contexts for _ in range(num_steps + 1)],
                                    experts_hit=verify_experts_hit), tp_size)
    state = per_gpu(roofline_bytes(model, contexts), tp_size)
    vocab = model.lm_head.vocab_size
    head = verify["weights"]["lm_head"] // vocab * (vocab if draft_head_rows is None else draft_head_rows)
    head = head / tp_size if tp_size > 1 else head
    if algorithm == "mtp":
        layers = sorted((m for m in model.modules() if isinstance(m, MTPLayer)), key=lambda m: m.k)[:num_steps]
        assert len(layers) == num_steps, f"{num_steps} MTP steps, {len(layers)} MTP layers"
        drafter_bytes, heads = _unique_bytes(layers), num_steps
    elif algorithm in ("dflash", "dspark"):
        if drafter is None:
            drafter = next((m for m in model.modules() if isinstance(m, BlockDrafter)), None)
        assert drafter is not None, f"{algorithm}: no block drafter given or inside the model"
        drafter_bytes, heads = _unique_bytes([drafter]), 1
    elif algorithm == "ngram":
        drafter_bytes, heads = 0, 0
    else:
        raise ValueError(f"round_bytes: unknown speculative algorithm {algorithm!r}")
    out = {"verify_weight_bytes": verify["weight_bytes"], "kv_bytes": state["kv_bytes"],
           "drafter_bytes": drafter_bytes, "draft_head_bytes": heads * head}
    out["bytes_per_round"] = sum(out.values())
    return out


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
