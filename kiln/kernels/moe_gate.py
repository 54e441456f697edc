"""Triton MoE routers: sigmoid + bias + top-k + renormalisation in one kernel.

`sink_gate` / `minimax_gate` return what `kiln.ops.moe.sink_gate_ref` / `minimax_gate_ref` return
with `forced_ids=None` (routing replay stays on the references): the same ids, ties to the lower
id, and the weights to ~1e-6. The router GEMM stays in torch (fp32 `F.linear`, the very call the
references make, so both see bit-identical logits); one program then handles BLOCK_T tokens with
all E (+S) logits of a token in registers. At a few rows on the engine's decode path
(`use_gemv`) the logits come from Kiln's GEMV instead (same products, another summation order),
and with a selection counter (`counter`, the gate module's buffer) the logits and the gate are
one launch, `_router_gate_kernel`: the last of its programs to finish selects (one launch and one
PDL wait fewer per MoE layer at batch 1).

Selection must match `topk_lower_id(sigmoid(z) + bias)` bit for bit, so the kernel computes the
sigmoid exactly as PyTorch's CUDA kernel does, 1 / (1 + expf(-z)) with full-precision expf and an
IEEE division (Triton's own `tl.exp` and `/` are the fast approximations). Top-k is k rounds of
"largest score, lowest id among equals", which is what a stable descending sort gives. Under
Triton's CPU interpreter (tests) libdevice is unavailable and numpy's exp stands in.
"""

from __future__ import annotations

from typing import Optional

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
    """Rank [BT, N_PAD] int32: j for the column picked in round j, -1 elsewhere. `score` (fp32, no
    NaN, never -0.0: a sigmoid plus a bias) is -inf where a column may not be picked.

    One reduction per round: each score and its column are packed into one int64 key whose order
    is "larger score, then lower id", so a round's max names its pick directly (the score's bits
    made order-preserving as a signed int, the complemented column below them). Two reductions a
    round (the max, then the lowest id at it) made the gate's serial chain twice as long."""
    bits = score.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: magnitude bits flipped
    key = (ordered.to(tl.int64) << 32) | (N_PAD - 1 - cols)[None, :].to(tl.int64)
    rank = tl.full(score.shape, -1, tl.int32)
    for j in tl.static_range(K):
        hit = key == tl.max(key, axis=1)[:, None]
        rank = tl.where(hit, j, rank)
        key = tl.where(hit, -9223372036854775807 - 1, key)
    return rank


@triton.jit
def _store_selection(rank, w, cols, rows, row_ok, ids_ptr, w_ptr, K: tl.constexpr):
    """Each picked column writes its id and weight to slot `rank` of its row: a scatter, with no
    reduction (one slot, one writer)."""
    picked = (rank >= 0) & row_ok[:, None]
    slot = rows[:, None].to(tl.int64) * K + tl.maximum(rank, 0)
    tl.store(ids_ptr + slot, (cols[None, :] + tl.zeros_like(rank)).to(tl.int64), mask=picked)
    tl.store(w_ptr + slot, w, mask=picked)


