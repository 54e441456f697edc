"""Triton prologue of MiniMax-M3's attention (MODELS.md 3.1): between the projections and MSA, in
one launch per layer.

Per token row t at position p (q, k, v split out of the qkv projection, qI and kI the indexer's):

    q_out  = RoPE(RMSNorm_q(q))            per head, the attention's table
    k'     = RoPE(RMSNorm_k(k))            -> k_cache[loc[t]]
    v      as is                           -> v_cache[loc[t]]
    qI_out = RoPE_I(qI)                    the indexer's table (its own when DI != D)
    kI'    = RoPE_I(kI)                    -> ki_cache[loc[t]]

Unfused that is five launches per layer (two norms, two RoPEs, the cache write), each bound by
its latency at small batches, not its bytes (the same reason as Inkling's `conv_qk_norm`).

Every value is rounded where the unfused path rounds it: the norm's output in the model's dtype
before RoPE reads it, RoPE's output in the model's dtype before a cache of another dtype gets it.
Compiled without FMA contraction (`enable_fp_fusion=False`), RoPE matches `kiln.kernels.rotary`
(and so the reference) bit for bit; the norms differ from `kiln.kernels.norm` only by the fp32
summation order (two half-row sums, for the rotate-half layout).

At decode it can also compute MSA's block scores (`scores=DecodeScores(...)`): selection reads
only the history blocks (before the query's own), whose index keys earlier steps wrote, so the
scores need this step's rotated qI alone, which each score program rotates for itself with the
rounding the qI programs store. The attention then selects from the scores itself
(`kiln.kernels.msa`): MiniMax-M3's whole attention in two launches.

Programs: one per (row, block of BLOCK_H heads) of q, then of k (with the same heads of v), then
of qI, then of kI, then (with scores) `msa_scores._score_programs` per (row, kv head), each
scoring every P-th history block as `msa_scores._decode_scores_kernel` does; 16 warps then, the
score kernel's. Positions and cache slots are read on the device and the grid depends only on
shapes: CUDA-graph capturable. Inference only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kiln.kernels import assert_rows
from kiln.kernels.launch import pdl_launch, wait_for_previous
from kiln.kernels.msa_scores import _num_blocks, _score_blocks, _score_programs, _scores_config
from kiln.kernels.rotary import _norm_rope_heads, _rotate


@triton.jit
def _prologue_scores(t, sp, pos, qi_ptr, kic_ptr, icos_ptr, isin_ptr, r2t_ptr, rslot_ptr, s_ptr, G,
                     stride_qit, stride_qih, stride_ics, stride_kics, stride_kich, s_r2t, s_sr, s_sg, sqrt_di,
                     num_blocks, select_blocks, score_programs, IHALF: tl.constexpr, BLOCK_DI: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, TILE_T: tl.constexpr):
    """Score program sp of decode row t: kv head sp % G, every (score_programs)-th history block
    from sp // G, its query qI' rotated here from the raw qI."""
    g = sp % G
    d = tl.arange(0, BLOCK_DI)
    d_ok = d < IHALF
    c = tl.load(icos_ptr + pos * stride_ics + d, mask=d_ok, other=0.0)
    s = tl.load(isin_ptr + pos * stride_ics + d, mask=d_ok, other=0.0)
    src = qi_ptr + t * stride_qit + g * stride_qih + d
    x1 = tl.load(src, mask=d_ok, other=0.0)
    x2 = tl.load(src + IHALF, mask=d_ok, other=0.0)
    r1, r2 = _rotate(x1.to(tl.float32), x2.to(tl.float32), c, s)
    # rounded as qI' is stored (`_norm_rope_heads`), so the scores equal those of the stored query
    q1 = r1.to(x1.dtype).to(tl.float32)
    q2 = r2.to(x1.dtype).to(tl.float32)
    rslot = tl.load(rslot_ptr + t).to(tl.int64)
    _score_blocks(q1, q2, kic_ptr, r2t_ptr, rslot, pos, s_ptr + t * s_sr + g * s_sg, g, stride_kics, stride_kich,
                  s_r2t, sqrt_di, num_blocks, select_blocks, sp // G, score_programs, IHALF, BLOCK_DI,
                  BLOCK_SIZE, TILE_T)


