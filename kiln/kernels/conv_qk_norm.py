"""Triton prologue of Inkling's attention (MODELS.md 2.2): the k and v ShortConvs and the per-head
q and k RMSNorms of a decode step, or of short chunks such as a speculative verify, in one launch.

Per token row t (at `positions[t]` of the request whose table row is `row_slots[t]`), with q, k, v
split out of the fused qkvr projection:

    k' = ShortConv_k(k), v' = ShortConv_v(v)     taps inside the chunk from the rows before,
                                                 earlier ones from the paged conv buffers, as
                                                 `kiln.kernels.shortconv`
    q_out = RMSNorm_q(q) per head [* lam_b]      as `kiln.layers.norm.rms_norm` (then, on full
    k_out = RMSNorm_k(k') per head                 layers, `(q.float() * lam).to(q.dtype)`)
    v_out = v'

and, like the ShortConv kernels, k and v are written into their conv buffers at out_locs[t] after
their history was read. `conv_qk_norm_store` writes k_out and v_out straight into the layer's
K/V cache at cache_locs[t] instead of into new tensors (the cache write of
`kiln.kernels.kv_store`, one launch fewer per layer).

A tap is inside the chunk when the row d before has the same request row
and position p - d (the rows of a chunk are consecutive; a request has one chunk per forward), so
decode rows, whose neighbours are other requests, read every tap from the buffer. Unfused that is five to seven launches per layer (two convs, two norms,
the lam scale's mul and casts); at batch 1 the launches, not the bytes, are the cost.

Every value is rounded where the unfused path rounds it: the conv result is cast to the model's
dtype before k's norm reads it, the normed q before lam scales it. Compiled without FMA
contraction (`enable_fp_fusion=False`), the convs and the lam scale match the reference ops bit
for bit; the norms differ only by the fp32 reduction order and rsqrt (as `kiln.kernels.norm`).

Programs: one per (row, block of BLOCK_H heads) of q, then of k, then of v; each reads its own
channels' history, then writes the same channels. No program reads a slot another writes: rows
write the slots of this forward's positions, and buffer taps are positions before each chunk. Lengths, slots and lam are read on
the device and the grid depends only on shapes: CUDA-graph capturable. Inference only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kiln.kernels import assert_rows
from kiln.kernels.launch import pdl_launch, wait_for_previous



@dataclass
class AttentionPrologue:
    """The prologue of one Inkling attention layer at a decode step, for
    `kiln.kernels.decode_attention.decode_attention(prologue=...)` to run inside the attention:
    `conv_qk_norm_store`'s arguments but q (which the attention takes raw), one row per sequence.
    The new k' and v' go to the cache slot the attention's page table maps position seq_len - 1
    to (where `conv_qk_norm_store`'s cache_locs point in a decode step)."""

    k: torch.Tensor  # [B, Hkv*D], a row-strided view of the qkvr projection
    v: torch.Tensor
    q_norm_w: torch.Tensor  # [D]
    k_norm_w: torch.Tensor
    q_eps: float
    k_eps: float
    k_conv_w: torch.Tensor  # [Hkv*D, K]
    v_conv_w: torch.Tensor
    k_buf: torch.Tensor  # [slots, Hkv*D], the two sites' conv buffers
    v_buf: torch.Tensor
    conv_table: torch.Tensor  # [rows, L]: the conv space's page table (rows: the attention's req_slots)
    positions: torch.Tensor  # [B]: seq_len - 1
    out_locs: torch.Tensor  # [B]: each row's conv buffer slot for its new input
    q_scale: Optional[torch.Tensor] = None  # [B] fp32: lam on full layers

    def check(self, bsz: int, hkv: int, d: int) -> None:
        """Shapes and layouts the kernel relies on (each tensor's last dim contiguous)."""
        assert self.k.shape == self.v.shape == (bsz, hkv * d), (self.k.shape, self.v.shape, (bsz, hkv * d))
        assert self.k.stride(-1) == 1 and self.v.stride(-1) == 1, "k / v rows must be contiguous"
        assert self.q_scale is None or self.q_scale.shape == (bsz,)
        _check_state(self.q_norm_w, self.k_norm_w, self.k_conv_w, self.v_conv_w, self.k_buf, self.v_buf,
                     self.conv_table, self.positions, self.out_locs, bsz, hkv * d, d)


def _check_state(q_norm_w, k_norm_w, k_conv_w, v_conv_w, k_buf, v_buf, conv_table, positions, out_locs,
                 bsz: int, c: int, d: int) -> None:
    """The prologue's weights, conv state and per-row addressing for bsz rows of c = Hkv * D
    k / v channels (both the prologue kernel's and the decode attention's PROLOGUE rely on them)."""
    assert k_conv_w.shape == v_conv_w.shape and k_conv_w.shape[0] == c, (k_conv_w.shape, c)
    assert k_buf.shape[1] == v_buf.shape[1] == c and q_norm_w.shape == k_norm_w.shape == (d,)
    assert positions.shape == out_locs.shape == (bsz,), (positions.shape, out_locs.shape)
    for t in (k_conv_w, v_conv_w, k_buf, v_buf, conv_table, q_norm_w, k_norm_w, positions, out_locs):
        assert t.stride(-1) == 1, "channel / position dims must be contiguous"


@triton.jit
def _rms_norm_tile(x, w_ptr, d, d_ok, D, eps):
    """(x * rsqrt(mean(x^2) + eps)) * w per row of an fp32 [BLOCK_H, BLOCK_D] tile (masked lanes 0)."""
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    return (x * inv[:, None]) * w[None, :]


@triton.jit
def _conv_tile(x_ptr, t, stride_x, w_ptr, stride_w, buf_ptr, stride_buf, table_row_ptr, slots_ptr, pos_ptr,
               slot, pos, out_loc, c, m, K: tl.constexpr):
    """ShortConv of row t's channels c ([BLOCK_H, BLOCK_D], mask m) in the reference's order:
    acc = 0; acc += w_j * x_j (j = 0..K-1); + x. Tap j (position pos - d, d = K - 1 - j) reads row
    t - d's input when that row is the same request one position back (inside this chunk), else
    the buffer (zeros before the sequence). Returns fp32; stores x into buf[out_loc] after the reads."""
    x_cur = tl.load(x_ptr + t * stride_x + c, mask=m, other=0.0)
    acc = tl.zeros(c.shape, dtype=tl.float32)
    for j in tl.static_range(K):
        w_j = tl.load(w_ptr + c * stride_w + j, mask=m, other=0.0).to(tl.float32)
        if j == K - 1:
            v = x_cur.to(tl.float32)
        else:
            d = K - 1 - j
            tap = pos - d
            tp = tl.maximum(t - d, 0)
            inside = (t - d >= 0) & (tl.load(slots_ptr + tp) == slot) & (tl.load(pos_ptr + tp) == tap)
            from_buf = (tap >= 0) & (inside == 0)
            loc = tl.load(table_row_ptr + tl.where(from_buf, tap, 0), mask=from_buf, other=0).to(tl.int64)
            vb = tl.load(buf_ptr + loc * stride_buf + c, mask=m & from_buf, other=0.0).to(tl.float32)
            vx = tl.load(x_ptr + tp * stride_x + c, mask=m & inside, other=0.0).to(tl.float32)
            v = tl.where(inside, vx, vb)
        acc = acc + w_j * v
    tl.store(buf_ptr + out_loc * stride_buf + c, x_cur.to(buf_ptr.dtype.element_ty), mask=m)
    return acc + x_cur.to(tl.float32)


@triton.jit
def _normed_query_heads(q_ptr, b, stride_q, stride_h, heads, g_mask, offs_d, d_mask, w_ptr, eps, lam_ptr,
                        D, HAS_LAM: tl.constexpr):
    """Query heads `heads` of decode row b, normed and (full layers) scaled by lam as
    `_conv_qk_norm_kernel` writes them: [BLOCK_G, BLOCK_D] in q's dtype, masked heads 0. For
    `kiln.kernels.decode_attention`'s PROLOGUE."""
    m = g_mask[:, None] & d_mask[None, :]
    x = tl.load(q_ptr + b * stride_q + heads[:, None] * stride_h + offs_d[None, :], mask=m, other=0.0)
    y = _rms_norm_tile(x.to(tl.float32), w_ptr, offs_d, d_mask, D, eps).to(q_ptr.dtype.element_ty)
    if HAS_LAM:
        y = (y.to(tl.float32) * tl.load(lam_ptr + b)).to(q_ptr.dtype.element_ty)
    return y


@triton.jit
def _conv_history(w_ptr, stride_w, buf_ptr, stride_buf, table_row, pos, c, m, K: tl.constexpr):
    """The taps before the new input of a decode row's ShortConv, summed in `_conv_tile`'s order
    (acc = 0; acc += w_j * x_j, j = 0..K-2; fp32): every one from the buffer (a decode row's
    neighbours are other requests), zeros before the sequence. Mask m off: zeros, nothing read."""
    acc = tl.zeros(c.shape, dtype=tl.float32)
    for j in tl.static_range(K - 1):
        tap = pos - (K - 1 - j)
        ok = tap >= 0
        loc = tl.load(table_row + tl.where(ok, tap, 0), mask=ok, other=0).to(tl.int64)
        w_j = tl.load(w_ptr + c * stride_w + j, mask=m, other=0.0).to(tl.float32)
        acc = acc + w_j * tl.load(buf_ptr + loc * stride_buf + c, mask=m & ok, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _new_key_value_history(kc_w_ptr, vc_w_ptr, stride_kcw, stride_vcw, k_buf_ptr, v_buf_ptr, stride_kbuf,
                           stride_vbuf, table_ptr, stride_tab, slots_ptr, pos_ptr, b, kvh, offs_d, d_mask, D,
                           K: tl.constexpr):
    """The first half of `_new_key_value`: the k and v convs' taps before the new input, [1,
    BLOCK_D] fp32 each (zeros where d_mask is off). It reads only what the host and earlier steps
    wrote (the page table, positions, older conv inputs), so `kiln.kernels.decode_attention` may
    call it before its PDL wait."""
    c = (kvh * D + offs_d)[None, :]
    m = d_mask[None, :]
    table_row = table_ptr + tl.load(slots_ptr + b).to(tl.int64) * stride_tab
    pos = tl.load(pos_ptr + b)
    return (_conv_history(kc_w_ptr, stride_kcw, k_buf_ptr, stride_kbuf, table_row, pos, c, m, K),
            _conv_history(vc_w_ptr, stride_vcw, v_buf_ptr, stride_vbuf, table_row, pos, c, m, K))


@triton.jit
def _new_key_value(hist_k, hist_v, k_ptr, v_ptr, b, stride_k, stride_v, kvh, offs_d, d_mask, D, kc_w_ptr,
                   vc_w_ptr, stride_kcw, stride_vcw, k_buf_ptr, v_buf_ptr, stride_kbuf, stride_vbuf, out_locs_ptr,
                   kn_w_ptr, k_eps, K: tl.constexpr):
    """KV head kvh of decode row b: (k', v') [1, BLOCK_D] in k's and v's dtypes, computed and
    rounded as `_conv_qk_norm_kernel` computes them (hist_k / hist_v from
    `_new_key_value_history`), with both raw inputs written into their conv buffers at
    out_locs[b]. For `kiln.kernels.decode_attention`'s PROLOGUE, whose program holding the new
    token calls it once per (row, KV head)."""
    c = (kvh * D + offs_d)[None, :]
    m = d_mask[None, :]
    out_loc = tl.load(out_locs_ptr + b).to(tl.int64)
    x_k = tl.load(k_ptr + b * stride_k + c, mask=m, other=0.0)
    x_v = tl.load(v_ptr + b * stride_v + c, mask=m, other=0.0)
    w_k = tl.load(kc_w_ptr + c * stride_kcw + K - 1, mask=m, other=0.0).to(tl.float32)
    w_v = tl.load(vc_w_ptr + c * stride_vcw + K - 1, mask=m, other=0.0).to(tl.float32)
    tl.store(k_buf_ptr + out_loc * stride_kbuf + c, x_k.to(k_buf_ptr.dtype.element_ty), mask=m)
    tl.store(v_buf_ptr + out_loc * stride_vbuf + c, x_v.to(v_buf_ptr.dtype.element_ty), mask=m)
    yk = (hist_k + w_k * x_k.to(tl.float32)) + x_k.to(tl.float32)
    yk = _rms_norm_tile(yk.to(k_ptr.dtype.element_ty).to(tl.float32), kn_w_ptr, offs_d, d_mask, D, k_eps)
    yv = (hist_v + w_v * x_v.to(tl.float32)) + x_v.to(tl.float32)
    return yk.to(k_ptr.dtype.element_ty), yv.to(v_ptr.dtype.element_ty)


@triton.jit
def _conv_qk_norm_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, v_out_ptr,
    qn_w_ptr, kn_w_ptr, kc_w_ptr, vc_w_ptr, k_buf_ptr, v_buf_ptr,
    table_ptr, slots_ptr, pos_ptr, out_locs_ptr, lam_ptr,
    cache_locs_ptr, HQ, HKV, D, NQB, NKB, q_eps, k_eps,
    stride_q, stride_k, stride_v, stride_kcw, stride_vcw, stride_kbuf, stride_vbuf, stride_tab,
    stride_kout, stride_vout,
    K: tl.constexpr, HAS_LAM: tl.constexpr, TO_CACHE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """k_out / v_out row of token b: b, or with TO_CACHE its cache slot cache_locs[b] (the outputs
    are then the K and V caches, rows of stride_kout / stride_vout)."""
    wait_for_previous(PDL)
    b = tl.program_id(0).to(tl.int64)  # the row (token)
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
        slot = tl.load(slots_ptr + b)
        pos = tl.load(pos_ptr + b)
        out_loc = tl.load(out_locs_ptr + b).to(tl.int64)
        table_row = table_ptr + slot.to(tl.int64) * stride_tab
        row = tl.load(cache_locs_ptr + b).to(tl.int64) if TO_CACHE else b
        if is_k:
            yk = _conv_tile(k_ptr, b, stride_k, kc_w_ptr, stride_kcw, k_buf_ptr, stride_kbuf, table_row,
                            slots_ptr, pos_ptr, slot, pos, out_loc, c, m, K)
            # The conv's result in the model's dtype is what k's norm reads.
            yk = yk.to(k_ptr.dtype.element_ty).to(tl.float32)
            yk = _rms_norm_tile(yk, kn_w_ptr, d, d_ok, D, k_eps)
            # rounded to k's dtype first, as the unfused path's k_out (then the cache's, as store_kv)
            yk = yk.to(k_ptr.dtype.element_ty).to(k_out_ptr.dtype.element_ty)
            tl.store(k_out_ptr + row * stride_kout + c, yk, mask=m)
        else:
            yv = _conv_tile(v_ptr, b, stride_v, vc_w_ptr, stride_vcw, v_buf_ptr, stride_vbuf, table_row,
                            slots_ptr, pos_ptr, slot, pos, out_loc, c, m, K)
            yv = yv.to(v_ptr.dtype.element_ty).to(v_out_ptr.dtype.element_ty)
            tl.store(v_out_ptr + row * stride_vout + c, yv, mask=m)


def conv_qk_norm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 q_norm_w: torch.Tensor, k_norm_w: torch.Tensor, q_eps: float, k_eps: float,
                 k_conv_w: torch.Tensor, v_conv_w: torch.Tensor,
                 k_buf: torch.Tensor, v_buf: torch.Tensor, conv_table: torch.Tensor,
                 row_slots: torch.Tensor, positions: torch.Tensor, out_locs: torch.Tensor,
                 head_dim: int, q_scale: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """T token rows: a decode step (one per sequence) or short chunks (a speculative verify), the
    rows of a chunk consecutive. q [T, Hq*D], k / v [T, Hkv*D] (row-strided views of the qkvr
    projection are read in place), norm weights [D], conv weights [Hkv*D, K], k_buf / v_buf
    [slots, Hkv*D] (the two sites' conv buffers), conv_table [rows, L]; row_slots (each row's
    request row in the table), positions and out_locs [T] int64 on the device; q_scale [T] fp32
    (lam) or None.

    Returns (q_out [T, Hq, D], k_out [T, Hkv, D], v_out [T, Hkv*D]), new tensors in the inputs'
    dtypes, and writes k, v into k_buf / v_buf at out_locs (after reading the history)."""
    assert_rows(q_scale=q_scale)
    hkv = k.shape[1] // head_dim
    k_out = torch.empty(k.shape[0], hkv, head_dim, dtype=k.dtype, device=k.device)
    v_out = torch.empty(v.shape[0], hkv * head_dim, dtype=v.dtype, device=v.device)
    q_out = _launch(q, k, v, q_norm_w, k_norm_w, q_eps, k_eps, k_conv_w, v_conv_w, k_buf, v_buf, conv_table,
                    row_slots, positions, out_locs, head_dim, q_scale, k_out.view(k.shape[0], -1), v_out, None)
    return q_out, k_out, v_out


def conv_qk_norm_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       q_norm_w: torch.Tensor, k_norm_w: torch.Tensor, q_eps: float, k_eps: float,
                       k_conv_w: torch.Tensor, v_conv_w: torch.Tensor,
                       k_buf: torch.Tensor, v_buf: torch.Tensor, conv_table: torch.Tensor,
                       row_slots: torch.Tensor, positions: torch.Tensor, out_locs: torch.Tensor,
                       head_dim: int, q_scale: Optional[torch.Tensor],
                       k_cache: torch.Tensor, v_cache: torch.Tensor, cache_locs: torch.Tensor) -> torch.Tensor:
    """`conv_qk_norm` whose k_out and v_out go to k_cache / v_cache [slots, Hkv, D] at cache_locs
    [T] (cast to the cache's dtype, as `kiln.kernels.kv_store.store_kv` writes them) instead of
    new tensors: bit for bit `conv_qk_norm` then `store_kv`, in one launch. Returns q_out."""
    assert_rows(q_scale=q_scale)
    hkv = k.shape[1] // head_dim
    for cache in (k_cache, v_cache):
        assert cache.dim() == 3 and cache.shape[1:] == (hkv, head_dim) and cache.stride(2) == 1 \
            and cache.stride(1) == head_dim, "cache rows must be [Hkv, D] contiguous"
    assert cache_locs.shape == (q.shape[0],) and cache_locs.stride(-1) == 1, cache_locs.shape
    return _launch(q, k, v, q_norm_w, k_norm_w, q_eps, k_eps, k_conv_w, v_conv_w, k_buf, v_buf, conv_table,
                   row_slots, positions, out_locs, head_dim, q_scale, k_cache.view(k_cache.shape[0], -1),
                   v_cache.view(v_cache.shape[0], -1), cache_locs)


def _launch(q, k, v, q_norm_w, k_norm_w, q_eps, k_eps, k_conv_w, v_conv_w, k_buf, v_buf, conv_table,
            row_slots, positions, out_locs, head_dim, q_scale, k_out, v_out, cache_locs) -> torch.Tensor:
    """The launch behind both wrappers: k_out / v_out are [rows, Hkv*D] with a contiguous last
    dim, indexed by token (cache_locs None) or by cache_locs. Returns q_out [T, Hq, D]."""
    d = head_dim
    bsz = q.shape[0]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    assert q.dim() == k.dim() == v.dim() == 2 and k.shape == v.shape and q.shape[1] % d == 0 and k.shape[1] % d == 0
    assert row_slots.shape == (bsz,) and row_slots.stride(-1) == 1, row_slots.shape
    hq, hkv = q.shape[1] // d, k.shape[1] // d
    c = hkv * d
    _check_state(q_norm_w, k_norm_w, k_conv_w, v_conv_w, k_buf, v_buf, conv_table, positions, out_locs, bsz, c, d)
    assert k_out.shape[1] == v_out.shape[1] == c, (k_out.shape, v_out.shape, c)
    assert k_out.stride(-1) == 1 and v_out.stride(-1) == 1, "channel / position dims must be contiguous"
    q_out = torch.empty(bsz, hq, d, dtype=q.dtype, device=q.device)
    if bsz == 0:
        return q_out
    block_d = triton.next_power_of_2(d)
    # ~512 elements per program: at batch 1 a few dozen programs share the step's few KB.
    block_h = max(1, min(triton.next_power_of_2(max(hq, hkv)), 512 // block_d))
    nqb, nkb = triton.cdiv(hq, block_h), triton.cdiv(hkv, block_h)
    lam = q_scale if q_scale is not None else positions  # unused without HAS_LAM
    _conv_qk_norm_kernel[(bsz, nqb + 2 * nkb)](
        q, k, v, q_out, k_out, v_out,
        q_norm_w, k_norm_w, k_conv_w, v_conv_w, k_buf, v_buf,
        conv_table, row_slots, positions, out_locs, lam,
        cache_locs if cache_locs is not None else out_locs, hq, hkv, d, nqb, nkb, float(q_eps), float(k_eps),
        q.stride(0), k.stride(0), v.stride(0), k_conv_w.stride(0), v_conv_w.stride(0),
        k_buf.stride(0), v_buf.stride(0), conv_table.stride(0), k_out.stride(0), v_out.stride(0),
        K=k_conv_w.shape[1], HAS_LAM=q_scale is not None, TO_CACHE=cache_locs is not None,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4, enable_fp_fusion=False, **pdl_launch(q.device),
    )
    return q_out
