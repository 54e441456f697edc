"""Sampling filters without a vocabulary sort and without a device -> host sync.

`filtered_probs` returns what `kiln.engine.sampler.filtered_probs` returns (temperature, softmax,
top-k, top-p on the top-k renormalised mass, min-p, renormalise, ties by token id); `sample`
draws from that distribution with the sampler's exponential race, argmax(probs / e), without
writing it out; `sample_from_probs` is the race alone. Everything runs on the device on grids that
depend only on shapes, so all three can be captured in a CUDA graph.

Launches: the softmax of logits / T in two (`kiln.kernels.softmax`); for batches of at most
`TABLE["MAX_ROWS"]` rows `_table_kernel` and `_copy_kernel` over (row, chunk of 1K tokens), which
give each row its maximum, total and a table of cnt / mass at 64 fixed thresholds, and copy the
first search's bracket into the scratch when it fits (below); then `_select_kernel`, one
program per row, which finds the kept set, then `_apply_kernel` over (row, chunk of 1K tokens),
which writes the renormalised row or the chunk's best draw, and for draws `_argmax_kernel`,
which merges the chunks. (Until the thirty-ninth session the softmax was torch's own ops,
bit-identical to the reference's; 18.7 us for one 49K-token row on an H100 against 5.9 for the
kernels' two launches.)

How the kept set is found without sorting
-----------------------------------------
Every filter keeps a prefix of the stable descending order (value desc, token id asc), so the kept
set is the first R ranks, R = max(1, min(k, R_p, R_m)), described by
- v_R, the value at rank R-1, and
- n_tie, how many tokens equal to v_R are kept: the n_tie lowest ids among them (stored as the id
  of the last one, found by one extra pass only when the ties are cut).
For a threshold u, cnt(u) = #{p >= u} and mass(u) = sum{p >= u} decide whether rank R-1 is at or
above u: cnt(u) >= R  <=>  cnt(u) >= 1 and (cnt(u) >= k or mass(u) >= top_p * S_k or
cnt(u) >= R_m) (for top-p: the first token below u is dropped iff the mass before it, mass(u),
reaches the threshold). This predicate P is monotone in u, so v_R is found by a search over the
float32 bit patterns of u (for p >= 0 they order like the values): each pass over the data
evaluates NP pivots at once and keeps the bracket [lo, hi) with P(lo) true and P(hi) false, until
hi = lo + 1; then v_R = lo and, with cnt/mass of the tokens above v_R, n_tie follows by
arithmetic (top-p: the j-th tie is kept iff mass_above + j * v_R < threshold). S_k, the mass of
the top-k tokens, comes from a first search of the same kind for the k-th value (only for rows
with both top-k and top-p).

Passes over a whole row are what costs (V = 128K; on one program ~27 us each for a 49K-token row
on an H100, and the scratch copy ~23 us), so at small batches, where one program per row leaves
the GPU nearly empty, the chunked launches do that work in parallel: the table (thresholds at
1.0 and every half octave below it, chunk sums added in chunk order) brackets every search's
crossing to half an octave with no pass over the row, and `_copy_kernel` copies the first
search's bracket (every token >= its lower end when those fit, so that a top-k + top-p row runs
both searches in the scratch; else the bracket alone) each chunk at the count of those before it,
in token order like the single-program copy. Rows with min-p (whose threshold needs the maximum
first) and brackets that do not fit go on as below. Then: the first pivots sit 1, 2, 4, ... 20
octaves below the maximum (bit patterns are a log scale); later ones are half evenly spaced, half
clustered where interpolating cnt / mass between the bracket's ends puts the crossing; every
pass also shrinks the bracket to the smallest and largest token inside it; and as soon as the
bracket holds at most CAP tokens they are copied once into a per-row scratch buffer and the search
continues there. Rows without filters, and rows with min-p alone, need no search.

Exactness: the probabilities are the reference's to float32 rounding (the softmax's exponential
and row sum are Triton's; equal logits still give equal probabilities), and the kept set is the
reference's, ties included, except within that rounding of a threshold: the reference compares a
float32 cumsum over the sorted values with top_p * S_k, this kernel float32 sums in another
order, so a token whose mass-before lies within rounding (~1e-6 of the total) of the top-p
threshold may fall the other way (typically with many equal probabilities where top_p * k is an
integer), as may one within rounding of min_p * p_max. There is no sort fallback: no case needs
one. Renormalised values match to float32 rounding; draws are exact given the same
probabilities (`sample_from_probs`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.launch import pdl_launch, wait_for_previous
from kiln.kernels.sampling_search import (_bits, _narrow, _pivot_stats, _pivots, _row_filters, _search,  # noqa: F401
                                          _search_scratch)
from kiln.kernels.sampling_table import _copy_kernel, _table_kernel, _table_pivots
from kiln.kernels.softmax import temperature_softmax as _softmax


CAP = 4096  # scratch tokens per row: the search leaves whole-row passes once the bracket fits


# ------------------------------------------------------------------------------ the kernels


# The three per-row parameters are one scalar load each: not specialised on their pointers' 16-byte
# alignment, which the sampler's views into one copied [6, B] float buffer (`SamplingBatch.from_reqs`)
# change with B. Specialised, each new alignment compiled this kernel again (~2.3 s on an H100,
# three times at the first sampled batch of 64; docs/benchmarks.md, thirty-eighth pass).
@triton.jit(do_not_specialize_on_alignment=["top_ks_ptr", "top_ps_ptr", "min_ps_ptr"])
def _select_kernel(
    probs_ptr, meta_i_ptr, meta_f_ptr, scratch_ptr, part_c_ptr, part_m_ptr, part_x_ptr, pre_i_ptr, pre_f_ptr,
    top_ks_ptr, top_ps_ptr, min_ps_ptr,
    V, stride_p, n_chunks,
    CAP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
    NP: tl.constexpr, BLOCK_S: tl.constexpr, NP_S: tl.constexpr, NT: tl.constexpr, CHUNKS: tl.constexpr,
    TABLE: tl.constexpr, PRE: tl.constexpr, PDL: tl.constexpr,
):
    """One program per row: find the kept prefix as in the module docstring and store it as
    (vb, cut, norm): token i is kept iff bits(p_i) > vb, or bits(p_i) == vb and i <= cut; kept
    tokens are renormalised by norm. The row itself is written by `_apply_kernel`. With TABLE
    its maximum, total and threshold table come from `_table_kernel`'s chunks (else pass 1 finds
    the first two and every search starts from the whole range)."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    row_ptr = probs_ptr + row * stride_p
    scratch = scratch_ptr + row * CAP
    tab_p = _table_pivots(NT)
    k, top_p, searches = _row_filters(top_ks_ptr, top_ps_ptr, row, V)
    tab_c = tl.zeros([NT], dtype=tl.int32)
    tab_m = tl.zeros([NT], dtype=tl.float32)
    if TABLE:  # the chunks' maxima, sums and table, added up in chunk order
        c = tl.arange(0, CHUNKS)
        in_row = c < n_chunks
        at = row * n_chunks + c
        p_max = tl.max(tl.load(part_x_ptr + at * 2, mask=in_row, other=0.0), axis=0)
        total = tl.sum(tl.load(part_x_ptr + at * 2 + 1, mask=in_row, other=0.0), axis=0)
        if searches:  # only rows that search built it
            t_at = at[:, None] * NT + tl.arange(0, NT)[None, :]
            tab_c = tl.sum(tl.load(part_c_ptr + t_at, mask=in_row[:, None], other=0), axis=0)
            tab_m = tl.sum(tl.load(part_m_ptr + t_at, mask=in_row[:, None], other=0.0), axis=0)
    else:  # pass 1: maximum and total mass (elementwise accumulators, one reduction at the end)
        mx_acc = tl.zeros([BLOCK], dtype=tl.float32)
        s_acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            p = tl.load(row_ptr + offs, mask=offs < V, other=0.0)
            mx_acc = tl.maximum(mx_acc, p)
            s_acc += p
        p_max = tl.max(mx_acc, axis=0)
        total = tl.sum(s_acc, axis=0)
    # `_copy_kernel`'s decision (PRE): the first search's bracket and whether the scratch holds it
    mode = tl.full([], 0, tl.int32)
    if PRE:
        mode = tl.load(pre_i_ptr + row * 5)
        total = tl.load(pre_f_ptr + row * 4 + 3)  # the total its bracket was chosen with

    min_p = tl.load(min_ps_ptr + row)
    use_k = k < V
    use_p = top_p < 1.0
    use_m = min_p > 0.0

    # min-p keeps p >= min_p * p_max (the same float32 product as the reference): R_m and its mass.
    thr_m = min_p * p_max
    bm = _bits(thr_m)
    r_m = tl.full([], 0, tl.int32) + V
    mass_m = total
    if use_m:
        c_acc = tl.zeros([BLOCK], dtype=tl.int32)
        m_acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            p = tl.load(row_ptr + offs, mask=offs < V, other=0.0)
            ge = (offs < V) & (p >= thr_m)
            c_acc += ge.to(tl.int32)
            m_acc += tl.where(ge, p, 0.0)
        r_m = tl.sum(c_acc, axis=0)
        mass_m = tl.sum(m_acc, axis=0)

    # Keep everything unless a filter is on.
    vb = tl.full([], -1, tl.int32)
    cut = tl.full([], -1, tl.int32)
    norm = total
    if use_m & ~use_k & ~use_p & (r_m > 0):
        vb = bm - 1  # min-p alone: a plain threshold, ties included
        norm = mass_m
    elif use_k | use_p | use_m:
        top = _bits(p_max) + 1
        zero_i = tl.full([], 0, tl.int32)
        zero_f = tl.full([], 0.0, tl.float32)
        lo = zero_i
        cnt_lo = zero_i + V
        mass_lo = total
        s_k = total
        inf = float("inf")
        # the copy's bracket [pre_lo, pre_hi) of the first search (mode > 0): the scratch holds its
        # n_pre tokens, and base_c / base_m count those >= pre_hi that it does not hold
        pre_lo, pre_cnt_lo, pre_hi, pre_cnt_hi = zero_i, zero_i, zero_i, zero_i
        pre_mass_lo, pre_mass_hi = zero_f, zero_f
        if PRE:
            pre_lo = tl.load(pre_i_ptr + row * 5 + 1)
            pre_cnt_lo = tl.load(pre_i_ptr + row * 5 + 2)
            pre_hi = tl.load(pre_i_ptr + row * 5 + 3)
            pre_cnt_hi = tl.load(pre_i_ptr + row * 5 + 4)
            pre_mass_lo = tl.load(pre_f_ptr + row * 4)
            pre_mass_hi = tl.load(pre_f_ptr + row * 4 + 1)
        n_pre = tl.where(mode == 2, pre_cnt_lo, pre_cnt_lo - pre_cnt_hi)
        base_c = tl.where(mode == 2, 0, pre_cnt_hi)
        base_m = tl.where(mode == 2, 0.0, pre_mass_hi)
        if use_k & use_p:  # top-p needs S_k, the mass of the top k: search the k-th value first
            if mode > 0:
                lo, cnt_lo, mass_lo, hi_k, cnt_gt_k, mass_gt_k = _search_scratch(
                    scratch, n_pre, base_c, base_m, pre_lo, pre_cnt_lo, pre_mass_lo, pre_hi, pre_cnt_hi,
                    pre_mass_hi, k, inf, V + 1, BLOCK_S, NP_S)
            else:
                hi, cnt_hi, mass_hi = top, zero_i, zero_f
                if TABLE:
                    lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi = _narrow(
                        tab_p, tab_c, tab_m, 0x7FFFFFFF, -1, lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, k, inf, V + 1)
                lo, cnt_lo, mass_lo, hi_k, cnt_gt_k, mass_gt_k = _search(
                    row_ptr, V, scratch, lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, k, inf, V + 1,
                    CAP, BLOCK, BLOCK_P, NP, BLOCK_S, NP_S)
            v_k = lo.to(tl.float32, bitcast=True)
            s_k = mass_gt_k + (k - cnt_gt_k).to(tl.float32) * v_k
        thr_p = tl.where(use_p, top_p * s_k, inf)
        if (mode == 2) & use_k & use_p:
            # the scratch holds every token >= the copy's lo, and v_k is above it
            lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi = _narrow(
                tab_p, tab_c, tab_m, 0x7FFFFFFF, -1, lo, cnt_lo, mass_lo, top, zero_i, zero_f, k, thr_p, r_m)
            lo, cnt_lo, mass_lo, hi, cnt_gt, mass_gt = _search_scratch(
                scratch, n_pre, 0, 0.0, lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, k, thr_p, r_m, BLOCK_S, NP_S)
        elif (mode > 0) & ~(use_k & use_p):  # the final search is the first: the copy's bracket
            lo, cnt_lo, mass_lo, hi, cnt_gt, mass_gt = _search_scratch(
                scratch, n_pre, base_c, base_m, pre_lo, pre_cnt_lo, pre_mass_lo, pre_hi, pre_cnt_hi, pre_mass_hi,
                k, thr_p, r_m, BLOCK_S, NP_S)
        else:
            # The final search starts at v_k when known (P holds there: cnt >= k), inside the
            # table's bracket.
            hi, cnt_hi, mass_hi = top, zero_i, zero_f
            if TABLE:
                lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi = _narrow(
                    tab_p, tab_c, tab_m, 0x7FFFFFFF, -1, lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, k, thr_p, r_m)
            lo, cnt_lo, mass_lo, hi, cnt_gt, mass_gt = _search(
                row_ptr, V, scratch, lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, k, thr_p, r_m,
                CAP, BLOCK, BLOCK_P, NP, BLOCK_S, NP_S)
        vb = lo
        v = lo.to(tl.float32, bitcast=True)
        cnt_eq = cnt_lo - cnt_gt
        # Ties of v: the j-th is kept iff j < k - cnt_gt, j < r_m - cnt_gt and (top-p) the mass
        # before it, mass_gt + j * v, is below thr_p; at least one is (rank R-1 is one of them).
        # n_p = the first j failing the float32 test; the division only estimates it (it rounds
        # e.g. 16.0000002 down to 16), the test itself decides among the neighbours of the estimate.
        j0 = tl.minimum(tl.math.floor((thr_p - mass_gt) / tl.maximum(v, 1e-38)),
                        (cnt_eq + 1).to(tl.float32))
        j0 = tl.maximum(j0, 0.0)
        n_p = (j0 - 1.0 + (mass_gt + (j0 - 1.0) * v < thr_p).to(tl.float32)
               + (mass_gt + j0 * v < thr_p).to(tl.float32) + (mass_gt + (j0 + 1.0) * v < thr_p).to(tl.float32))
        n_p = tl.maximum(n_p, 0.0).to(tl.int32)
        n_p = tl.where((thr_p == inf) | (v == 0.0), cnt_eq + 1, n_p)
        n_tie = tl.minimum(tl.minimum(k - cnt_gt, r_m - cnt_gt), n_p)
        n_tie = tl.maximum(tl.minimum(n_tie, cnt_eq), 1)
        norm = mass_gt + n_tie.to(tl.float32) * v
        cut = tl.full([], 0, tl.int32) + V  # all ties kept
        if n_tie < cnt_eq:  # ties cut: the id of the n_tie-th one (ids ascending), one more pass
            running = tl.full([], 0, tl.int32)
            cut = tl.full([], -1, tl.int32)
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                p = tl.load(row_ptr + offs, mask=offs < V, other=0.0)
                eq = ((offs < V) & (_bits(p) == vb)).to(tl.int32)
                last = eq.to(tl.int1) & (running + tl.cumsum(eq, axis=0) == n_tie)
                cut = tl.maximum(cut, tl.max(tl.where(last, offs, -1), axis=0))
                running += tl.sum(eq, axis=0)
    tl.store(meta_i_ptr + row * 2, vb)
    tl.store(meta_i_ptr + row * 2 + 1, cut)
    tl.store(meta_f_ptr + row, norm)