@triton.jit
def _msa_prologue_kernel(
    q_ptr, k_ptr, v_ptr, qi_ptr, ki_ptr, q_out_ptr, qi_out_ptr, kc_ptr, vc_ptr, kic_ptr,
    qn_w_ptr, kn_w_ptr, cos_ptr, sin_ptr, icos_ptr, isin_ptr, pos_ptr, loc_ptr, q_eps, k_eps,
    HQ, HK, G, NQB, NKB, NIB,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qit, stride_qih,
    stride_kit, stride_kih, stride_cs, stride_ics, stride_kcs, stride_kch, stride_vcs, stride_vch,
    stride_kics, stride_kich,
    r2t_ptr, rslot_ptr, s_ptr, s_r2t, s_sr, s_sg, sqrt_di, num_blocks, select_blocks, score_programs,
    HALF: tl.constexpr, IHALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DI: tl.constexpr,
    BLOCK_H: tl.constexpr, PDL: tl.constexpr, SCORES: tl.constexpr = False, BLOCK_SIZE: tl.constexpr = 1,
    TILE_T: tl.constexpr = 1,
):
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    if blk >= NQB + NKB + 2 * NIB:  # (the grid has such programs only with SCORES)
        # MSA's block scores of decode row t (`kiln.kernels.msa_scores`): only history blocks are
        # scored, whose index keys earlier steps wrote, so they need this launch's qI' alone,
        # which each program rotates for itself (as the qI branch does: the same rounding).
        if SCORES:
            _prologue_scores(t, blk - (NQB + NKB + 2 * NIB), pos, qi_ptr, kic_ptr, icos_ptr, isin_ptr, r2t_ptr,
                             rslot_ptr, s_ptr, G, stride_qit, stride_qih, stride_ics, stride_kics, stride_kich,
                             s_r2t, s_sr, s_sg, sqrt_di, num_blocks, select_blocks, score_programs, IHALF,
                             BLOCK_DI, BLOCK_SIZE, TILE_T)
    elif blk < NQB + NKB:  # the attention's heads: its table
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HALF
        c = tl.load(cos_ptr + pos * stride_cs + d, mask=d_ok, other=0.0)
        s = tl.load(sin_ptr + pos * stride_cs + d, mask=d_ok, other=0.0)
        if blk < NQB:
            _norm_rope_heads(q_ptr + t * stride_qt, stride_qh, q_out_ptr + t * HQ * 2 * HALF, 2 * HALF,
                             blk * BLOCK_H, HQ, qn_w_ptr, q_eps, c, s, d, d_ok, True, HALF, BLOCK_H)
        else:
            h0 = (blk - NQB) * BLOCK_H
            slot = tl.load(loc_ptr + t).to(tl.int64)
            _norm_rope_heads(k_ptr + t * stride_kt, stride_kh, kc_ptr + slot * stride_kcs, stride_kch,
                             h0, HK, kn_w_ptr, k_eps, c, s, d, d_ok, True, HALF, BLOCK_H)
            h = h0 + tl.arange(0, BLOCK_H)
            dv = tl.arange(0, 2 * BLOCK_D)
            m = (h < HK)[:, None] & (dv < 2 * HALF)[None, :]
            x = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + dv[None, :], mask=m)
            tl.store(vc_ptr + slot * stride_vcs + h[:, None] * stride_vch + dv[None, :],
                     x.to(vc_ptr.dtype.element_ty), mask=m)
    else:  # the indexer's heads: its table, no norm
        # Names of their own: Triton merges a name assigned in both branches of an `if`, and the
        # index table's rows are shorter than the attention's when DI < D.
        di = tl.arange(0, BLOCK_DI)
        di_ok = di < IHALF
        ic = tl.load(icos_ptr + pos * stride_ics + di, mask=di_ok, other=0.0)
        isn = tl.load(isin_ptr + pos * stride_ics + di, mask=di_ok, other=0.0)
        if blk < NQB + NKB + NIB:
            _norm_rope_heads(qi_ptr + t * stride_qit, stride_qih, qi_out_ptr + t * G * 2 * IHALF, 2 * IHALF,
                             (blk - NQB - NKB) * BLOCK_H, G, qn_w_ptr, q_eps, ic, isn, di, di_ok, False, IHALF,
                             BLOCK_H)
        else:
            islot = tl.load(loc_ptr + t).to(tl.int64)
            _norm_rope_heads(ki_ptr + t * stride_kit, stride_kih, kic_ptr + islot * stride_kics, stride_kich,
                             (blk - NQB - NKB - NIB) * BLOCK_H, G, qn_w_ptr, q_eps, ic, isn, di, di_ok, False, IHALF,
                             BLOCK_H)


@dataclass
class DecodeScores:
    """Asks `msa_prologue` for MSA's decode block scores too (one query per row, at its position),
    what `kiln.kernels.msa_scores.msa_decode_scores(qI', ..., select_blocks=N)` returns: the
    request table, each row's table row, the block size, N, and `max_len` as there."""

    req_to_token: torch.Tensor
    req_slots: torch.Tensor
    block_size: int
    select_blocks: int
    max_len: Optional[int] = None
    programs: Optional[int] = None  # score programs per (row, head) (tests)


def msa_prologue(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qI: torch.Tensor,
                 kI: torch.Tensor, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor, q_eps: float, k_eps: float,
                 cos: torch.Tensor, sin: torch.Tensor, index_cos: torch.Tensor, index_sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, ki_cache: torch.Tensor,
                 loc: torch.Tensor, scores: Optional[DecodeScores] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """positions, loc [T] (device, integer); q [T, Hq, D], k / v [T, Hkv, D], qI / kI [T, G, DI]
    (last dim contiguous, any token / head strides: views of the projections are read in place);
    norm weights [D]; cos / sin [max_positions, D/2] and index_cos / index_sin [max_positions,
    DI/2] fp32 tables; caches [slots, Hkv, D] and [slots, G, DI] written in place at loc.

    Returns (q_out [T, Hq, D], qI_out [T, G, DI], S): q_out and qI_out new contiguous tensors in
    the inputs' dtypes, `rope(positions, rms_norm(q), rms_norm(k))`, `rope(positions, qI, kI)` on
    the index tables and `store_kv(k', v, ..., kI', ki_cache)` in one launch; with `scores` (decode:
    row t's query at positions[t]) that launch also scores the history blocks selection reads,
    S [T, G, NB] fp32 as `msa_decode_scores` gives it (one launch fewer); else S is None."""
    assert_rows(positions=positions)
    t, hq, dim = q.shape
    hk, g, di = k.shape[1], qI.shape[1], qI.shape[2]
    assert k.shape == v.shape == (t, hk, dim) and kI.shape == qI.shape and qI.shape[0] == t, \
        (q.shape, k.shape, v.shape, qI.shape, kI.shape)
    assert positions.shape == loc.shape == (t,) and not loc.is_floating_point()
    assert dim % 2 == 0 and di % 2 == 0 and cos.shape[-1] * 2 == dim and index_cos.shape[-1] * 2 == di
    assert cos.stride() == sin.stride() and index_cos.stride() == index_sin.stride()
    assert k_cache.shape[1:] == v_cache.shape[1:] == (hk, dim) and ki_cache.shape[1:] == (g, di)
    for x in (q, k, v, qI, kI, k_cache, v_cache, ki_cache, cos, index_cos, q_norm_w, k_norm_w):
        assert x.stride(-1) == 1, "last dims must be contiguous (caches are written in place)"
    q_out = torch.empty(t, hq, dim, dtype=q.dtype, device=q.device)
    qi_out = torch.empty(t, g, di, dtype=qI.dtype, device=qI.device)
    # Without scores their arguments are never read: any tensors of the right kinds stand in.
    s_out, table, slots, s_arg, nb, select = None, loc, loc, cos, 0, 0
    warps, score_args, per_row = 4, {}, 0
    if scores is not None:
        table, slots, select = scores.req_to_token, scores.req_slots, scores.select_blocks
        assert table.stride(-1) == 1 and slots.shape == (t,)
        nb = _num_blocks(table, scores.block_size, scores.max_len)
        s_out = s_arg = torch.empty(t, g, nb, dtype=torch.float32, device=q.device)
        tile_t, warps = _scores_config(scores.block_size)
        per_row = scores.programs or _score_programs(t, g, nb, q.device)
        score_args = dict(SCORES=True, BLOCK_SIZE=scores.block_size, TILE_T=tile_t)
    if t == 0:
        return q_out, qi_out, s_out
    half, ihalf = dim // 2, di // 2
    block_d, block_di = triton.next_power_of_2(half), triton.next_power_of_2(ihalf)
    # ~512 elements per program, as Inkling's prologue: a few dozen programs share a decode step's few KB
    block_h = max(1, min(triton.next_power_of_2(max(hq, hk, g)), 256 // max(block_d, block_di)))
    nqb, nkb, nib = triton.cdiv(hq, block_h), triton.cdiv(hk, block_h), triton.cdiv(g, block_h)
    _msa_prologue_kernel[(t, nqb + nkb + 2 * nib + per_row * g)](
        q, k, v, qI, kI, q_out, qi_out, k_cache, v_cache, ki_cache,
        q_norm_w, k_norm_w, cos, sin, index_cos, index_sin, positions, loc, float(q_eps), float(k_eps),
        hq, hk, g, nqb, nkb, nib,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), qI.stride(0), qI.stride(1),
        kI.stride(0), kI.stride(1), cos.stride(0), index_cos.stride(0), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), ki_cache.stride(0), ki_cache.stride(1),
        table, slots, s_arg, table.stride(0), s_arg.stride(0), s_arg.stride(1), math.sqrt(di), nb, select, per_row,
        HALF=half, IHALF=ihalf, BLOCK_D=block_d, BLOCK_DI=block_di, BLOCK_H=block_h, num_warps=warps,
        enable_fp_fusion=False, **score_args, **pdl_launch(q.device),
    )
    return q_out, qi_out, s_out
