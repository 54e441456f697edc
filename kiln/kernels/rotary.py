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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.launch import pdl_launch, wait_for_previous


@triton.jit
def _rotate_heads(x_ptr, out_ptr, stride_h, n_heads, c, s, d, d_ok,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate heads 0..n_heads-1 of one token: x at x_ptr (head stride stride_h), out contiguous."""
    for h0 in range(0, n_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        m = (h < n_heads)[:, None] & d_ok[None, :]
        src = x_ptr + h[:, None] * stride_h + d[None, :]
        x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
        o1 = x1 * c[None, :] - x2 * s[None, :]
        o2 = x2 * c[None, :] + x1 * s[None, :]
        dst = out_ptr + h[:, None] * (2 * HALF) + d[None, :]
        tl.store(dst, o1.to(out_ptr.dtype.element_ty), mask=m)
        tl.store(dst + HALF, o2.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, pos_ptr,
                 HQ, HK, stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
                 HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    c = tl.load(cos_ptr + pos * stride_cs + d, mask=d_ok, other=0.0)
    s = tl.load(sin_ptr + pos * stride_cs + d, mask=d_ok, other=0.0)
    _rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * HQ * 2 * HALF, stride_qh, HQ, c, s, d, d_ok,
                  HALF, BLOCK_H)
    _rotate_heads(k_ptr + t * stride_kt, k_out_ptr + t * HK * 2 * HALF, stride_kh, HK, c, s, d, d_ok,
                  HALF, BLOCK_H)


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int (device), q [T, Hq, D], k [T, Hk, D] (last dim contiguous, any token/head
    strides), cos/sin [max_positions, D/2] fp32 tables -> (q, k) rotated, new contiguous tensors."""
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