@triton.jit
def _apply_kernel(
    probs_ptr, meta_i_ptr, meta_f_ptr, out_ptr, e_ptr, part_v_ptr, part_i_ptr,
    V, stride_p, stride_o, stride_e, n_chunks,
    FILTER: tl.constexpr, SAMPLE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (rows, chunks of CHUNK tokens): apply (vb, cut, norm) and write the renormalised
    probabilities, or (SAMPLE) the chunk's best argmax(q / max(e, tiny)) and its token id (first
    index on ties). FILTER=False: q = p, the race alone."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if FILTER:
        vb = tl.load(meta_i_ptr + row * 2)
        cut = tl.load(meta_i_ptr + row * 2 + 1)
        norm = tl.load(meta_f_ptr + row)
    best = tl.full([BLOCK], -1.0, dtype=tl.float32)
    best_id = tl.full([BLOCK], 0, dtype=tl.int32)
    for sub in range(0, CHUNK, BLOCK):
        offs = chunk * CHUNK + sub + tl.arange(0, BLOCK)
        ok = offs < V
        p = tl.load(probs_ptr + row * stride_p + offs, mask=ok, other=0.0)
        if FILTER:
            b = _bits(p)
            keep = (b > vb) | ((b == vb) & (offs <= cut))
            q = tl.where(keep, tl.math.div_rn(p, norm), 0.0)
        else:
            q = p
        if SAMPLE:
            e = tl.load(e_ptr + row * stride_e + offs, mask=ok, other=1.0)
            r = tl.where(ok, tl.math.div_rn(q, tl.maximum(e, 1.1754943508222875e-38)), -1.0)
            take = r > best  # strict: each lane keeps its first maximum
            best_id = tl.where(take, offs, best_id)
            best = tl.where(take, r, best)
        else:
            tl.store(out_ptr + row * stride_o + offs, q, mask=ok)
    if SAMPLE:
        m = tl.max(best, axis=0)
        first = tl.min(tl.where(best == m, best_id, 0x7FFFFFFF), axis=0)
        tl.store(part_v_ptr + row * n_chunks + chunk, m)
        tl.store(part_i_ptr + row * n_chunks + chunk, first)


