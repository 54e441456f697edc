"""Triton paged attention for a block drafter's rows: runs of query rows that share one request
and one key range, each K/V byte read once per run.

A DFlash / DSpark block pass (`kiln.engine.spec.block_pass`) attends every one of a block's B
rows over the same keys: its request's context and the whole block, positions 0 .. anchor + B - 1
(the block is bidirectional). `decode_attention` would treat each row as a sequence of its own and
read the request's K/V B times per layer (16 times at B = 16), and pad each row's G query heads to
an MMA tile of 16 (12 of 16 rows idle at G = 4). Here one program holds ROWS rows x G heads of one
KV head as one query tile (ROWS * G rows, at most 64), so the K/V of a run is read once per KV
head and split, and the tile is full.

Same arguments and result as `kiln.ops.attention.paged_decode_attention` (no window, no bias),
plus `rows_per_block`: consecutive runs of that many rows of q share their request (`req_slots`)
and length (`seq_lens`), the caller's promise, which the kernel relies on by reading both from a
run's first row. Splits of the keys work as in `kiln.kernels.decode_attention` (the same
`_split_len`), with a run in place of a sequence, and `decode_attention`'s merge kernel merges
them, one program per row and KV head. Not inside the attention kernel, as `decode_attention`
can: the last split of a run would merge all ROWS x G heads' partials alone, a serial chain of
L2 round trips per row. The grid depends only on shapes and host ints: CUDA-graph safe after a
warm-up.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kiln.kernels import assert_rows
from kiln.kernels.decode_attention import (LOG2E, MAX_SPLITS, decode_config, dot_precision, head_dim_block,
                                           sm_count)
from kiln.kernels.decode_splits import _merge_kernel, _split_len, merge_tile
from kiln.kernels.launch import pdl_launch, wait_for_previous

# Query rows (rows x heads of a group) in one program's tile: 64 keeps the fp32 accumulator at 64
# registers a thread at 4 warps and D = 128.
MAX_TILE_ROWS = 64
# Keys per split at least, and (run, KV head, split) programs per SM that the split count aims
# at. A split's partials are a whole tile (rows x heads x D fp32: 32 KB at B = 16, G = 4,
# D = 128, as many bytes as 64 keys' K and V) and each program's tile is 4x `decode_attention`'s,
# so fewer, longer splits than its 4-8 programs per SM: on an H100 (B = 16, Hq 16, Hkv 4, D 128;
# docs/benchmarks.md, fifty-second pass) one program per SM took 17.6 us at batch 8 / 1K against
# 25.8 at four, and was within 7% of the best setting at batch 1 and 8, 1K to 32K. Splits of at
# least 64 keys: 11.7 us at batch 1 / 1K against 14.4 at 256.
MIN_SPLIT_KEYS = 64
PROGRAMS_PER_SM = 1


def pick_block_splits(programs: int, kv_heads: int, max_keys: int, device: torch.device, min_split: int) -> int:
    """Splits per run: about PROGRAMS_PER_SM programs per SM over the grid, never more than the
    `min_split`-key splits of `max_keys` or `MAX_SPLITS` (the merge's partials)."""
    splits = triton.cdiv(PROGRAMS_PER_SM * sm_count(device), max(1, programs * kv_heads))
    return max(1, min(splits, triton.cdiv(max(max_keys, 1), min_split), MAX_SPLITS))


def rows_per_program(rows_per_block: int, group: int) -> int:
    """How many rows of a run one program holds: the largest divisor of `rows_per_block` whose
    rows x `group` heads fit MAX_TILE_ROWS (at least 1)."""
    fit = max(1, MAX_TILE_ROWS // group)
    return max(r for r in range(1, min(rows_per_block, fit) + 1) if rows_per_block % r == 0)


@triton.jit
def _block_attention_kernel(
    Q, K, V, Out, MidO, MidLse, ReqToToken, ReqSlots, SeqLens,
    scale_log2, num_splits,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ob, stride_oh,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_rt,
    GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, MIN_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """One program: rows row0 .. row0 + ROWS - 1 (one run's, or part of one), the GROUP query heads
    of KV head `kvh`, keys of split `split`. Tile row i is row row0 + i // GROUP, head
    kvh * GROUP + i % GROUP."""
    wait_for_previous(PDL)
    chunk = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row0 = chunk * ROWS
    seq_len = tl.load(SeqLens + row0).to(tl.int32)
    lo, per_split, n_splits = _split_len(seq_len, 0, num_splits, False, BLOCK_N, MIN_SPLIT)
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < ROWS * GROUP
    d_mask = offs_d < HEAD_DIM
    rows = (row0 + offs_m // GROUP).to(tl.int64)
    heads = kvh * GROUP + offs_m % GROUP
    out_mask = m_mask[:, None] & d_mask[None, :]
    if SPLIT:
        if start >= end:  # past this run's keys (the merge skips this split)
            return
    token_row = ReqToToken + tl.load(ReqSlots + row0).to(tl.int64) * stride_rt
    k_base = K + kvh * stride_kh
    v_base = V + kvh * stride_vh
    q = tl.load(Q + rows[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=out_mask, other=0.0).to(K.dtype.element_ty)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        slots = tl.load(token_row + pos, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + slots[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + slots[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if not SPLIT:
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i is 0 only for a run of length 0
        tl.store(Out + rows[:, None] * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 acc.to(Out.dtype.element_ty), mask=out_mask)
    else:
        acc = acc / l_i[:, None]
        tl.store(MidO + rows[:, None] * stride_mb + heads[:, None] * stride_mh + split * stride_ms
                 + offs_d[None, :], acc, mask=out_mask)
        tl.store(MidLse + rows * stride_lb + heads * stride_lh + split, m_i + tl.log2(l_i), mask=m_mask)


def block_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    req_to_token: torch.Tensor, req_slots: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, rows_per_block: int, max_len: Optional[int] = None,
                    num_splits: Optional[int] = None, min_split_keys: Optional[int] = None) -> torch.Tensor:
    """Attention of q [N, Hq, D] over paged K/V, [N, Hq, D] in q's dtype, where every run of
    `rows_per_block` consecutive rows (N a multiple of it) shares its `req_slots` and `seq_lens`
    entries ([N] each): each row sees keys 0 .. seq_len - 1 of its request, whose K/V are in
    k_cache / v_cache [num_slots, Hkv, D] at req_to_token[slot, position].

    Equals `kiln.ops.attention.paged_decode_attention(q, ..., scale)` on such rows. max_len bounds
    seq_lens on the host and only sizes the grid (default req_to_token.shape[1]); num_splits
    overrides the split count and min_split_keys the least keys per split (default
    MIN_SPLIT_KEYS, rounded up to a multiple of the key block); neither changes the result. A
    run of length 0 yields zeros. No host sync."""
    assert_rows(req_slots=req_slots, seq_lens=seq_lens)
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    assert hq % hkv == 0, f"query heads {hq} not a multiple of KV heads {hkv}"
    assert v_cache.shape == k_cache.shape and k_cache.shape[2] == d
    assert rows_per_block >= 1 and n % rows_per_block == 0, (n, rows_per_block)
    assert req_slots.shape == seq_lens.shape == (n,), (req_slots.shape, seq_lens.shape, n)
    out = q.new_empty(n, hq, d)
    if n == 0:
        return out
    q, k_cache, v_cache, req_to_token = (t if t.stride(-1) == 1 else t.contiguous()
                                         for t in (q, k_cache, v_cache, req_to_token))
    group = hq // hkv
    rows = rows_per_program(rows_per_block, group)
    programs = n // rows
    block_d = head_dim_block(d)
    cfg = decode_config(block_d, q.device)
    block_n = cfg["block_n"]
    min_split = MIN_SPLIT_KEYS if min_split_keys is None else min_split_keys
    min_split = max(1, triton.cdiv(min_split, block_n)) * block_n
    max_keys = req_to_token.shape[1] if max_len is None else max_len
    if num_splits is None:
        num_splits = pick_block_splits(programs, hkv, max_keys, q.device, min_split)
    if num_splits > 1:
        mid_o = torch.empty(n, hq, num_splits, d, device=q.device, dtype=torch.float32)
        mid_lse = torch.empty(n, hq, num_splits, device=q.device, dtype=torch.float32)
    else:
        mid_o = mid_lse = out.new_empty(1, 1, 1, 1, dtype=torch.float32)  # unused
    _block_attention_kernel[(programs, hkv, num_splits)](
        q, k_cache, v_cache, out, mid_o, mid_lse, req_to_token, req_slots, seq_lens,
        scale * LOG2E, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), req_to_token.stride(0),
        GROUP=group, ROWS=rows, BLOCK_M=max(16, triton.next_power_of_2(rows * group)), HEAD_DIM=d,
        BLOCK_D=block_d, BLOCK_N=block_n, SPLIT=num_splits > 1, MIN_SPLIT=min_split,
        DOT_PRECISION=dot_precision(k_cache.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(q.device),
    )
    if num_splits > 1:  # per row (the rows of a run share their length)
        block_h, split_tile = merge_tile(group, block_d, num_splits)
        _merge_kernel[(n, hkv)](
            out, mid_o, mid_lse, seq_lens, 0, 0, num_splits,
            out.stride(0), out.stride(1), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
            mid_lse.stride(0), mid_lse.stride(1),
            GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_N=block_n, MIN_SPLIT=min_split, BLOCK_H=block_h,
            SPLIT_TILE=split_tile, HAS_WINDOW=False, num_warps=4, **pdl_launch(q.device),
        )
    return out
