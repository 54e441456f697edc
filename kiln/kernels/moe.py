"""Triton fused MoE experts: routed SwiGLU experts (and shared experts) as two grouped GEMMs, or
as two GEMVs for one token.

`fused_experts` has the arguments and result of `kiln.ops.moe.experts_ref` (within bf16
tolerance); with `shared=` it also folds in `kiln.ops.moe.shared_experts_ref`. The routers'
kernels live in `kiln.kernels.moe_gate` and are re-exported here.

Slots. Token t owns KS = k + C consecutive slots t*KS + j: j < k is its j-th routed selection,
j >= k is shared chunk j - k. A shared expert of intermediate size I_s = r*I (r >= 1) is C = r
"chunks" of the routed size I: SwiGLU is separable along the intermediate dim, and the linearised
layout ([gate_0; ..; up_0; ..], [down_0 | ..]) already stores those chunks as consecutive row /
column blocks, so chunk c reads rows c*I.. of the gate half, C*I + c*I.. (up) and columns c*I..
(down) of the shared tensors, in place. Chunks are experts E..E+C-1 of the grouped GEMMs.

Grouped path (more tokens than the GEMV path takes): four launches whose grids depend only on
shapes, never on values, and no host sync, so the decode step can be captured in a CUDA graph.
1. `_align_kernel` (`kiln.kernels.moe_align`, one program per expert, routed and shared): like SGLang/vLLM's
   moe_align_block_size. Every program histograms all routed ids (redundantly: the ids are few, and
   it saves a launch and a grid-wide sync), rounds each expert's count up to BLOCK_M, prefix-sums
   those into segment ends, then writes its own assignments' slot numbers into its segment of
   `sorted_slots` and the sentinel `num_slots` into the padding rows. Program 0 also stores the
   segment ends; a GEMM program finds its expert by counting the ends <= its first row. The buffer
   is sized for the worst case (every nonempty expert wastes BLOCK_M - 1 rows), and blocks past the
   used rows exit at once. (Each GEMM program computing its block's rows from the ids in
   registers instead, with no align launch, was measured slower and removed: forty-seventh pass.)
2. `_gate_up_kernel`: per (row block, intermediate tile): gathers x rows, two dots (gate and up
   rows of the block's expert), SwiGLU in fp32, writes the activation (weight dtype) by sorted row.
3. `_down_kernel`: per (row block, hidden tile): act @ down^T, times the slot's routing weight in
   fp32 (shared chunks: the shared weight or 1), stored per slot in fp32.
4. `_sum_slots_kernel`: per token, the KS slot rows summed in fp32 in slot order, cast once.
   With a ShortConv on the sum (Inkling's out_conv; at most SUM_CONV_MAX_TOKENS tokens: decode
   sequences, or the short chunks of a speculative verify, which is what the engine hands it),
   `_sum_slots_conv_kernel` instead: every program holds all tokens of its hidden tile and runs
   the conv in its epilogue (`kiln.kernels.shortconv`), one launch fewer.

One-token path (T <= `gemv_max_tokens`, by default GEMV_MAX_TOKENS = 1: batch-1 decode): two
expert GEMVs, `kiln.kernels.moe_gemv`, with the same slots and the same numerics up to the order
of the sums.

Between the two, at 2-8 tokens, a path with two launches and nothing sorted (each program found
the distinct experts from the ids in registers; the down walk in splits, the last one summing) was
built and measured slower than the grouped path, 0.75-0.98x at the bench shapes on an H200: the
grouped GEMMs already stream 2.6-3.4 TB/s there (commit 70c4010, removed after it;
docs/benchmarks.md, twenty-first pass).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kiln.kernels.launch import pdl_launch, wait_for_previous
from kiln.kernels.moe_align import _align_kernel, _block_expert
from kiln.kernels.moe_gemv import experts_gemv
from kiln.kernels.shortconv import decode_conv_epilogue, decode_conv_history, decode_conv_kernel_args

from kiln.kernels.moe_gate import minimax_gate, sink_gate  # noqa: F401  (re-exported)

# Routed ids the align kernel reads per step: at least 128 (one per thread of its 4 warps, so that
# tl.histogram sees no replicated elements), at most this many (tests lower it to cover the
# carry of ranks across steps with few tokens).
ALIGN_CHUNK_MAX = 2048
# Up to this many tokens `fused_experts` takes the GEMV path (module docstring). Past one token the
# grouped path stays, since it reads an expert shared by several tokens once (on an H200 the GEMV
# path took 1.37x (Inkling) and 1.27x (MiniMax-M3) the grouped path's time at 4 tokens:
# docs/benchmarks.md, nineteenth pass); the engine's `--moe-gemv-max-tokens` overrides it; tests
# lower it to 0 to force the grouped path.
GEMV_MAX_TOKENS = 1
# Up to this many tokens the grouped path can run a ShortConv on its sum (`_sum_slots_conv_kernel`):
# each program holds every token, as the GEMV's 4-row loop does. Its hidden tile: 32 columns (64
# programs at H = 2048) made a batch-1 K = 3 round 2.70 ms against 2.71 without the sum conv (one
# run each, within run-to-run spread); 128 columns profiled at 7.5 us per call (nineteenth pass).
SUM_CONV_MAX_TOKENS = 4
SUM_CONV_BLOCK_H = 32


@dataclass(frozen=True)
class MoEConfig:
    """Tile sizes. BLOCK_M is shared by both GEMMs (it is the padding unit of the sorted rows);
    the rest are (BLOCK_N, BLOCK_K, num_warps, num_stages) of the gate/up and the down GEMM."""

    block_m: int
    up: tuple[int, int, int, int]
    down: tuple[int, int, int, int]


def pick_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int) -> MoEConfig:
    """Tiles by the average number of rows a routed expert gets (m = T*k/E).

    Decode (small m) is weight-bandwidth bound: small BLOCK_M (16, the smallest MMA tile) wastes
    little padding, and narrow N tiles with long K steps give enough programs and bytes in flight
    to stream every selected expert's weights once. Prefill (large m) is compute bound: big tiles.
    Chosen with `python -m benchmarks.kernel_bench.moe --sweep` on an H200 for the bench shapes."""
    m = num_tokens * top_k / max(num_experts, 1)
    if m <= 12:  # T <= 128 at k=6 of 64: 22.5 / 73 / 118 us at T=1 / 8 / 64 (+2 shared)
        cfg = MoEConfig(16, (32, 128, 4, 4), (128, 128, 8, 3))
    elif m <= 48:  # T=256: 140 us
        cfg = MoEConfig(32, (64, 64, 4, 4), (64, 128, 4, 3))
    elif m <= 192:  # not swept
        cfg = MoEConfig(64, (64, 64, 4, 4), (128, 64, 4, 4))
    else:  # T=8192: 1184 us (1381 with (64, 64, 8, 4) / (128, 64, 8, 4))
        cfg = MoEConfig(128, (128, 64, 8, 3), (256, 64, 8, 3))
    return _clamp(cfg, hidden, inter)


def _clamp(cfg: MoEConfig, hidden: int, inter: int) -> MoEConfig:
    # No tile wider than the (power-of-2 padded) dim it covers, none under 16 (tl.dot's minimum).
    def fit(b: int, dim: int) -> int:
        return max(16, min(b, triton.next_power_of_2(dim)))

    bn, bk, w, s = cfg.up
    up = (fit(bn, inter), fit(bk, hidden), w, s)
    bn, bk, w, s = cfg.down
    down = (fit(bn, hidden), fit(bk, inter), w, s)
    return MoEConfig(cfg.block_m, up, down)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 weights (tiny presets, parity tests) must not silently drop to TF32 on the GPU.
    return "ieee" if dtype == torch.float32 else "tf32"


def shared_chunks(inter: int, shared_w2: torch.Tensor, shared_weights: Optional[torch.Tensor]) -> int:
    """How many routed-size chunks (C) the shared experts split into; 0 if they cannot be folded
    into `fused_experts` (a shared intermediate size that is not a multiple of the routed one)."""
    total = shared_w2.shape[1]
    n_shared = shared_weights.shape[1] if shared_weights is not None else 1
    if total == 0 or n_shared == 0 or total % n_shared or (total // n_shared) % inter:
        return 0
    return total // inter


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, sw13_ptr, sorted_ptr, seg_end_ptr, act_ptr,
                    H, I, num_slots, stride_xt, stride_we, stride_wn, stride_sn,
                    E: tl.constexpr, E_TOT: tl.constexpr, E_PAD: tl.constexpr, KS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(I, BLOCK_N)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    m_start = pid_m * BLOCK_M
    e = _block_expert(seg_end_ptr, m_start, E_TOT, E_PAD)
    if e >= E_TOT:
        return
    rows = m_start + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ptr + rows)
    valid = slot < num_slots
    tok = (slot // KS).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    ks = tl.arange(0, BLOCK_K)

    # Routed expert e: gate rows n and up rows I + n of w13[e]. Shared chunk c = e - E: rows c*I + n
    # and C*I + c*I + n of sw13, with its own row stride.
    is_shared = e >= E
    chunk = tl.maximum(e - E, 0).to(tl.int64)
    w_base = tl.where(is_shared, sw13_ptr + chunk * I * stride_sn, w13_ptr + e.to(tl.int64) * stride_we)
    row_stride = tl.where(is_shared, stride_sn, stride_wn).to(tl.int64)
    up_off = tl.where(is_shared, (E_TOT - E) * I, I).to(tl.int64) * row_stride
    g_ptrs = w_base + cols[None, :].to(tl.int64) * row_stride + ks[:, None]  # [BLOCK_K, BLOCK_N]
    a_ptrs = x_ptr + tok[:, None] * stride_xt + ks[None, :]  # [BLOCK_M, BLOCK_K]

    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(H, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=col_ok[None, :], other=0.0)
            u = tl.load(g_ptrs + up_off, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < H - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            u = tl.load(g_ptrs + up_off, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        a = a.to(g.dtype)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up, fp32
    out_ptrs = act_ptr + rows[:, None].to(tl.int64) * I + cols[None, :]
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=col_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, w2_ptr, sw2_ptr, sorted_ptr, seg_end_ptr, topk_w_ptr, shared_w_ptr,
                 out_ptr, H, I, num_slots, stride_we, stride_wh, stride_sh,
                 E: tl.constexpr, E_TOT: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr,
                 KS: tl.constexpr, NUM_SW: tl.constexpr, SW_REP: tl.constexpr,
                 HAS_SW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(H, BLOCK_N)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    m_start = pid_m * BLOCK_M
    e = _block_expert(seg_end_ptr, m_start, E_TOT, E_PAD)
    if e >= E_TOT:
        return
    rows = m_start + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ptr + rows)
    valid = slot < num_slots
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    ks = tl.arange(0, BLOCK_K)

    # Routed: w2[e] [H, I]. Shared chunk c: columns c*I.. of sw2 [H, C*I].
    is_shared = e >= E
    chunk = tl.maximum(e - E, 0).to(tl.int64)
    w_base = tl.where(is_shared, sw2_ptr + chunk * I, w2_ptr + e.to(tl.int64) * stride_we)
    row_stride = tl.where(is_shared, stride_sh, stride_wh).to(tl.int64)
    b_ptrs = w_base + cols[None, :].to(tl.int64) * row_stride + ks[:, None]  # [BLOCK_K, BLOCK_N]
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * I + ks[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(I, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < I - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    # The routing weight multiplies the expert's fp32 output, as in experts_ref.
    tok = slot // KS
    j = slot % KS
    w = tl.load(topk_w_ptr + tok * K + j, mask=valid & (j < K), other=0.0)
    if HAS_SW:
        sw = tl.load(shared_w_ptr + tok * NUM_SW + tl.maximum(j - K, 0) // SW_REP,
                     mask=valid & (j >= K), other=0.0)
        w = tl.where(j < K, w, sw)
    else:
        w = tl.where(j < K, w, 1.0)
    out_ptrs = out_ptr + slot[:, None].to(tl.int64) * H + cols[None, :]
    tl.store(out_ptrs, acc * w[:, None], mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _sum_slots_kernel(slots_ptr, out_ptr, H, KS: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(KS):  # routed slots in selection order, then the shared chunks
        acc += tl.load(slots_ptr + (t * KS + j) * H + offs, mask=ok, other=0.0)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _sum_slots_conv_kernel(slots_ptr, out_ptr, T, H, CW, CBUF, CTAB, CSLOTS, CLENS, CLOCS, stride_cw, stride_cbuf,
                           stride_ctab, KS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                           CONV: tl.constexpr, CK: tl.constexpr, CKP: tl.constexpr, CCHUNK: tl.constexpr,
                           PDL: tl.constexpr):
    """`_sum_slots_kernel` for all T <= BLOCK_M tokens of one hidden tile per program, the sum
    (rounded to the state's dtype, as the unfused path stores it) then through its ShortConv:
    token t is decode sequence t, or (CCHUNK) a token of a short chunk
    (`kiln.kernels.shortconv.decode_conv_epilogue`)."""
    wait_for_previous(PDL)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < T
    offs = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    hist = decode_conv_history(rm, m_ok, offs, ok, CBUF, stride_cbuf, CTAB, stride_ctab, CSLOTS, CLENS, CK, CKP,
                               CCHUNK)
    mask = m_ok[:, None] & ok[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(KS):
        acc += tl.load(slots_ptr + (rm[:, None].to(tl.int64) * KS + j) * H + offs[None, :], mask=mask, other=0.0)
    y = decode_conv_epilogue(acc.to(CBUF.dtype.element_ty), hist, rm, m_ok, offs, ok, CW, stride_cw, CBUF,
                             stride_cbuf, CLOCS, CSLOTS, CLENS, CK, CKP, CCHUNK)
    tl.store(out_ptr + rm[:, None] * H + offs[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def on_gemv_path(num_tokens: int, config: Optional[MoEConfig] = None, gemv_max_tokens: Optional[int] = None) -> bool:
    """Whether `fused_experts` of `num_tokens` tokens takes the expert GEMVs (up to
    `gemv_max_tokens`, None: GEMV_MAX_TOKENS) rather than the grouped GEMMs."""
    limit = GEMV_MAX_TOKENS if gemv_max_tokens is None else gemv_max_tokens
    return 0 < num_tokens <= limit and config is None


def takes_conv(num_tokens: int, config: Optional[MoEConfig] = None, gemv_max_tokens: Optional[int] = None,
               chunk: bool = False) -> bool:
    """Whether `fused_experts` of `num_tokens` tokens can run a ShortConv on its result in a
    kernel's epilogue (its `conv` argument): the one-token GEMV path's down kernel (decode
    sequences only), or the grouped path's sum of at most SUM_CONV_MAX_TOKENS tokens (decode
    sequences, or with `chunk` the tokens of short chunks). `gemv_max_tokens`: the largest T of the
    GEMV path (None: GEMV_MAX_TOKENS; the engine's `--moe-gemv-max-tokens`)."""
    if on_gemv_path(num_tokens, config, gemv_max_tokens):
        return not chunk
    return 0 < num_tokens <= SUM_CONV_MAX_TOKENS


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
                  shared: Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]] = None,
                  config: Optional[MoEConfig] = None, conv: Optional[tuple] = None,
                  gemv_max_tokens: Optional[int] = None, conv_chunk: bool = False,
                  trace: Optional[tuple] = None) -> torch.Tensor:
    """sum_j w_j * Expert_{id_j}(x) (+ shared experts), as `experts_ref` (+ `shared_experts_ref`).

    x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_ids [T, k] (any int
    dtype); topk_weights [T, k] fp32. `shared=(sw13 [2*S*I_s, H], sw2 [H, S*I_s], weights [T, S] fp32
    or None)` in the linearised layout of `shared_experts_ref` adds sum_s w_s * Shared_s(x) (weight
    1 when None); I_s must be a multiple of I (`shared_chunks` says whether it is). GEMMs run in
    the weights' dtype, activations, weights and the sum over slots in fp32, one cast to
    `out_dtype` (x's dtype by default). Up to `gemv_max_tokens` tokens (None: GEMV_MAX_TOKENS)
    take the two-kernel GEMV path, more the grouped GEMMs (module docstring). `config` overrides
    the grouped path's tiles and so forces that path at any T (benchmark sweeps).
    `conv` (where `takes_conv` allows it): the arguments of
    `kiln.kernels.shortconv.short_conv_decode` after x, token t being decode sequence t; the result
    is then that ShortConv of the sum (rounded to `out_dtype`, the state's dtype), run in the down
    GEMV's epilogue on the one-token path, in the sum's on the grouped path (Inkling's out_conv).
    `conv_chunk` (the grouped path): the tokens are short chunks instead, conv as
    `kiln.engine.paged_backend.PagedBackend.chunk_conv_args` gives it (`kiln.kernels.gemv.gemv`'s
    `conv_chunk`). `trace` (the one-token path, CUDA): the two expert GEMVs' `kiln.kernels.trace`
    buffers (`benchmarks/kernel_bench/gemv_trace.py --chains moe`).
    """
    T, H = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    k = topk_ids.shape[1]
    out = torch.empty(T, H, dtype=out_dtype or x.dtype, device=x.device)
    chunks, shared_w = 0, None
    sw13, sw2 = w13, w2  # placeholders: never addressed without shared chunks
    if shared is not None:
        sw13, sw2, shared_w = shared
        chunks = shared_chunks(inter, sw2, shared_w)
        if chunks == 0 and sw2.shape[1] > 0:
            raise ValueError(f"shared experts of intermediate {sw2.shape[1]} cannot be folded into "
                             f"routed experts of intermediate {inter}; run shared_experts_ref instead")
        assert sw13.dtype == w13.dtype and sw2.dtype == w2.dtype, "shared and routed weight dtypes differ"
    if T == 0:
        return out
    ks_slots, e_tot = k + chunks, E + chunks
    n_shared_w = shared_w.shape[1] if shared_w is not None else 1
    has_sw = shared_w is not None

    x = _last_dim_contiguous(x)
    w13, w2, sw13, sw2 = (_last_dim_contiguous(w) for w in (w13, w2, sw13, sw2))
    ids = topk_ids.contiguous()
    topk_w = topk_weights.float().contiguous()
    shared_w = shared_w.float().contiguous() if has_sw else topk_w
    sw_rep = max(1, chunks // n_shared_w)
    if on_gemv_path(T, config, gemv_max_tokens):
        assert not conv_chunk, "the one-token path's conv epilogue takes decode sequences only"
        return experts_gemv(x, w13, w2, sw13, sw2, ids, topk_w, shared_w, out, k, ks_slots, n_shared_w,
                            sw_rep, has_sw, conv, trace)
    assert trace is None, "only the one-token path's expert GEMVs are traced"
    assert conv is None or T <= SUM_CONV_MAX_TOKENS, \
        f"the conv epilogue takes 1..{SUM_CONV_MAX_TOKENS} tokens on the grouped path, not {T}"

    cfg = config or pick_config(T, k, E, H, inter)
    bm = cfg.block_m

    # Worst-case sorted rows: each nonempty routed expert pads at most BLOCK_M - 1 rows; each
    # shared chunk holds all T tokens.
    routed_rows = T * k + min(E, T * k) * (bm - 1)
    rows = routed_rows + chunks * triton.cdiv(T, bm) * bm
    num_blocks = triton.cdiv(rows, bm)
    num_slots = T * ks_slots
    dev = x.device
    sorted_slots = torch.empty(num_blocks * bm, dtype=torch.int32, device=dev)
    seg_end = torch.empty(e_tot, dtype=torch.int32, device=dev)
    act = torch.empty(num_blocks * bm, inter, dtype=w2.dtype, device=dev)
    slot_out = torch.empty(num_slots, H, dtype=torch.float32, device=dev)
    e_pad = max(32, triton.next_power_of_2(e_tot))  # tl.histogram wants >= 32 bins
    chunk = max(128, min(ALIGN_CHUNK_MAX, triton.next_power_of_2(T * k)))

    _align_kernel[(e_tot,)](
        ids, sorted_slots, seg_end, T * k, T, num_slots,
        E=E, E_TOT=e_tot, K=k, KS=ks_slots, BLOCK_M=bm, E_PAD=e_pad, CHUNK=chunk, num_warps=4,
        **pdl_launch(x.device))

    bn, bk, warps, stages = cfg.up
    _gate_up_kernel[(num_blocks * triton.cdiv(inter, bn),)](
        x, w13, sw13, sorted_slots, seg_end, act, H, inter, num_slots,
        x.stride(0), w13.stride(0), w13.stride(1), sw13.stride(0),
        E=E, E_TOT=e_tot, E_PAD=e_pad, KS=ks_slots, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        EVEN_K=H % bk == 0, PRECISION=_dot_precision(w13.dtype), num_warps=warps, num_stages=stages,
        **pdl_launch(x.device))

    bn, bk, warps, stages = cfg.down
    _down_kernel[(num_blocks * triton.cdiv(H, bn),)](
        act, w2, sw2, sorted_slots, seg_end, topk_w, shared_w, slot_out, H, inter, num_slots,
        w2.stride(0), w2.stride(1), sw2.stride(0),
        E=E, E_TOT=e_tot, E_PAD=e_pad, K=k, KS=ks_slots, NUM_SW=n_shared_w,
        SW_REP=sw_rep, HAS_SW=has_sw,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=inter % bk == 0,
        PRECISION=_dot_precision(w2.dtype), num_warps=warps, num_stages=stages, **pdl_launch(x.device))

    if conv is not None:
        block_h = min(SUM_CONV_BLOCK_H, triton.next_power_of_2(H))
        _sum_slots_conv_kernel[(triton.cdiv(H, block_h),)](
            slot_out, out, T, H, **decode_conv_kernel_args(conv, out, conv_chunk), KS=ks_slots,
            BLOCK_M=triton.next_power_of_2(T), BLOCK_H=block_h, num_warps=4, **pdl_launch(x.device))
        return out
    block_h = min(1024, triton.next_power_of_2(H))
    _sum_slots_kernel[(T, triton.cdiv(H, block_h))](slot_out, out, H, KS=ks_slots, BLOCK_H=block_h,
                                                   num_warps=4, **pdl_launch(x.device))
    return out
