"""Triton paged decode attention (flash-decoding): one new query per sequence.

Same arguments and result as `kiln.ops.attention.paged_decode_attention`, plus `max_len`, a host
bound on the context that only sizes the grid. Each program handles one (sequence, KV head,
split) and all G query heads sharing that KV head, so every K/V byte is read once per step and
the G x BLOCK_N scores come from one `tl.dot` (G padded to 16 rows, the smallest MMA tile).
Splits partition each sequence's visible keys (the whole context, or the last W keys with a
sliding window) into num_splits chunks of equal length (the last one may be shorter), a multiple
of the key block and at least `min_split_keys`; the grid is sized for the longest context the
caller allows, so a short sequence uses only its first few splits. The per-split partial results
are merged by their log-sum-exp. With one split the first kernel writes the output directly.

The merge runs either as a second kernel or, given `split_counters` (a zeroed int32 buffer the
caller keeps), inside the first: each (sequence, KV head) counts its finished splits with an
atomic, and the program that finishes last merges that head group's partials and resets its
counter to zero for the next call. At batch-1 decode the merge kernel was a launch of its own per
layer, bound by latency (docs/benchmarks.md). Calls sharing one counter buffer must not run
concurrently (one stream: each call's programs wait for the previous kernel to complete).

With `early_kv` (a plain decode step) each program loads its lengths, page-table entries and
first block of keys before its PDL wait, overlapping the kernel that writes q and the new K/V;
the new token's row is read after the wait (`kiln.kernels.launch`).

Graph capture: the grid depends only on shapes and host ints (B, Hkv, `max_len`), never on
tensor values; each program derives its key range from `seq_lens` on the device, and splits
past a sequence's end exit at once. Warm the kernel up once before capturing (Triton compiles
and loads it on the first call).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from kiln.kernels import assert_rows
from kiln.kernels.conv_qk_norm import AttentionPrologue, _new_key_value, _new_key_value_history, _normed_query_heads
from kiln.kernels.decode_splits import _merge_heads, _merge_kernel, _split_len, merge_tile
from kiln.kernels.launch import pdl_launch, wait_for_previous
from kiln.ops.attention import RelProjection


LOG2E = 1.4426950408889634


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA device, which the split counts aim to fill; 4 off CUDA (the interpreter),
    so that CPU tests still split a little."""
    if device.type != "cuda":
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def head_dim_block(d: int) -> int:
    """The padded head dim the kernels work on; D itself must be in [16, 256]."""
    assert 16 <= d <= 256, (
        f"Triton attention supports head dims 16..256, got {d}; use the reference ops in "
        "kiln.ops.attention for this model")
    return triton.next_power_of_2(d)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 caches (CPU-parity tests, fp32 models) must not silently drop to TF32 on the GPU.
    return "ieee" if dtype == torch.float32 else "tf32"


# Launch shape, tuned on an H200 (benchmarks/kernel_bench/attention.py); module attributes so that a
# sweep can override them. Splits aim at MIN_PROGRAMS_PER_SM (sequence, kv head, split) programs
# per SM, more (up to MAX_PROGRAMS_PER_SM) while each split keeps SPLIT_KEYS keys: short
# programs spend a larger share on their start (three dependent loads before the first key).
MIN_PROGRAMS_PER_SM = 4
MAX_PROGRAMS_PER_SM = 8
SPLIT_KEYS = 512
# At most 32 splits: the engine sizes the grid for its longest context, which at batch 1 would ask
# for 128, and the last program of each head group then merges 128 partials (8B shape at 8K: 31 us
# per call at 128 splits, 21 at 32 in the kernel benchmark, but only 20.2 -> 19.6 us inside the
# engine's step; docs/benchmarks.md, thirteenth pass).
MAX_SPLITS = 32
# Keys per split at least (0: one key block). Longer minimum splits were slower at batch 1 on an
# H200 (1K context: 8.7 us at one block against 10.0 at 128 keys and 14.1 at 256; docs/benchmarks.md,
# thirteenth pass): a split's keys are a chain of dependent block loads, and fewer programs
# overlap fewer of them. Kept as a knob for other GPUs and head dims.
MIN_SPLIT_KEYS = 0


def decode_config(block_d: int, device: torch.device) -> dict:
    """Keys per loop step, warps and pipeline stages of the decode kernel."""
    if device.type != "cuda":  # the interpreter: small blocks so tiny tests span several
        return dict(block_n=16, num_warps=4, num_stages=1)
    return dict(block_n=64 if block_d <= 128 else 32, num_warps=4, num_stages=3)


