"""Exact verification of sampled drafts in two launches: token-wise rejection sampling and block
verification (Sun et al.), with the emitted tokens laid out per round.

The reference is `kiln.engine.spec.verify` (`verify_tokenwise`, `verify_block`) followed by
`sampled_verify._emitted`: about thirty small torch launches per round batch (gathers, a cumprod,
a clamp, a cumsum over the vocabulary, a searchsorted, a flipped argmax, the emitted row's cat /
where / scatter), which on an H100 made a sampled MTP round's verification cost more GPU time than
its size warrants (docs/benchmarks.md, thirty-ninth pass). Here:

- `_partials_kernel`, grid (round, chunk of CHUNK tokens): each program finds the accepted count
  (token-wise: n = the leading run of u_i q_i(d_i) < p_i(d_i)) or the block weights
  w_i = min(1, w_{i-1} p_{i-1}(d_i) / q_{i-1}(d_i)), and sums over its chunk the residual
  max(0, w_i p_i - q_i) of the rows that may be sampled from (token-wise: row n alone; block:
  every row, row k being p_k, the bonus), and the chunk's mass of p_i (the fallback when a
  residual is all zero).
- `_sample_kernel`, one program per round: the block rule's h_i = r_i / (r_i + 1 - w_i) and
  tau = max{i : eta_i < h_i} from the chunk sums, then the inverse-CDF draw of the residual at the
  stopping row: the chunk where u * total falls from the chunk sums, then that chunk alone
  scanned; writes n, the next token y, and the round's emitted row d_1..d_n, y, 0...

Exactness: the accept decisions, the block weights and the residual values are the reference's
float32 operations (IEEE division, no fused multiply-add); the sums over the vocabulary are taken
in another order than torch's cumsum and sum, so a draw whose u * total lies within float rounding
of a token's CDF boundary (or an eta within rounding of h_i) may fall the other way. Only tokens of
positive residual weight can be drawn, as in the reference. `tests/kernels/test_spec_verify.py`
compares the two on random rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.launch import pdl_launch, wait_for_previous

CHUNK = 1024  # tokens per program of the partial sums: 49 per round at V = 49K (4.6 against 7.7 us at 4096, H100)
BLOCK = 1024


@triton.jit
def _num_accepted(p_row, q_row, d_row, ua_row, k, sp_i, sq_i, sd_i, sua_i, G: tl.constexpr):
    """Token-wise: the leading run of accepted drafts (u_i q_i(d_i) < p_i(d_i)), 0..k."""
    i = tl.arange(0, G)
    ok = i < k
    d = tl.load(d_row + i * sd_i, mask=ok, other=0)
    pd = tl.load(p_row + i * sp_i + d, mask=ok, other=0.0)
    qd = tl.load(q_row + i * sq_i + d, mask=ok, other=0.0)
    u = tl.load(ua_row + i * sua_i, mask=ok, other=1.0)
    rejected = ok & ~(u * qd < pd)
    return tl.min(tl.where(rejected, i, k), axis=0)


@triton.jit
def _next_weight(w, p_row, q_row, d_row, i, sp_i, sq_i, sd_i):
    """Block verification's w_{i+1} = min(1, w_i p_i(d_{i+1}) / q_i(d_{i+1})), with x / 0 = 1 and
    0 / 0 = 0 as in the reference."""
    d = tl.load(d_row + i * sd_i)
    num = w * tl.load(p_row + i * sp_i + d)
    den = tl.load(q_row + i * sq_i + d)
    ratio = tl.where(den > 0, tl.math.div_rn(num, tl.where(den > 0, den, 1.0)), tl.where(num > 0, 1.0, 0.0))
    return tl.minimum(ratio, 1.0)


@triton.jit
def _chunk_sums(p_i, q_i, has_q, w, start, V, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Over tokens [start, start + CHUNK): sum max(0, w p - q) (q = 0 without `has_q`) and sum p."""
    acc_r = tl.zeros([BLOCK], dtype=tl.float32)
    acc_p = tl.zeros([BLOCK], dtype=tl.float32)
    for sub in range(0, CHUNK, BLOCK):
        offs = start + sub + tl.arange(0, BLOCK)
        ok = offs < V
        p = tl.load(p_i + offs, mask=ok, other=0.0)
        q = tl.load(q_i + offs, mask=ok & has_q, other=0.0)
        acc_r += tl.maximum(w * p - q, 0.0)
        acc_p += p
    return tl.sum(acc_r, axis=0), tl.sum(acc_p, axis=0)


# The drafts', uniforms' and output's strides (scalar loads and stores) differ between the host
# path and the device round and with the batch size (a drafts column of stride 1 at batch 1): each
# specialisation Triton would key on them is one more compile, met in the first rounds of a
# sampled batch of a new size (~0.3 s at batch 8, forty-fourth pass). p's and q's strides, which
# the vectorised scans over the vocabulary use, stay specialised.
_SCALAR_ARGS = ["k", "sd_b", "sd_i", "sua_b", "sua_i"]


