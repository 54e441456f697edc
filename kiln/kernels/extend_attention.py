"""Triton paged extend (prefill) attention: flash attention over a paged K/V cache.

Same result as `kiln.ops.attention.paged_attention` for a whole batch in one launch. Each
program holds BLOCK_M consecutive new queries of one sequence and one query head, and walks the
keys they can see (cached prefix + new tokens, all already in the cache) BLOCK_N at a time
through req_to_token, so any page size and page order work. Key blocks past the block's last
query (causal) or before the window of its first query are never visited.

The MTP layers of speculative decoding (MODELS.md 2.4) use the same kernel with three extras:
explicit query positions (`positions`: catch-up rows followed by a draft row further ahead,
ascending per sequence), a `key_gap` g (query i sees key j iff j == i or i - j >= g) and a
`key_offset` (entry j is stored at position j + offset).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kiln.kernels import assert_rows
from kiln.kernels.launch import pdl_launch, wait_for_previous

from kiln.kernels.decode_attention import LOG2E, dot_precision, head_dim_block


def extend_config(block_d: int, device: torch.device) -> dict:
    """Query rows and keys per block, warps and pipeline stages of the extend kernel."""
    if device.type != "cuda":  # the interpreter is slow per element; keep CPU tests quick
        return dict(block_m=16, block_n=16, num_warps=4, num_stages=1)
    if block_d <= 128:
        return dict(block_m=64, block_n=32, num_warps=4, num_stages=3)
    return dict(block_m=64, block_n=32, num_warps=8, num_stages=2)


# key_gap / key_offset (1 in some MTP passes) and the per-sequence metadata (slices at any offset,
# read a scalar at a time) would make variants Triton compiles mid-serve, on the first pass of
# their kind (benchmarks/compile_watch.py; docs/benchmarks.md, thirty-fifth pass).
@triton.jit(do_not_specialize=["key_gap", "key_offset"],
            do_not_specialize_on_alignment=["ReqSlots", "PrefixLens", "ExtendLens", "ExtendStarts", "Positions"])
def _extend_kernel(
    Q, K, V, Out, ReqToToken, ReqSlots, PrefixLens, ExtendLens, ExtendStarts, Rel, Positions,
    scale_log2, window, rel_len, key_gap, key_offset,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
    stride_rt, stride_relt, stride_relh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_REL: tl.constexpr,
    HAS_POSITIONS: tl.constexpr, HAS_GAP: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    n_new = tl.load(ExtendLens + b).to(tl.int32)
    if m0 >= n_new:  # the grid is sized for the longest extend of the batch
        return
    prefix = tl.load(PrefixLens + b).to(tl.int32)
    row0 = tl.load(ExtendStarts + b).to(tl.int32)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = m0 + offs_m < n_new
    d_mask = offs_d < HEAD_DIM
    rows = (row0 + m0 + offs_m).to(tl.int64)
    last = tl.minimum(n_new, m0 + BLOCK_M) - 1  # the block's last query row (within the sequence)
    if HAS_POSITIONS:  # ascending per sequence: the block's first and last rows bound its keys
        q_pos = tl.load(Positions + rows, mask=m_mask, other=0).to(tl.int32)
        first_pos = tl.load(Positions + row0 + m0).to(tl.int32)
        last_pos = tl.load(Positions + row0 + last).to(tl.int32)
    else:
        q_pos = prefix + m0 + offs_m
        first_pos = prefix + m0
        last_pos = prefix + last
    q = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(K.dtype.element_ty)
    token_row = ReqToToken + tl.load(ReqSlots + b).to(tl.int64) * stride_rt
    kvh = h // GROUP
    k_base = K + kvh * stride_kh
    v_base = V + kvh * stride_vh

    # Keys any query of this block sees: [lo, hi).
    hi = last_pos + 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < hi
        slots = tl.load(token_row + pos + key_offset, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + slots[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        dist = q_pos[:, None] - pos[None, :]  # >= 0 for visible keys
        visible = (dist >= 0) & n_mask[None, :]
        if HAS_WINDOW:
            visible &= dist < window
        if HAS_GAP:
            visible &= (dist == 0) | (dist >= key_gap)
        if HAS_REL:
            bias = tl.load(Rel + rows[:, None] * stride_relt + h * stride_relh + dist,
                           mask=visible & m_mask[:, None] & (dist < rel_len), other=0.0)
            s += bias.to(tl.float32) * 1.4426950408889634
        s = tl.where(visible, s, float("-inf"))
        # A row may see no key of this block (causal corner, window edge): keep its max finite
        # so that exp2 gives 0, not NaN.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slots[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             acc.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     req_to_token: torch.Tensor, req_slots: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, extend_starts: torch.Tensor, scale: float,
                     sliding_window: Optional[int] = None, rel: Optional[torch.Tensor] = None,
                     max_extend_len: Optional[int] = None, positions: Optional[torch.Tensor] = None,
                     key_gap: int = 0, key_offset: int = 0) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached + new K/V; [T, Hq, D].

    Same semantics as `kiln.ops.attention.paged_attention`: sequence b's extend_lens[b] queries
    are rows extend_starts[b]... of q [T, Hq, D], at positions prefix_lens[b]..; their K/V are
    already in k_cache/v_cache [num_slots, Hkv, D] at req_to_token[req_slots[b], position].
    req_slots/prefix_lens/extend_lens/extend_starts: [B] int tensors on q's device. Optional
    sliding window W (query i sees keys j with i - W < j <= i) and rel [T, Hq, R] bias at
    distance i - j < R. max_extend_len: host int >= max(extend_lens) that sizes the grid;
    computed here (one host sync) if not given. Rows of q that belong to no sequence are left
    unwritten. MTP layers: `positions` [T] (device, ascending per sequence; prefix_lens then
    unused) places the queries, `key_gap` hides keys at distances 1..gap-1, and keys are read at
    req_to_token[slot, position + key_offset] (as in the reference op).
    """
    assert_rows(req_slots=req_slots, prefix_lens=prefix_lens, extend_lens=extend_lens, extend_starts=extend_starts,
                positions=positions)
    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    assert hq % hkv == 0, f"query heads {hq} not a multiple of KV heads {hkv}"
    assert v_cache.shape == k_cache.shape and k_cache.shape[2] == d
    block_d = head_dim_block(d)
    # row-major whatever q's strides (empty_like keeps them): the kernel writes out's last dimension at stride 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    b = req_slots.shape[0]
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max()) if b else 0
    if t == 0 or b == 0 or max_extend_len == 0:
        return out
    q, k_cache, v_cache = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_cache, v_cache))
    req_to_token = req_to_token if req_to_token.stride(-1) == 1 else req_to_token.contiguous()
    if rel is not None:
        assert rel.shape[:2] == (t, hq), f"rel must be [T, Hq, R], got {tuple(rel.shape)}"
        rel = rel if rel.stride(-1) == 1 else rel.contiguous()
    rel_arg = rel if rel is not None else q  # never read without HAS_REL
    if positions is not None:
        assert positions.shape == (t,), f"positions must be [T], got {tuple(positions.shape)}"
    pos_arg = positions if positions is not None else prefix_lens  # never read without HAS_POSITIONS
    cfg = extend_config(block_d, q.device)
    block_m = cfg["block_m"]
    grid = (b, hq, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, k_cache, v_cache, out, req_to_token, req_slots, prefix_lens, extend_lens, extend_starts,
        rel_arg, pos_arg, scale * LOG2E, sliding_window if sliding_window is not None else 0,
        rel.shape[2] if rel is not None else 0, key_gap, key_offset,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0), rel_arg.stride(0), rel_arg.stride(1),
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=cfg["block_n"],
        HAS_WINDOW=sliding_window is not None, HAS_REL=rel is not None,
        HAS_POSITIONS=positions is not None, HAS_GAP=key_gap > 1,
        DOT_PRECISION=dot_precision(k_cache.dtype), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **pdl_launch(q.device),
    )
    return out