def pick_num_splits(batch: int, kv_heads: int, max_keys: int, device: torch.device,
                    min_split_keys: int = 0) -> int:
    """How many chunks each sequence's keys are split into (see MIN_PROGRAMS_PER_SM); never more
    than `max_keys` fills at `min_split_keys` keys a split (the kernel's least split length)."""
    sms = sm_count(device)
    programs = max(1, batch * kv_heads)
    low = triton.cdiv(MIN_PROGRAMS_PER_SM * sms, programs)
    high = triton.cdiv(MAX_PROGRAMS_PER_SM * sms, programs)
    splits = min(high, max(low, triton.cdiv(max_keys, SPLIT_KEYS)))
    # Never more splits than BLOCK_N-key blocks (64 keys at least per split) or minimum splits.
    return max(1, min(splits, triton.cdiv(max(max_keys, 1), max(64, min_split_keys)), MAX_SPLITS))


@triton.jit
def _projected_bias(rel_r, RelW, stride_rw, lam, query_pos, pos, n_mask, offs_r, r_mask,
                    DOT_PRECISION: tl.constexpr):
    """[BLOCK_G, BLOCK_N] bias of `kiln.ops.attention.RelProjection`: each head's r [BLOCK_G,
    BLOCK_R] against the row of P at each key's distance, rounded to P's dtype as the projection's
    output is, then times lam (fp32)."""
    w = tl.load(RelW + (query_pos - pos)[:, None] * stride_rw + offs_r[None, :],
                mask=n_mask[:, None] & r_mask[None, :], other=0.0)
    bias = tl.dot(rel_r, tl.trans(w), input_precision=DOT_PRECISION)
    return bias.to(RelW.dtype.element_ty).to(tl.float32) * lam