@triton.jit
def _argmax_kernel(part_v_ptr, part_i_ptr, ids_ptr, n_chunks, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Per row: the chunk with the largest value, the earliest chunk on ties (chunks are in id
    order), so the result is the first maximum, as torch.argmax."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < n_chunks
    v = tl.load(part_v_ptr + row * n_chunks + c, mask=ok, other=-2.0)
    i = tl.load(part_i_ptr + row * n_chunks + c, mask=ok, other=0x7FFFFFFF)
    m = tl.max(v, axis=0)
    tl.store(ids_ptr + row, tl.min(tl.where(v == m, i, 0x7FFFFFFF), axis=0).to(tl.int64))


# ------------------------------------------------------------------------------ host wrappers

# Launch shapes (module attributes so a sweep can change them).
SELECT = dict(BLOCK=4096, BLOCK_P=1024, NP=8, BLOCK_S=256, NP_S=16, num_warps=8)
# The threshold table over chunks (`_table_kernel`) for batches of at most MAX_ROWS rows: NT half
# octaves (down to 2^-31.5); PRE: the first search's copy by `_copy_kernel` (False: `_search` copies).
# Larger batches already fill the GPU with one program per row, and the table's ALU work (NT
# thresholds per token) made them slower (64 rows: 115 -> 209 us at top-p 0.9, 29 -> 174 us
# without a filter, on an H100; docs/benchmarks.md, fortieth pass).
TABLE = dict(CHUNK=1024, BLOCK=128, NT=64, PRE=True, MAX_ROWS=8, num_warps=8)
APPLY = dict(CHUNK=1024, BLOCK=1024, num_warps=4)  # 1024: 3.5 against 11.4 us per 49K row at 8192 (H100)


def _apply(probs, meta_i, meta_f, e):
    """Write the filtered rows (e None) or draw from them ([N] int64)."""
    n, v = probs.shape
    chunk = min(APPLY["CHUNK"], triton.next_power_of_2(v))
    block = min(APPLY["BLOCK"], chunk)
    n_chunks = triton.cdiv(v, chunk)
    sample = e is not None
    filt = meta_i is not None
    out = torch.empty_like(probs) if not sample else probs
    part_v = torch.empty(n, n_chunks, dtype=torch.float32, device=probs.device) if sample else probs
    part_i = torch.empty(n, n_chunks, dtype=torch.int32, device=probs.device) if sample else probs
    _apply_kernel[(n, n_chunks)](
        probs, meta_i if filt else probs, meta_f if filt else probs, out, e if sample else probs,
        part_v, part_i, v, probs.stride(0), out.stride(0), e.stride(0) if sample else 0, n_chunks,
        FILTER=filt, SAMPLE=sample, CHUNK=chunk, BLOCK=block, num_warps=APPLY["num_warps"],
        **pdl_launch(probs.device),
    )
    if not sample:
        return out
    ids = torch.empty(n, dtype=torch.int64, device=probs.device)
    _argmax_kernel[(n,)](part_v, part_i, ids, n_chunks, BLOCK=triton.next_power_of_2(n_chunks), num_warps=1,
                         **pdl_launch(part_v.device))
    return ids


def _filter(probs, top_ks, top_ps, min_ps, e, cap, searches=True):
    n, v = probs.shape
    assert probs.stride(1) == 1 and probs.dtype == torch.float32
    if e is not None:
        assert e.shape == probs.shape and e.stride(1) == 1 and e.dtype == torch.float32
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=probs.device) if e is not None else torch.empty_like(probs)
    meta_i, meta_f, _ = _select(probs, top_ks, top_ps, min_ps, cap, searches)
    return _apply(probs, meta_i, meta_f, e)


