"""How `kiln.kernels.decode_attention` splits a sequence's keys and merges the splits' partial
results: `_split_len` is the one layout both of its kernels derive on the device, `_merge_heads`
the log-sum-exp merge that either the last split of a head group runs (the attention kernel's
MERGE_HERE) or `_merge_kernel` runs as a launch of its own."""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.kernels.launch import wait_for_previous


@triton.jit
def _split_len(seq_len, window, num_splits, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
               MIN_SPLIT: tl.constexpr):
    """First visible key, keys per split (a multiple of BLOCK_N, at least MIN_SPLIT) and the number
    of splits that hold keys, of one sequence. Both kernels call this, so the merge sees exactly
    the splits the attention kernel wrote."""
    tl.static_assert(MIN_SPLIT >= BLOCK_N and MIN_SPLIT % BLOCK_N == 0)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N, MIN_SPLIT)
    return lo, per_split, tl.cdiv(seq_len - lo, per_split)



@triton.jit
def _merge_heads(Out, MidO, MidLse, b, h0, n_heads, n_splits,
                 stride_ob, stride_oh, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                 SPLIT_TILE: tl.constexpr):
    """Out[b, h] for the n_heads query heads from h0: sum_s exp2(lse_s - m) * o_s / sum_s exp2(lse_s
    - m) over the first n_splits splits (the ones that held keys; the others were never written).
    Online over tiles of SPLIT_TILE splits x BLOCK_H heads, each tile's log-sum-exps and partials
    loaded at once: the merge is a chain of L2 round trips, one per tile (one or two at the 32
    splits of `MAX_SPLITS` and a group of 4), not one per split. The partials may come from other programs of the same kernel: read through L2
    (".cg"), never a stale L1 line."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_t = tl.arange(0, SPLIT_TILE)
    offs_d = tl.arange(0, BLOCK_D)
    heads = h0 + offs_h
    h_mask = offs_h < n_heads
    d_mask = offs_d < HEAD_DIM
    lse_rows = MidLse + b * stride_lb + heads[:, None] * stride_lh
    o_rows = MidO + b * stride_mb + heads[:, None, None] * stride_mh + offs_d[None, None, :]
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s0 in range(0, n_splits, SPLIT_TILE):
        t_mask = h_mask[:, None] & (s0 + offs_t < n_splits)[None, :]
        lse = tl.load(lse_rows + s0 + offs_t[None, :], mask=t_mask, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(o_rows + (s0 + offs_t)[None, :, None] * stride_ms, mask=t_mask[:, :, None] & d_mask[None, None, :],
                    other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_i, tl.max(lse, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split of this head yet: no NaN
        alpha = tl.exp2(m_i - m_safe)
        w = tl.exp2(lse - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 1)
        m_i = m_new
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no keys at all (graph padding): zeros
    tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], acc.to(Out.dtype.element_ty),
             mask=h_mask[:, None] & d_mask[None, :])



@triton.jit
def _merge_kernel(
    Out, MidO, MidLse, SeqLens, len_offset, window, num_splits,
    stride_ob, stride_oh, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, SPLIT_TILE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PDL: tl.constexpr,
):
    """The merge of one (sequence, KV head)'s query heads, when the attention kernel does not merge
    (`_merge_heads`)."""
    wait_for_previous(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(SeqLens + b).to(tl.int32) + len_offset
    lo, per_split, n_splits = _split_len(seq_len, window, num_splits, HAS_WINDOW, BLOCK_N, MIN_SPLIT)
    _merge_heads(Out, MidO, MidLse, b, kvh * GROUP, GROUP, n_splits,
                 stride_ob, stride_oh, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                 HEAD_DIM, BLOCK_D, BLOCK_H, SPLIT_TILE)


# fp32 partials in one merge tile: 64 registers a thread at 4 warps.
MERGE_TILE_VALUES = 8192


def merge_tile(group: int, block_d: int, num_splits: int) -> tuple[int, int]:
    """(BLOCK_H, SPLIT_TILE) of `_merge_heads`: all of a KV head's query heads, and as many splits
    as keep a tile of partials within MERGE_TILE_VALUES (at least one split: a group of more than
    MERGE_TILE_VALUES / D heads, 64 at D 128, exceeds it)."""
    block_h = max(2, triton.next_power_of_2(group))  # an MHA group of 1 is masked to a tile of 2
    tile = max(1, min(triton.next_power_of_2(num_splits), MERGE_TILE_VALUES // (block_h * block_d)))
    return block_h, tile
