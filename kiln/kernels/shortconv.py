"""Triton ShortConv (MODELS.md 2.1) over the paged "conv" window space.

    y_t[c] = x_t[c] + sum_{j=0..K-1} w[c, j] * x_{t-K+1+j}[c]

Both entry points compute exactly `kiln.ops.shortconv.short_conv` with `prev` built like
`PagedBackend._conv_history`: the inputs before a sequence's first new token come from
`conv_buf[conv_table[req_slot, pos]]` (zeros where pos < 0), the inputs inside the chunk from `x`.
Accumulation is fp32 in the reference's order (acc = 0; acc += w_j * x_j for j = 0..K-1; y = acc +
x; one cast) and the kernels are compiled without FMA contraction (`enable_fp_fusion=False`), so
on the GPU they match the reference bit for bit, not just within a tolerance.

Both also store this forward's inputs in the buffer (`conv_buf[out_locs] = x`) in the same
kernel, each program after reading its own history. No program can read a slot another one
writes: the history of a sequence is its positions before the chunk and the writes go to the
chunk's positions, which have their own slots (a window space keeps every page a chunk and its
history need until after the forward, `CacheManager.max_chunk_tokens`); shared prefix-cache
pages are only read; padding rows read and write nothing but the scratch slot 0, which no real
position maps to. (The extend path used to write with a second launch, `index_copy_`: one more
kernel per ShortConv site, ~100 per verify forward of the Inkling bench preset.)

No `.item()`/`.tolist()`, and grids depend only on shapes: both are CUDA-graph capturable.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kiln.kernels import assert_rows
from kiln.kernels.launch import pdl_launch, wait_for_previous



# The metadata pointers are gathered a few int64 per program and T and B only bound its rows and
# its scan over the sequences: not specialised on their 16-byte alignment / divisibility by 16,
# which change with the batch (views into the step's metadata buffers, the graph ladder's sizes).
# Specialised, the first prefill batch of 64 compiled this kernel five times (0.5-0.7 s each on an
# H100 with a cold cache), of which four differed only there (docs/benchmarks.md, thirty-eighth
# pass, compile_watch).
@triton.jit(do_not_specialize=["T", "B"],
            do_not_specialize_on_alignment=["slots_ptr", "prefix_ptr", "lens_ptr", "starts_ptr", "out_locs_ptr"])
def _short_conv_kernel(
    x_ptr, w_ptr, y_ptr, buf_ptr, table_ptr,
    slots_ptr, prefix_ptr, lens_ptr, starts_ptr, out_locs_ptr,
    T, C, B,
    stride_x, stride_w, stride_y, stride_buf, stride_tab,
    K: tl.constexpr, DECODE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr, PDL: tl.constexpr,
):
    """One program: BLOCK_T token rows x BLOCK_C channels.

    DECODE: row t is sequence t, its only new token at position seq_lens[t] - 1 (`prefix_ptr`
    holds seq_lens), and the program also writes x into conv_buf[out_locs].
    Extend: row t belongs to the sequence b with starts[b] <= t < starts[b] + lens[b] (found by a
    scan over the B sequences, so no host-side token->sequence map is needed); rows of no sequence
    get y = x.
    """
    wait_for_previous(PDL)
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok = t < T
    c_ok = c < C

    if DECODE:
        seq = t
        row_ok = t_ok
        prefix = tl.load(prefix_ptr + seq, mask=row_ok, other=1) - 1  # seq_len - 1 earlier tokens
        p = tl.zeros([BLOCK_T], dtype=tl.int64)  # index of the token inside its chunk
    else:
        seq = tl.zeros([BLOCK_T], dtype=tl.int64)
        hits = tl.zeros([BLOCK_T], dtype=tl.int32)
        for b0 in range(0, B, BLOCK_B):
            b = (b0 + tl.arange(0, BLOCK_B)).to(tl.int64)
            b_ok = b < B
            st = tl.load(starts_ptr + b, mask=b_ok, other=0)
            ln = tl.load(lens_ptr + b, mask=b_ok, other=0)
            inside = (t[:, None] >= st[None, :]) & (t[:, None] < st[None, :] + ln[None, :]) & b_ok[None, :]
            seq += tl.sum(tl.where(inside, b[None, :], 0), axis=1)
            hits += tl.sum(inside.to(tl.int32), axis=1)
        row_ok = t_ok & (hits > 0)
        prefix = tl.load(prefix_ptr + seq, mask=row_ok, other=0)
        p = t - tl.load(starts_ptr + seq, mask=row_ok, other=0)
    slot = tl.load(slots_ptr + seq, mask=row_ok, other=0)

    mask2 = t_ok[:, None] & c_ok[None, :]
    x_cur = tl.load(x_ptr + t[:, None] * stride_x + c[None, :], mask=mask2, other=0.0)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        w_j = tl.load(w_ptr + c * stride_w + j, mask=c_ok, other=0.0).to(tl.float32)
        q = p - (K - 1) + j  # tap's index inside the chunk; < 0 reads the history
        if j == K - 1:
            v = x_cur.to(tl.float32)  # the current token itself
        else:
            from_x = row_ok & (q >= 0)
            hist_pos = prefix + q
            from_buf = row_ok & (q < 0) & (hist_pos >= 0)
            loc = tl.load(table_ptr + slot * stride_tab + tl.where(from_buf, hist_pos, 0),
                          mask=from_buf, other=0).to(tl.int64)
            vb = tl.load(buf_ptr + loc[:, None] * stride_buf + c[None, :],
                         mask=from_buf[:, None] & c_ok[None, :], other=0.0)
            if DECODE:
                v = vb.to(tl.float32)  # a decode token's earlier taps are all history
            else:
                vx = tl.load(x_ptr + (t + q - p)[:, None] * stride_x + c[None, :],
                             mask=from_x[:, None] & c_ok[None, :], other=0.0)
                v = tl.where(from_x[:, None], vx.to(tl.float32), vb.to(tl.float32))
        acc = acc + w_j[None, :] * v
    y = acc + x_cur.to(tl.float32)
    tl.store(y_ptr + t[:, None] * stride_y + c[None, :], y.to(y_ptr.dtype.element_ty), mask=mask2)

    # The state write, after this program's reads of the history (program order; module doc)
    out = tl.load(out_locs_ptr + t, mask=t_ok, other=0)
    tl.store(buf_ptr + out[:, None] * stride_buf + c[None, :], x_cur.to(buf_ptr.dtype.element_ty), mask=mask2)


@triton.jit
def _rows_back(v, rm, d):
    """Row m - d of v [BLOCK_M, C] for every row m (0 where m < d; rm: the row ids): a masked sum
    over one lane, so exact."""
    return tl.sum(tl.where((rm[None, :] == rm[:, None] - d)[:, :, None], v[None, :, :], 0), axis=1)


@triton.jit
def _chunk_taps(rm, m_ok, slots_ptr, pos_ptr, K: tl.constexpr, KP: tl.constexpr):
    """int32 [BLOCK_M, KP], 1 where tap j of row m is row m - (K - 1 - j) of the same forward: that
    row has the same request row and the position K - 1 - j before (as `kiln.kernels.conv_qk_norm`
    decides it). The rows of a request's chunk are consecutive, and a GEMV's program holds all of
    its <= 4 rows."""
    jj = tl.arange(0, KP)
    slot = tl.load(slots_ptr + rm, mask=m_ok, other=-1)
    pos = tl.load(pos_ptr + rm, mask=m_ok, other=-1)
    inside = tl.zeros([rm.shape[0], KP], dtype=tl.int32)
    for d in tl.static_range(1, K):
        back = rm[None, :] == rm[:, None] - d  # [m, m']: m' = m - d
        slot_back = tl.sum(tl.where(back, slot[None, :], 0), axis=1)
        pos_back = tl.sum(tl.where(back, pos[None, :], 0), axis=1)
        hit = (rm >= d) & m_ok & (slot_back == slot) & (pos_back == pos - d)
        inside += ((jj == K - 1 - d)[None, :] & hit[:, None]).to(tl.int32)
    return inside


@triton.jit
def decode_conv_history(rm, m_ok, c, c_ok, buf_ptr, stride_buf, table_ptr, stride_tab, slots_ptr, lens_ptr,
                        K: tl.constexpr, KP: tl.constexpr, CHUNK: tl.constexpr):
    """The K-1 earlier inputs of decode rows rm (row m: sequence m, its new token at position
    seq_lens[m] - 1) for channels c: fp32 [BLOCK_M, KP, BLOCK_C], tap j at position
    seq_len - K + j (zeros before the sequence and for j >= K - 1). For a kernel that runs the
    decode ShortConv in its epilogue (`kiln.kernels.gemv`): loaded before its main loop, the
    table and buffer round trips overlap it.
    CHUNK: row m is a token of a short chunk (a speculative verify) at position lens_ptr[m] of
    table row slots_ptr[m]; taps that are rows of the same forward (`_chunk_taps`) are left 0 here
    (the epilogue takes them from its own rows), the rest come from the buffer as above."""
    jj = tl.arange(0, KP)
    slot = tl.load(slots_ptr + rm, mask=m_ok, other=0).to(tl.int64)
    if CHUNK:
        last = tl.load(lens_ptr + rm, mask=m_ok, other=0)  # the row's own position
    else:
        last = tl.load(lens_ptr + rm, mask=m_ok, other=1) - 1
    pos = last[:, None] - (K - 1) + jj[None, :]  # [BLOCK_M, KP]
    ok = m_ok[:, None] & (jj < K - 1)[None, :] & (pos >= 0)
    if CHUNK:
        ok = ok & (_chunk_taps(rm, m_ok, slots_ptr, lens_ptr, K, KP) == 0)
    loc = tl.load(table_ptr + slot[:, None] * stride_tab + tl.where(ok, pos, 0), mask=ok, other=0).to(tl.int64)
    return tl.load(buf_ptr + loc[:, :, None] * stride_buf + c[None, None, :],
                   mask=ok[:, :, None] & c_ok[None, None, :], other=0.0).to(tl.float32)


@triton.jit
def decode_conv_epilogue(x_cur, hist, rm, m_ok, c, c_ok, w_ptr, stride_w, buf_ptr, stride_buf, locs_ptr,
                         slots_ptr, lens_ptr, K: tl.constexpr, KP: tl.constexpr, CHUNK: tl.constexpr):
    """ShortConv of decode rows whose current inputs x_cur [BLOCK_M, BLOCK_C] (in the buffer's
    dtype) and history (`decode_conv_history`) are given: fp32 y in the reference's order (acc = 0;
    acc += w_j * x_j for j = 0..K-1; y = acc + x), and x_cur stored at buf[out_locs[m]]. Each tap
    is taken out of `hist` by a masked sum over one non-zero lane (exact). CHUNK: a tap that is
    row m - d of the same forward (`_chunk_taps`) is that row of x_cur (the same values the
    ShortConv extend kernel reads back from the projection's output)."""
    jj = tl.arange(0, KP)
    xf = x_cur.to(tl.float32)
    if CHUNK:
        inside = _chunk_taps(rm, m_ok, slots_ptr, lens_ptr, K, KP)
    acc = tl.zeros(x_cur.shape, dtype=tl.float32)
    for j in tl.static_range(K):
        w_j = tl.load(w_ptr + c * stride_w + j, mask=c_ok, other=0.0).to(tl.float32)
        if j == K - 1:
            v = xf
        else:
            v = tl.sum(tl.where((jj == j)[None, :, None], hist, 0.0), axis=1)
            if CHUNK:
                own = tl.sum(tl.where((jj == j)[None, :], inside, 0), axis=1) > 0
                v = tl.where(own[:, None], _rows_back(xf, rm, K - 1 - j), v)
        acc = acc + w_j[None, :] * v
    out = tl.load(locs_ptr + rm, mask=m_ok, other=0).to(tl.int64)
    tl.store(buf_ptr + out[:, None] * stride_buf + c[None, :], x_cur, mask=m_ok[:, None] & c_ok[None, :])
    return acc + xf


def decode_conv_kernel_args(conv: Optional[tuple], y: torch.Tensor, chunk: bool = False) -> dict:
    """Launch arguments of a kernel that runs the decode ShortConv in its epilogue
    (`decode_conv_history` / `decode_conv_epilogue`) on its output y [M, C]: conv = the arguments
    of `short_conv_decode` after x, or None for none (then y stands in for every pointer). chunk:
    the rows are tokens of short chunks, conv's lengths are then each row's position and its
    request rows one per token (`PagedBackend.chunk_conv_args`)."""
    if conv is None:
        return dict(CW=y, CBUF=y, CTAB=y, CSLOTS=y, CLENS=y, CLOCS=y, stride_cw=0, stride_cbuf=0, stride_ctab=0,
                    CONV=False, CK=1, CKP=1, CCHUNK=False)
    w, buf, table, slots, lens, locs = conv
    m, n = y.shape
    assert w.shape[0] == buf.shape[1] == n and w.shape[1] >= 1, (w.shape, buf.shape, n)
    assert buf.dtype == y.dtype, "the conv state is kept in the model's dtype"
    assert slots.shape[0] >= m and lens.shape[0] >= m and locs.shape[0] >= m
    for t in (w, buf, table, slots, lens, locs):
        assert t.stride(-1) == 1, "channel / position dims must be contiguous"
    return dict(CW=w, CBUF=buf, CTAB=table, CSLOTS=slots, CLENS=lens, CLOCS=locs, stride_cw=w.stride(0),
                stride_cbuf=buf.stride(0), stride_ctab=table.stride(0), CONV=True, CK=w.shape[1],
                CKP=triton.next_power_of_2(max(1, w.shape[1] - 1)),  # K = 1: no history (one masked lane)
                CCHUNK=chunk)


def _block_c(c: int) -> int:
    return min(256, triton.next_power_of_2(c))


def _check(x, w, conv_buf, conv_table):
    assert x.dim() == 2 and conv_buf.dim() == 2 and conv_table.dim() == 2 and w.dim() == 2
    assert w.shape[0] == x.shape[1] == conv_buf.shape[1], (w.shape, x.shape, conv_buf.shape)
    assert w.shape[1] >= 1
    for t in (x, w, conv_buf, conv_table):
        assert t.stride(-1) == 1, "the channel / position dim must be contiguous"


def short_conv_decode(x: torch.Tensor, w: torch.Tensor, conv_buf: torch.Tensor, conv_table: torch.Tensor,
                      req_slots: torch.Tensor, seq_lens: torch.Tensor, out_locs: torch.Tensor) -> torch.Tensor:
    """One new token per sequence. x [B, C] (token at position seq_len - 1), w [C, K],
    conv_buf [slots, C], conv_table [rows, L] slot of each position, req_slots / seq_lens /
    out_locs [B] int64 on the device. Returns y [B, C] in x's dtype and writes x into
    conv_buf[out_locs] (after reading the history)."""
    assert_rows(req_slots=req_slots, seq_lens=seq_lens, out_locs=out_locs)
    _check(x, w, conv_buf, conv_table)
    bsz, c = x.shape
    y = torch.empty_like(x)
    if bsz == 0:
        return y
    block_t, block_c = 4, _block_c(c)
    grid = (triton.cdiv(bsz, block_t), triton.cdiv(c, block_c))
    _short_conv_kernel[grid](
        x, w, y, conv_buf, conv_table,
        req_slots, seq_lens, seq_lens, seq_lens, out_locs,  # lens/starts unused in decode
        bsz, c, bsz,
        x.stride(0), w.stride(0), y.stride(0), conv_buf.stride(0), conv_table.stride(0),
        K=w.shape[1], DECODE=True, BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_B=16,
        num_warps=4, enable_fp_fusion=False, **pdl_launch(x.device),
    )
    return y


def short_conv_extend(x: torch.Tensor, w: torch.Tensor, conv_buf: torch.Tensor, conv_table: torch.Tensor,
                      req_slots: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                      extend_starts: torch.Tensor, out_locs: torch.Tensor) -> torch.Tensor:
    """Chunks of several tokens per sequence, packed along dim 0. x [T, C]; req_slots,
    prefix_lens (tokens already in the buffer), extend_lens, extend_starts (first row in x) [B]
    int64 on the device; out_locs [T] the slot of every row. Returns y [T, C] and writes all x
    rows into conv_buf[out_locs] (after reading the history)."""
    assert_rows(req_slots=req_slots, prefix_lens=prefix_lens, extend_lens=extend_lens, extend_starts=extend_starts,
                out_locs=out_locs)
    _check(x, w, conv_buf, conv_table)
    n_tok, c = x.shape
    bsz = req_slots.shape[0]
    y = torch.empty_like(x)
    if n_tok == 0:
        return y
    block_t, block_c = 8, _block_c(c)
    grid = (triton.cdiv(n_tok, block_t), triton.cdiv(c, block_c))
    _short_conv_kernel[grid](
        x, w, y, conv_buf, conv_table,
        req_slots, prefix_lens, extend_lens, extend_starts, out_locs,
        n_tok, c, bsz,
        x.stride(0), w.stride(0), y.stride(0), conv_buf.stride(0), conv_table.stride(0),
        K=w.shape[1], DECODE=False, BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_B=32,
        num_warps=4, enable_fp_fusion=False, **pdl_launch(x.device),
    )
    return y
