"""Triton decode prologue of Inkling's attention (MODELS.md 2.2): the k and v ShortConvs and the
per-head q and k RMSNorms of one decode step in one launch.

Per sequence b (one new token at position seq_lens[b] - 1), with q, k, v split out of the fused
qkvr projection:

    k' = ShortConv_k(k), v' = ShortConv_v(v)     history from the paged conv buffers, as
                                                 `kiln.kernels.shortconv.short_conv_decode`
    q_out = RMSNorm_q(q) per head [* lam_b]      as `kiln.layers.norm.rms_norm` (then, on full
    k_out = RMSNorm_k(k') per head                 layers, `(q.float() * lam).to(q.dtype)`)
    v_out = v'

and, like `short_conv_decode`, k and v are written into their conv buffers at out_locs[b] after
their history was read. Unfused that is five to seven launches per layer (two convs, two norms,
the lam scale's mul and casts); at batch 1 the launches, not the bytes, are the cost.

Every value is rounded where the unfused path rounds it: the conv result is cast to the model's
dtype before k's norm reads it, the normed q before lam scales it. Compiled without FMA
contraction (`enable_fp_fusion=False`), the convs and the lam scale match the reference ops bit
for bit; the norms differ only by the fp32 reduction order and rsqrt (as `kiln.kernels.norm`).

Programs: one per (sequence, block of BLOCK_H heads) of q, then of k, then of v; each reads its
own channels' history, then writes the same channels (program order orders the two; other
sequences' out_locs are fresh slots, never anyone's history). Lengths, slots and lam are read on
the device and the grid depends only on shapes: CUDA-graph capturable. Inference only.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_tile(x, w_ptr, d, d_ok, D, eps):
    """(x * rsqrt(mean(x^2) + eps)) * w per row of an fp32 [BLOCK_H, BLOCK_D] tile (masked lanes 0)."""
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    return (x * inv[:, None]) * w[None, :]


@triton.jit
def _conv_tile(x_row_ptr, w_ptr, stride_w, buf_ptr, stride_buf, table_row_ptr, seq_len, out_loc, c, m,
               K: tl.constexpr):
    """ShortConv of one token's channels c ([BLOCK_H, BLOCK_D], mask m) in the reference's order:
    acc = 0; acc += w_j * x_j (j = 0..K-1, taps before the current one from the buffer); + x.
    Returns fp32; stores x into buf[out_loc] after the reads."""
    x_cur = tl.load(x_row_ptr + c, mask=m, other=0.0)
    acc = tl.zeros(c.shape, dtype=tl.float32)
    for j in tl.static_range(K):
        w_j = tl.load(w_ptr + c * stride_w + j, mask=m, other=0.0).to(tl.float32)
        if j == K - 1:
            v = x_cur.to(tl.float32)
        else:
            pos = seq_len - K + j  # position of tap j; < 0 reads zeros (before the sequence)
            ok = pos >= 0
            loc = tl.load(table_row_ptr + tl.where(ok, pos, 0), mask=ok, other=0).to(tl.int64)
            v = tl.load(buf_ptr + loc * stride_buf + c, mask=m & ok, other=0.0).to(tl.float32)
        acc = acc + w_j * v
    tl.store(buf_ptr + out_loc * stride_buf + c, x_cur.to(buf_ptr.dtype.element_ty), mask=m)
    return acc + x_cur.to(tl.float32)


@triton.jit
def _conv_qk_norm_decode_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, v_out_ptr,
    qn_w_ptr, kn_w_ptr, kc_w_ptr, vc_w_ptr, k_buf_ptr, v_buf_ptr,
    table_ptr, slots_ptr, seq_lens_ptr, out_locs_ptr, lam_ptr,
    HQ, HKV, D, NQB, NKB, q_eps, k_eps,
    stride_q, stride_k, stride_v, stride_kcw, stride_vcw, stride_kbuf, stride_vbuf, stride_tab,
    K: tl.constexpr, HAS_LAM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    if blk < NQB:
        h = blk * BLOCK_H + tl.arange(0, BLOCK_H)
        m = (h < HQ)[:, None] & d_ok[None, :]
        c = h[:, None] * D + d[None, :]
        x = tl.load(q_ptr + b * stride_q + c, mask=m, other=0.0).to(tl.float32)
        # Names differ per branch: the compiler unifies a name's type across the if and else.
        yq = _rms_norm_tile(x, qn_w_ptr, d, d_ok, D, q_eps).to(q_out_ptr.dtype.element_ty)
        if HAS_LAM:  # (q.float() * lam).to(q.dtype), on the rounded norm output
            yq = (yq.to(tl.float32) * tl.load(lam_ptr + b)).to(q_out_ptr.dtype.element_ty)
        tl.store(q_out_ptr + b * HQ * D + c, yq, mask=m)
    else:
        is_k = blk < NQB + NKB
        hb = tl.where(is_k, blk - NQB, blk - NQB - NKB)
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        m = (h < HKV)[:, None] & d_ok[None, :]
        c = h[:, None] * D + d[None, :]
        slot = tl.load(slots_ptr + b).to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
        out_loc = tl.load(out_locs_ptr + b).to(tl.int64)
        table_row = table_ptr + slot * stride_tab
        if is_k:
            yk = _conv_tile(k_ptr + b * stride_k, kc_w_ptr, stride_kcw, k_buf_ptr, stride_kbuf, table_row,
                            seq_len, out_loc, c, m, K)
            # The conv's result in the model's dtype is what k's norm reads.
            yk = yk.to(k_out_ptr.dtype.element_ty).to(tl.float32)
            yk = _rms_norm_tile(yk, kn_w_ptr, d, d_ok, D, k_eps)
            tl.store(k_out_ptr + b * HKV * D + c, yk.to(k_out_ptr.dtype.element_ty), mask=m)
        else:
            yv = _conv_tile(v_ptr + b * stride_v, vc_w_ptr, stride_vcw, v_buf_ptr, stride_vbuf, table_row,
                            seq_len, out_loc, c, m, K)
            tl.store(v_out_ptr + b * HKV * D + c, yv.to(v_out_ptr.dtype.element_ty), mask=m)


def conv_qk_norm_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        q_norm_w: torch.Tensor, k_norm_w: torch.Tensor, q_eps: float, k_eps: float,
                        k_conv_w: torch.Tensor, v_conv_w: torch.Tensor,
                        k_buf: torch.Tensor, v_buf: torch.Tensor, conv_table: torch.Tensor,
                        req_slots: torch.Tensor, seq_lens: torch.Tensor, out_locs: torch.Tensor,
                        head_dim: int, q_scale: Optional[torch.Tensor] = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One new token per sequence. q [B, Hq*D], k / v [B, Hkv*D] (row-strided views of the qkvr
    projection are read in place), norm weights [D], conv weights [Hkv*D, K], k_buf / v_buf
    [slots, Hkv*D] (the two sites' conv buffers), conv_table [rows, L], req_slots / seq_lens /
    out_locs [B] on the device, q_scale [B] fp32 (lam) or None.

    Returns (q_out [B, Hq, D], k_out [B, Hkv, D], v_out [B, Hkv*D]), new tensors in the inputs'
    dtypes, and writes k, v into k_buf / v_buf at out_locs (after reading the history)."""
    d = head_dim
    bsz = q.shape[0]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    assert q.dim() == k.dim() == v.dim() == 2 and k.shape == v.shape and q.shape[1] % d == 0 and k.shape[1] % d == 0
    hq, hkv = q.shape[1] // d, k.shape[1] // d
    c = hkv * d
    assert k_conv_w.shape == v_conv_w.shape and k_conv_w.shape[0] == c, (k_conv_w.shape, c)
    assert k_buf.shape[1] == v_buf.shape[1] == c and q_norm_w.shape == k_norm_w.shape == (d,)
    for t in (k_conv_w, v_conv_w, k_buf, v_buf, conv_table, q_norm_w, k_norm_w):
        assert t.stride(-1) == 1, "channel / position dims must be contiguous"
    q_out = torch.empty(bsz, hq, d, dtype=q.dtype, device=q.device)
    k_out = torch.empty(bsz, hkv, d, dtype=k.dtype, device=k.device)
    v_out = torch.empty(bsz, c, dtype=v.dtype, device=v.device)
    if bsz == 0:
        return q_out, k_out, v_out
    block_d = triton.next_power_of_2(d)
    # ~512 elements per program: at batch 1 a few dozen programs share the step's few KB.
    block_h = max(1, min(triton.next_power_of_2(max(hq, hkv)), 512 // block_d))
    nqb, nkb = triton.cdiv(hq, block_h), triton.cdiv(hkv, block_h)
    lam = q_scale if q_scale is not None else seq_lens  # unused without HAS_LAM
    _conv_qk_norm_decode_kernel[(bsz, nqb + 2 * nkb)](
        q, k, v, q_out, k_out, v_out,
        q_norm_w, k_norm_w, k_conv_w, v_conv_w, k_buf, v_buf,
        conv_table, req_slots, seq_lens, out_locs, lam,
        hq, hkv, d, nqb, nkb, float(q_eps), float(k_eps),
        q.stride(0), k.stride(0), v.stride(0), k_conv_w.stride(0), v_conv_w.stride(0),
        k_buf.stride(0), v_buf.stride(0), conv_table.stride(0),
        K=k_conv_w.shape[1], HAS_LAM=q_scale is not None, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4, enable_fp_fusion=False,
    )
    return q_out, k_out, v_out
