"""The filter's chunked launches at small batches (`kiln.kernels.sampling`'s docstring): a table
of cnt / mass at fixed thresholds over 1K-token chunks (`_table_kernel`), and the first search's
scratch copy, each chunk at the count of those before it (`_copy_kernel`). One program per row
(`_select_kernel`) leaves most of the GPU idle at a few rows, and its whole-row passes and copy
were most of its time (~27 and ~23 us for a 49K-token row on an H100, docs/benchmarks.md, fortieth
pass)."""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.kernels.launch import wait_for_previous
from kiln.kernels.sampling_search import _bits, _narrow, _pivot_stats, _row_filters


@triton.jit
def _table_pivots(NT: tl.constexpr):
    """The table's NT bit patterns: 1.0 and then half octaves below it (2^-0.5, 2^-1, ...)."""
    return (0x3F800000 - tl.arange(0, NT) * (1 << 22)).to(tl.int32)


@triton.jit
def _table_kernel(probs_ptr, part_c_ptr, part_m_ptr, part_x_ptr, top_ks_ptr, top_ps_ptr, V, stride_p, n_chunks,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr, NT: tl.constexpr, PDL: tl.constexpr):
    """Grid (rows, chunks of CHUNK tokens): the chunk's maximum and sum, and how many of its
    tokens are >= each table pivot (`_table_pivots`) and their mass. `_select_kernel` adds the
    chunks up, in chunk order: the row's maximum and total, and cnt / mass at NT thresholds, which
    bracket every search's crossing to half an octave without a pass over the row (those passes,
    on one program per row, were most of its time: ~27 us each for a 49K-token row on an H100).
    The table is NT x the ALU work of such a pass, spread over the chunks: only rows that search
    (top-k or top-p) build it, and only small batches take this path (`TABLE["MAX_ROWS"]`)."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    start = chunk * CHUNK
    n = tl.minimum(V - start, CHUNK)
    ptr = probs_ptr + row * stride_p + start
    searches = _row_filters(top_ks_ptr, top_ps_ptr, row, V)[2]
    at = row * n_chunks + chunk
    if searches:
        cnt, mass, _, _ = _pivot_stats(ptr, n, _table_pivots(NT), 0, 0, BLOCK, NT)
        tl.store(part_c_ptr + at * NT + tl.arange(0, NT), cnt)
        tl.store(part_m_ptr + at * NT + tl.arange(0, NT), mass)
    offs = tl.arange(0, CHUNK)
    p = tl.load(ptr + offs, mask=offs < n, other=0.0)
    tl.store(part_x_ptr + at * 2, tl.max(p, axis=0))
    tl.store(part_x_ptr + at * 2 + 1, tl.sum(p, axis=0))


@triton.jit
def _copy_kernel(probs_ptr, scratch_ptr, part_c_ptr, part_m_ptr, part_x_ptr, pre_i_ptr, pre_f_ptr,
                 top_ks_ptr, top_ps_ptr, min_ps_ptr, V, stride_p, n_chunks,
                 CAP: tl.constexpr, CHUNK: tl.constexpr, NT: tl.constexpr, CHUNKS: tl.constexpr, PDL: tl.constexpr):
    """Grid (rows, chunks): the first search's table bracket [lo, hi) and, when its tokens fit the
    scratch, their copy into it, every chunk its own tokens at the count of those before it (from
    the table's chunk counts at lo and hi), so the scratch is in token order as `_search`'s copy
    (one program, ~23 us for a 49K-token row on an H100) writes it. Mode 2: every token >= lo fits
    (both searches of a top-k + top-p row then read only the scratch); mode 1: those of [lo, hi);
    0: neither, or min-p is on (its threshold needs a pass first), or no filter. Every program
    reduces the table alike; chunk 0's writes the decision and the row's maximum and total for
    `_select_kernel` (pre_i: mode, lo, cnt_lo, hi, cnt_hi; pre_f: mass_lo, mass_hi, p_max, total)."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    k, top_p, searches = _row_filters(top_ks_ptr, top_ps_ptr, row, V)
    use_k = k < V
    first = searches & (tl.load(min_ps_ptr + row) <= 0.0)
    c = tl.arange(0, CHUNKS)
    in_row = c < n_chunks
    at = row * n_chunks + c
    p_max = tl.max(tl.load(part_x_ptr + at * 2, mask=in_row, other=0.0), axis=0)
    total = tl.sum(tl.load(part_x_ptr + at * 2 + 1, mask=in_row, other=0.0), axis=0)
    zero_i = tl.full([], 0, tl.int32)
    zero_f = tl.full([], 0.0, tl.float32)
    mode, lo, cnt_lo, hi, cnt_hi, mass_lo, mass_hi = zero_i, zero_i, zero_i, zero_i, zero_i, zero_f, zero_f
    if first:
        t_at = at[:, None] * NT + tl.arange(0, NT)[None, :]
        chunk_c = tl.load(part_c_ptr + t_at, mask=in_row[:, None], other=0)  # [CHUNKS, NT]
        tab_c = tl.sum(chunk_c, axis=0)
        tab_m = tl.sum(tl.load(part_m_ptr + t_at, mask=in_row[:, None], other=0.0), axis=0)
        tab_p = _table_pivots(NT)
        # the first search: the k-th value (top-k, with or without top-p), else top-p's crossing
        thr = tl.where(use_k, float("inf"), top_p * total)
        rm = tl.where(use_k, V + 1, V)
        lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi = _narrow(
            tab_p, tab_c, tab_m, 0x7FFFFFFF, -1, zero_i, zero_i + V, total, _bits(p_max) + 1, zero_i, zero_f,
            k, thr, rm)
        mode = tl.where(cnt_lo <= CAP, 2, tl.where(cnt_lo - cnt_hi <= CAP, 1, 0))
        if mode > 0:
            # each chunk's tokens >= lo (and, mode 1, >= hi): lo is 0 or a table pivot; hi a pivot
            # or above the maximum
            n_here = tl.minimum(V - c * CHUNK, CHUNK)
            ge_lo = tl.where(lo == 0, n_here, tl.sum(tl.where(tab_p[None, :] == lo, chunk_c, 0), axis=1))
            ge_hi = tl.sum(tl.where(tab_p[None, :] == hi, chunk_c, 0), axis=1)
            per_chunk = tl.where(in_row, ge_lo - tl.where(mode == 1, ge_hi, 0), 0)
            offset = tl.sum(tl.where(c < chunk, per_chunk, 0), axis=0)
            offs = chunk * CHUNK + tl.arange(0, CHUNK)
            ok = offs < V
            p = tl.load(probs_ptr + row * stride_p + offs, mask=ok, other=0.0)
            b = _bits(p)
            inside = ok & (b >= lo) & ((mode == 2) | (b < hi))
            dst = offset + tl.cumsum(inside.to(tl.int32), axis=0) - 1
            tl.store(scratch_ptr + row * CAP + dst, p, mask=inside)
    if chunk == 0:
        tl.store(pre_i_ptr + row * 5, mode)
        tl.store(pre_i_ptr + row * 5 + 1, lo)
        tl.store(pre_i_ptr + row * 5 + 2, cnt_lo)
        tl.store(pre_i_ptr + row * 5 + 3, hi)
        tl.store(pre_i_ptr + row * 5 + 4, cnt_hi)
        tl.store(pre_f_ptr + row * 4, mass_lo)
        tl.store(pre_f_ptr + row * 4 + 1, mass_hi)
        tl.store(pre_f_ptr + row * 4 + 2, p_max)
        tl.store(pre_f_ptr + row * 4 + 3, total)

