"""Reference MoE ops in plain PyTorch: the two routers and the routed experts.

These are the spec that fused kernels (sigmoid top-k + renormalisation, grouped expert GEMMs) are
tested against. Router math is fp32; expert activations and the weighted sum are fp32 with one cast
at the end (MODELS.md 2.3, 3.2).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def topk_lower_id(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row, in descending order; equal scores go to the lower
    index. torch.topk does not promise an order among ties, a stable sort does."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def sink_gate_ref(x: torch.Tensor, weight: torch.Tensor, expert_bias: torch.Tensor,
                  global_scale: torch.Tensor, top_k: int, route_scale: float,
                  forced_ids: Optional[torch.Tensor] = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inkling's router (MODELS.md 2.3): shared experts compete for one normalised budget.

    x [T, H]; weight [E+S, H] (rows E.. score the shared experts); expert_bias [E];
    global_scale [] (learned). Returns (topk_ids [T, k] int64, routed_w [T, k] fp32,
    shared_w [T, S] fp32). `forced_ids` (routing replay) replaces the selection; the weights are
    still computed from the live logits, so gradients reach the router.
    """
    e = expert_bias.shape[0]
    s = weight.shape[0] - e
    z = F.linear(x.float(), weight.float())  # [T, E+S]
    if forced_ids is None:
        with torch.no_grad():  # selection is not differentiable; the bias only steers it
            ids = topk_lower_id(torch.sigmoid(z[:, :e]) + expert_bias.float(), top_k)
    else:
        ids = forced_ids.to(device=z.device, dtype=torch.long)
    shared = torch.arange(e, e + s, device=z.device).expand(z.shape[0], s)
    z_j = z.gather(1, torch.cat([ids, shared], dim=1))
    # softmax(logsigmoid(z)) == sigmoid(z_j) / sum_J sigmoid(z), without overflow or underflow.
    w = torch.softmax(F.logsigmoid(z_j), dim=-1) * (route_scale * global_scale.float())
    return ids, w[:, :top_k], w[:, top_k:]


