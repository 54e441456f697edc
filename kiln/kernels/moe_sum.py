"""The grouped MoE's last step (`kiln.kernels.moe`): each token's KS slot rows (fp32, one per routed
selection and shared chunk, weighted by the down GEMM) summed in slot order and cast once, and
with Inkling's out_conv that sum then through its ShortConv.

Two homes for the same sum. `_sum_slots_kernel` / `_sum_slots_conv_kernel` are launches of their
own after the down GEMM. With a counter (`fused_experts(sum_counter=...)`, at most
DOWN_SUM_MAX_TOKENS tokens) the down GEMM's last program per hidden tile runs `sum_slot_tokens`
instead, as the GEMV's norm epilogue does (`kiln.kernels.gemv`): one launch and one device-wide
hand-off fewer per MoE layer, the same numbers bit for bit (same loads, same order, same cast).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.kernels.launch import wait_for_previous
from kiln.kernels.shortconv import decode_conv_epilogue, decode_conv_history


@triton.jit
def sum_slot_tokens(slots_ptr, out_ptr, T, H, offs, ok, CW, CBUF, CTAB, CSLOTS, CLENS, CLOCS, stride_cw,
                    stride_cbuf, stride_ctab, KS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                    CONV: tl.constexpr, CK: tl.constexpr, CKP: tl.constexpr, CCHUNK: tl.constexpr):
    """Tokens 0..T-1 of hidden columns `offs` [BLOCK_H]: the KS rows t*KS + j of slots [T*KS, H] fp32 summed
    in slot order (routed in selection order, then the shared chunks), cast once into out [T, H],
    BLOCK_M tokens at a time. CONV (then T <= BLOCK_M: a chunk's taps are rows of the same tile):
    the sum, rounded to the state's dtype as the unfused path stores it, through its ShortConv
    (token t: decode sequence t, or with CCHUNK a token of a short chunk;
    `kiln.kernels.shortconv.decode_conv_epilogue`)."""
    for t0 in range(0, T, BLOCK_M):
        rm = t0 + tl.arange(0, BLOCK_M)
        m_ok = rm < T
        if CONV:  # its table and buffer round trips before the sum's loads
            hist = decode_conv_history(rm, m_ok, offs, ok, CBUF, stride_cbuf, CTAB, stride_ctab, CSLOTS, CLENS, CK,
                                       CKP, CCHUNK)
        mask = m_ok[:, None] & ok[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(KS):
            acc += tl.load(slots_ptr + (rm[:, None].to(tl.int64) * KS + j) * H + offs[None, :], mask=mask, other=0.0)
        if CONV:
            y = decode_conv_epilogue(acc.to(CBUF.dtype.element_ty), hist, rm, m_ok, offs, ok, CW, stride_cw, CBUF,
                                     stride_cbuf, CLOCS, CSLOTS, CLENS, CK, CKP, CCHUNK)
        else:
            y = acc
        tl.store(out_ptr + rm[:, None].to(tl.int64) * H + offs[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_slots_kernel(slots_ptr, out_ptr, H, KS: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """One token's BLOCK_H columns per program: any number of tokens (prefill)."""
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(KS):  # routed slots in selection order, then the shared chunks
        acc += tl.load(slots_ptr + (t * KS + j) * H + offs, mask=ok, other=0.0)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _sum_slots_conv_kernel(slots_ptr, out_ptr, T, H, CW, CBUF, CTAB, CSLOTS, CLENS, CLOCS, stride_cw, stride_cbuf,
                           stride_ctab, KS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                           CONV: tl.constexpr, CK: tl.constexpr, CKP: tl.constexpr, CCHUNK: tl.constexpr,
                           PDL: tl.constexpr):
    """`sum_slot_tokens` with its ShortConv for all T <= BLOCK_M tokens of one hidden tile per
    program, after the down GEMM when no counter lets that GEMM's last programs run it."""
    wait_for_previous(PDL)
    offs = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    sum_slot_tokens(slots_ptr, out_ptr, T, H, offs, offs < H, CW, CBUF, CTAB, CSLOTS, CLENS, CLOCS, stride_cw,
                    stride_cbuf, stride_ctab, KS, BLOCK_M, BLOCK_H, CONV, CK, CKP, CCHUNK)