def _select(probs, top_ks, top_ps, min_ps, cap, searches=True):
    """The kept set of every row: (meta_i [n, 2], meta_f [n], the copy kernel's decision pre_i
    [n, 5] whose column 0 is each row's mode, or None without the chunked launches). `searches`
    False: the caller knows no row has top-k or top-p, so the chunked launches would build nothing
    (a min-p-only row paid them for nothing: 16.6 -> 23.3 us at one row on an H100)."""
    n, v = probs.shape
    dev = probs.device
    meta_i = torch.empty(n, 2, dtype=torch.int32, device=dev)
    meta_f = torch.empty(n, dtype=torch.float32, device=dev)
    scratch = torch.empty(n, cap, dtype=torch.float32, device=dev)
    tab = TABLE
    chunk = min(tab["CHUNK"], triton.next_power_of_2(v))
    n_chunks = triton.cdiv(v, chunk)
    # read at ptr + row: an expanded (stride-0) view, as `expand(...).reshape(-1)` gives at one
    # request, would hand rows 1.. the memory after row 0
    params = (top_ks.to(torch.int64).contiguous(), top_ps.float().contiguous(), min_ps.float().contiguous())
    table = searches and n <= tab["MAX_ROWS"]
    part_c, part_m, part_x = meta_i, meta_f, meta_f  # unread without the table
    if table:
        part_c = torch.empty(n, n_chunks, tab["NT"], dtype=torch.int32, device=dev)
        part_m = torch.empty(n, n_chunks, tab["NT"], dtype=torch.float32, device=dev)
        part_x = torch.empty(n, n_chunks, 2, dtype=torch.float32, device=dev)
        _table_kernel[(n, n_chunks)](probs, part_c, part_m, part_x, *params[:2], v, probs.stride(0), n_chunks,
                                     CHUNK=chunk, BLOCK=min(tab["BLOCK"], chunk), NT=tab["NT"],
                                     num_warps=tab["num_warps"], **pdl_launch(dev))
    chunks = triton.next_power_of_2(n_chunks)
    pre = table and tab["PRE"]
    pre_i = torch.empty(n, 5, dtype=torch.int32, device=dev) if pre else meta_i
    pre_f = torch.empty(n, 4, dtype=torch.float32, device=dev) if pre else meta_f
    if pre:
        _copy_kernel[(n, n_chunks)](probs, scratch, part_c, part_m, part_x, pre_i, pre_f, *params, v, probs.stride(0),
                                    n_chunks, CAP=cap, CHUNK=chunk, NT=tab["NT"], CHUNKS=chunks,
                                    num_warps=tab["num_warps"], **pdl_launch(dev))
    cfg = SELECT
    _select_kernel[(n,)](
        probs, meta_i, meta_f, scratch, part_c, part_m, part_x, pre_i, pre_f, *params, v, probs.stride(0), n_chunks,
        CAP=cap, BLOCK=cfg["BLOCK"], BLOCK_P=cfg["BLOCK_P"], NP=cfg["NP"], BLOCK_S=cfg["BLOCK_S"],
        NP_S=cfg["NP_S"], NT=tab["NT"], CHUNKS=chunks, TABLE=table, PRE=pre, num_warps=cfg["num_warps"],
        **pdl_launch(dev),
    )
    return meta_i, meta_f, pre_i if pre else None


