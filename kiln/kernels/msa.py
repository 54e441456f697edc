"""Triton kernels for MSA (MiniMax-M3 sparse attention, MODELS.md 3.1): the fast path of
`kiln.ops.msa.paged_msa_attention`.

One MSA attention over the paged cache runs as three stages over "rows" (one row = one query
token: the request row of `req_to_token` it reads and its absolute position `q_pos`):

1. block scores  S[row, g, b] = max over keys t of block b with t <= q_pos of qI.kI / sqrt(DI)
   (-inf when block b holds no such key). Decode reads every cached index key of every
   sequence, so this is the bandwidth-bound part: each (kv head, row) has a fixed number of
   programs, and each streams every P-th block's index keys once, up to the query's own block
   (`_decode_scores_kernel`, in `kiln.kernels.msa_scores` with the other stage-1 code). Chunked
   prefill scores a tile of queries of one sequence against a block with one `tl.dot`
   (`_extend_scores_kernel`), with the same loop over blocks. At decode the engine runs the
   scores inside MiniMax-M3's prologue launch instead (`kiln.kernels.msa_prologue`, `scores=`):
   they read only history blocks, which that step does not write. The loop
   is bounded by the row's length, not the grid: a grid of one program per block of the longest
   context a graph may see cost MiniMax-M3 `bench` 25 us per layer at a 1K context (131072 / 128
   blocks x 4 heads, nearly all idle).
2. selection (`_selected_blocks`): exactly `select_blocks` - all causal blocks when there are
   at most N, else the N-1 best history blocks, best first, equal scores to the lower id, then
   the local block; -1 pads. Each block becomes one int64 key ordered like (score desc, id asc),
   and pick k is the max key below pick k-1: N-1 max reductions, no scratch, exact tie order
   (torch.topk does not promise one); rows of at most RANK_MAX_BLOCKS blocks take the block of
   rank k instead, all ranks in one [blocks, blocks] comparison. The engine runs it inside the attention kernel (every
   program selects for its row and kv head from the scores, one launch and one dependent wait
   fewer per layer); `msa_select` (`_select_kernel`, one program per (row, kv head)) stores it.
3. sparse attention (`_sparse_attn_kernel`): one program per (row, kv head, split) gathers its
   share of the selected blocks through `req_to_token`, and runs all query heads of the group
   against them at once (one `tl.dot` per tile) with an fp32 online softmax. With more than one
   split per row (flash-decoding: small batches need more programs than rows x heads), the last
   split to finish merges the partial softmaxes (with the caller's split counters), or
   `_combine_kernel` does.

Everything launches on grids sized from shapes only (the scores' width comes from `max_len`,
default `req_to_token.shape[1]`), with no host sync: `msa_decode` can be captured in a CUDA graph.
Loops over blocks are `while` loops on a loaded length (Triton's interpreter, which runs the CPU
tests, cannot take a loaded value as a `range` bound); loops within a block have compile-time
bounds and mask what runs past the data.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from kiln.kernels import assert_rows
from kiln.kernels.launch import pdl_launch, wait_for_previous
from kiln.kernels.msa_scores import _dot_precision, _p2, _programs_wanted, msa_decode_scores, msa_extend_scores

# Blocks of scores one selection pass looks at per step (bounds its registers for long contexts).
_SELECT_CHUNK = 1024
# Rows of at most this many blocks (8K tokens at MiniMax-M3's 128) select by rank, in one step: a
# [blocks, blocks] comparison, 32 int64 values per thread of 4 warps at 64; longer ones by the
# chain of N-1 max reductions.
RANK_MAX_BLOCKS = tl.constexpr(64)


# ---- 1. block scores: kiln/kernels/msa_scores.py ---------------------------------------------

# ---- 2. selection ----------------------------------------------------------------------------

@triton.jit
def _history_keys(base, ids, local):
    """One int64 per block whose order is (score descending, id ascending): the score's bits made
    order-preserving (flip all bits of negatives, set the sign bit of the rest) times 2^31, plus
    2^31-1-id. Blocks that do not compete (the local block and later) get -1."""
    hist = ids < local
    s = tl.load(base + ids, mask=hist, other=0.0)
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 ties with 0.0, as in a sort
    bits = s.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, ~bits, bits | -2147483648).to(tl.uint32, bitcast=True).to(tl.int64)
    return tl.where(hist, ordered * 2147483648 + (2147483647 - ids), -1)


@triton.jit
def _selected_blocks(base, qp, BLOCK_SIZE: tl.constexpr, TOPK: tl.constexpr, TOPK_P: tl.constexpr,
                     CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr):
    """The selection [TOPK_P] int64 of the query at position qp from its row's scores at `base`,
    by the rule of `kiln.ops.msa.select_blocks` (-1 pads; entries past TOPK are not part of it).
    A row with at most TOPK causal blocks reads no score."""
    n_causal = qp // BLOCK_SIZE + 1
    local = n_causal - 1
    offs_k = tl.arange(0, TOPK_P)
    # Dense case: all causal blocks, in order, then -1.
    out = tl.where(offs_k < n_causal, offs_k.to(tl.int64), -1)
    if n_causal > TOPK:
        offs_c = tl.arange(0, CHUNK)
        if NUM_CHUNKS == 1 and CHUNK <= RANK_MAX_BLOCKS:
            # Short rows: every block's rank among the history keys at once (keys are distinct),
            # and pick k is the block of rank k. One step instead of N-1 dependent reductions.
            keys = _history_keys(base, offs_c, local)
            # (the other blocks' key, -1, ranks after every history block: never below N - 1)
            rank = tl.sum((keys[None, :] > keys[:, None]).to(tl.int32), axis=1)
            hit = rank[None, :] == offs_k[:, None]
            picked = tl.sum(tl.where(hit, offs_c[None, :].to(tl.int64), 0), axis=1)
            out = tl.where(offs_k < TOPK - 1, picked, out)
        else:
            if NUM_CHUNKS == 1:
                keys = _history_keys(base, offs_c, local)  # read once, kept in registers
            # Pick k is the largest key below pick k-1: the order of a stable descending sort.
            prev = tl.full([], 9223372036854775807, tl.int64)
            for k in range(TOPK - 1):
                if NUM_CHUNKS == 1:
                    best = tl.max(tl.where(keys < prev, keys, -1), axis=0)
                else:
                    best = tl.full([], -1, tl.int64)
                    for c in range(NUM_CHUNKS):  # chunks past the local block load nothing
                        ck = _history_keys(base, c * CHUNK + offs_c, local)
                        best = tl.maximum(best, tl.max(tl.where(ck < prev, ck, -1), axis=0))
                out = tl.where(offs_k == k, 2147483647 - (best % 2147483648), out)
                prev = best
        out = tl.where(offs_k == TOPK - 1, local, out)
    return out


@triton.jit
def _select_kernel(s_ptr, qpos_ptr, sel_ptr, s_sr, s_sg, sel_r, sel_g,
                   BLOCK_SIZE: tl.constexpr, TOPK: tl.constexpr, TOPK_P: tl.constexpr,
                   CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, PDL: tl.constexpr):
    """Sel[row, g, :] by the rule of `kiln.ops.msa.select_blocks` (`_selected_blocks`)."""
    wait_for_previous(PDL)
    row = tl.program_id(0)
    g = tl.program_id(1)
    qp = tl.load(qpos_ptr + row)
    out = _selected_blocks(s_ptr + row * s_sr + g * s_sg, qp, BLOCK_SIZE, TOPK, TOPK_P, CHUNK, NUM_CHUNKS)
    offs_k = tl.arange(0, TOPK_P)
    tl.store(sel_ptr + row * sel_r + g * sel_g + offs_k, out, mask=offs_k < TOPK)


# ---- 3. sparse attention ---------------------------------------------------------------------

@triton.jit
def _sparse_attn_kernel(q_ptr, k_ptr, v_ptr, r2t_ptr, rslot_ptr, qpos_ptr, sel_ptr,
                        out_ptr, opart_ptr, mpart_ptr, lpart_ptr, counters_ptr,
                        s_qr, s_qh, s_ks, s_kg, s_vs, s_vg, s_r2t, sel_r, sel_g, s_or, s_oh,
                        scale_log2,
                        HG: tl.constexpr, HG_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, TILE_T: tl.constexpr, TOPK: tl.constexpr,
                        BLOCKS_PER_SPLIT: tl.constexpr, SPLITS: tl.constexpr,
                        DOT_PREC: tl.constexpr, PDL: tl.constexpr, MERGE_HERE: tl.constexpr = False,
                        SPLITS_P: tl.constexpr = 1, SELECT_HERE: tl.constexpr = False,
                        TOPK_P: tl.constexpr = 1, CHUNK: tl.constexpr = 1, NUM_CHUNKS: tl.constexpr = 1):
    """Attention of the HG query heads of kv head g of one row over its selected blocks
    BLOCKS_PER_SPLIT * split .. (one split's share), fp32 online softmax in base 2. MERGE_HERE:
    the split that finishes last (counted in counters_ptr[row, g], left at zero) merges the
    group's partials, as `_combine_kernel` would. SELECT_HERE: sel_ptr holds the block scores
    [rows, G, NB] (strides sel_r, sel_g) and every program selects from them itself
    (`_selected_blocks`, what `_select_kernel` stores), one launch fewer per attention."""
    wait_for_previous(PDL)
    row = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    qp = tl.load(qpos_ptr + row)
    rslot = tl.load(rslot_ptr + row).to(tl.int64)
    offs_h = tl.arange(0, HG_P)  # padded to 16 rows: tl.dot needs M >= 16
    offs_d = tl.arange(0, D_P)
    offs_t = tl.arange(0, TILE_T)
    hmask = offs_h < HG
    dmask = offs_d < D
    q = tl.load(q_ptr + row * s_qr + (g * HG + offs_h)[:, None] * s_qh + offs_d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    q = q.to(k_ptr.dtype.element_ty)
    m = tl.full([HG_P], float("-inf"), tl.float32)
    l = tl.zeros([HG_P], tl.float32)
    acc = tl.zeros([HG_P, D_P], tl.float32)
    if SELECT_HERE:
        picks = _selected_blocks(sel_ptr + row * sel_r + g * sel_g, qp, BLOCK_SIZE, TOPK, TOPK_P, CHUNK, NUM_CHUNKS)
        offs_k = tl.arange(0, TOPK_P)
    for jj in range(BLOCKS_PER_SPLIT):
        j = split * BLOCKS_PER_SPLIT + jj
        if SELECT_HERE:
            blk = tl.where(j < TOPK, tl.sum(tl.where(offs_k == j, picks, 0), axis=0), -1)
        else:
            blk = tl.load(sel_ptr + row * sel_r + g * sel_g + j, mask=j < TOPK, other=-1)
        for t0 in range(0, BLOCK_SIZE, TILE_T):
            t = t0 + offs_t
            pos = blk * BLOCK_SIZE + t
            # -1 padding and keys past the query (the local block's tail) load nothing.
            tmask = (blk >= 0) & (t < BLOCK_SIZE) & (pos <= qp)
            slot = tl.load(r2t_ptr + rslot * s_r2t + pos, mask=tmask, other=0).to(tl.int64)
            kv_mask = tmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + slot[:, None] * s_ks + g * s_kg + offs_d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2  # [HG_P, TILE_T]
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            # A fully masked tile leaves m at -inf: shift by 0 instead of (-inf) - (-inf).
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_ref)
            p = tl.exp2(s - m_ref[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + slot[:, None] * s_vs + g * s_vg + offs_d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m = m_new
    heads = g * HG + offs_h
    if SPLITS == 1:
        o = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + row * s_or + heads[:, None] * s_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])
    else:
        # Partials are [rows, Hq, SPLITS(, D)] fp32, contiguous.
        part = (row * (tl.num_programs(1) * HG) + heads) * SPLITS + split
        tl.store(mpart_ptr + part, m, mask=hmask)
        tl.store(lpart_ptr + part, l, mask=hmask)
        tl.store(opart_ptr + part[:, None] * D + offs_d[None, :], acc, mask=hmask[:, None] & dmask[None, :])
        if MERGE_HERE:
            counter = counters_ptr + row * tl.num_programs(1) + g
            # Every warp's partials are written before the release; the last arrival acquires them.
            tl.debug_barrier()
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
                for hh in tl.static_range(HG):  # unrolled: every head's partials are in flight at once
                    _combine_head(opart_ptr, mpart_ptr, lpart_ptr, out_ptr, s_or, s_oh, row, g * HG + hh,
                                  tl.num_programs(1) * HG, D, D_P, SPLITS, SPLITS_P, ".cg")


@triton.jit
def _combine_head(opart_ptr, mpart_ptr, lpart_ptr, out_ptr, s_or, s_oh, row, h, hq,
                  D: tl.constexpr, D_P: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
                  CACHE: tl.constexpr):
    """out[row, h] = sum_j acc_j 2^(m_j - M) / sum_j l_j 2^(m_j - M) over the splits (hq query
    heads per row in the partials). CACHE ".cg": partials other programs of the same kernel wrote,
    read through L2, never a stale L1 line."""
    offs_j = tl.arange(0, SPLITS_P)
    offs_d = tl.arange(0, D_P)
    jmask = offs_j < SPLITS
    base = (row * hq + h) * SPLITS
    m = tl.load(mpart_ptr + base + offs_j, mask=jmask, other=float("-inf"), cache_modifier=CACHE)
    l = tl.load(lpart_ptr + base + offs_j, mask=jmask, other=0.0, cache_modifier=CACHE)
    acc = tl.load(opart_ptr + (base + offs_j)[:, None] * D + offs_d[None, :],
                  mask=jmask[:, None] & (offs_d < D)[None, :], other=0.0, cache_modifier=CACHE)
    m_all = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_all))  # empty splits weigh nothing
    den = tl.sum(l * w, axis=0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + row * s_or + h * s_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=offs_d < D)


@triton.jit
def _combine_kernel(opart_ptr, mpart_ptr, lpart_ptr, out_ptr, s_or, s_oh,
                    D: tl.constexpr, D_P: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
                    PDL: tl.constexpr):
    """The merge of one (row, query head)'s splits as a launch of its own (`_combine_head`)."""
    wait_for_previous(PDL)
    _combine_head(opart_ptr, mpart_ptr, lpart_ptr, out_ptr, s_or, s_oh, tl.program_id(0), tl.program_id(1),
                  tl.num_programs(1), D, D_P, SPLITS, SPLITS_P, "")


# ---- host wrappers ---------------------------------------------------------------------------

def _attn_config(block_size: int) -> tuple[int, int]:
    """(keys per tile, warps) of the sparse attention kernel; tl.dot needs tiles >= 16. A whole
    128-key block per tile with 4 warps was fastest on an H200 at every batch size tried."""
    return max(16, min(_p2(block_size), 128)), 4


def _select_warps(chunk: int) -> int:
    """Warps of the selection kernel: its N-1 reductions are a serial chain, so fewer warps
    (fewer cross-warp exchanges) finish sooner on short rows."""
    return max(1, min(4, chunk // 256))


def msa_select(scores: torch.Tensor, q_pos: torch.Tensor, block_size: int, topk_blocks: int,
               chunk: Optional[int] = None) -> torch.Tensor:
    """Selected block ids [R, G, N] int64 from block scores [R, G, NB] (the query of row r at
    position q_pos[r]); the rule and order of `kiln.ops.msa.select_blocks`, -1 padding.

    Only blocks before the query's own are read, so scores past it may hold anything. `chunk`
    (a power of two) overrides how many scores one step reads (tests).
    """
    assert_rows(q_pos=q_pos)
    r, g, nb = scores.shape
    assert scores.stride(-1) == 1
    sel = torch.empty(r, g, topk_blocks, dtype=torch.int64, device=scores.device)
    if r == 0:
        return sel
    chunk = chunk or min(_SELECT_CHUNK, _p2(nb))
    _select_kernel[(r, g)](
        scores, q_pos, sel, scores.stride(0), scores.stride(1), sel.stride(0), sel.stride(1),
        BLOCK_SIZE=block_size, TOPK=topk_blocks, TOPK_P=_p2(topk_blocks), CHUNK=chunk,
        NUM_CHUNKS=-(-nb // chunk), num_warps=_select_warps(chunk), **pdl_launch(scores.device))
    return sel


def _blocks_per_split(rows: int, g: int, topk: int, device: torch.device) -> int:
    """Selected blocks per attention program: split a row's N blocks over as many programs as it
    takes to fill the GPU (one block each at small batch), none once rows x heads fill it. On an
    H200 (bench shapes) this picked the best or near-best split at B = 1, 8, 64, 128: more
    programs than a wave only add partials to merge."""
    want = _programs_wanted(device)
    per = 1
    while per < topk and rows * g * (-(-topk // (per * 2))) >= want:
        per *= 2
    return per


def msa_sparse_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         req_to_token: torch.Tensor, req_slots: torch.Tensor, q_pos: torch.Tensor,
                         sel: Optional[torch.Tensor], block_size: int, scale: float,
                         blocks_per_split: Optional[int] = None,
                         split_counters: Optional[torch.Tensor] = None,
                         scores: Optional[torch.Tensor] = None, topk_blocks: int = 0,
                         select_chunk: Optional[int] = None) -> torch.Tensor:
    """Attention of one query per row over the keys t <= q_pos of its selected blocks.

    q: [R, Hq, D]; k_cache, v_cache: [slots, G, D]; sel: [R, G, N] (-1 = none). Or, with sel
    None, the block scores [R, G, NB] (`scores`) and N (`topk_blocks`): the kernel then selects
    as `msa_select` would, in the same launch. Returns [R, Hq, D] in q's dtype.
    `blocks_per_split` overrides the split heuristic, `select_chunk` `msa_select`'s `chunk` (tests).
    split_counters: an int32 buffer of zeros with at least R * G entries, the caller's, left
    zeroed: several splits are then merged inside the attention kernel (as
    `kiln.kernels.decode_attention` does); too small or None: `_combine_kernel` merges them.
    """
    assert_rows(req_slots=req_slots, q_pos=q_pos)
    r, hq, d = q.shape
    g = k_cache.shape[1]
    select_here = sel is None
    assert select_here == (scores is not None), "pass either sel or scores"
    if select_here:
        assert topk_blocks > 0, "selecting in the kernel needs topk_blocks"
        sel, topk = scores, topk_blocks
        nb = scores.shape[-1]
        chunk = select_chunk or min(_SELECT_CHUNK, _p2(nb))
        assert scores.stride(-1) == 1
        select_args = dict(SELECT_HERE=True, TOPK_P=_p2(topk), CHUNK=chunk, NUM_CHUNKS=-(-nb // chunk))
    else:
        topk = sel.shape[-1]
        select_args = {}
    assert hq % g == 0 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1
    assert sel.stride(-1) == 1 and req_to_token.stride(-1) == 1
    out = torch.empty_like(q)
    if r == 0:
        return out
    per = blocks_per_split or _blocks_per_split(r, g, topk, q.device)
    splits = -(-topk // per)
    if splits > 1:
        opart = torch.empty(r, hq, splits, d, dtype=torch.float32, device=q.device)
        mpart = torch.empty(r, hq, splits, dtype=torch.float32, device=q.device)
        lpart = torch.empty_like(mpart)
    else:
        opart = mpart = lpart = out  # unused
    hg = hq // g
    tile_t, warps = _attn_config(block_size)
    merge_here = splits > 1 and split_counters is not None and split_counters.numel() >= r * g
    if merge_here:
        assert split_counters.dtype == torch.int32 and split_counters.device == q.device
    # never touched without MERGE_HERE; an int32 tensor either way, so that both compile to one variant
    counters = split_counters if merge_here else req_slots.new_empty(1, dtype=torch.int32)
    _sparse_attn_kernel[(r, g, splits)](
        q, k_cache, v_cache, req_to_token, req_slots, q_pos, sel, out, opart, mpart, lpart, counters,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), req_to_token.stride(0), sel.stride(0), sel.stride(1),
        out.stride(0), out.stride(1), scale * math.log2(math.e),
        HG=hg, HG_P=max(16, _p2(hg)), D=d, D_P=max(16, _p2(d)), BLOCK_SIZE=block_size,
        TILE_T=tile_t, TOPK=topk, BLOCKS_PER_SPLIT=per, SPLITS=splits,
        DOT_PREC=_dot_precision(k_cache.dtype), num_warps=warps, MERGE_HERE=merge_here, SPLITS_P=_p2(splits),
        **select_args, **pdl_launch(q.device))
    if splits > 1 and not merge_here:
        _combine_kernel[(r, hq)](opart, mpart, lpart, out, out.stride(0), out.stride(1),
                                 D=d, D_P=_p2(d), SPLITS=splits, SPLITS_P=_p2(splits), num_warps=4,
                                 **pdl_launch(out.device))
    return out


def msa_decode(q: torch.Tensor, qI: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               ki_cache: torch.Tensor, req_to_token: torch.Tensor, req_slots: torch.Tensor,
               seq_lens: torch.Tensor, block_size: int, topk_blocks: int, scale: float,
               max_len: Optional[int] = None, q_pos: Optional[torch.Tensor] = None,
               split_counters: Optional[torch.Tensor] = None, select_in_attention: bool = True) -> torch.Tensor:
    """MSA decode: one query per sequence at position seq_len - 1, whose K, V and kI are already
    in the caches. Same result as `kiln.ops.msa.paged_msa_attention` with prefix_lens =
    seq_lens - 1 and extend_lens = 1.

    q: [B, Hq, D]; qI: [B, G, DI]; k_cache, v_cache: [slots, G, D]; ki_cache: [slots, G, DI];
    req_to_token: [rows, L]; req_slots, seq_lens: [B] int64 on the device. `max_len` bounds the
    sequence lengths (default L); it sets the grid of the score kernel, so keep it fixed across
    replays of a captured graph. `q_pos` may pass seq_lens - 1 when the caller has it (the
    engine's decode positions), saving a launch per layer. `split_counters`: as
    `msa_sparse_attention`'s. `select_in_attention`: the attention kernel selects the blocks
    itself (two launches; False: scores, `msa_select`, attention). Returns [B, Hq, D] in q's dtype.
    """
    q_pos = seq_lens - 1 if q_pos is None else q_pos
    scores = msa_decode_scores(qI, ki_cache, req_to_token, req_slots, q_pos, block_size, max_len,
                               select_blocks=topk_blocks)
    return _select_and_attend(q, k_cache, v_cache, req_to_token, req_slots, q_pos, scores, block_size,
                              topk_blocks, scale, split_counters, select_in_attention)


def _select_and_attend(q, k_cache, v_cache, req_to_token, row_slots, q_pos, scores, block_size, topk_blocks,
                       scale, split_counters, select_in_attention: bool) -> torch.Tensor:
    """Stages 2 and 3 from the scores: in one launch, or `msa_select` then the attention."""
    if select_in_attention:
        return msa_sparse_attention(q, k_cache, v_cache, req_to_token, row_slots, q_pos, None, block_size, scale,
                                    split_counters=split_counters, scores=scores, topk_blocks=topk_blocks)
    sel = msa_select(scores, q_pos, block_size, topk_blocks)
    return msa_sparse_attention(q, k_cache, v_cache, req_to_token, row_slots, q_pos, sel, block_size, scale,
                                split_counters=split_counters)


# ---- chunked prefill -------------------------------------------------------------------------

def msa_extend(q: torch.Tensor, qI: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               ki_cache: torch.Tensor, req_to_token: torch.Tensor, req_slots: torch.Tensor,
               prefix_lens: torch.Tensor, extend_lens: torch.Tensor, extend_starts: torch.Tensor,
               block_size: int, topk_blocks: int, scale: float,
               max_len: Optional[int] = None, split_counters: Optional[torch.Tensor] = None,
               select_in_attention: bool = True, q_pos: Optional[torch.Tensor] = None,
               row_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
    """MSA of each sequence's new queries over its whole cache (chunked prefill, mixed batches):
    `kiln.ops.msa.paged_msa_attention` with device-tensor metadata.

    q: [T, Hq, D], qI: [T, G, DI], sequences concatenated; req_slots, prefix_lens, extend_lens,
    extend_starts: [S] int64 on the device (sequence s owns rows extend_starts[s] ..
    + extend_lens[s], at positions prefix_lens[s] ..). No host sync. Selection and attention run
    per query row with the decode kernels (each row gathers its own N blocks);
    `select_in_attention` as `msa_decode`'s. `q_pos` and `row_slots` ([T] int64: every row's
    position and request row) may pass what the caller already has (the engine's positions and
    token rows); without them they are derived here, ~10 small launches, per call: a verify of
    MiniMax-M3 `bench` paid them on every one of its 24 layers (fifty-second pass).
    """
    t = q.shape[0]
    if q_pos is None or row_slots is None:
        seq = torch.repeat_interleave(torch.arange(extend_lens.shape[0], device=q.device), extend_lens,
                                      output_size=t)
        q_pos = prefix_lens[seq] + torch.arange(t, device=q.device) - extend_starts[seq]
        row_slots = req_slots[seq]
    scores = msa_extend_scores(qI, ki_cache, req_to_token, req_slots, prefix_lens, extend_lens,
                               extend_starts, block_size, max_len, select_blocks=topk_blocks)
    return _select_and_attend(q, k_cache, v_cache, req_to_token, row_slots, q_pos, scores, block_size,
                              topk_blocks, scale, split_counters, select_in_attention)
