"""Triton GEMV for decode: y = x W^T for a few rows, its weight stream started before the PDL wait.

At batch 1 a linear layer is a pure weight stream, and what separates cuBLAS from the HBM
roofline is mostly the start of each GEMM: the launch, then the first round trip to DRAM before
any byte arrives (docs/benchmarks.md, "seventh pass"). With programmatic dependent launch
(`kiln.kernels.launch`) this kernel starts as its predecessor's programs (a norm, attention, the
SwiGLU product) exit, before that grid has completed and its writes are visible, and it loads its
first weight tile *before* `griddepcontrol.wait`: weights are never written by the kernel before
it, so the stream is under way by the time x is readable. Only x (and, with a ShortConv epilogue,
its state; with a norm prologue, `gemv_prenorm`, the residual and the norm's weight) is read after
the wait. A weight of at most `prefetch_bytes` can also be asked into L2
whole before the wait (`kiln.kernels.prefetch`), so that HBM streams it while the kernel before
runs; measured slower on an H200 (docs/benchmarks.md, fourteenth pass), so the engine's default
is 0.

Two inner loops, picked by the number of rows:
- 1 to 4 rows (BLOCK_M = M rounded up to 1, 2 or 4): CUDA-core FMAs into a [BLOCK_M, BLOCK_N, BLOCK_K]
  fp32 accumulator reduced once at the end, the next weight tile loaded while the current one is
  multiplied (two tiles in flight per program). Narrow BLOCK_N gives many programs per SM. The
  activation side (x, and a folded norm's residual and weight) is loaded one tile ahead as well
  (XPIPE): in a dependent chain each K step otherwise waits for its own L2 round trip after the
  PDL wait, ~0.3-0.4 us each (`benchmarks/kernel_bench/gemv_trace.py`, twenty-third pass). A tile
  as deep as K (ONE_TILE: any tile with BLOCK_K >= K, so also `fma_tile`'s 2x1024 at K <= 1024;
  chosen for it at one row and 1024 < K <= 2048) has no loop: the program's whole row slice is
  loaded before the wait and reduced once, with no accumulator tile to carry, so its registers
  stay low enough that every program of the grid is resident at once.
- 5..16 rows: one 16-row MMA tile (`tl.dot`), pipelined by Triton. Except an fp32 weight's
  half-precision rows (the MoE routers, up to WIDEN_MAX_ROWS): they stay on the FMA loop, blocks
  of 4 rows side by side on a second grid axis (M_BLOCKS), since the MMA loop's IEEE fp32 products
  are FMAs over too few programs (docs/benchmarks.md, forty-ninth pass). An LM head of 1..4 rows
  can ask for the MMA loop too (`mma`): its wide head tile loads each weight tile once for all
  rows, where every FMA tile loses to cuBLAS at 4 rows.

The tile is a fixed function of the shape, not autotuned (`kiln.kernels.gemv_tiles` holds the
rules and the candidates `python -m benchmarks.kernel_bench.gemv --sweep` times).

With `trace` each program records its timestamps (`kiln.kernels.trace`): what the trace tool reads.

Reference: `torch.nn.functional.linear`; `tests/kernels/test_gemv.py` compares the two.
`kiln.layers.decode_gemv` routes the engine's decode projections here (`--gemv-max-rows`).
Inference only; no host sync; the grid depends only on shapes (CUDA-graph capturable).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kiln.kernels import interpreting
from kiln.kernels.gemv_tiles import (FMA_MAX_ROWS, MAX_ROWS, WIDEN_MAX_ROWS, dot_tile, fma_tile, interpreter_dot_tile,
                                     interpreter_tile, prenorm_tile)
from kiln.kernels.launch import pdl_launch, wait_for_previous
from kiln.kernels.norm import norm_operands, normed_tile, normed_values, prenorm_inv_rms, store_normed_rows
from kiln.kernels.prefetch import l2_prefetch_span, prefetch_args
from kiln.kernels.rotary import rope_epilogue, rope_epilogue_args, rope_pair_rows
from kiln.kernels.shortconv import decode_conv_epilogue, decode_conv_history, decode_conv_kernel_args
from kiln.kernels.trace import global_time, store_trace, trace_args

PRENORM_MAX_BLOCK = 4096  # values per program in one step of the norm prologue's statistics (tests lower it)


@triton.jit
def _gemv_fma_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym, PF_SPAN, PF_CHUNK, PF_PROGRAMS,
                     CW, CBUF, CTAB, CSLOTS, CLENS, CLOCS, stride_cw, stride_cbuf, stride_ctab,
                     NR, NW, NS, NX, stride_nr, eps, NCNT,
                     COS, SIN, POS, LOC, KC, VC, stride_cs, stride_kcs, stride_kch, stride_vcs, stride_vch, HQ, HK, TR,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                     GLU: tl.constexpr, PREFETCH: tl.constexpr, CONV: tl.constexpr, CK: tl.constexpr,
                     CKP: tl.constexpr, CCHUNK: tl.constexpr, NORM: tl.constexpr, NORM_RES: tl.constexpr,
                     NORM_KEEP: tl.constexpr, NORM_BLOCK: tl.constexpr, NORM_OUT: tl.constexpr,
                     NORM_ONE_PASS: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr, TRACE: tl.constexpr,
                     XPIPE: tl.constexpr, ONE_TILE: tl.constexpr, ROUND_TO_X: tl.constexpr = False,
                     M_BLOCKS: tl.constexpr = 1):
    """Columns pid*BLOCK_N .. +BLOCK_N of y [M, N] for M <= BLOCK_M <= 4 (M <= M_BLOCKS x BLOCK_M
    with M_BLOCKS, below), fp32 accumulation.
    ROUND_TO_X (the plain store only): y is fp32 and takes the product rounded to x's dtype first.
    Tiles are addressed in 3-D ([1, BLOCK_N, BLOCK_K] weights, [BLOCK_M, 1, BLOCK_K] rows of x) so
    that both load straight into the product's layout (no shared-memory shuffle per tile).
    GLU: W is [2N, K] (gate rows, then up rows) and y = silu(gate) * up, with gate and up rounded
    to y's dtype first and the product computed as `kiln.kernels.activation` does: bit for bit
    the GEMV followed by `silu_and_mul`, one launch fewer.
    CONV: row m is decode sequence m and y goes through its ShortConv (`kiln.kernels.shortconv`:
    weight CW [N, CK], buffer CBUF, table CTAB, rows CSLOTS, lengths CLENS, state slots CLOCS),
    the history loaded after the wait, before the main loop. CCHUNK: the rows are tokens of short
    chunks instead (CSLOTS their request rows, CLENS their positions); a tap inside a row's chunk
    comes from this program's own rows.
    NORM: x holds a pre-norm sublayer's input h and the product is taken with RMSNorm(h + NR)
    (weight NW, eps; `kiln.kernels.norm.normed_tile`), its statistics computed by every program
    after the wait; program 0 also writes h + NR to NS (NORM_RES) and the normed rows to NX
    (NORM_KEEP).
    NORM_OUT: instead the next sublayer's pre-norm runs on the product: each program stores its
    columns of s = y + NR to NS and counts itself done (an acq_rel atomic on NCNT, as the router
    gate's programs do); the last to finish norms whole rows of s (weight NW) into NX and resets
    the count (`kiln.kernels.norm.store_normed_rows`, the row in registers with NORM_ONE_PASS).
    y itself is not stored.
    ROPE: W is a fused qkv projection, each program's rows a head's rotation pairs
    (`kiln.kernels.rotary.rope_pair_rows`), and the epilogue rotates q into Y and writes k and v into
    the cache (`rope_epilogue`) instead of storing y.
    TRACE: each program writes its timestamps to TR (`kiln.kernels.trace`).
    XPIPE: the activation tiles (x; with NORM, the residual's and the norm weight's) are loaded one
    K tile ahead, as the weights are; off, each in its own iteration (the same values, bit for bit).
    ONE_TILE (BLOCK_K >= K, set by the wrapper): no K loop and no accumulator tile.
    M_BLOCKS > 1 (a plain product only: the routers' logits of more than BLOCK_M rows): program
    (i, j) computes rows j * BLOCK_M .. of its columns, each block of rows reading the weight tile
    again (from L2 after the first)."""
    if M_BLOCKS > 1:
        m0 = tl.program_id(1) * BLOCK_M
        X += m0 * stride_xm
        Y += m0 * stride_ym
        M -= m0
    if TRACE:
        t_start = global_time(0.0)
    if ROPE:
        rn = rope_pair_rows(tl.program_id(0), BLOCK_N, HALF)
    else:
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = (rn < N)[None, :, None]
    m_ok = (rm < M)[:, None, None]
    kk = rk[None, None, :]
    w_ptrs = W + rn[None, :, None].to(tl.int64) * stride_wn + kk
    x_ptrs = X + rm[:, None, None] * stride_xm + kk
    # The weights are never written by the previous kernel: start their stream before the wait.
    w = tl.load(w_ptrs, mask=n_ok & (kk < K), other=0.0)
    if GLU:
        u_ptrs = W + (rn + N)[None, :, None].to(tl.int64) * stride_wn + kk
        u = tl.load(u_ptrs, mask=n_ok & (kk < K), other=0.0)
    if PREFETCH:
        l2_prefetch_span(W, tl.program_id(0), PF_SPAN, PF_CHUNK, PF_PROGRAMS)
    wait_for_previous(PDL)
    if TRACE:
        t_waited = global_time(0.0)
    if XPIPE:  # x's first tile (and the norm's operands) in flight with the statistics' loads
        xa = tl.load(x_ptrs, mask=m_ok & (kk < K), other=0.0)
        if NORM:
            ra, na = norm_operands(NR, NW, rm[:, None, None], kk, m_ok & (kk < K), stride_nr, NORM_RES)
    if NORM:
        inv = prenorm_inv_rms(X, NR, rm, rm < M, stride_xm, stride_nr, K, eps, NORM_RES, BLOCK_M,
                              NORM_BLOCK)[:, None, None]
        first = tl.program_id(0) == 0
    if CONV:
        hist = decode_conv_history(rm, rm < M, rn, rn < N, CBUF, stride_cbuf, CTAB, stride_ctab, CSLOTS, CLENS,
                                   CK, CKP, CCHUNK)
    if TRACE:  # after the norm's statistics; without a norm, once the prologue's loads are issued (a
        # dependence on the conv history would hold the loop back until it arrives)
        if NORM:
            t_prologue = global_time(tl.sum(tl.sum(tl.sum(inv, axis=2), axis=1), axis=0))
        else:
            t_prologue = global_time(0.0)
    if ONE_TILE:  # the whole row was loaded before the wait: no loop, no accumulator tile to carry
        x_ok = m_ok & (kk < K)
        if XPIPE:
            x = xa.to(tl.float32)
            if NORM:
                x = normed_values(x, ra, na, NS, NX, rm[:, None, None], kk, x_ok, inv, K, first, NORM_RES, NORM_KEEP)
        else:
            x = tl.load(x_ptrs, mask=x_ok, other=0.0).to(tl.float32)
            if NORM:
                x = normed_tile(x, NR, NW, NS, NX, rm[:, None, None], kk, x_ok, inv, stride_nr, K, first, NORM_RES,
                                NORM_KEEP)
        y = tl.sum(w.to(tl.float32) * x, axis=2)
        if GLU:
            y_u = tl.sum(u.to(tl.float32) * x, axis=2)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        if GLU:
            acc_u = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(BLOCK_K, K + BLOCK_K, BLOCK_K):
            # load tile k0 (masked off past K) while tile k0 - BLOCK_K is multiplied
            w_next = tl.load(w_ptrs + k0, mask=n_ok & (kk < K - k0), other=0.0)
            if GLU:
                u_next = tl.load(u_ptrs + k0, mask=n_ok & (kk < K - k0), other=0.0)
            x_ok = m_ok & (kk < K - k0 + BLOCK_K)
            if XPIPE:  # x's tile k0 too: only the first tile's round trip after the wait is not hidden
                x = xa.to(tl.float32)
                xa = tl.load(x_ptrs + k0, mask=m_ok & (kk < K - k0), other=0.0)
                if NORM:
                    x = normed_values(x, ra, na, NS, NX, rm[:, None, None], kk + (k0 - BLOCK_K), x_ok, inv, K,
                                      first, NORM_RES, NORM_KEEP)
                    ra, na = norm_operands(NR, NW, rm[:, None, None], kk + k0, m_ok & (kk < K - k0), stride_nr,
                                           NORM_RES)
            else:
                x = tl.load(x_ptrs + (k0 - BLOCK_K), mask=x_ok, other=0.0).to(tl.float32)
                if NORM:
                    x = normed_tile(x, NR, NW, NS, NX, rm[:, None, None], kk + (k0 - BLOCK_K), x_ok, inv,
                                    stride_nr, K, first, NORM_RES, NORM_KEEP)
            acc += w.to(tl.float32) * x
            w = w_next
            if GLU:
                acc_u += u.to(tl.float32) * x
                u = u_next
        y = tl.sum(acc, axis=2)
        if GLU:
            y_u = tl.sum(acc_u, axis=2)
    if TRACE:
        if GLU:
            t_reduced = global_time(tl.sum(tl.sum(y + y_u, axis=1), axis=0))
        else:
            t_reduced = global_time(tl.sum(tl.sum(y, axis=1), axis=0))
    if GLU:
        g = y.to(Y.dtype.element_ty).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * y_u.to(Y.dtype.element_ty).to(tl.float32)
    if CONV:  # the conv reads the projection as the unfused path stores it
        y = decode_conv_epilogue(y.to(CBUF.dtype.element_ty), hist, rm, rm < M, rn, rn < N, CW, stride_cw, CBUF,
                                 stride_cbuf, CLOCS, CSLOTS, CLENS, CK, CKP, CCHUNK)
    if ROPE:
        rope_epilogue(y, tl.program_id(0), rm, rm < M, Y, stride_ym, COS, SIN, stride_cs, POS, LOC, KC, VC, stride_kcs,
                      stride_kch, stride_vcs, stride_vch, HQ, HK, BLOCK_M, BLOCK_N, HALF)
    elif NORM_OUT:
        ok = (rm < M)[:, None] & (rn < N)[None, :]
        r = tl.load(NR + rm[:, None] * stride_nr + rn[None, :], mask=ok, other=0.0).to(tl.float32)
        # y rounded as the unfused path stores it, the sum rounded as the reference's `h + f`
        s = (y.to(Y.dtype.element_ty).to(tl.float32) + r).to(NS.dtype.element_ty)
        tl.store(NS + rm[:, None] * N + rn[None, :], s, mask=ok)
        # Every warp's columns are written before the release (one thread issues the atomic); the
        # last arrival acquires them all.
        tl.debug_barrier()
        if tl.atomic_add(NCNT, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            tl.atomic_xchg(NCNT, 0, sem="relaxed", scope="gpu")
            store_normed_rows(NS, NW, NX, rm, rm < M, N, eps, BLOCK_M, NORM_BLOCK, NORM_ONE_PASS)
    else:
        if ROUND_TO_X:  # `.float()` of the product in x's dtype, without its launch
            y = y.to(X.dtype.element_ty).to(tl.float32)
        tl.store(Y + rm[:, None] * stride_ym + rn[None, :], y.to(Y.dtype.element_ty),
                 mask=(rm < M)[:, None] & (rn < N)[None, :])
    if TRACE:
        store_trace(TR, tl.program_id(0), t_start, t_waited, t_prologue, t_reduced, global_time(0.0))


@triton.jit
def _gemv_dot_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym, PF_SPAN, PF_CHUNK, PF_PROGRAMS,
                     PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                     PREFETCH: tl.constexpr, ROUND_TO_X: tl.constexpr = False):
    """Columns pid*BLOCK_N .. +BLOCK_N of y [M, N] for M <= 16 rows (one MMA tile). ROUND_TO_X: as
    `_gemv_fma_kernel`'s (fp32 y of the product rounded to x's dtype)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, 16)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    w_ptrs = W + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    x_ptrs = X + rm[:, None] * stride_xm + rk[None, :]
    w = tl.load(w_ptrs, mask=n_ok[:, None] & (rk < K)[None, :], other=0.0)  # before the wait, as above
    if PREFETCH:
        l2_prefetch_span(W, tl.program_id(0), PF_SPAN, PF_CHUNK, PF_PROGRAMS)
    wait_for_previous(PDL)
    x = tl.load(x_ptrs, mask=m_ok[:, None] & (rk < K)[None, :], other=0.0)
    acc = tl.dot(x, tl.trans(w), tl.zeros((16, BLOCK_N), dtype=tl.float32), input_precision=PRECISION)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k_ok = rk < K - k0
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if ROUND_TO_X:  # (the same name's type must not change inside the branch: the compiler refuses it)
        acc = acc.to(X.dtype.element_ty).to(tl.float32)
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemv(x: torch.Tensor, weight: torch.Tensor, tile: Optional[dict] = None, glu: bool = False,
         prefetch_bytes: int = 0, conv: Optional[tuple] = None, rope: Optional[tuple] = None,
         conv_chunk: bool = False, trace: Optional[torch.Tensor] = None, float_out: bool = False,
         mma: bool = False) -> torch.Tensor:
    """x @ weight.T for x [M, K] with 1 <= M <= MAX_ROWS and weight [N, K] of x's dtype; y [M, N]
    in x's dtype, accumulated in fp32 (IEEE fp32 products for fp32 weights). `tile` overrides the
    shape rule (`fma_tile` / `dot_tile`; the benchmark's sweep).

    float_out (a plain product): y is fp32, bit for bit `.float()` of the result in x's dtype,
    without that cast's launch (the LM heads' fp32 logits).

    mma (a plain product): the MMA loop at any row count, 1..4 rows padded to its 16 as 5..16 are
    (an LM head: `dot_tile`'s head tile loads each weight tile once for all rows, where every FMA
    tile loses to cuBLAS at 4 rows).

    An fp32 weight with bf16 / fp16 rows (the MoE routers, up to WIDEN_MAX_ROWS rows) gives the
    fp32 `F.linear(x.float(), weight)` (x widened exactly in the kernel: no cast launch); past
    FMA_MAX_ROWS rows the FMA loop runs on blocks of 4 rows side by side (grid axis 1).

    glu (M <= FMA_MAX_ROWS): weight is a fused gate_up [2I, K] and the result is
    `kiln.kernels.activation.silu_and_mul` of the product, [M, I], bit for bit, in one launch.
    Each program then streams BLOCK_N / 2 gate rows and as many up rows (the bytes in flight per
    program of the plain tile).

    prefetch_bytes: a weight whose storage spans at most this many bytes is prefetched into L2
    before the PDL wait (`kiln.kernels.prefetch`; NVIDIA sm_90+, not interpreted). The result does
    not change by a bit.

    conv (M <= FMA_MAX_ROWS, not glu) = (weight [N, conv width], conv_buf, conv_table, req_slots, seq_lens,
    out_locs), the arguments of `kiln.kernels.shortconv.short_conv_decode` after x: the result is
    that decode ShortConv of the GEMV's output (row m is sequence m; with `conv_chunk`, below, the
    rows are short chunks), and the output rows go into conv_buf[out_locs], in one launch. Same
    rounding points as the two launches; the conv's adds may be contracted into FMAs here (the ShortConv kernel forbids that), so within a few fp32
    ulps of them before the final rounding rather than bit for bit (the interpreter: bit for bit).

    rope (M <= FMA_MAX_ROWS, not glu or conv) = (cos, sin, positions, loc, k_cache, v_cache), the
    arguments of `kiln.kernels.rotary.rope_store` after q, k, v with cos / sin first: weight is a
    fused qkv projection [(Hq + 2 Hk) D, K] (k_cache [slots, Hk, D]) and the result is q [M, Hq D]
    rotated, with k rotated and v written into the caches at rows loc: `rope_store` of the
    projection, in one launch. Each program's rows are rotation pairs of one head. Same rounding
    points; the rotation's products may be contracted into FMAs (`rope_store` forbids that), so
    within a few fp32 ulps of it before the final rounding (the interpreter: bit for bit).

    trace (M <= FMA_MAX_ROWS, CUDA only): an int64 buffer of at least programs x
    `kiln.kernels.trace.FIELDS` values that receives each program's timestamps; the result does
    not change (`benchmarks/kernel_bench/gemv_trace.py`)."""
    return _launch(x, weight, tile, glu, prefetch_bytes, conv, None, rope, conv_chunk, trace=trace,
                   float_out=float_out, mma=mma)