def filtered_probs(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                   top_ps: torch.Tensor, min_ps: torch.Tensor, cap: int = CAP) -> torch.Tensor:
    """Same as `kiln.engine.sampler.filtered_probs` ([N, V] float32), without sorting.
    `cap`: scratch tokens per row (tests shrink it to exercise the whole-row search passes)."""
    return _filter(_softmax(logits, temperatures), top_ks, top_ps, min_ps, None, cap)


def sample(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
           min_ps: torch.Tensor, exponentials: torch.Tensor, cap: int = CAP, searches: bool = True) -> torch.Tensor:
    """`argmax(filtered_probs(...) / exponentials)` per row, [N] int64, fused: the filtered
    distribution is never written out. `exponentials` [N, V] float32 Exp(1) noise (clamped to the
    smallest normal float like the sampler does). `searches=False` is a hint from a caller that
    knows no row has top-k or top-p (only launches change, not the result)."""
    return _filter(_softmax(logits, temperatures), top_ks, top_ps, min_ps, exponentials.float(), cap, searches)


def sample_from_probs(probs: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """The exponential race alone: argmax(probs / max(e, tiny)) per row, [N] int64, first index on
    ties; equal to `(probs / e.clamp_min(tiny)).argmax(-1)`."""
    assert probs.dtype == exponentials.dtype == torch.float32 and exponentials.shape == probs.shape
    assert probs.stride(1) == 1 and exponentials.stride(1) == 1
    if probs.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=probs.device)
    return _apply(probs, None, None, exponentials)