def minimax_gate_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int,
                     routed_scaling_factor: float, forced_ids: Optional[torch.Tensor] = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMax-M3's router (MODELS.md 3.2): sigmoid scores, top-k of score + bias, weights are the
    selected scores renormalised and scaled. Returns (topk_ids [T, k] int64, routed_w [T, k] fp32)."""
    s = torch.sigmoid(F.linear(x.float(), weight.float()))  # [T, E]
    if forced_ids is None:
        with torch.no_grad():
            ids = topk_lower_id(s + bias.float(), top_k)
    else:
        ids = forced_ids.to(device=s.device, dtype=torch.long)
    s_t = s.gather(1, ids)
    return ids, s_t / s_t.sum(-1, keepdim=True) * routed_scaling_factor


def swiglu_act(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, gate and up stacked on the last dim. Returns fp32."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return F.silu(gate) * up


def experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
                act: Callable[[torch.Tensor], torch.Tensor] = swiglu_act) -> torch.Tensor:
    """sum_j w_j * Expert_{id_j}(x) for routed SwiGLU experts, looping over experts that got tokens.

    x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_ids [T, k];
    topk_weights [T, k] fp32. The GEMMs run in the weights' dtype; the activation product, the
    routing weight and the sum over the k slots are fp32; the result is cast once to `out_dtype`
    (x's dtype by default; pass torch.float32 to keep adding in fp32, e.g. shared experts).
    The k slots of a token are summed in selection order, so the result is deterministic.
    `act` computes the fp32 activation product (a layer passes the Triton kernel on CUDA).

    The (token, slot) pairs are sorted by expert once (stable: within an expert, in slot order)
    and put back in slot order with one gather, so an expert's rows reach its GEMMs as a slice
    and the loop reads the expert counts with one host synchronisation. (The trainer runs this
    under autograd: a scatter into the whole [T * k, H] buffer per expert had copied it E times.)
    """
    rows, order, counts = _slots_by_expert(x, topk_ids, w13.shape[0])
    # Per-expert views from one unbind: its backward stacks the experts' gradients once, where
    # indexing w13[e] in the loop made each expert's backward a zero-filled full-size gradient
    # added into the parameter's (E times the stacked weights' bytes).
    w13s, w2s = w13.unbind(0), w2.unbind(0)
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            a = act(F.linear(rows[start:start + n], w13s[e]))
            outs.append(F.linear(a.to(w2.dtype), w2s[e]).float())
            start += n
    return _weighted_slot_sum(torch.cat(outs), order, topk_weights, out_dtype or x.dtype)


def _slots_by_expert(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x's row per (token, slot) pair sorted by expert (stable: within an expert, in slot order),
    the sorting permutation, the pairs per expert [E])."""
    k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # slot indices grouped by expert
    # x's row per slot, then the permutation (each row once): the repeat's backward adds a
    # token's k slot gradients in slot order, not in whatever order an index with repeated rows
    # accumulates them.
    rows = x.repeat_interleave(k, dim=0)[order]
    return rows, order, torch.bincount(flat_ids, minlength=num_experts)


def _weighted_slot_sum(y: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """The experts' fp32 rows `y` (in `_slots_by_expert` order) times their routing weights, put
    back in slot order and summed over each token's k slots (in selection order), cast once."""
    t, k = topk_weights.shape
    y = y * topk_weights.reshape(-1).float()[order, None]
    slots = y[torch.argsort(order)]  # back to slot order
    return slots.view(t, k, -1).sum(dim=1).to(out_dtype)


def experts_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
                    act: Callable[[torch.Tensor], torch.Tensor] = swiglu_act) -> torch.Tensor:
    """`experts_ref` with each projection as one grouped GEMM (`torch._grouped_mm`) over the
    expert-sorted rows: the same arguments, sorting, fp32 weighted sum and slot order.

    Two GEMM launches per layer instead of two per expert, autograd included (its backward is
    grouped too), and no host synchronisation (the group offsets stay on the device). This is what
    the trainer's recompute and backward run; `grouped_mm_supported` says where it applies.
    """
    rows, order, counts = _slots_by_expert(x, topk_ids, w13.shape[0])
    ends = torch.cumsum(counts, 0).to(torch.int32)
    a = act(torch._grouped_mm(rows, w13.transpose(1, 2), offs=ends))
    y = torch._grouped_mm(a.to(w2.dtype), w2.transpose(1, 2), offs=ends).float()
    return _weighted_slot_sum(y, order, topk_weights, out_dtype or x.dtype)


@functools.lru_cache(maxsize=None)
def _grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """One tiny grouped GEMM, forward and backward, with autograd on whatever the caller's mode
    (the first caller may be an engine's forward): torch's grouped GEMM is a private op whose
    coverage varies by version, device and dtype (torch 2.13's CPU build and 2.11's sm_90 build
    have it in bf16 and fp32). Where it fails, the reason is logged once and the loop runs."""
    if not hasattr(torch, "_grouped_mm"):
        logger.info("torch %s has no _grouped_mm: the routed experts run per expert", torch.__version__)
        return False
    try:
        with torch.inference_mode(False), torch.enable_grad():
            a = torch.ones(16, 8, device=device_type, dtype=dtype, requires_grad=True)
            b = torch.ones(2, 8, 8, device=device_type, dtype=dtype, requires_grad=True)
            y = torch._grouped_mm(a, b, offs=torch.tensor([8, 16], device=device_type, dtype=torch.int32))
            y.backward(torch.ones_like(y))
    except (RuntimeError, NotImplementedError) as e:  # what torch raises for an unsupported device / dtype
        logger.info("no grouped GEMM on %s in %s (%s): the routed experts run per expert", device_type, dtype, e)
        return False
    assert bool((y == 8).all()) and b.grad is not None, "torch._grouped_mm gave a wrong result"
    return True


def grouped_mm_supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether `experts_grouped` runs here: torch has a grouped GEMM for this device and dtype,
    and every row the GEMMs read or write is a multiple of 16 bytes (the op's stride rule)."""
    if x.dtype != w13.dtype or w13.dtype != w2.dtype or x.device != w13.device:
        return False
    size = w13.element_size()
    if any(n * size % 16 for n in (x.shape[-1], w13.shape[1], w2.shape[2])):
        return False
    return _grouped_mm_works(x.device.type, x.dtype)


def experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
                   act: Callable[[torch.Tensor], torch.Tensor] = swiglu_act) -> torch.Tensor:
    """The routed experts in PyTorch ops (the path without the fused kernels: CPU, autograd):
    `experts_grouped` where `grouped_mm_supported`, else the per-expert loop of `experts_ref`."""
    fn = experts_grouped if grouped_mm_supported(x, w13, w2) else experts_ref
    return fn(x, w13, w2, topk_ids, topk_weights, out_dtype, act)


def shared_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       weights: Optional[torch.Tensor] = None,
                       act: Callable[[torch.Tensor], torch.Tensor] = swiglu_act) -> torch.Tensor:
    """S SwiGLU experts in the linearised layout, as two dense GEMMs. Returns fp32 [T, H].

    w13 [2*S*I, H] = [gate_0; ..; gate_{S-1}; up_0; ..; up_{S-1}]; w2 [H, S*I] = [down_0 | .. ].
    weights [T, S] fp32 (None: every shared expert has weight 1) scale each expert's slice of the
    intermediate activations, so down(sum) = sum_s w_s * down_s(act_s). `act` as in `experts_ref`.
    """
    a = act(F.linear(x, w13))  # [T, S*I]
    if weights is not None:
        inter = a.shape[1] // weights.shape[1]
        a = a * weights.float().repeat_interleave(inter, dim=1)
    return F.linear(a.to(w2.dtype), w2).float()
