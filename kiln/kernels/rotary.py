"""Triton RoPE: q and k of a layer rotated in one launch.

Computes exactly `kiln.layers.rotary.RotaryEmbedding.forward` (rotate-half layout): per token the
fp32 cos/sin rows of its absolute position, then for every head, with x1, x2 the two halves in fp32,

    out = cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin), cast back to x's dtype.

The reference runs ~20 small launches per layer (two table gathers, casts, chunk, four products,
add, sub, cat, casts, for q and for k). Compiled without FMA contraction (`enable_fp_fusion=False`)
every product and sum is rounded like the reference's separate ops, so results are bit-identical,
not just close.

q and k are read in place through their strides (views split out of a fused QKV projection); the
results are new contiguous [T, heads, D] tensors. One program per token, all its heads; positions
are read on the device, the grid depends only on T: CUDA-graph capturable. Inference only.

`rope_store` also writes the layer's cache rows (`kiln.ops.attention.store_kv` of the rotated k
and of v) in the same launch: at batch-1 decode RoPE and the cache write were two launches of a
few microseconds each per layer, both bound by latency, not bytes (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kiln.kernels import assert_rows
from kiln.kernels.kv_store import _blocks, _copy_row
from kiln.kernels.launch import pdl_launch, wait_for_previous


@triton.jit
def _rotate(x1, x2, c, s):
    """The rotate-half rotation of fp32 halves x1, x2 by cos c and sin s (broadcast like them)."""
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _norm_rope_heads(x_ptr, stride_h, out_ptr, stride_oh, h0, n_heads, w_ptr, eps, c, s, d, d_ok,
                     NORM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Heads h0 .. h0 + BLOCK_H - 1 (below n_heads) of one token: RMSNorm (NORM, weight w_ptr)
    rounded to x's dtype, then the rotate-half RoPE by fp32 rows c, s, rounded to x's dtype and
    then to out's."""
    h = h0 + tl.arange(0, BLOCK_H)
    m = (h < n_heads)[:, None] & d_ok[None, :]
    src = x_ptr + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(src, mask=m, other=0.0)
    x2 = tl.load(src + HALF, mask=m, other=0.0)
    dtype = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    if NORM:  # (x * inv) * w, as kiln.kernels.norm
        inv = tl.math.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
        f1 = ((f1 * inv[:, None]) * w1[None, :]).to(dtype).to(tl.float32)
        f2 = ((f2 * inv[:, None]) * w2[None, :]).to(dtype).to(tl.float32)
    o1, o2 = _rotate(f1, f2, c[None, :], s[None, :])
    dst = out_ptr + h[:, None] * stride_oh + d[None, :]
    tl.store(dst, o1.to(dtype).to(out_ptr.dtype.element_ty), mask=m)
    tl.store(dst + HALF, o2.to(dtype).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rotate_heads(x_ptr, out_ptr, stride_h, n_heads, c, s, d, d_ok,
                  stride_oh, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate heads 0..n_heads-1 of one token: x at x_ptr (head stride stride_h), out at out_ptr
    (head stride stride_oh). Rounded to x's dtype first, then to out's:
    a cache of another dtype holds what storing the rotated tensor would give."""
    for h0 in range(0, n_heads, BLOCK_H):
        _norm_rope_heads(x_ptr, stride_h, out_ptr, stride_oh, h0, n_heads, x_ptr, 0.0, c, s, d, d_ok, False, HALF,
                         BLOCK_H)


@triton.jit
def _cos_sin(t, pos_ptr, cos_ptr, sin_ptr, stride_cs, HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token t's fp32 cos and sin rows (its position read on the device), the half-dim offsets
    and their mask."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    c = tl.load(cos_ptr + pos * stride_cs + d, mask=d_ok, other=0.0)
    s = tl.load(sin_ptr + pos * stride_cs + d, mask=d_ok, other=0.0)
    return c, s, d, d_ok


@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, pos_ptr,
                 HQ, HK, stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
                 HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    c, s, d, d_ok = _cos_sin(t, pos_ptr, cos_ptr, sin_ptr, stride_cs, HALF, BLOCK_D)
    _rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * HQ * 2 * HALF, stride_qh, HQ, c, s, d, d_ok,
                  2 * HALF, HALF, BLOCK_H)
    _rotate_heads(k_ptr + t * stride_kt, k_out_ptr + t * HK * 2 * HALF, stride_kh, HK, c, s, d, d_ok,
                  2 * HALF, HALF, BLOCK_H)


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int (device), q [T, Hq, D], k [T, Hk, D] (last dim contiguous, any token/head
    strides), cos/sin [max_positions, D/2] fp32 tables -> (q, k) rotated, new contiguous tensors."""
    assert_rows(positions=positions)
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] == positions.shape[0]
    assert q.shape[-1] == k.shape[-1] == 2 * cos.shape[-1] and cos.stride() == sin.stride()
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    t, hq, dim = q.shape
    hk = k.shape[1]
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype,
                                                                                      device=k.device)
    if t == 0:
        return q_out, k_out
    half = dim // 2
    block_d = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(max(hq, hk)), 4096 // block_d))
    _rope_kernel[(t,)](
        q, k, q_out, k_out, cos, sin, positions,
        hq, hk, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        HALF=half, BLOCK_D=block_d, BLOCK_H=block_h, num_warps=4, enable_fp_fusion=False,
        **pdl_launch(q.device),
    )
    return q_out, k_out