def gemv_prenorm(h: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor, eps: float,
                 weight: torch.Tensor, glu: bool = False, keep_normed: bool = False, prefetch_bytes: int = 0,
                 tile: Optional[dict] = None, rope: Optional[tuple] = None, trace: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The GEMV of a pre-norm sublayer's first projection with the norm in its prologue:
    x = rms_norm(h + residual) (`kiln.kernels.norm.fused_add_rms_norm`; rms_norm(h) when residual
    is None), then `gemv(x, weight, glu=glu)`, in one launch. Each program computes the row
    statistics itself after the PDL wait (a few KB from L2), so no program waits for another.

    h, residual [M, K], M <= FMA_MAX_ROWS, of one dtype; norm_weight [K]; weight as `gemv` takes it
    (an fp32 router weight included); the tile `prenorm_tile` unless given. Returns (y,
    h + residual (h itself when residual is None), the normed rows if `keep_normed` else None).
    The normed values are the norm kernel's up to its statistics: summed in another order, they
    may differ from it by an ulp of x's dtype. The product may also sum in another order than
    `gemv`'s, `prenorm_tile` picking another tile than `fma_tile`. rope, trace: as `gemv`'s (y is
    then q)."""
    m, k = h.shape
    assert m <= FMA_MAX_ROWS, f"the norm prologue takes 1..{FMA_MAX_ROWS} rows, got {m}"
    assert norm_weight.shape == (k,) and norm_weight.stride(0) == 1, (norm_weight.shape, k)
    assert residual is None or (residual.shape == h.shape and residual.dtype == h.dtype), "residual must match h"
    h = h if h.stride(-1) == 1 else h.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    summed = torch.empty_like(h) if residual is not None else h  # without a residual nothing is stored
    normed = torch.empty_like(h) if keep_normed else None
    norm = (residual, norm_weight, float(eps), summed, normed)
    tile = tile or (None if interpreting() else prenorm_tile(m, weight.shape[0], k))
    y = _launch(h, weight, tile, glu, prefetch_bytes, None, norm, rope, trace=trace)
    return y, summed, normed


def gemv_add_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                  eps: float, counter: torch.Tensor, prefetch_bytes: int = 0, tile: Optional[dict] = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMV of a sublayer's last projection with the next sublayer's pre-norm in its epilogue:
    f = x @ weight.T, then `kiln.kernels.norm.fused_add_rms_norm(f, residual, norm_weight, eps)`,
    in one launch. Returns (rms_norm(f + residual), f + residual).

    Each program adds the residual to its columns; the last program to finish (counted on
    `counter`, an int32 [1] of zeros that it leaves zeroed: one launch at a time per counter) norms
    the whole rows. So, unlike the norm prologue (`gemv_prenorm`), no program repeats the
    statistics, and one launch and one PDL hand-off fewer run than with the norm kernel. f and
    the sum are rounded as the unfused path rounds them (f + residual bit for bit); the normed
    rows may differ from the norm kernel's by an ulp of x's dtype (another summation order).

    x [M, K] with M <= FMA_MAX_ROWS; weight [N, K]; residual [M, N] of x's dtype; norm_weight [N].
    The product takes `fma_tile` (or `tile`), so f is `gemv(x, weight)` bit for bit."""
    m = x.shape[0]
    n = weight.shape[0]
    assert m <= FMA_MAX_ROWS, f"the norm epilogue takes 1..{FMA_MAX_ROWS} rows, got {m}"
    assert residual.shape == (m, n) and residual.dtype == x.dtype, "residual must be [M, N] of x's dtype"
    assert norm_weight.shape == (n,) and norm_weight.stride(0) == 1, (norm_weight.shape, n)
    assert counter.dtype == torch.int32 and counter.numel() == 1, "counter: an int32 [1] of zeros"
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    summed, normed = torch.empty_like(residual), torch.empty_like(residual)
    _launch(x, weight, tile, False, prefetch_bytes, None, (residual, norm_weight, float(eps), summed, normed),
            norm_counter=counter)
    return normed, summed


def _norm_kernel_args(norm: Optional[tuple], x: torch.Tensor, block_m: int,
                      counter: Optional[torch.Tensor] = None) -> dict:
    """Launch arguments of the GEMV's norm prologue: norm = (residual or None, weight, eps,
    summed out, normed out or None), or None for none (x then stands in for every pointer). With
    `counter` the norm runs in the epilogue instead (`gemv_add_norm`; residual and normed given)."""
    off = dict(NORM=False, NORM_RES=False, NORM_KEEP=False, NORM_OUT=False, NORM_ONE_PASS=False)
    if norm is None:
        return dict(NR=x, NW=x, NS=x, NX=x, stride_nr=0, eps=0.0, NCNT=x, NORM_BLOCK=1, **off)
    if counter is not None:
        residual, weight, eps, summed, normed = norm
        n = weight.shape[0]
        # the whole row in registers up to 4K values per program; wider rows (or more of them) in chunks
        block = max(16, min(triton.next_power_of_2(n), PRENORM_MAX_BLOCK // block_m))
        return dict(NR=residual, NW=weight, NS=summed, NX=normed, stride_nr=residual.stride(0), eps=eps,
                    NCNT=counter, NORM_BLOCK=block, **dict(off, NORM_OUT=True, NORM_ONE_PASS=block >= n))
    residual, weight, eps, summed, normed = norm
    # the statistics' tile: the whole row at once up to 4K values per program (one round trip to L2)
    block = max(16, min(triton.next_power_of_2(x.shape[1]), PRENORM_MAX_BLOCK // block_m))
    return dict(NR=x if residual is None else residual, NW=weight, NS=summed,
                NX=x if normed is None else normed, stride_nr=0 if residual is None else residual.stride(0),
                eps=eps, NCNT=x, NORM_BLOCK=block,
                **dict(off, NORM=True, NORM_RES=residual is not None, NORM_KEEP=normed is not None))


def _launch(x, weight, tile, glu, prefetch_bytes, conv, norm, rope=None, conv_chunk=False,
            norm_counter=None, trace=None, float_out=False, mma=False) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    # half-precision rows against an fp32 weight (the routers): widened in the kernel, fp32 result
    widen = weight.dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16)
    assert 0 < m <= (WIDEN_MAX_ROWS if widen else MAX_ROWS), \
        f"gemv takes 1..{MAX_ROWS} rows (1..{WIDEN_MAX_ROWS} widened for an fp32 weight), got {m}: use F.linear"
    assert weight.shape[1] == k, f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}"
    assert weight.dtype == x.dtype or widen, f"weight {weight.dtype} and x {x.dtype} differ"
    m_blocks = triton.cdiv(m, FMA_MAX_ROWS) if widen else 1  # (widened rows take the FMA loop, 4 at a time)
    assert m_blocks == 1 or not (glu or conv is not None or norm is not None or rope is not None or float_out
                                 or trace is not None), "more than 4 widened rows take a plain product only"
    assert not glu or (m <= FMA_MAX_ROWS and n % 2 == 0), f"glu takes 1..{FMA_MAX_ROWS} rows and [2I, K] weights"
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    n_out = n // 2 if glu else n
    if rope is not None:  # y is q: the k and v rows go into the caches
        assert m <= FMA_MAX_ROWS and not glu and conv is None and not widen, \
            "the RoPE epilogue takes 1..4 rows of a qkv projection, without glu or conv"
        n_out = n - 2 * rope[4].shape[1] * rope[4].shape[2]
    if float_out or mma:
        assert not (glu or widen or conv is not None or rope is not None or norm is not None), \
            "float_out and mma take a plain product (no glu, conv, rope, norm or widened rows)"
    if norm_counter is not None:  # the norm epilogue stores the sum and the normed rows, never y
        y = norm[3]
    else:
        y = torch.empty(m, n_out, device=x.device, dtype=torch.float32 if widen or float_out else x.dtype)
    # N: the weight rows the programs cover (the q, k and v rows with rope)
    args = (x, weight, y, m, n if rope is not None else n_out, k, x.stride(0), weight.stride(0), y.stride(0))
    pdl = pdl_launch(x.device)
    assert conv is None or (m <= FMA_MAX_ROWS and not glu), "the conv epilogue takes 1..4 rows, without glu"
    assert conv is None or norm is None, "a GEMV takes a norm prologue or a conv epilogue, not both"
    if (m <= FMA_MAX_ROWS or widen) and not mma:
        rows = min(m, FMA_MAX_ROWS)  # per program (M_BLOCKS blocks of them past FMA_MAX_ROWS)
        if not tile:  # (the RoPE half-dim matters to the interpreter's tile only: no work on a GPU launch)
            tile = interpreter_tile(n, rope[4].shape[2] // 2 if rope is not None else 0) if interpreting() \
                else fma_tile(rows, k)
        tile = dict(tile)
        if glu:
            tile["BLOCK_N"] = max(1, tile["BLOCK_N"] // 2)
        grid = triton.cdiv(args[4], tile["BLOCK_N"])
        block_m = triton.next_power_of_2(rows)
        _gemv_fma_kernel[(grid, m_blocks)](*args, **prefetch_args(weight, prefetch_bytes, grid),
                                           **decode_conv_kernel_args(conv, y, conv_chunk),
                                           **_norm_kernel_args(norm, x, block_m, norm_counter),
                                           **rope_epilogue_args(rope, y, n, tile["BLOCK_N"]), BLOCK_M=block_m,
                                           GLU=glu, **trace_args(trace, x, grid), **{"XPIPE": True, **tile},
                                           ONE_TILE=tile["BLOCK_K"] >= k, ROUND_TO_X=float_out, M_BLOCKS=m_blocks,
                                           **pdl)
        return y
    assert trace is None, f"only the FMA path (1..{FMA_MAX_ROWS} rows) is traced"
    precision = "ieee" if weight.dtype == torch.float32 else "tf32"
    tile = {k: v for k, v in tile.items() if k != "XPIPE"} if tile else None  # the MMA loop has no XPIPE
    tile = tile or (interpreter_dot_tile(n) if interpreting() else dot_tile(n))
    grid = triton.cdiv(n, tile["BLOCK_N"])
    _gemv_dot_kernel[(grid,)](*args, **prefetch_args(weight, prefetch_bytes, grid), PRECISION=precision,
                              ROUND_TO_X=float_out, **tile, **pdl)
    return y