@triton.jit
def _sink_select(z_ptr, rows, row_ok, bias_ptr, gscale_ptr, ids_ptr, rw_ptr, sw_ptr, route_scale,
                 E: tl.constexpr, S: tl.constexpr, K: tl.constexpr, N_PAD: tl.constexpr, PRECISE: tl.constexpr):
    """The sink gate of token rows `rows` from their logits z [T, E+S] in memory (read from L2:
    `_router_gate_kernel`'s last program reads what the other programs wrote)."""
    cols = tl.arange(0, N_PAD)
    routed = cols < E
    is_shared = (cols >= E) & (cols < E + S)
    z = tl.load(z_ptr + rows[:, None].to(tl.int64) * (E + S) + cols[None, :],
                mask=row_ok[:, None] & (cols < E + S)[None, :], other=0.0, cache_modifier=".cg")
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
def _minimax_select(z_ptr, rows, row_ok, bias_ptr, ids_ptr, w_ptr, scaling,
                    E: tl.constexpr, K: tl.constexpr, N_PAD: tl.constexpr, PRECISE: tl.constexpr):
    """MiniMax-M3's gate of token rows `rows` from their logits z [T, E] in memory (from L2)."""
    cols = tl.arange(0, N_PAD)
    routed = cols < E
    z = tl.load(z_ptr + rows[:, None].to(tl.int64) * E + cols[None, :],
                mask=row_ok[:, None] & routed[None, :], other=0.0, cache_modifier=".cg")
    bias = tl.load(bias_ptr + cols, mask=routed, other=0.0).to(tl.float32)
    s = _sigmoid_exact(z, PRECISE)
    rank = _select_topk(tl.where(routed[None, :], s + bias[None, :], float("-inf")), cols, K, N_PAD)
    s_sel = tl.where(rank >= 0, s, 0.0)
    w = s_sel / tl.sum(s_sel, axis=1)[:, None] * scaling
    _store_selection(rank, w, cols, rows, row_ok, ids_ptr, w_ptr, K)


