"""The kept-set search of `kiln.kernels.sampling`'s filter: device helpers shared by its
selection kernel (one program per row) and its chunked launches (`kiln.kernels.sampling_table`).

The algorithm is in `kiln.kernels.sampling`'s docstring ("How the kept set is found without
sorting"): a search over float32 bit patterns for the value at rank R - 1, each pass counting the
tokens >= NP pivots and their mass, the bracket [lo, hi) narrowed until hi = lo + 1, whole-row
passes while the bracket holds more than CAP tokens, then passes over a scratch copy of them.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row_filters(top_ks_ptr, top_ps_ptr, row, V):
    """Row `row`'s top-k (V when off: <= 0 or > V) and top-p, and whether either is on, which is
    what makes the row search its kept set (min-p alone is a plain threshold)."""
    k = tl.load(top_ks_ptr + row)
    k = tl.where((k <= 0) | (k > V), V, k).to(tl.int32)
    top_p = tl.load(top_ps_ptr + row)
    return k, top_p, (k < V) | (top_p < 1.0)


@triton.jit
def _bits(p):
    """float32 >= 0 -> int32 bit pattern, ordered like the values."""
    return p.to(tl.int32, bitcast=True)


@triton.jit
def _pivot_stats(ptr, n, piv, lo, hi, BLOCK: tl.constexpr, NP: tl.constexpr):
    """For each of the NP pivots (bit patterns): how many of ptr[0:n] are >= it, and their mass;
    plus the smallest and largest bit pattern inside the bracket [lo, hi). Accumulates [BLOCK, NP]
    partials elementwise and reduces once at the end (no barrier inside the loop)."""
    acc_c = tl.zeros([BLOCK, NP], dtype=tl.int32)
    acc_m = tl.zeros([BLOCK, NP], dtype=tl.float32)
    b_min = tl.full([BLOCK], 0x7FFFFFFF, dtype=tl.int32)
    b_max = tl.full([BLOCK], -1, dtype=tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < n
        p = tl.load(ptr + offs, mask=ok, other=0.0)
        b = tl.where(ok, _bits(p), -1)
        ge = b[:, None] >= piv[None, :]
        acc_c += ge.to(tl.int32)
        acc_m += tl.where(ge, p[:, None], 0.0)
        inside = (b >= lo) & (b < hi)
        b_min = tl.minimum(b_min, tl.where(inside, b, 0x7FFFFFFF))
        b_max = tl.maximum(b_max, tl.where(inside, b, -1))
    return tl.sum(acc_c, axis=0), tl.sum(acc_m, axis=0), tl.min(b_min, axis=0), tl.max(b_max, axis=0)


@triton.jit
def _pivots(lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, kk, thr, rm, TARGET: tl.constexpr, NP: tl.constexpr):
    """NP pivots inside (lo, hi).

    While the bracket spans many octaves (the first pass, from 0): octaves below hi (bit
    patterns are a log scale). After that, half of them evenly spaced (progress whatever the
    data), half clustered around an estimate of the crossing: P's clauses interpolated linearly
    in bit space between the stats at lo and hi, the cluster spanning about TARGET tokens if the
    tokens were spread evenly, so that one pass usually leaves a bracket of about TARGET tokens."""
    H = NP // 2
    i = tl.arange(0, NP)
    j = (i // 2).to(tl.float32)
    width = (hi - lo).to(tl.int64)
    w_f = width.to(tl.float32)
    n_b = tl.maximum((cnt_lo - cnt_hi).to(tl.float32), 1.0)
    # Crossing of each clause as a fraction of the bracket (-1 where it does not cross inside).
    f_k = tl.where((kk > cnt_hi) & (kk <= cnt_lo), (cnt_lo - kk).to(tl.float32) / n_b, -1.0)
    f_r = tl.where((rm > cnt_hi) & (rm <= cnt_lo), (cnt_lo - rm).to(tl.float32) / n_b, -1.0)
    m_b = mass_lo - mass_hi
    f_m = tl.where((thr > mass_hi) & (thr <= mass_lo) & (m_b > 0), (mass_lo - thr) / tl.maximum(m_b, 1e-30), -1.0)
    f = tl.maximum(tl.maximum(f_k, f_r), f_m)
    f = tl.where(f < 0.0, 0.5, f)
    d = TARGET / n_b
    guided = f + d * (j - (H - 1) / 2)
    even = (j + 1.0) / (H + 1)
    frac = tl.minimum(tl.maximum(tl.where(i % 2 == 0, even, guided), 0.0), 1.0)
    lin = lo + (frac * w_f).to(tl.int64)
    octaves = i.to(tl.int64) + 1 + (i.to(tl.int64) * i) // 4  # 1, 2, 4, 6, 9, 12, 16, 20, ...
    geo = (hi - 1) - (octaves << 23)
    piv = tl.where(width > (24 << 23), geo, lin)
    return piv.to(tl.int32)


@triton.jit
def _narrow(piv, cnt, mass, b_min, b_max, lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, kk, thr, rm):
    """Shrink [lo, hi) with the pivots' stats: P(u) = cnt >= 1 and (cnt >= kk or mass >= thr or
    cnt >= rm); lo takes the largest pivot where P holds, hi the smallest where it does not.
    Then tighten to the data: no token of the old bracket lies in [lo, b_min) or (b_max, hi), so
    P (and cnt, mass) is the same at b_min as at lo and at b_max + 1 as at hi."""
    valid = (piv > lo) & (piv < hi)
    pred = (cnt >= 1) & ((cnt >= kk) | (mass >= thr) | (cnt >= rm))
    yes = valid & pred
    no = valid & ~pred
    new_lo = tl.max(tl.where(yes, piv, lo), axis=0)
    at_lo = yes & (piv == new_lo)
    cnt_lo = tl.where(new_lo > lo, tl.max(tl.where(at_lo, cnt, 0), axis=0), cnt_lo)
    mass_lo = tl.where(new_lo > lo, tl.max(tl.where(at_lo, mass, 0.0), axis=0), mass_lo)
    new_hi = tl.min(tl.where(no, piv, hi), axis=0)
    at_hi = no & (piv == new_hi)
    cnt_hi = tl.where(new_hi < hi, tl.max(tl.where(at_hi, cnt, 0), axis=0), cnt_hi)
    mass_hi = tl.where(new_hi < hi, tl.max(tl.where(at_hi, mass, 0.0), axis=0), mass_hi)
    new_lo = tl.where((b_min > new_lo) & (b_min < new_hi), b_min, new_lo)
    new_hi = tl.where((b_max + 1 < new_hi) & (b_max >= new_lo), b_max + 1, new_hi)
    return new_lo, cnt_lo, mass_lo, new_hi, cnt_hi, mass_hi


@triton.jit
def _search(row_ptr, V, scratch_ptr, lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, kk, thr, rm,
            CAP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, NP: tl.constexpr,
            BLOCK_S: tl.constexpr, NP_S: tl.constexpr):
    """Narrow [lo, hi) (P(lo) true, P(hi) false, cnt/mass known at both ends) to hi = lo + 1.
    Whole-row passes while the bracket holds more than CAP tokens; then the bracket's tokens are
    copied to scratch once and the remaining passes read only them (tokens >= hi are counted by
    cnt_hi / mass_hi at the time of the copy)."""
    while (hi - lo > 1) & (cnt_lo - cnt_hi > CAP):
        piv = _pivots(lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, kk, thr, rm, CAP // 4, NP)
        cnt, mass, b_min, b_max = _pivot_stats(row_ptr, V, piv, lo, hi, BLOCK_P, NP)
        lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi = _narrow(piv, cnt, mass, b_min, b_max, lo, cnt_lo, mass_lo,
                                                           hi, cnt_hi, mass_hi, kk, thr, rm)
    if hi - lo > 1:
        n_c = tl.full([], 0, tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < V
            p = tl.load(row_ptr + offs, mask=ok, other=0.0)
            b = _bits(p)
            inside = ok & (b >= lo) & (b < hi)
            dst = n_c + tl.cumsum(inside.to(tl.int32), axis=0) - 1
            tl.store(scratch_ptr + dst, p, mask=inside)
            n_c += tl.sum(inside.to(tl.int32), axis=0)
        lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi = _search_scratch(
            scratch_ptr, n_c, cnt_hi, mass_hi, lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, kk, thr, rm, BLOCK_S, NP_S)
    return lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi


@triton.jit
def _search_scratch(scratch_ptr, n_c, base_c, base_m, lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, kk, thr, rm,
                    BLOCK_S: tl.constexpr, NP_S: tl.constexpr):
    """`_search`'s passes over the scratch: its n_c tokens are every token of [lo, hi) (and maybe
    some >= hi), and base_c / base_mass count the row's tokens >= hi that it does not hold."""
    while hi - lo > 1:
        piv = _pivots(lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, kk, thr, rm, 1, NP_S)
        cnt, mass, b_min, b_max = _pivot_stats(scratch_ptr, n_c, piv, lo, hi, BLOCK_S, NP_S)
        lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi = _narrow(piv, cnt + base_c, mass + base_m, b_min, b_max, lo,
                                                           cnt_lo, mass_lo, hi, cnt_hi, mass_hi, kk, thr, rm)
    return lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi
