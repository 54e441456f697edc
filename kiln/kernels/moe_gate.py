"""Triton MoE routers: sigmoid + bias + top-k + renormalisation in one kernel.

`sink_gate` / `minimax_gate` return what `kiln.ops.moe.sink_gate_ref` / `minimax_gate_ref` return
with `forced_ids=None` (routing replay stays on the references): the same ids, ties to the lower
id, and the weights to ~1e-6. The router GEMM stays in torch (fp32 `F.linear`, the very call the
references make, so both see bit-identical logits); one program then handles BLOCK_T tokens with
all E (+S) logits of a token in registers.

Selection must match `topk_lower_id(sigmoid(z) + bias)` bit for bit, so the kernel computes the
sigmoid exactly as PyTorch's CUDA kernel does, 1 / (1 + expf(-z)) with full-precision expf and an
IEEE division (Triton's own `tl.exp` and `/` are the fast approximations). Top-k is k rounds of
"largest score, lowest id among equals", which is what a stable descending sort gives. Under
Triton's CPU interpreter (tests) libdevice is unavailable and numpy's exp stands in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.kernels.launch import pdl_launch, wait_for_previous
from triton.language.extra import libdevice

from kiln.kernels import interpreting


@triton.jit
def _sigmoid_exact(z, PRECISE: tl.constexpr):
    if PRECISE:
        return tl.math.div_rn(1.0, 1.0 + libdevice.exp(-z))
    else:
        return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _select_topk(score, cols, K: tl.constexpr, N_PAD: tl.constexpr):
    """Rank [BT, N_PAD] int32: j for the column picked in round j, -1 elsewhere. `score` is -inf
    where a column may not be picked."""
    rank = tl.full(score.shape, -1, tl.int32)
    for j in tl.static_range(K):
        best = tl.max(score, axis=1)
        pick = tl.min(tl.where(score == best[:, None], cols[None, :], N_PAD), axis=1)
        hit = cols[None, :] == pick[:, None]
        rank = tl.where(hit, j, rank)
        score = tl.where(hit, float("-inf"), score)
    return rank


@triton.jit
def _store_selection(rank, w, cols, rows, row_ok, ids_ptr, w_ptr, K: tl.constexpr):
    for j in tl.static_range(K):
        sel = rank == j
        tl.store(ids_ptr + rows * K + j, tl.sum(tl.where(sel, cols[None, :], 0), axis=1).to(tl.int64),
                 mask=row_ok)
        tl.store(w_ptr + rows * K + j, tl.sum(tl.where(sel, w, 0.0), axis=1), mask=row_ok)


@triton.jit
def _sink_gate_kernel(z_ptr, bias_ptr, gscale_ptr, ids_ptr, rw_ptr, sw_ptr, T, route_scale,
                      E: tl.constexpr, S: tl.constexpr, K: tl.constexpr, N_PAD: tl.constexpr,
                      BLOCK_T: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    cols = tl.arange(0, N_PAD)
    routed = cols < E
    is_shared = (cols >= E) & (cols < E + S)
    z = tl.load(z_ptr + rows[:, None].to(tl.int64) * (E + S) + cols[None, :],
                mask=row_ok[:, None] & (cols < E + S)[None, :], other=0.0)
    bias = tl.load(bias_ptr + cols, mask=routed, other=0.0).to(tl.float32)
    score = tl.where(routed[None, :], _sigmoid_exact(z, PRECISE) + bias[None, :], float("-inf"))
    rank = _select_topk(score, cols, K, N_PAD)
    # softmax(logsigmoid(z)) over the selected routed and all shared logits (= s_j / sum s),
    # in the log domain so that very negative logits neither underflow nor divide 0 by 0.
    member = (rank >= 0) | is_shared[None, :]
    log_s = tl.minimum(z, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(z)))
    log_s = tl.where(member, log_s, float("-inf"))
    p = tl.exp(log_s - tl.max(log_s, axis=1)[:, None])
    scale = route_scale * tl.load(gscale_ptr).to(tl.float32)
    w = p / tl.sum(p, axis=1)[:, None] * scale
    _store_selection(rank, w, cols, rows, row_ok, ids_ptr, rw_ptr, K)
    if S > 0:
        tl.store(sw_ptr + rows[:, None] * S + (cols - E)[None, :], w,
                 mask=row_ok[:, None] & is_shared[None, :])


@triton.jit
def _minimax_gate_kernel(z_ptr, bias_ptr, ids_ptr, w_ptr, T, scaling,
                         E: tl.constexpr, K: tl.constexpr, N_PAD: tl.constexpr,
                         BLOCK_T: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    cols = tl.arange(0, N_PAD)
    routed = cols < E
    z = tl.load(z_ptr + rows[:, None].to(tl.int64) * E + cols[None, :],
                mask=row_ok[:, None] & routed[None, :], other=0.0)
    bias = tl.load(bias_ptr + cols, mask=routed, other=0.0).to(tl.float32)
    s = _sigmoid_exact(z, PRECISE)
    rank = _select_topk(tl.where(routed[None, :], s + bias[None, :], float("-inf")), cols, K, N_PAD)
    s_sel = tl.where(rank >= 0, s, 0.0)
    w = s_sel / tl.sum(s_sel, axis=1)[:, None] * scaling
    _store_selection(rank, w, cols, rows, row_ok, ids_ptr, w_ptr, K)


def router_logits(x: torch.Tensor, weight: torch.Tensor, use_gemv: bool = False) -> torch.Tensor:
    """z = F.linear(x.float(), weight.float()) [T, E], as in the references. With `use_gemv` and
    at most FMA_MAX_ROWS rows (decode, a speculative verify), one GEMV launch that widens x as
    it loads it (`kiln.kernels.gemv`), instead of a cast and an fp32 cuBLAS GEMM (a split-K
    SIMT kernel at 2-4 rows: docs/benchmarks.md, "sixth pass"). Same products, another
    summation order."""
    from kiln.kernels.gemv import FMA_MAX_ROWS, gemv

    if use_gemv and 0 < x.shape[0] <= FMA_MAX_ROWS and weight.dtype == torch.float32 and x.dim() == 2:
        return gemv(x, weight)
    return F.linear(x.float(), weight.float())


def _block_t(num_tokens: int) -> int:
    # A few tokens per program: enough work per program at prefill, one program at decode.
    return min(16, triton.next_power_of_2(max(num_tokens, 1)))


def sink_gate(x: torch.Tensor, weight: torch.Tensor, expert_bias: torch.Tensor,
              global_scale: torch.Tensor, top_k: int, route_scale: float, use_gemv: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inkling's router (MODELS.md 2.3) = `sink_gate_ref(..., forced_ids=None)`.

    x [T, H]; weight [E+S, H]; expert_bias [E]; global_scale [] (read on the device, no sync).
    `use_gemv`: the logits of a few rows through the GEMV (`router_logits`).
    Returns (topk_ids [T, k] int64, routed_w [T, k] fp32, shared_w [T, S] fp32)."""
    e = expert_bias.shape[0]
    s = weight.shape[0] - e
    z = router_logits(x, weight, use_gemv)  # [T, E+S]
    t = z.shape[0]
    ids = torch.empty(t, top_k, dtype=torch.long, device=z.device)
    routed_w = torch.empty(t, top_k, dtype=torch.float32, device=z.device)
    shared_w = torch.empty(t, s, dtype=torch.float32, device=z.device)
    if t == 0:
        return ids, routed_w, shared_w
    bt = _block_t(t)
    _sink_gate_kernel[(triton.cdiv(t, bt),)](
        z, expert_bias, global_scale, ids, routed_w, shared_w if s > 0 else routed_w, t,
        float(route_scale), E=e, S=s, K=top_k, N_PAD=max(16, triton.next_power_of_2(e + s)),
        BLOCK_T=bt, PRECISE=not interpreting(), num_warps=4, **pdl_launch(z.device))
    return ids, routed_w, shared_w


def minimax_gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int,
                 routed_scaling_factor: float, use_gemv: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMax-M3's router (MODELS.md 3.2) = `minimax_gate_ref(..., forced_ids=None)`.

    x [T, H]; weight [E, H]; bias [E]; `use_gemv` as in `sink_gate`. Returns (topk_ids [T, k]
    int64, routed_w [T, k] fp32)."""
    e = weight.shape[0]
    z = router_logits(x, weight, use_gemv)
    t = z.shape[0]
    ids = torch.empty(t, top_k, dtype=torch.long, device=z.device)
    w = torch.empty(t, top_k, dtype=torch.float32, device=z.device)
    if t == 0:
        return ids, w
    bt = _block_t(t)
    _minimax_gate_kernel[(triton.cdiv(t, bt),)](
        z, bias, ids, w, t, float(routed_scaling_factor), E=e, K=top_k,
        N_PAD=max(16, triton.next_power_of_2(e)), BLOCK_T=bt, PRECISE=not interpreting(),
        num_warps=4, **pdl_launch(z.device))
    return ids, w