@triton.jit
def _load_keys(n0, end, token_row, k_base, v_base, stride_ks, stride_vs, d_mask, query_pos, key_gap,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_GAP: tl.constexpr, SKIP_QUERY: tl.constexpr):
    """K and V [BLOCK_N, BLOCK_D] of keys n0 .. min(n0 + BLOCK_N, end) - 1, their slots, positions
    and mask. HAS_GAP (MTP layers): keys at distances 1 .. key_gap - 1 are hidden. SKIP_QUERY: the
    query's own row (position query_pos) is not read and stays zero (`_decode_kernel`'s EARLY_KV
    reads it after the wait)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    pos = n0 + offs_n
    n_mask = pos < end
    slots = tl.load(token_row + pos, mask=n_mask, other=0).to(tl.int64)
    if HAS_GAP:
        dist = query_pos - pos
        n_mask = n_mask & ((dist == 0) | (dist >= key_gap))
    kv_mask = n_mask[:, None] & d_mask[None, :]
    if SKIP_QUERY:
        kv_mask = kv_mask & (pos != query_pos)[:, None]
    k = tl.load(k_base + slots[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
    # V's load is issued with K's, not after the scores. The pipelined loop (num_stages > 1) turns
    # both into asynchronous copies anyway; unpipelined, this saves a memory round trip per block.
    v = tl.load(v_base + slots[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
    return k, v, slots, pos, n_mask


@triton.jit
def _attend_keys(q, n0, end, m_i, l_i, acc, token_row, k_base, v_base, stride_ks, stride_vs,
                 scale_log2, rel_row, g_mask, d_mask, query_pos, key_gap, rel_r, RelW, stride_rw, lam,
                 offs_r, r_mask, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, APPLY_REL: tl.constexpr, HAS_GAP: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, REL_PROJ: tl.constexpr):
    """Online-softmax update with keys n0 .. min(n0 + BLOCK_N, end) - 1 (at least one): loaded
    (`_load_keys`), then `_attend_block`."""
    k, v, slots, pos, n_mask = _load_keys(n0, end, token_row, k_base, v_base, stride_ks, stride_vs, d_mask,
                                          query_pos, key_gap, BLOCK_N, BLOCK_D, HAS_GAP, False)
    return _attend_block(q, k, v, pos, n_mask, m_i, l_i, acc, scale_log2, rel_row, g_mask, query_pos, rel_r,
                         RelW, stride_rw, lam, offs_r, r_mask, APPLY_REL, HAS_GAP, DOT_PRECISION, REL_PROJ)


@triton.jit
def _attend_block(q, k, v, pos, n_mask, m_i, l_i, acc, scale_log2, rel_row, g_mask, query_pos, rel_r, RelW,
                  stride_rw, lam, offs_r, r_mask, APPLY_REL: tl.constexpr, HAS_GAP: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, REL_PROJ: tl.constexpr):
    """Online-softmax update with one loaded block of keys (`_load_keys`). rel_row points at each
    head's bias for distance 0 shifted by the query position: rel_row - pos; with REL_PROJ the
    bias is computed from rel_r and P instead (`_projected_bias`)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if APPLY_REL:
        if REL_PROJ:
            bias = _projected_bias(rel_r, RelW, stride_rw, lam, query_pos, pos, n_mask, offs_r, r_mask,
                                   DOT_PRECISION)
        else:
            bias = tl.load(rel_row - pos[None, :], mask=g_mask[:, None] & n_mask[None, :], other=0.0)
        s += bias.to(tl.float32) * 1.4426950408889634
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if HAS_GAP:  # a block may hide all its keys: keep the max finite so that exp2 gives 0, not NaN
        m_new = tl.where(m_new == float("-inf"), -1e30, m_new)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_new_key(q, k, v, m_i, l_i, acc, scale_log2, rel_0, g_mask, rel_r, RelW, lam, offs_r, r_mask,
                    HAS_REL: tl.constexpr, REL_PROJ: tl.constexpr):
    """Online-softmax update with the query's own key (distance 0), k and v [1, BLOCK_D] as the
    cache holds them: `_attend_block` for one key (p rounded to v's dtype before it weights v, as
    the block's dot takes it). rel_0 points at each head's bias for distance 0."""
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32), axis=1) * scale_log2
    if HAS_REL:
        if REL_PROJ:  # the row of P at distance 0, as `_projected_bias`
            w0 = tl.load(RelW + offs_r, mask=r_mask, other=0.0)
            bias = tl.sum(rel_r.to(tl.float32) * w0.to(tl.float32)[None, :], axis=1)
            bias = bias.to(RelW.dtype.element_ty).to(tl.float32) * lam
        else:
            bias = tl.sum(tl.load(rel_0, mask=g_mask[:, None], other=0.0).to(tl.float32), axis=1)
        s += bias * 1.4426950408889634
    m_new = tl.maximum(m_i, s)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p.to(v.dtype).to(tl.float32)[:, None] * v.to(tl.float32)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(
    Q, K, V, Out, MidO, MidLse, ReqToToken, ReqSlots, SeqLens, Rel, Counters, RelW, Lam,
    KRaw, VRaw, QNormW, KNormW, KConvW, VConvW, KBuf, VBuf, ConvTable, Positions, ConvLocs, QLam,
    scale_log2, window, rel_len, num_splits, key_gap, key_offset, len_offset, rel_dim, q_eps, k_eps,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ob, stride_oh,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_rt, stride_relb, stride_relh, stride_rw,
    stride_kraw, stride_vraw, stride_kcw, stride_vcw, stride_kbuf, stride_vbuf, stride_ct,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_REL: tl.constexpr, HAS_GAP: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
    MERGE_HERE: tl.constexpr, MIN_SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, SPLIT_TILE: tl.constexpr,
    REL_PROJ: tl.constexpr = False,
    HAS_LAM: tl.constexpr = False, BLOCK_R: tl.constexpr = 16, EARLY_KV: tl.constexpr = False,
    PROLOGUE: tl.constexpr = False, CONV_K: tl.constexpr = 4, HAS_QLAM: tl.constexpr = False,
):
    """EARLY_KV: `decode_attention`'s early_kv (the first block of keys read before the PDL wait).
    PROLOGUE: its `prologue` (Q holds the raw q; the new token's K/V are not in the cache yet)."""
    if not EARLY_KV:
        wait_for_previous(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b).to(tl.int32) + len_offset
    lo, per_split, n_splits = _split_len(seq_len, window, num_splits, HAS_WINDOW, BLOCK_N, MIN_SPLIT)
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    key_end = end  # the keys this program reads from the cache
    if PROLOGUE:  # not the new token's: the program holding it makes it (below)
        key_end = tl.minimum(end, seq_len - 1)
        owner = (end == seq_len) & (start < end)
        # its convs' older taps: with EARLY_KV still before the wait (the host's and earlier steps' writes)
        hist_k, hist_v = _new_key_value_history(KConvW, VConvW, stride_kcw, stride_vcw, KBuf, VBuf, stride_kbuf,
                                                stride_vbuf, ConvTable, stride_ct, ReqSlots, Positions, b, kvh,
                                                offs_d, d_mask & owner, HEAD_DIM, CONV_K)
    if SPLIT:
        if start >= end:  # past this sequence's keys (the merge skips this split)
            if EARLY_KV:  # every program waits (kiln.kernels.launch), and nothing is written before
                wait_for_previous(PDL)
            if MERGE_HERE and split == 0:  # no keys at all (graph padding): zeros, as the merge kernel
                tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                         tl.zeros([BLOCK_G, BLOCK_D], tl.float32).to(Out.dtype.element_ty),
                         mask=g_mask[:, None] & d_mask[None, :])
            return
    # key_offset: where entries are stored (position + offset, the MTP layers' convention)
    token_row = ReqToToken + tl.load(ReqSlots + b).to(tl.int64) * stride_rt + key_offset
    k_base = K + kvh * stride_kh
    v_base = V + kvh * stride_vh
    query_pos = seq_len - 1
    # Keys at distance >= R get no bias: only the last R keys (a tail of the range) pay for
    # loading it, in a second loop.
    rel_start = key_end
    if HAS_REL:
        rel_start = tl.minimum(tl.maximum(seq_len - rel_len, start), key_end)
    if EARLY_KV:  # the first block: in the first loop's range, or the second's when that starts here
        peel_rel = start >= rel_start
        peel_end = tl.minimum(start + BLOCK_N, tl.where(peel_rel, key_end, rel_start))
        k0, v0, slots0, pos0, n_mask0 = _load_keys(start, peel_end, token_row, k_base, v_base, stride_ks,
                                                   stride_vs, d_mask, query_pos, key_gap, BLOCK_N, BLOCK_D,
                                                   HAS_GAP, True)
        wait_for_previous(PDL)
    if PROLOGUE:
        q = _normed_query_heads(Q, b, stride_qb, stride_qh, heads, g_mask, offs_d, d_mask, QNormW, q_eps, QLam,
                                HEAD_DIM, HAS_QLAM)
    else:
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(K.dtype.element_ty)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    rel_row = Rel + b * stride_relb + heads[:, None] * stride_relh + query_pos
    # REL_PROJ: Rel holds r [B, Hq, d_r] (its strides in stride_relb / stride_relh), RelW P [R, d_r]
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rel_dim
    rel_r = tl.zeros([BLOCK_G, BLOCK_R], K.dtype.element_ty)
    lam = 1.0
    if REL_PROJ:
        rel_r = tl.load(Rel + b * stride_relb + heads[:, None] * stride_relh + offs_r[None, :],
                        mask=g_mask[:, None] & r_mask[None, :], other=0.0).to(RelW.dtype.element_ty)
        if HAS_LAM:
            lam = tl.load(Lam + b)
    first, first_rel = start, rel_start  # where the two loops start
    if EARLY_KV:
        if not PROLOGUE:
            cur = ((pos0 == query_pos) & n_mask0)[:, None] & d_mask[None, :]  # the query's K/V: the previous kernel's
            k0 = tl.where(cur, tl.load(k_base + slots0[:, None] * stride_ks + offs_d[None, :], mask=cur, other=0.0),
                          k0)
            v0 = tl.where(cur, tl.load(v_base + slots0[:, None] * stride_vs + offs_d[None, :], mask=cur, other=0.0),
                          v0)
        apply_rel = False
        if HAS_REL:
            apply_rel = peel_rel
        if start < key_end:  # (a sequence of length 0 has no keys: the loops would not run either)
            if apply_rel:
                m_i, l_i, acc = _attend_block(q, k0, v0, pos0, n_mask0, m_i, l_i, acc, scale_log2, rel_row, g_mask,
                                              query_pos, rel_r, RelW, stride_rw, lam, offs_r, r_mask, HAS_REL,
                                              HAS_GAP, DOT_PRECISION, REL_PROJ)
            else:
                m_i, l_i, acc = _attend_block(q, k0, v0, pos0, n_mask0, m_i, l_i, acc, scale_log2, rel_row, g_mask,
                                              query_pos, rel_r, RelW, stride_rw, lam, offs_r, r_mask, False,
                                              HAS_GAP, DOT_PRECISION, REL_PROJ)
        first = start + BLOCK_N
        first_rel = tl.where(peel_rel, start + BLOCK_N, rel_start)
    for n0 in range(first, rel_start, BLOCK_N):
        m_i, l_i, acc = _attend_keys(q, n0, rel_start, m_i, l_i, acc, token_row, k_base, v_base,
                                     stride_ks, stride_vs, scale_log2, rel_row, g_mask, d_mask, query_pos,
                                     key_gap, rel_r, RelW, stride_rw, lam, offs_r, r_mask,
                                     BLOCK_N, BLOCK_D, False, HAS_GAP, DOT_PRECISION, REL_PROJ)
    if HAS_REL:
        for n0 in range(first_rel, key_end, BLOCK_N):
            m_i, l_i, acc = _attend_keys(q, n0, key_end, m_i, l_i, acc, token_row, k_base, v_base,
                                         stride_ks, stride_vs, scale_log2, rel_row, g_mask, d_mask, query_pos,
                                         key_gap, rel_r, RelW, stride_rw, lam, offs_r, r_mask,
                                         BLOCK_N, BLOCK_D, True, HAS_GAP, DOT_PRECISION, REL_PROJ)
    if PROLOGUE:
        if owner:  # this program holds the new token: k', v' from the raw k, v
            k_new, v_new = _new_key_value(hist_k, hist_v, KRaw, VRaw, b, stride_kraw, stride_vraw, kvh, offs_d, d_mask,
                                          HEAD_DIM, KConvW, VConvW, stride_kcw, stride_vcw, KBuf, VBuf, stride_kbuf,
                                          stride_vbuf, ConvLocs, KNormW, k_eps, CONV_K)
            k_new = k_new.to(K.dtype.element_ty)
            v_new = v_new.to(V.dtype.element_ty)
            slot = tl.load(token_row + query_pos).to(tl.int64)
            tl.store(k_base + slot * stride_ks + offs_d[None, :], k_new, mask=d_mask[None, :])
            tl.store(v_base + slot * stride_vs + offs_d[None, :], v_new, mask=d_mask[None, :])
            m_i, l_i, acc = _attend_new_key(q, k_new, v_new, m_i, l_i, acc, scale_log2, rel_row - query_pos, g_mask,
                                            rel_r, RelW, lam, offs_r, r_mask, HAS_REL, REL_PROJ)

    out_mask = g_mask[:, None] & d_mask[None, :]
    if not SPLIT:
        # l_i is 0 only for an empty sequence (seq_len 0): write zeros.
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 acc.to(Out.dtype.element_ty), mask=out_mask)
    else:
        acc = acc / l_i[:, None]
        tl.store(MidO + b * stride_mb + heads[:, None] * stride_mh + split * stride_ms + offs_d[None, :],
                 acc, mask=out_mask)
        tl.store(MidLse + b * stride_lb + heads * stride_lh + split, m_i + tl.log2(l_i), mask=g_mask)
        if MERGE_HERE:
            counter = Counters + b * tl.num_programs(1) + kvh
            # Every warp's partials are written before the release; the last arrival acquires them.
            tl.debug_barrier()
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == n_splits - 1:
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
                _merge_heads(Out, MidO, MidLse, b, kvh * GROUP, GROUP, n_splits,
                             stride_ob, stride_oh, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                             HEAD_DIM, BLOCK_D, BLOCK_H, SPLIT_TILE)