@triton.jit
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, pos_ptr, loc_ptr,
                       HQ, HK, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
                       stride_loc, stride_kcs, stride_kch, stride_vcs, stride_vch,
                       HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_HK: tl.constexpr, BLOCK_DV: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + t * stride_loc).to(tl.int64)
    c, s, d, d_ok = _cos_sin(t, pos_ptr, cos_ptr, sin_ptr, stride_cs, HALF, BLOCK_D)
    _rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * HQ * 2 * HALF, stride_qh, HQ, c, s, d, d_ok,
                  2 * HALF, HALF, BLOCK_H)
    _rotate_heads(k_ptr + t * stride_kt, kc_ptr + slot * stride_kcs, stride_kh, HK, c, s, d, d_ok,
                  stride_kch, HALF, BLOCK_H)
    _copy_row(v_ptr, vc_ptr, t, slot, HK, 2 * HALF, stride_vt, stride_vh, stride_vcs, stride_vch,
              BLOCK_HK, BLOCK_DV)


def rope_store(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               loc: torch.Tensor) -> torch.Tensor:
    """`rope` and `kiln.kernels.kv_store.store_kv` in one launch: q [T, Hq, D] rotated into a new
    contiguous tensor (returned); k [T, Hk, D] rotated and v [T, Hk, D] copied into k_cache /
    v_cache [slots, Hk, D] at rows loc [T] (device, any integer dtype). Bit-identical to
    `store_kv(*rope(positions, q, k, cos, sin)[1:], v, ...)`, with the rotated k never written
    anywhere but the cache."""
    assert_rows(positions=positions)
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] == positions.shape[0] == loc.shape[0]
    assert v.shape == k.shape and k_cache.shape[1:] == v_cache.shape[1:] == k.shape[1:], \
        (q.shape, k.shape, v.shape, k_cache.shape, v_cache.shape)
    assert q.shape[-1] == 2 * cos.shape[-1] and cos.stride() == sin.stride() and not loc.is_floating_point()
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches are written in place: no copies"
    cos, sin = cos.contiguous(), sin.contiguous()
    t, hq, dim = q.shape
    hk = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    half = dim // 2
    block_d = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(max(hq, hk)), 4096 // block_d))
    block_hk, block_dv = _blocks(hk, dim)
    _rope_store_kernel[(t,)](
        q, k, v, q_out, k_cache, v_cache, cos, sin, positions, loc,
        hq, hk, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        loc.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HALF=half, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_HK=block_hk, BLOCK_DV=block_dv,
        num_warps=4, enable_fp_fusion=False, **pdl_launch(q.device),
    )
    return q_out


# ---- RoPE + cache write in the epilogue of the qkv projection (`kiln.kernels.gemv`) -------------