@triton.jit(do_not_specialize=_SCALAR_ARGS)
def _partials_kernel(p_ptr, q_ptr, d_ptr, ua_ptr, part_r_ptr, part_p_ptr, k, V, n_chunks,
                     sp_b, sp_i, sq_b, sq_i, sd_b, sd_i, sua_b, sua_i,
                     BLOCKWISE: tl.constexpr, G: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    """Program (round b, chunk c): the chunk's residual and p sums of the rows the draw may use,
    into part_r / part_p [B, k + 1, n_chunks]."""
    wait_for_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    p_row, q_row = p_ptr + b * sp_b, q_ptr + b * sq_b
    d_row, ua_row = d_ptr + b * sd_b, ua_ptr + b * sua_b
    start = c * CHUNK
    base = b * (k + 1) * n_chunks + c
    if BLOCKWISE:
        w = tl.full([], 1.0, dtype=tl.float32)  # w_0
        for i in range(0, k + 1):
            # row k is the bonus: p_k itself (weight 1, no q)
            r, m = _chunk_sums(p_row + i * sp_i, q_row + i * sq_i, i < k, tl.where(i < k, w, 1.0), start, V,
                               CHUNK, BLOCK)
            tl.store(part_r_ptr + base + i * n_chunks, r)
            tl.store(part_p_ptr + base + i * n_chunks, m)
            if i < k:
                w = _next_weight(w, p_row, q_row, d_row, i, sp_i, sq_i, sd_i)
    else:
        n = _num_accepted(p_row, q_row, d_row, ua_row, k, sp_i, sq_i, sd_i, sua_i, G)
        r, m = _chunk_sums(p_row + n * sp_i, q_row + n * sq_i, n < k, 1.0, start, V, CHUNK, BLOCK)
        tl.store(part_r_ptr + base + n * n_chunks, r)
        tl.store(part_p_ptr + base + n * n_chunks, m)


@triton.jit(do_not_specialize=_SCALAR_ARGS + ["sur_b", "so_b"])
def _sample_kernel(p_ptr, q_ptr, d_ptr, ua_ptr, ur_ptr, part_r_ptr, part_p_ptr, n_ptr, y_ptr, out_ptr,
                   k, V, n_chunks, sp_b, sp_i, sq_b, sq_i, sd_b, sd_i, sua_b, sua_i, sur_b, so_b,
                   BLOCKWISE: tl.constexpr, G: tl.constexpr, G1: tl.constexpr, CP2: tl.constexpr,
                   CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (round b): the stopping row t and its weight, then the inverse-CDF draw from the
    residual at t (from p_t when that residual is all zero); writes n, y and the emitted row."""
    wait_for_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    p_row, q_row = p_ptr + b * sp_b, q_ptr + b * sq_b
    d_row, ua_row = d_ptr + b * sd_b, ua_ptr + b * sua_b
    chunks = tl.arange(0, CP2)
    c_ok = chunks < n_chunks
    base = b * (k + 1) * n_chunks
    if BLOCKWISE:
        w = tl.full([], 1.0, dtype=tl.float32)
        w_t = tl.full([], 1.0, dtype=tl.float32)
        t = tl.full([], 0, dtype=tl.int32)
        for i in range(0, k):
            w = _next_weight(w, p_row, q_row, d_row, i, sp_i, sq_i, sd_i)  # w_{i+1}
            h = w  # h_k = w_k
            if i + 1 < k:
                r = tl.sum(tl.load(part_r_ptr + base + (i + 1) * n_chunks + chunks, mask=c_ok, other=0.0), axis=0)
                hden = (r + 1.0) - w
                h = tl.where(hden > 0, tl.math.div_rn(r, tl.where(hden > 0, hden, 1.0)), 0.0)
            hit = tl.load(ua_row + i * sua_i) < h
            t = tl.where(hit, i + 1, t)
            w_t = tl.where(hit, w, w_t)
        w_t = tl.where(t == k, 1.0, w_t)
    else:
        t = _num_accepted(p_row, q_row, d_row, ua_row, k, sp_i, sq_i, sd_i, sua_i, G)
        w_t = tl.full([], 1.0, dtype=tl.float32)

    part = tl.load(part_r_ptr + base + t * n_chunks + chunks, mask=c_ok, other=0.0)
    use_p = tl.sum(part, axis=0) <= 0  # an all-zero residual: draw from p_t
    part = tl.where(use_p, tl.load(part_p_ptr + base + t * n_chunks + chunks, mask=c_ok, other=0.0), part)
    target = tl.load(ur_ptr + b * sur_b) * tl.sum(part, axis=0)
    # the chunk where the CDF passes the target (one holding positive weight), else the last such
    incl = tl.cumsum(part, axis=0)
    c_star = tl.min(tl.where((incl > target) & (part > 0) & c_ok, chunks, CP2), axis=0)
    c_last = tl.max(tl.where((part > 0) & c_ok, chunks, -1), axis=0)
    c_star = tl.where(c_star < CP2, c_star, c_last)
    carry = tl.sum(tl.where(chunks < c_star, part, 0.0), axis=0)
    p_t, q_t = p_row + t * sp_i, q_row + t * sq_i
    has_q = (t < k) & ~use_p
    found = tl.full([], 2147483647, dtype=tl.int32)
    last = tl.full([], -1, dtype=tl.int32)
    for sub in range(0, CHUNK, BLOCK):
        offs = c_star * CHUNK + sub + tl.arange(0, BLOCK)
        ok = offs < V
        p = tl.load(p_t + offs, mask=ok, other=0.0)
        q = tl.load(q_t + offs, mask=ok & has_q, other=0.0)
        r = tl.where(ok, tl.where(use_p, p, tl.maximum(w_t * p - q, 0.0)), 0.0)
        cdf = carry + tl.cumsum(r, axis=0)
        found = tl.minimum(found, tl.min(tl.where((cdf > target) & (r > 0), offs, 2147483647), axis=0))
        last = tl.maximum(last, tl.max(tl.where(r > 0, offs, -1), axis=0))
        carry += tl.sum(r, axis=0)
    y = tl.where(found < 2147483647, found, last).to(tl.int64)

    j = tl.arange(0, G1)
    d = tl.load(d_row + j * sd_i, mask=j < k, other=0)
    emitted = tl.where(j < t, d, tl.where(j == t, y, 0))
    tl.store(out_ptr + b * so_b + j, emitted, mask=j <= k)
    tl.store(n_ptr + b, t.to(tl.int64))
    tl.store(y_ptr + b, y)


def verify(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, uniforms: torch.Tensor,
           residual_uniform: torch.Tensor, block: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`verify_block` (block True) or `verify_tokenwise` of `kiln.engine.spec.verify` for rounds of
    k drafts: p [B, k + 1, V] and q [B, k, V] float32 (last dimension contiguous), drafts [B, k],
    uniforms [B, k] and residual_uniform [B] float32. Returns (num_accepted [B], next_token [B],
    emitted [B, k + 1]: d_1..d_n, y, then 0), int64, without a host sync."""
    B, k1, V = p.shape
    k = k1 - 1
    assert q.shape == (B, k, V) and drafts.shape == (B, k), (p.shape, q.shape, drafts.shape)
    assert p.dtype == q.dtype == uniforms.dtype == residual_uniform.dtype == torch.float32
    assert p.stride(2) == 1 and (k == 0 or q.stride(2) == 1)
    dev = p.device
    n = torch.empty(B, dtype=torch.int64, device=dev)
    y = torch.empty(B, dtype=torch.int64, device=dev)
    out = torch.empty(B, k + 1, dtype=torch.int64, device=dev)
    if B == 0:
        return n, y, out
    if k == 0:  # nothing to read from q, the drafts or the acceptance uniforms: any valid pointers
        q, drafts, uniforms = p, n.view(B, 1), p.view(B, -1)
    chunk = min(CHUNK, triton.next_power_of_2(V))
    blk = min(BLOCK, chunk)
    n_chunks = triton.cdiv(V, chunk)
    part_r = torch.empty(B, k + 1, n_chunks, dtype=torch.float32, device=dev)
    part_p = torch.empty_like(part_r)
    g = triton.next_power_of_2(max(k, 1))
    # No fused multiply-add: both kernels must compute the same residual values (the draw's chunk
    # holds positive weight in the second one because it did in the first), as the reference's
    # separate multiply and subtract do.
    strides = (p.stride(0), p.stride(1), q.stride(0), q.stride(1), drafts.stride(0), drafts.stride(1),
               uniforms.stride(0), uniforms.stride(1))
    common = dict(BLOCKWISE=block, G=g, CHUNK=chunk, BLOCK=blk, enable_fp_fusion=False)
    _partials_kernel[(B, n_chunks)](p, q, drafts, uniforms, part_r, part_p, k, V, n_chunks, *strides,
                                    num_warps=4, **common, **pdl_launch(dev))
    _sample_kernel[(B,)](p, q, drafts, uniforms, residual_uniform, part_r, part_p, n, y, out, k, V, n_chunks,
                         *strides, residual_uniform.stride(0), out.stride(0),
                         G1=triton.next_power_of_2(k + 1), CP2=triton.next_power_of_2(n_chunks),
                         num_warps=4, **common, **pdl_launch(dev))
    return n, y, out
