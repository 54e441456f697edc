"""Triton RMSNorm, alone and fused with the residual add before it.

    rms_norm(x, w, eps)                  = x / sqrt(mean(x^2) + eps) * w
    fused_add_rms_norm(x, r, w, eps)     = (rms_norm(x + r, w, eps), x + r)

The reference is `kiln.layers.norm.rms_norm` (MODELS.md: statistics and scaling in fp32, one
cast back): x in fp32, times rsqrt(mean + eps), times w in fp32, cast to x's dtype. The kernels do
the same per row in registers, so the ~7 elementwise/reduction launches of the reference (casts,
pow, mean, rsqrt, two muls) and the residual add become one launch.

The residual sum is rounded to the residual's dtype before the norm reads it, exactly like the
reference's `h + a` in the model's dtype, so the residual stream is bit-identical to the reference
and only the norm's fp32 reduction order (and the hardware rsqrt) differ, by a few fp32 ulps. The
sum is written to a new tensor, never in place: nothing else that holds the old residual can see
it change.

Rows are the leading dims flattened: x is addressed as [A, B, H] with its own strides, so a per-head
norm of q / k split out of a fused QKV projection ([T, heads, D] views with a row stride of the
whole projection) needs no copy first. One program handles BLOCK_R rows (several for small H,
such as head dims); rows up to MAX_BLOCK_H wide stay in registers (one pass), wider rows take two
passes over H (the sum of squares, then the scaled output; the second pass recomputes x + r from
the inputs rather than reading back what the first pass stored).

No host sync, grids depend only on shapes: CUDA-graph capturable. Inference only (no backward).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kiln.kernels.launch import pdl_launch, wait_for_previous

MAX_BLOCK_H = 8192  # widest row kept in registers in one pass (tests lower it to reach the loop)


@triton.jit
def _row_values(x_ptr, r_ptr, r_out_ptr, x_off, r_off, o_off, cols, mask,
                HAS_RESIDUAL: tl.constexpr, STORE_RESIDUAL: tl.constexpr):
    """fp32 values of a [BLOCK_R, BLOCK_H] tile: x, or x + r rounded to r's dtype (what the
    reference's add produces), optionally storing that sum."""
    v = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + r_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = (v + r).to(r_out_ptr.dtype.element_ty)
        if STORE_RESIDUAL:
            tl.store(r_out_ptr + o_off[:, None] + cols[None, :], s, mask=mask)
        v = s.to(tl.float32)
    return v


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr,
    N, H, B, eps,
    stride_xa, stride_xb, stride_ra, stride_rb,
    HAS_RESIDUAL: tl.constexpr, ONE_PASS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    """Rows pid*BLOCK_R .. +BLOCK_R of the [N = A*B, H] input; row n is x[n // B, n % B, :]."""
    wait_for_previous(PDL)
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    row_ok = rows < N
    a, b = rows // B, rows % B
    x_off = a * stride_xa + b * stride_xb
    r_off = a * stride_ra + b * stride_rb
    o_off = rows * H  # outputs are contiguous [N, H]
    cols = tl.arange(0, BLOCK_H)
    if ONE_PASS:
        mask = row_ok[:, None] & (cols < H)[None, :]
        v = _row_values(x_ptr, r_ptr, r_out_ptr, x_off, r_off, o_off, cols, mask, HAS_RESIDUAL, True)
        inv = tl.math.rsqrt(tl.sum(v * v, axis=1) / H + eps)
        w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        # (x * inv) * w: the reference's order of the two products.
        y = (v * inv[:, None]) * w[None, :]
        tl.store(out_ptr + o_off[:, None] + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ss = tl.zeros([BLOCK_R], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            c = h0 + cols
            mask = row_ok[:, None] & (c < H)[None, :]
            v = _row_values(x_ptr, r_ptr, r_out_ptr, x_off, r_off, o_off, c, mask, HAS_RESIDUAL, True)
            ss += tl.sum(v * v, axis=1)
        inv = tl.math.rsqrt(ss / H + eps)
        for h0 in range(0, H, BLOCK_H):
            c = h0 + cols
            mask = row_ok[:, None] & (c < H)[None, :]
            v = _row_values(x_ptr, r_ptr, r_out_ptr, x_off, r_off, o_off, c, mask, HAS_RESIDUAL, False)
            w = tl.load(w_ptr + c, mask=c < H, other=0.0).to(tl.float32)
            y = (v * inv[:, None]) * w[None, :]
            tl.store(out_ptr + o_off[:, None] + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def prenorm_inv_rms(X, R, rm, m_ok, stride_xm, stride_rm, K, eps, HAS_RESIDUAL: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_M] fp32 1 / sqrt(mean(s^2) + eps) of rows s = x, or x + r rounded to r's dtype: the
    statistics of a norm that a kernel reading its output computes itself (the decode GEMV's
    prologue, `kiln.kernels.gemv`). Sums BLOCK_K columns at a time, so the order differs from
    `_rms_norm_kernel`'s by a few fp32 ulps of the result."""
    rk = tl.arange(0, BLOCK_K)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask = m_ok[:, None] & (k0 + rk < K)[None, :]
        v = _row_values(X, R, R, rm * stride_xm, rm * stride_rm, rm, k0 + rk, mask, HAS_RESIDUAL, False)
        ss += tl.sum(v * v, axis=1)
    return tl.math.rsqrt(ss / K + eps)


@triton.jit
def normed_tile(x, R, W, S_OUT, N_OUT, rows, cols, mask, inv, stride_rm, K, store,
                HAS_RESIDUAL: tl.constexpr, KEEP_NORMED: tl.constexpr):
    """The norm's output at `cols` of `rows` (any tile shape, broadcast as `x`), from x's fp32 tile
    and `inv` (`prenorm_inv_rms`, broadcast likewise): s = x, or x + r rounded to the residual's
    dtype, then ((s * inv) * w) rounded to x's dtype (S_OUT's), as `_rms_norm_kernel` computes it;
    returned in fp32. Where `store`, s (the residual stream's new value) goes to S_OUT and, with
    KEEP_NORMED, the normed tile to N_OUT (both contiguous [M, K])."""
    r, w = norm_operands(R, W, rows, cols, mask, stride_rm, HAS_RESIDUAL)
    return normed_values(x, r, w, S_OUT, N_OUT, rows, cols, mask, inv, K, store, HAS_RESIDUAL, KEEP_NORMED)


@triton.jit
def norm_operands(R, W, rows, cols, mask, stride_rm, HAS_RESIDUAL: tl.constexpr):
    """The residual's tile (R's dtype; 0 without one) and the norm weight's tile (W's dtype) at
    `cols` of `rows`, as `normed_tile` reads them: loaded apart so that a loop can issue the next
    tile's loads before it uses the current one (`normed_values`)."""
    if HAS_RESIDUAL:
        r = tl.load(R + rows * stride_rm + cols, mask=mask, other=0.0)
    else:
        r = 0.0
    w = tl.load(W + cols, mask=mask, other=0.0)
    return r, w


@triton.jit
def normed_values(x, r, w, S_OUT, N_OUT, rows, cols, mask, inv, K, store,
                  HAS_RESIDUAL: tl.constexpr, KEEP_NORMED: tl.constexpr):
    """`normed_tile` from operands already loaded (`norm_operands`): the same values, bit for bit."""
    if HAS_RESIDUAL:
        s = (x + r.to(tl.float32)).to(S_OUT.dtype.element_ty)
        tl.store(S_OUT + rows * K + cols, s, mask=mask & store)
        x = s.to(tl.float32)
    n = ((x * inv) * w.to(tl.float32)).to(S_OUT.dtype.element_ty)
    if KEEP_NORMED:
        tl.store(N_OUT + rows * K + cols, n, mask=mask & store)
    return n.to(tl.float32)


@triton.jit
def store_normed_rows(S, W, OUT, rm, m_ok, N, eps, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
                      ONE_PASS: tl.constexpr):
    """RMSNorm of rows rm of S [M, N] into OUT [M, N] (both contiguous), ((s * inv) * w) as
    `_rms_norm_kernel` computes it, for a program that runs a norm on rows other programs of its
    grid wrote (the decode GEMV's epilogue, `kiln.kernels.gemv`): S is read through L2 (`.cg`),
    never from a stale L1 line. ONE_PASS (BLOCK >= N): the rows stay in registers, S and W loaded
    together; else the statistics, then the scaled output, BLOCK columns at a time. The sum of
    squares runs in this kernel's layout, so it may differ from the norm kernel's by fp32 ulps."""
    cols = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = m_ok[:, None] & (cols < N)[None, :]
        v = tl.load(S + rm[:, None] * N + cols[None, :], mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(v * v, axis=1) / N + eps)
        y = (v * inv[:, None]) * w[None, :]
        tl.store(OUT + rm[:, None] * N + cols[None, :], y.to(OUT.dtype.element_ty), mask=mask)
    else:
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c0 in range(0, N, BLOCK):
            mask = m_ok[:, None] & (c0 + cols < N)[None, :]
            v = tl.load(S + rm[:, None] * N + c0 + cols[None, :], mask=mask, other=0.0,
                        cache_modifier=".cg").to(tl.float32)
            ss += tl.sum(v * v, axis=1)
        inv = tl.math.rsqrt(ss / N + eps)
        for c0 in range(0, N, BLOCK):
            mask = m_ok[:, None] & (c0 + cols < N)[None, :]
            v = tl.load(S + rm[:, None] * N + c0 + cols[None, :], mask=mask, other=0.0,
                        cache_modifier=".cg").to(tl.float32)
            w = tl.load(W + c0 + cols, mask=c0 + cols < N, other=0.0).to(tl.float32)
            y = (v * inv[:, None]) * w[None, :]
            tl.store(OUT + rm[:, None] * N + c0 + cols[None, :], y.to(OUT.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [A, B, H] with a contiguous last dim, a view whenever the layout allows it."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    if x.dim() > 3:
        return x.reshape(-1, x.shape[-2], x.shape[-1])
    return x


def _launch(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float):
    h = x.shape[-1]
    assert weight.shape == (h,) and weight.stride(0) == 1, (weight.shape, h)
    x3 = _as_rows(x)
    r3 = _as_rows(residual) if residual is not None else x3
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    r_out = torch.empty(x.shape, dtype=residual.dtype, device=x.device) if residual is not None else out
    n = x3.shape[0] * x3.shape[1]
    if n == 0:
        return out, r_out
    block_h = triton.next_power_of_2(h)
    one_pass = block_h <= MAX_BLOCK_H
    if not one_pass:
        block_h = min(4096, MAX_BLOCK_H)
    block_r = max(1, min(64, 4096 // block_h))  # small H (head dims): several rows per program
    num_warps = 4 if block_r * block_h <= 4096 else 8
    _rms_norm_kernel[(triton.cdiv(n, block_r),)](
        x3, r3, weight, out, r_out,
        n, h, x3.shape[1], float(eps),
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        HAS_RESIDUAL=residual is not None, ONE_PASS=one_pass,
        BLOCK_R=block_r, BLOCK_H=block_h, num_warps=num_warps, **pdl_launch(x3.device),
    )
    return out, r_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`kiln.layers.norm.rms_norm` over the last dim of x (any leading dims, any row strides):
    statistics and scaling in fp32, result in x's dtype."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the sum in the residual's dtype (bit-identical to
    `x + residual`), the norm as `rms_norm`. Both results are new tensors."""
    assert x.shape == residual.shape and x.dtype == residual.dtype, (x.shape, residual.shape, x.dtype,
                                                                      residual.dtype)
    return _launch(x, residual, weight, eps)