@triton.jit
def _sink_gate_kernel(z_ptr, bias_ptr, gscale_ptr, ids_ptr, rw_ptr, sw_ptr, T, route_scale,
                      E: tl.constexpr, S: tl.constexpr, K: tl.constexpr, N_PAD: tl.constexpr,
                      BLOCK_T: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    _sink_select(z_ptr, rows, rows < T, bias_ptr, gscale_ptr, ids_ptr, rw_ptr, sw_ptr, route_scale, E, S, K, N_PAD,
                 PRECISE)


@triton.jit
def _minimax_gate_kernel(z_ptr, bias_ptr, ids_ptr, w_ptr, T, scaling,
                         E: tl.constexpr, K: tl.constexpr, N_PAD: tl.constexpr,
                         BLOCK_T: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    _minimax_select(z_ptr, rows, rows < T, bias_ptr, ids_ptr, w_ptr, scaling, E, K, N_PAD, PRECISE)


@triton.jit
def _router_gate_kernel(x_ptr, w_ptr, z_ptr, counter_ptr, bias_ptr, gscale_ptr, ids_ptr, rw_ptr, sw_ptr,
                        T, H, stride_xt, scale,
                        E: tl.constexpr, S: tl.constexpr, K: tl.constexpr, N_PAD: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SINK: tl.constexpr,
                        PRECISE: tl.constexpr, PDL: tl.constexpr):
    """The router's fp32 logits z [T, E+S] of T <= BLOCK_T rows and the gate over them, one launch.
    Program n computes BLOCK_N logits as `kiln.kernels.gemv`'s FMA loop does (its fp32 weight
    stream started before the PDL wait, the rows widened as loaded), stores them and counts
    itself done (an acq_rel atomic, as decode attention's splits); the last program to finish
    reads all logits back from L2, runs the sink gate (SINK) or MiniMax-M3's, and resets the
    count to 0 for the next call. A gate's counter serves one launch at a time: a gate must never
    run on two streams at once."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rt = tl.arange(0, BLOCK_T)
    kk = tl.arange(0, BLOCK_K)[None, None, :]
    n_ok = (n < E + S)[None, :, None]
    t_ok = (rt < T)[:, None, None]
    w_ptrs = w_ptr + n[None, :, None].to(tl.int64) * H + kk
    w = tl.load(w_ptrs, mask=n_ok & (kk < H), other=0.0)  # weights: no kernel writes them
    wait_for_previous(PDL)
    x_ptrs = x_ptr + rt[:, None, None] * stride_xt + kk
    acc = tl.zeros((BLOCK_T, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(BLOCK_K, H + BLOCK_K, BLOCK_K):
        # load tile k0 (masked off past H) while tile k0 - BLOCK_K is multiplied
        w_next = tl.load(w_ptrs + k0, mask=n_ok & (kk < H - k0), other=0.0)
        xk = tl.load(x_ptrs + (k0 - BLOCK_K), mask=t_ok & (kk < H - k0 + BLOCK_K), other=0.0).to(tl.float32)
        acc += w * xk
        w = w_next
    tl.store(z_ptr + rt[:, None] * (E + S) + n[None, :], tl.sum(acc, axis=2),
             mask=(rt < T)[:, None] & (n < E + S)[None, :])
    # Every warp's logits are written before the release (one thread issues the atomic); the
    # last arrival acquires them all.
    tl.debug_barrier()
    if tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
        if SINK:
            _sink_select(z_ptr, rt, rt < T, bias_ptr, gscale_ptr, ids_ptr, rw_ptr, sw_ptr, scale, E, S, K, N_PAD,
                         PRECISE)
        else:
            _minimax_select(z_ptr, rt, rt < T, bias_ptr, ids_ptr, rw_ptr, scale, E, K, N_PAD, PRECISE)


def _fused_router_gate(x: torch.Tensor, weight: torch.Tensor, counter: torch.Tensor, bias: torch.Tensor,
                       gscale: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, sw: torch.Tensor, top_k: int,
                       scale: float, sink: bool) -> None:
    """One launch of `_router_gate_kernel` for the rows of x (at most FMA_MAX_ROWS), on the tile
    the router GEMV takes for them (`kiln.kernels.gemv_tiles.fma_tile`; `interpreter_tile` under the
    interpreter), so that both sum the logits in the same order."""
    from kiln.kernels.gemv_tiles import fma_tile, interpreter_tile

    t, h = x.shape
    n = weight.shape[0]
    tile = dict(interpreter_tile(n) if interpreting() else fma_tile(t, h))
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight.contiguous()
    z = torch.empty(t, n, dtype=torch.float32, device=x.device)
    e = bias.shape[0]
    _router_gate_kernel[(triton.cdiv(n, tile["BLOCK_N"]),)](
        x, weight, z, counter, bias, gscale, ids, rw, sw, t, h, x.stride(0), float(scale),
        E=e, S=n - e, K=top_k, N_PAD=max(16, triton.next_power_of_2(n)), BLOCK_T=triton.next_power_of_2(t),
        SINK=sink, PRECISE=not interpreting(), **tile, **pdl_launch(x.device))


def _fuses(x: torch.Tensor, weight: torch.Tensor, use_gemv: bool, counter) -> bool:
    """Whether a gate call takes `_router_gate_kernel`: the GEMV's rows (`router_logits`) and a
    selection counter to count its programs with (int32 [1] zeros, the gate module's buffer)."""
    from kiln.kernels.gemv_tiles import FMA_MAX_ROWS

    return (use_gemv and counter is not None and x.dim() == 2 and 0 < x.shape[0] <= FMA_MAX_ROWS
            and weight.dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16, torch.float32))


def router_logits(x: torch.Tensor, weight: torch.Tensor, use_gemv: bool = False) -> torch.Tensor:
    """z = F.linear(x.float(), weight.float()) [T, E], as in the references. With `use_gemv` and
    at most WIDEN_MAX_ROWS rows (decode, a speculative verify), one GEMV launch that widens x as
    it loads it (`kiln.kernels.gemv`), instead of a cast and an fp32 cuBLAS GEMM (a split-K
    SIMT kernel and its reduction at 2-32 rows: docs/benchmarks.md, "sixth pass" and
    "forty-ninth pass"). Same products, another summation order. fp32 rows (a model served in
    fp32) are not widened: the GEMV takes up to MAX_ROWS of them."""
    from kiln.kernels.gemv import gemv
    from kiln.kernels.gemv_tiles import MAX_ROWS, WIDEN_MAX_ROWS

    rows = WIDEN_MAX_ROWS if x.dtype in (torch.bfloat16, torch.float16) else MAX_ROWS
    if use_gemv and x.dim() == 2 and 0 < x.shape[0] <= rows and weight.dtype == torch.float32:
        return gemv(x, weight)
    return F.linear(x.float(), weight.float())


def _block_t(num_tokens: int) -> int:
    # A few tokens per program: enough work per program at prefill, one program at decode.
    return min(16, triton.next_power_of_2(max(num_tokens, 1)))


# Warps of a gate program over one token (decode): its E+S logits fit one warp, so every reduction
# of the selection is a warp shuffle, with no shared memory and no barrier between warps.
# Four warps for more tokens per program.
DECODE_GATE_WARPS = 1


def _gate_warps(block_t: int) -> int:
    return DECODE_GATE_WARPS if block_t == 1 else 4


def sink_gate(x: torch.Tensor, weight: torch.Tensor, expert_bias: torch.Tensor,
              global_scale: torch.Tensor, top_k: int, route_scale: float, use_gemv: bool = False,
              counter: Optional[torch.Tensor] = None, logits: Optional[torch.Tensor] = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inkling's router (MODELS.md 2.3) = `sink_gate_ref(..., forced_ids=None)`.

    x [T, H]; weight [E+S, H]; expert_bias [E]; global_scale [] (read on the device, no sync).
    `use_gemv`: the logits of a few rows through the GEMV (`router_logits`); with a `counter`
    (int32 [1], zero, the caller's: `SinkGate`'s buffer) the logits and the gate run as one launch
    (`_router_gate_kernel`), the counter zero again after it. `logits`: F.linear(x.float(), weight)
    computed by the caller (the router GEMV with the norm before it in its prologue,
    `kiln.layers.decode_gemv.decode_prenorm`); x is then not read.
    Returns (topk_ids [T, k] int64, routed_w [T, k] fp32, shared_w [T, S] fp32)."""
    e = expert_bias.shape[0]
    s = weight.shape[0] - e
    t = x.shape[0]
    ids = torch.empty(t, top_k, dtype=torch.long, device=x.device)
    routed_w = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    shared_w = torch.empty(t, s, dtype=torch.float32, device=x.device)
    if t == 0:
        return ids, routed_w, shared_w
    if logits is None and _fuses(x, weight, use_gemv, counter):
        _fused_router_gate(x, weight, counter, expert_bias, global_scale, ids, routed_w,
                           shared_w if s > 0 else routed_w, top_k, route_scale, sink=True)
        return ids, routed_w, shared_w
    z = router_logits(x, weight, use_gemv) if logits is None else logits  # [T, E+S]
    bt = _block_t(t)
    _sink_gate_kernel[(triton.cdiv(t, bt),)](
        z, expert_bias, global_scale, ids, routed_w, shared_w if s > 0 else routed_w, t,
        float(route_scale), E=e, S=s, K=top_k, N_PAD=max(16, triton.next_power_of_2(e + s)),
        BLOCK_T=bt, PRECISE=not interpreting(), num_warps=_gate_warps(bt), **pdl_launch(z.device))
    return ids, routed_w, shared_w


def minimax_gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int,
                 routed_scaling_factor: float, use_gemv: bool = False,
                 counter: Optional[torch.Tensor] = None, logits: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMax-M3's router (MODELS.md 3.2) = `minimax_gate_ref(..., forced_ids=None)`.

    x [T, H]; weight [E, H]; bias [E]; `use_gemv`, `counter` and `logits` as in `sink_gate`. Returns
    (topk_ids [T, k] int64, routed_w [T, k] fp32)."""
    e = weight.shape[0]
    t = x.shape[0]
    ids = torch.empty(t, top_k, dtype=torch.long, device=x.device)
    w = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    if t == 0:
        return ids, w
    if logits is None and _fuses(x, weight, use_gemv, counter):
        _fused_router_gate(x, weight, counter, bias, bias, ids, w, w, top_k, routed_scaling_factor, sink=False)
        return ids, w
    z = router_logits(x, weight, use_gemv) if logits is None else logits
    bt = _block_t(t)
    _minimax_gate_kernel[(triton.cdiv(t, bt),)](
        z, bias, ids, w, t, float(routed_scaling_factor), E=e, K=top_k,
        N_PAD=max(16, triton.next_power_of_2(e)), BLOCK_T=bt, PRECISE=not interpreting(),
        num_warps=_gate_warps(bt), **pdl_launch(z.device))
    return ids, w