def _prologue_args(prologue: Optional[AttentionPrologue], q: torch.Tensor, bsz: int, hkv: int, d: int) -> dict:
    """`_decode_kernel`'s PROLOGUE arguments: the prologue's tensors, eps and strides, or stand-ins
    (q, never read) without one."""
    if prologue is None:
        return dict(tensors=[q] * 12, eps=(0.0, 0.0), strides=[0] * 7, conv_k=4, has_lam=False)
    p = prologue
    p.check(bsz, hkv, d)
    return dict(tensors=[p.k, p.v, p.q_norm_w, p.k_norm_w, p.k_conv_w, p.v_conv_w, p.k_buf, p.v_buf, p.conv_table,
                         p.positions, p.out_locs, p.q_scale if p.q_scale is not None else q],
                eps=(float(p.q_eps), float(p.k_eps)),
                strides=[p.k.stride(0), p.v.stride(0), p.k_conv_w.stride(0), p.v_conv_w.stride(0), p.k_buf.stride(0),
                         p.v_buf.stride(0), p.conv_table.stride(0)],
                conv_k=p.k_conv_w.shape[1], has_lam=p.q_scale is not None)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     req_to_token: torch.Tensor, req_slots: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, sliding_window: Optional[int] = None,
                     rel: Optional[torch.Tensor] = None, max_len: Optional[int] = None,
                     num_splits: Optional[int] = None, key_gap: int = 0, key_offset: int = 0,
                     split_counters: Optional[torch.Tensor] = None,
                     min_split_keys: Optional[int] = None, early_kv: bool = False,
                     prologue: Optional[AttentionPrologue] = None, len_offset: int = 0) -> torch.Tensor:
    """Attention of one new token per sequence over its paged K/V; [B, Hq, D] in q's dtype.

    Same semantics as `kiln.ops.attention.paged_decode_attention`: q [B, Hq, D] is the token at
    position seq_len - 1 whose K/V are already in k_cache/v_cache [num_slots, Hkv, D];
    req_to_token [rows, max_context] (int32/int64) maps (req_slots[b], position) to a cache slot;
    seq_lens [B] int64; optional sliding window W (keys with seq_len - 1 - j < W) and rel
    [B, Hq, R] bias added to the scaled logit at distance seq_len - 1 - j < R; rel may also be a
    `RelProjection` (r [B, Hq, d_r], P [R, d_r], lam [B]), whose bias the kernel computes per key.

    max_len: host bound on seq_lens used only to size the grid (default req_to_token.shape[1]);
    results do not depend on it. num_splits overrides the split count and min_split_keys the
    least keys per split (default `MIN_SPLIT_KEYS`; rounded up to a multiple of the key block,
    64 keys or 32 at D > 128, and at least one block); neither changes the result or the grid
    (splits past a sequence's keys exit at once): tests and tuning. A
    sequence of length 0 yields zeros. No host sync: safe inside a CUDA graph after a warm-up.
    MTP layers: `key_gap` hides keys at distances 1 .. gap - 1 and keys are read at
    req_to_token[slot, position + key_offset] (as `kiln.ops.attention.paged_attention`).
    split_counters: an int32 buffer of zeros with at least B * Hkv entries, owned by the caller
    and left zeroed by every call: the splits are then merged inside the attention kernel (one
    launch, see the module docstring). Too small or None: a second kernel merges.
    early_kv: the caller promises that seq_lens, req_slots, req_to_token and every key but each
    query's own (position seq_len - 1) were written before the kernel before this one started (a
    plain decode step: its metadata from the host, the older keys from earlier steps). Each
    program then reads its first block of keys before its PDL wait, overlapping that kernel (the
    one writing q and the new K/V); the result does not change by a bit. Not with key_gap.
    prologue (Inkling, a decode step): q is the raw projection (a [B, Hq, D] view of qkvr) and the
    new token's K/V are not in the cache yet. Every program norms its query heads (and scales
    them by lam), and the program whose keys end at the new token runs the k/v ShortConvs and
    k's norm for its KV head, writes the raw inputs into the conv buffers and k', v' into the
    cache, and attends to the new key from registers: `conv_qk_norm_store` and this function in
    one launch. Same result up to summation order (on a GPU the conv's products may also
    contract into FMAs, which `conv_qk_norm_store` is compiled without). Not with key_gap.
    len_offset: added to every seq_len on the device: a query per token (a verify's, an MTP pass's)
    passes its positions and 1, not a `positions + 1` tensor (one launch less per layer).
    """
    assert_rows(req_slots=req_slots, seq_lens=seq_lens)
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    assert not (early_kv and key_gap > 1), "early_kv reads keys before the wait: not for MTP layers (key_gap)"
    # a copy made here would be the kernel before this one, whose output early_kv reads before the wait
    assert not early_kv or all(t.stride(-1) == 1 for t in (k_cache, v_cache, req_to_token)), \
        "early_kv needs the caches and the table with a contiguous last dim (no copy before the kernel)"
    assert hq % hkv == 0, f"query heads {hq} not a multiple of KV heads {hkv}"
    assert v_cache.shape == k_cache.shape and k_cache.shape[2] == d
    assert prologue is None or (key_gap <= 1 and key_offset == 0), "the prologue is a main layer's (no key_gap)"
    block_d = head_dim_block(d)
    out = q.new_empty(b, hq, d)  # q may be a strided view (prologue)
    if b == 0:
        return out
    q, k_cache, v_cache = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_cache, v_cache))
    req_to_token = req_to_token if req_to_token.stride(-1) == 1 else req_to_token.contiguous()
    group = hq // hkv
    max_keys = req_to_token.shape[1] if max_len is None else max_len
    if sliding_window is not None:
        max_keys = min(max_keys, sliding_window)
    cfg = decode_config(block_d, q.device)
    block_n = cfg["block_n"]
    min_split = MIN_SPLIT_KEYS if min_split_keys is None else min_split_keys
    min_split = max(1, triton.cdiv(min_split, block_n)) * block_n
    if num_splits is None:
        num_splits = pick_num_splits(b, hkv, max_keys, q.device, min_split)
    block_h, split_tile = merge_tile(group, block_d, num_splits)
    proj = rel if isinstance(rel, RelProjection) else None
    if proj is not None:
        rel = proj.r
        assert proj.weight.stride(-1) == 1 and proj.weight.shape[1] == rel.shape[2]
        rel_len, rel_dim = proj.weight.shape
        lam = proj.lam if proj.lam is not None else seq_lens  # never read without a lam
    else:
        rel_len, rel_dim, lam = (rel.shape[2] if rel is not None else 0), 0, seq_lens
    if rel is not None:
        assert rel.shape[:2] == (b, hq), f"rel must be [B, Hq, R] (or r [B, Hq, d_r]), got {tuple(rel.shape)}"
        rel = rel if rel.stride(-1) == 1 else rel.contiguous()
    rel_arg = rel if rel is not None else q  # never read without HAS_REL
    rel_w = proj.weight if proj is not None else q  # never read without REL_PROJ
    if num_splits > 1:
        mid_o = torch.empty(b, hq, num_splits, d, device=q.device, dtype=torch.float32)
        mid_lse = torch.empty(b, hq, num_splits, device=q.device, dtype=torch.float32)
    else:
        mid_o = mid_lse = out.new_empty(1, 1, 1, 1, dtype=torch.float32)  # unused
    window = sliding_window if sliding_window is not None else 0
    merge_here = num_splits > 1 and split_counters is not None and split_counters.numel() >= b * hkv
    if merge_here:
        assert split_counters.dtype == torch.int32 and split_counters.device == q.device
    # never touched without MERGE_HERE; an int32 tensor either way, so that both compile to one variant
    counters = split_counters if merge_here else req_slots.new_empty(1, dtype=torch.int32)
    pro = _prologue_args(prologue, q, b, hkv, d)
    _decode_kernel[(b, hkv, num_splits)](
        q, k_cache, v_cache, out, mid_o, mid_lse, req_to_token, req_slots, seq_lens, rel_arg, counters,
        rel_w, lam, *pro["tensors"], scale * LOG2E, window, rel_len, num_splits, key_gap, key_offset, len_offset,
        rel_dim,
        *pro["eps"], q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        req_to_token.stride(0), rel_arg.stride(0), rel_arg.stride(1), rel_w.stride(0), *pro["strides"],
        PROLOGUE=prologue is not None, CONV_K=pro["conv_k"], HAS_QLAM=pro["has_lam"],
        REL_PROJ=proj is not None, HAS_LAM=proj is not None and proj.lam is not None,
        BLOCK_R=max(16, triton.next_power_of_2(rel_dim)), EARLY_KV=early_kv,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, BLOCK_D=block_d,
        BLOCK_N=block_n, SPLIT=num_splits > 1, HAS_WINDOW=sliding_window is not None,
        HAS_REL=rel is not None, HAS_GAP=key_gap > 1, DOT_PRECISION=dot_precision(k_cache.dtype),
        MERGE_HERE=merge_here, MIN_SPLIT=min_split, BLOCK_H=block_h, SPLIT_TILE=split_tile,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(q.device),
    )
    if num_splits > 1 and not merge_here:
        _merge_kernel[(b, hkv)](
            out, mid_o, mid_lse, seq_lens, len_offset, window, num_splits,
            out.stride(0), out.stride(1), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
            mid_lse.stride(0), mid_lse.stride(1),
            GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_N=block_n, MIN_SPLIT=min_split, BLOCK_H=block_h,
            SPLIT_TILE=split_tile, HAS_WINDOW=sliding_window is not None, num_warps=4, **pdl_launch(q.device),
        )
    return out