@triton.jit
def rope_pair_rows(pid, BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """The BLOCK_N weight rows of a qkv GEMV program that ends in `rope_epilogue`: BLOCK_N / 2
    rotation pairs of one head, each row d beside its partner d + HALF (head dim 2 * HALF), so
    that the product's columns split into the two halves. Pairs are numbered over the q, k and v
    heads in the fused projection's order; BLOCK_N / 2 divides HALF, so a program stays in one head."""
    i = tl.arange(0, BLOCK_N)
    pair = pid * (BLOCK_N // 2) + i // 2
    return (pair // HALF) * (2 * HALF) + pair % HALF + (i % 2) * HALF


@triton.jit
def rope_epilogue(y, pid, rm, m_ok, Q_OUT, stride_qm, COS, SIN, stride_cs, POS, LOC, KC, VC, stride_kcs, stride_kch,
                  stride_vcs, stride_vch, HQ, HK, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HALF: tl.constexpr):
    """Finish a qkv GEMV program whose rows are `rope_pair_rows`: y [BLOCK_M, BLOCK_N] fp32 sums,
    row m the token at POS[m] with cache row LOC[m]. The sums are rounded to the projection's
    dtype (Q_OUT's), then a q head is rotated into Q_OUT [M, HQ * 2 * HALF], a k head rotated into
    KC [slots, HK, 2 * HALF] and a v head copied into VC, as `rope_store` computes them (its
    products and sums may be contracted into FMAs here)."""
    P: tl.constexpr = BLOCK_N // 2
    x1, x2 = tl.split(tl.reshape(y.to(Q_OUT.dtype.element_ty).to(tl.float32), (BLOCK_M, P, 2)))
    pair0 = pid * P
    head = pair0 // HALF
    j = pair0 % HALF + tl.arange(0, P)
    ok = m_ok[:, None] & (j < HALF)[None, :]
    if head < HQ + HK:  # q or k: rotated
        pos = tl.load(POS + rm, mask=m_ok, other=0).to(tl.int64)
        c = tl.load(COS + pos[:, None] * stride_cs + j[None, :], mask=ok, other=0.0)
        s = tl.load(SIN + pos[:, None] * stride_cs + j[None, :], mask=ok, other=0.0)
        o1, o2 = _rotate(x1, x2, c, s)
    else:
        o1 = x1
        o2 = x2
    if head < HQ:
        dst = Q_OUT + rm[:, None] * stride_qm + head * (2 * HALF) + j[None, :]
        tl.store(dst, o1.to(Q_OUT.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, o2.to(Q_OUT.dtype.element_ty), mask=ok)
    else:
        loc = tl.load(LOC + rm, mask=m_ok, other=0).to(tl.int64)
        if head < HQ + HK:
            dst = KC + loc[:, None] * stride_kcs + (head - HQ) * stride_kch + j[None, :]
        else:
            dst = VC + loc[:, None] * stride_vcs + (head - HQ - HK) * stride_vch + j[None, :]
        # rounded to the projection's dtype first (above), then to the cache's, as `_rotate_heads`
        # (the K and V caches share one dtype: `rope_epilogue_args`)
        tl.store(dst, o1.to(Q_OUT.dtype.element_ty).to(KC.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, o2.to(Q_OUT.dtype.element_ty).to(KC.dtype.element_ty), mask=ok)


def rope_epilogue_args(rope: Optional[tuple], y: torch.Tensor, n_rows: int, block_n: int) -> dict:
    """Launch arguments of a GEMV ending in `rope_epilogue` for weight rows [n_rows, K] into q out
    y [M, Hq * D]: rope = (cos, sin [positions, D / 2] fp32, positions [M], loc [M], k_cache,
    v_cache [slots, Hk, D]), or None for none (then y stands in for every pointer)."""
    if rope is None:
        return dict(COS=y, SIN=y, POS=y, LOC=y, KC=y, VC=y, stride_cs=0, stride_kcs=0, stride_kch=0, stride_vcs=0,
                    stride_vch=0, HQ=0, HK=0, ROPE=False, HALF=1)
    cos, sin, positions, loc, k_cache, v_cache = rope
    m = y.shape[0]
    hk, d = k_cache.shape[1:]
    half = d // 2
    hq = y.shape[1] // d
    assert d % 2 == 0 and cos.shape[-1] == half and cos.stride() == sin.stride() and cos.stride(-1) == 1
    assert v_cache.shape[1:] == k_cache.shape[1:] and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert n_rows == (hq + 2 * hk) * d, f"qkv rows {n_rows} != (q heads {hq} + 2 x kv heads {hk}) x head dim {d}"
    assert block_n % 2 == 0 and half % (block_n // 2) == 0, f"tile of {block_n} rows does not pair within a head"
    assert positions.shape[0] >= m and loc.shape[0] >= m and not loc.is_floating_point()
    assert positions.stride(0) == 1 and loc.stride(0) == 1 and k_cache.dtype == v_cache.dtype
    return dict(COS=cos, SIN=sin, POS=positions, LOC=loc, KC=k_cache, VC=v_cache, stride_cs=cos.stride(0),
                stride_kcs=k_cache.stride(0), stride_kch=k_cache.stride(1), stride_vcs=v_cache.stride(0),
                stride_vch=v_cache.stride(1), HQ=hq, HK=hk, ROPE=True, HALF=half)
