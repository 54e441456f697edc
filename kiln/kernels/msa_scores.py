"""MSA's block scores (MiniMax-M3 sparse attention, MODELS.md 3.1): the first of the three stages
of `kiln.kernels.msa` (scores, selection, sparse attention), the one that reads every cached
index key. Decode scores one query per row against each of its blocks (`_decode_scores_kernel`:
each (kv head, row) has a fixed number of programs, each streaming every P-th block's index keys
once, up to the query's own block); chunked prefill scores a tile of queries of one sequence
against a block with one `tl.dot` (`_extend_scores_kernel`). Grids are sized from shapes only
(the scores' width comes from `max_len`): capturable in a CUDA graph.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from kiln.kernels import assert_rows
from kiln.kernels.launch import pdl_launch, wait_for_previous


def _p2(x: int) -> int:
    return triton.next_power_of_2(int(x))


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs_wanted(device: torch.device) -> int:
    """Programs that fill the GPU (one wave); the interpreter wants as few as possible."""
    if device.type != "cuda":
        return 1
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 caches (tests) keep full precision; for 16-bit inputs the argument is moot.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _score_blocks(q1, q2, kI_ptr, r2t_ptr, rslot, qp, s_row_ptr, g, s_ks, s_kg, s_r2t, sqrt_di, num_blocks,
                  select_blocks, first, step, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, TILE_T: tl.constexpr):
    """S[blk] at s_row_ptr for blocks first, first + step, .. of one (row, head) whose query is at
    position qp, its halves q1, q2 [BLOCK_HALF] fp32 (the rotate-half layout's halves, so that a
    kernel that has just rotated the query passes them on): the max over the block's keys up to
    qp of qI.kI, divided by sqrt(DI). Blocks past the query's are not written. With
    select_blocks = N > 0 only what selection reads: the history blocks (before the query's own)
    of rows with more than N causal blocks; nothing for the others."""
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    offs_t = tl.arange(0, TILE_T)
    local = qp // BLOCK_SIZE
    last = local
    if select_blocks > 0:
        last = tl.where(local + 1 > select_blocks, local - 1, -1)
    last = tl.minimum(last, num_blocks - 1)  # a row longer than max_len: no store past NB
    blk = first
    while blk <= last:
        best = tl.full([TILE_T], float("-inf"), tl.float32)
        for t0 in range(0, BLOCK_SIZE, TILE_T):
            t = t0 + offs_t
            pos = blk * BLOCK_SIZE + t
            # Keys past the query are masked before their slot is read: req_to_token holds stale
            # or zero slots there.
            tmask = (t < BLOCK_SIZE) & (pos <= qp)
            slot = tl.load(r2t_ptr + rslot * s_r2t + pos, mask=tmask, other=0).to(tl.int64)
            m = tmask[:, None] & dmask[None, :]
            k = kI_ptr + slot[:, None] * s_ks + g * s_kg + d[None, :]
            k1 = tl.load(k, mask=m, other=0.0).to(tl.float32)
            k2 = tl.load(k + HALF, mask=m, other=0.0).to(tl.float32)
            logit = tl.sum(k1 * q1[None, :] + k2 * q2[None, :], axis=1)
            best = tl.maximum(best, tl.where(tmask, logit, float("-inf")))
        # max commutes with the division (rounding is monotone), so this equals the reference's
        # max of (qI.kI / sqrt(DI)) up to the order of the dot product's sum.
        score = tl.max(best, axis=0) / sqrt_di
        tl.store(s_row_ptr + blk, score)
        blk += step


@triton.jit
def _decode_scores_kernel(qI_ptr, kI_ptr, r2t_ptr, rslot_ptr, qpos_ptr, s_ptr,
                          s_qr, s_qg, s_ks, s_kg, s_r2t, s_sr, s_sg, sqrt_di, num_blocks, select_blocks,
                          HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          TILE_T: tl.constexpr, PDL: tl.constexpr):
    """S[row, g, blk] for one query per row: GEMV of one block's index keys, then max
    (`_score_blocks`).

    Program p of a (head, row) scores blocks p, p + P, .. (P = the grid's first dimension) up to
    the query's own block, a loop bounded by the row's length: the grid is sized to fill the GPU,
    not by the longest possible context (a captured graph's grid spans the context, which cost
    one program per block of it, nearly all idle)."""
    wait_for_previous(PDL)
    g = tl.program_id(1)
    row = tl.program_id(2)
    qp = tl.load(qpos_ptr + row)
    rslot = tl.load(rslot_ptr + row).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    q = qI_ptr + row * s_qr + g * s_qg + d
    q1 = tl.load(q, mask=dmask, other=0.0).to(tl.float32)
    q2 = tl.load(q + HALF, mask=dmask, other=0.0).to(tl.float32)
    _score_blocks(q1, q2, kI_ptr, r2t_ptr, rslot, qp, s_ptr + row * s_sr + g * s_sg, g, s_ks, s_kg, s_r2t, sqrt_di,
                  num_blocks, select_blocks, tl.program_id(0), tl.num_programs(0), HALF, BLOCK_HALF, BLOCK_SIZE,
                  TILE_T)


@triton.jit
def _extend_scores_kernel(qI_ptr, kI_ptr, r2t_ptr, seq_rslot_ptr, seq_prefix_ptr, seq_len_ptr,
                          seq_start_ptr, s_ptr,
                          s_qr, s_qg, s_ks, s_kg, s_r2t, s_sr, s_sg, sqrt_di, num_seqs, num_blocks,
                          select_blocks, NUM_SEQS_P: tl.constexpr, DI: tl.constexpr, DI_P: tl.constexpr,
                          BLOCK_SIZE: tl.constexpr, TILE_Q: tl.constexpr, TILE_T: tl.constexpr,
                          DOT_PREC: tl.constexpr, PDL: tl.constexpr):
    """S[row, g, blk] for TILE_Q consecutive queries of one sequence: [TILE_Q, DI] x [DI, TILE_T]
    dots against the block's index keys, causal mask, row max.

    Programs are laid out over an upper bound of the tile count; every program sums the tiles per
    sequence itself (a running total over at most NUM_SEQS_P lengths) and finds its sequence by
    counting the ends <= its id (programs past the last tile store nothing). A cumsum launched
    before the kernel cost a verify of MiniMax-M3 `bench` three launches a layer (fifty-second
    pass). As in the decode kernel, program p of a tile
    scores blocks p, p + P, .. up to the tile's last visible key, whatever the grid's size; with
    select_blocks = N > 0 only what selection reads (`_score_blocks`): the blocks before each
    query's own, of queries with more than N causal blocks.
    """
    wait_for_previous(PDL)
    tile = tl.program_id(0)
    g = tl.program_id(2)
    offs_s = tl.arange(0, NUM_SEQS_P)
    s_mask = offs_s < num_seqs
    tiles = (tl.load(seq_len_ptr + offs_s, mask=s_mask, other=0).to(tl.int32) + TILE_Q - 1) // TILE_Q
    ends = tl.where(s_mask, tl.cumsum(tiles, axis=0), 2147483647)
    seq = tl.sum((ends <= tile).to(tl.int32), axis=0)
    live = seq < num_seqs
    first_tile = tl.sum(tl.where(offs_s < seq, tiles, 0), axis=0)  # the tiles before this sequence's
    seq = tl.minimum(seq, num_seqs - 1)
    n = tl.load(seq_len_ptr + seq)
    prefix = tl.load(seq_prefix_ptr + seq)
    row0 = tl.load(seq_start_ptr + seq)
    rslot = tl.load(seq_rslot_ptr + seq).to(tl.int64)
    i = (tile - first_tile) * TILE_Q + tl.arange(0, TILE_Q)  # query index within the sequence
    qmask = live & (i < n)
    q_pos = prefix + i
    rows = row0 + i
    offs_d = tl.arange(0, DI_P)
    dmask = offs_d < DI
    q = tl.load(qI_ptr + rows[:, None] * s_qr + g * s_qg + offs_d[None, :],
                mask=qmask[:, None] & dmask[None, :], other=0.0)
    offs_t = tl.arange(0, TILE_T)
    # A key is needed if some live query of the tile sees it: positions below `end`, one past
    # the last live query's (prefix + min(n, tile end) - 1); a dead program has end = 0.
    end = tl.where(live, prefix + tl.minimum(n, (tile - first_tile + 1) * TILE_Q), 0)
    # Under selection a query with at most N causal blocks takes them all and reads no score,
    # and a longer one reads only the blocks before its own (a verify at a 1K context: none).
    local = q_pos // BLOCK_SIZE
    needed = qmask & ((select_blocks == 0) | (local + 1 > select_blocks))
    stop = tl.where(select_blocks > 0, tl.max(tl.where(needed, local, 0), axis=0),
                    (end + BLOCK_SIZE - 1) // BLOCK_SIZE)
    blk = tl.program_id(1)
    while blk < tl.minimum(stop, num_blocks):
        best = tl.full([TILE_Q], float("-inf"), tl.float32)
        for t0 in range(0, BLOCK_SIZE, TILE_T):
            t = t0 + offs_t
            pos = blk * BLOCK_SIZE + t
            tmask = (t < BLOCK_SIZE) & (pos < end)
            slot = tl.load(r2t_ptr + rslot * s_r2t + pos, mask=tmask, other=0).to(tl.int64)
            k = tl.load(kI_ptr + slot[:, None] * s_ks + g * s_kg + offs_d[None, :],
                        mask=tmask[:, None] & dmask[None, :], other=0.0)
            logit = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC)  # [TILE_Q, TILE_T], fp32
            vis = tmask[None, :] & (pos[None, :] <= q_pos[:, None])
            best = tl.maximum(best, tl.max(tl.where(vis, logit, float("-inf")), axis=1))
        tl.store(s_ptr + rows * s_sr + g * s_sg + blk, best / sqrt_di,
                 mask=needed & ((select_blocks == 0) | (blk < local)))
        blk += tl.num_programs(1)


def _scores_config(block_size: int) -> tuple[int, int]:
    """(keys per tile, warps) of the decode score kernel. Measured on an H200 (block 128, DI 128,
    bf16): 64-key tiles with 16 warps stream the index keys at 3.6-3.9 TB/s, ~10% ahead of 4 or 8
    warps and of 128-key tiles."""
    tile = min(_p2(block_size), 64)
    return tile, 16 if tile >= 64 else 4


def _num_blocks(req_to_token: torch.Tensor, block_size: int, max_len: Optional[int]) -> int:
    length = req_to_token.shape[1] if max_len is None else int(max_len)
    return max(1, -(-length // block_size))


def _score_programs(rows: int, g: int, nb: int, device: torch.device) -> int:
    """Programs per (row or query tile, head) of the score kernels: 4 per SM across the grid (one
    wave of the decode kernel's 16-warp programs), at most one per block. The grid never depends
    on the lengths, so in a large batch a row much longer than the others is walked by few
    programs (a known limit: spreading (row, block) pairs over the grid would need a device-side
    prefix sum)."""
    return max(1, min(nb, -(-4 * _programs_wanted(device) // (rows * g))))


def msa_decode_scores(qI: torch.Tensor, ki_cache: torch.Tensor, req_to_token: torch.Tensor,
                      req_slots: torch.Tensor, q_pos: torch.Tensor, block_size: int,
                      max_len: Optional[int] = None, programs: Optional[int] = None,
                      select_blocks: int = 0) -> torch.Tensor:
    """Block scores S [R, G, NB] fp32 of one query per row, NB = ceil(max_len / block_size).

    qI: [R, G, DI]; ki_cache: [slots, G, DI]; req_slots, q_pos: [R] int64 (the row of
    req_to_token and the query's position; it sees positions 0..q_pos). Only the blocks up to
    the query's own (0..q_pos // block_size) are written; the rest hold anything (`msa_select`
    reads none of them). With `select_blocks` N > 0, only what `msa_select(..., N)` reads: the
    blocks before the query's own, in rows with more than N causal blocks (at most N: all are
    taken, no score is read). `programs` overrides the programs per (row, head) (tests).
    """
    assert_rows(req_slots=req_slots, q_pos=q_pos)
    r, g, di = qI.shape
    assert ki_cache.stride(-1) == 1 and qI.stride(-1) == 1 and req_to_token.stride(-1) == 1
    assert di % 2 == 0, "index heads are RoPE'd, so of even size"
    nb = _num_blocks(req_to_token, block_size, max_len)
    assert g <= 65535 and r <= 65535
    scores = torch.empty(r, g, nb, dtype=torch.float32, device=qI.device)
    if r == 0:
        return scores
    tile_t, warps = _scores_config(block_size)
    per_row = programs or _score_programs(r, g, nb, qI.device)
    _decode_scores_kernel[(per_row, g, r)](
        qI, ki_cache, req_to_token, req_slots, q_pos, scores,
        qI.stride(0), qI.stride(1), ki_cache.stride(0), ki_cache.stride(1), req_to_token.stride(0),
        scores.stride(0), scores.stride(1), math.sqrt(di), nb, select_blocks,
        HALF=di // 2, BLOCK_HALF=_p2(di // 2), BLOCK_SIZE=block_size, TILE_T=tile_t, num_warps=warps,
        **pdl_launch(qI.device))
    return scores


_EXTEND_TILE_Q = 32


def msa_extend_scores(qI: torch.Tensor, ki_cache: torch.Tensor, req_to_token: torch.Tensor,
                      req_slots: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                      extend_starts: torch.Tensor, block_size: int,
                      max_len: Optional[int] = None, programs: Optional[int] = None,
                      select_blocks: int = 0) -> torch.Tensor:
    """Block scores S [T, G, NB] fp32 for the new queries of several sequences (concatenated in
    qI [T, G, DI]; sequence s has extend_lens[s] queries from row extend_starts[s], at positions
    prefix_lens[s]..). Blocks with no key visible to a query are -inf. With `select_blocks` N > 0,
    only what `msa_select(..., N)` reads, as `msa_decode_scores`: the blocks before each query's
    own, of queries with more than N causal blocks; the rest hold anything, unfilled. `programs`
    overrides the programs per (query tile, head) (tests)."""
    assert_rows(req_slots=req_slots, prefix_lens=prefix_lens, extend_lens=extend_lens, extend_starts=extend_starts)
    t, g, di = qI.shape
    assert ki_cache.stride(-1) == 1 and qI.stride(-1) == 1 and req_to_token.stride(-1) == 1
    nb = _num_blocks(req_to_token, block_size, max_len)
    if select_blocks > 0:  # nothing unwritten is read: no fill launch
        scores = torch.empty(t, g, nb, dtype=torch.float32, device=qI.device)
    else:
        scores = torch.full((t, g, nb), float("-inf"), dtype=torch.float32, device=qI.device)
    ns = extend_lens.shape[0]
    if t == 0 or ns == 0:
        return scores
    tq = _EXTEND_TILE_Q
    max_tiles = -(-t // tq) + ns  # each sequence wastes less than one tile
    # Eager (max_len given, so nb is tight): a program per block, which keeps a long sequence's
    # blocks parallel beside a long prefill chunk. In a graph nb spans the context: fill the GPU.
    if programs is None and max_len is not None:
        programs = nb
    per_tile = programs or _score_programs(max_tiles, g, nb, qI.device)
    assert per_tile <= 65535 and g <= 65535
    _extend_scores_kernel[(max_tiles, per_tile, g)](
        qI, ki_cache, req_to_token, req_slots, prefix_lens, extend_lens, extend_starts, scores,
        qI.stride(0), qI.stride(1), ki_cache.stride(0), ki_cache.stride(1), req_to_token.stride(0),
        scores.stride(0), scores.stride(1), math.sqrt(di), ns, nb, select_blocks,
        NUM_SEQS_P=_p2(ns), DI=di, DI_P=max(16, _p2(di)), BLOCK_SIZE=block_size, TILE_Q=tq,
        TILE_T=max(16, min(_p2(block_size), 64)), DOT_PREC=_dot_precision(qI.dtype), num_warps=4,
        **pdl_launch(qI.device))
    return scores

