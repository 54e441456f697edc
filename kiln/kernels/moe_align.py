"""Which sorted rows of the grouped MoE GEMMs (`kiln.kernels.moe`) belong to which expert.

Token t's KS = k + C slots (its k routed selections, then the C shared chunks) are sorted by
expert into segments padded to BLOCK_M rows, so that every BLOCK_M-row block of a GEMM belongs to
one expert; the padding rows hold the sentinel `num_slots`. `_align_kernel` stores them (the
sorted slots and the segment ends); `_block_expert` finds a GEMM program's expert from the ends.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.kernels.launch import wait_for_previous

_INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, seg_end_ptr, num_routed, num_tokens, num_slots,
                  E: tl.constexpr, E_TOT: tl.constexpr, K: tl.constexpr, KS: tl.constexpr,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    e = tl.program_id(0)
    bins = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_routed, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ok = offs < num_routed
        ids = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
        counts += tl.histogram(ids, E_PAD, mask=ok)
    # Every token uses every shared chunk once.
    counts = tl.where((bins >= E) & (bins < E_TOT), num_tokens, counts)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    mine = bins == e
    my_end = tl.sum(tl.where(mine, ends, 0), axis=0)
    my_start = my_end - tl.sum(tl.where(mine, padded, 0), axis=0)
    my_count = tl.sum(tl.where(mine, counts, 0), axis=0)
    if e == 0:
        tl.store(seg_end_ptr + bins, ends, mask=bins < E_TOT)
    if e < E:
        # Assignment i = t*K + j goes to slot t*KS + j, in token order within the segment.
        base = my_start
        for start in range(0, num_routed, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            ok = offs < num_routed
            ids = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
            hit = (ids == e) & ok
            rank = tl.cumsum(hit.to(tl.int32), axis=0) - 1
            slot = (offs // K) * KS + offs % K
            tl.store(sorted_ptr + base + rank, slot, mask=hit)
            base += tl.sum(hit.to(tl.int32), axis=0)
    else:
        for start in range(0, num_tokens, CHUNK):
            t = start + tl.arange(0, CHUNK)
            tl.store(sorted_ptr + my_start + t, t * KS + K + (e - E), mask=t < num_tokens)
    pad = my_start + my_count + tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + pad, num_slots, mask=pad < my_end)


@triton.jit
def _block_expert(seg_end_ptr, m_start, E_TOT: tl.constexpr, E_PAD: tl.constexpr):
    """The expert whose segment holds row `m_start`; E_TOT for rows past the last segment."""
    bins = tl.arange(0, E_PAD)
    ends = tl.load(seg_end_ptr + bins, mask=bins < E_TOT, other=_INT32_MAX)
    return tl.sum((ends <= m_start).to(tl.int32), axis=0)
