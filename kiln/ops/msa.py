"""Reference MSA ops (MiniMax-M3 sparse attention, MODELS.md 3.1) in plain PyTorch, fp32.

MSA splits each sequence into blocks of B tokens. Per KV head g, a small indexer scores every
causal block for every query by the max indexer logit inside it; each query then attends (with all
query heads of its group) only to its N best blocks, always including its own ("local") block:

    S[g, i, b] = max_{t in block b, t <= p_i} (qI[i, g] . kI[t, g]) / sqrt(DI)       (-inf if none)
    n_i = floor(p_i / B) + 1
    Sel[g, i]  = all of 0..n_i-1                                   if n_i <= N
               = top N-1 of S over blocks 0..n_i-2 (ties: lower id), then block n_i-1   otherwise
    o[i, h]    = softmax over keys t <= p_i with block(t) in Sel[g(h), i]

Every op takes the queries' and keys' absolute positions, so the same call serves a whole packed
sequence (trainer), a chunk of new queries against all cached keys of its sequence (chunked
prefill) and one query (decode): nothing depends on how many queries are in the call.
`sparse_attention` gathers the selected blocks; `dense_masked_attention` is the oracle it is
tested against (full scores with a block mask).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

# Queries per step of `sparse_attention`: bounds the gathered [G, n, N*B, D] keys in memory.
_QUERY_CHUNK = 256


def block_scores(qI: torch.Tensor, kI: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """Indexer block scores S [G, n, nblocks] in fp32, nblocks = max(q_pos) // B + 1.

    qI: [n, G, DI]; kI: [m, G, DI]; q_pos: [n], k_pos: [m] absolute positions. S[g, i, b] is the
    max of (qI . kI) / sqrt(DI) over keys of block b visible to query i (k_pos <= q_pos); -inf
    when block b has no such key.
    """
    di = qI.shape[-1]
    nblocks = int(q_pos.max()) // block_size + 1
    logits = torch.einsum("ngd,mgd->gnm", qI.float(), kI.float()) / math.sqrt(di)
    visible = k_pos[None, :] <= q_pos[:, None]  # [n, m]
    logits = logits.masked_fill(~visible, float("-inf"))
    # Keys past the last query's block are invisible to every query; clamp keeps them in range.
    blk = (k_pos // block_size).clamp(max=nblocks - 1)
    g, n, m = logits.shape
    s = logits.new_full((g, n, nblocks), float("-inf"))
    return s.scatter_reduce(2, blk.view(1, 1, m).expand(g, n, m), logits, reduce="amax", include_self=True)


def select_blocks(scores: torch.Tensor, q_pos: torch.Tensor, block_size: int, topk_blocks: int) -> torch.Tensor:
    """Selected block ids [G, n, N] int64 from block scores [G, n, nblocks]; -1 pads.

    A row with n_i <= N causal blocks selects all of them in order. A longer row selects its N-1
    best history blocks (best first; equal scores: the lower id first, by a stable sort) and then
    its local block n_i - 1 as the last entry.
    """
    g, n, nblocks = scores.shape
    big_n = topk_blocks
    n_causal = q_pos // block_size + 1  # [n]
    local = n_causal - 1
    ids = torch.arange(max(nblocks, big_n), device=scores.device)

    dense = torch.where(ids[None, :big_n] < n_causal[:, None], ids[None, :big_n], -1)  # [n, N]
    dense = dense.unsqueeze(0).expand(g, n, big_n)
    if bool((n_causal <= big_n).all()):
        return dense.clone()

    # Only history blocks compete; the local block (and anything later) is pushed to the end.
    history = scores.float().masked_fill(ids[None, None, :nblocks] >= local[None, :, None], float("-inf"))
    order = torch.sort(history, dim=-1, descending=True, stable=True).indices[..., :big_n - 1]
    sparse = torch.cat([order, local.view(1, n, 1).expand(g, n, 1)], dim=-1)
    return torch.where((n_causal > big_n).view(1, n, 1), sparse, dense)


def select(qI: torch.Tensor, kI: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
           block_size: int, topk_blocks: int) -> torch.Tensor:
    """Block scores then selection: [G, n, N] block ids (the indexer is frozen: no gradient)."""
    with torch.no_grad():
        return select_blocks(block_scores(qI, kI, q_pos, k_pos, block_size), q_pos, block_size, topk_blocks)


def block_mask(sel: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """M [G, n, m] bool: key t is visible to query i of group g (causal and its block selected)."""
    kb = k_pos // block_size  # [m]
    in_sel = (sel[:, :, :, None] == kb[None, None, None, :]).any(dim=2)  # -1 never matches
    return in_sel & (k_pos[None, None, :] <= q_pos[None, :, None])


def dense_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                           k_pos: torch.Tensor, sel: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """The oracle: fp32 softmax(q k^T * scale + log M) v over ALL keys, M from `block_mask`.

    q: [n, Hq, D]; k, v: [m, G, D]; sel: [G, n, N]. Returns [n, Hq, D] in q's dtype.
    """
    n, hq, d = q.shape
    g = k.shape[1]
    qf = q.float().view(n, g, hq // g, d)
    scores = torch.einsum("ngrd,mgd->grnm", qf, k.float()) * scale
    mask = block_mask(sel, q_pos, k_pos, block_size)  # [G, n, m]
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    out = torch.einsum("grnm,mgd->ngrd", torch.softmax(scores, dim=-1), v.float())
    return out.reshape(n, hq, d).to(q.dtype)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                     k_pos: torch.Tensor, sel: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """Attention over the selected blocks only: gathers N*B keys per (group, query).

    q: [n, Hq, D]; k, v: [m, G, D] with distinct positions k_pos (any order, gaps allowed);
    sel: [G, n, N] as `select_blocks` returns it (valid ids first, then -1 padding).
    Same result as `dense_masked_attention`, cost O(n * N * B) instead of O(n * m).
    """
    n, hq, d = q.shape
    m, g, _ = k.shape
    bsz = block_size
    # -1 padding trails every row: drop columns no query uses (short sequences, huge N).
    sel = sel[..., :max(1, int((sel >= 0).sum(-1).max()))]
    # Row of the key at each position (-1: no such key), so a block id becomes B key rows.
    row_of_pos = torch.full((int(k_pos.max()) + 1,), -1, dtype=torch.long, device=k.device)
    row_of_pos[k_pos] = torch.arange(m, device=k.device)
    kt, vt = k.float().transpose(0, 1), v.float().transpose(0, 1)  # [G, m, D]
    gidx = torch.arange(g, device=k.device).view(g, 1, 1)
    out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    for s in range(0, n, _QUERY_CHUNK):
        e = min(s + _QUERY_CHUNK, n)
        blocks = sel[:, s:e]  # [G, c, N]
        pos = (blocks[..., None] * bsz + torch.arange(bsz, device=k.device)).flatten(2)  # [G, c, N*B]
        in_range = (blocks[..., None] >= 0).expand(*blocks.shape, bsz).flatten(2) & (pos < row_of_pos.numel())
        rows = torch.where(in_range, row_of_pos[pos.clamp(0, row_of_pos.numel() - 1)], -1)
        valid = (rows >= 0) & (pos <= q_pos[None, s:e, None])
        kg = kt[gidx, rows.clamp(min=0)]  # [G, c, N*B, D]
        vg = vt[gidx, rows.clamp(min=0)]
        qc = q[s:e].float().view(e - s, g, hq // g, d)
        scores = torch.einsum("cgrd,gcjd->grcj", qc, kg) * scale
        scores = scores.masked_fill(~valid[:, None], float("-inf"))
        o = torch.einsum("grcj,gcjd->cgrd", torch.softmax(scores, dim=-1), vg)
        out[s:e] = o.reshape(e - s, hq, d).to(q.dtype)
    return out


def packed_msa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qI: torch.Tensor,
                         kI: torch.Tensor, seq_lens: Sequence[int], block_size: int, topk_blocks: int,
                         scale: float) -> torch.Tensor:
    """MSA over whole sequences packed along dim 0 (the trainer's path; no cache).

    q: [T, Hq, D]; k, v: [T, G, D]; qI, kI: [T, G, DI]; each sequence starts at position 0.
    """
    out = torch.empty_like(q)
    start = 0
    for n in seq_lens:
        sl = slice(start, start + n)
        pos = torch.arange(n, device=q.device)
        sel = select(qI[sl], kI[sl], pos, pos, block_size, topk_blocks)
        out[sl] = sparse_attention(q[sl], k[sl], v[sl], pos, pos, sel, block_size, scale)
        start += n
    return out


def paged_msa_attention(q: torch.Tensor, qI: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        index_k_cache: torch.Tensor, req_to_token: torch.Tensor, req_slots: Sequence[int],
                        prefix_lens: Sequence[int], extend_lens: Sequence[int], block_size: int,
                        topk_blocks: int, scale: float) -> torch.Tensor:
    """MSA of each sequence's new queries over its whole cache (chunked prefill, decode, mixed).

    q: [T, Hq, D], qI: [T, G, DI] (sequences concatenated); k_cache/v_cache: [slots, G, D] and
    index_k_cache: [slots, G, DI] already holding this forward's K, V and kI;
    req_to_token[slot, pos] = token slot of position pos. The new queries of a sequence sit at
    positions prefix..prefix+n-1 and see positions 0..prefix+n-1.
    """
    out = torch.empty_like(q)
    start = 0
    for slot, prefix, n in zip(req_slots, prefix_lens, extend_lens):
        total = prefix + n
        slots = req_to_token[slot, :total].long()
        q_pos = torch.arange(prefix, total, device=q.device)
        k_pos = torch.arange(total, device=q.device)
        rows = slice(start, start + n)
        sel = select(qI[rows], index_k_cache[slots], q_pos, k_pos, block_size, topk_blocks)
        out[rows] = sparse_attention(q[rows], k_cache[slots], v_cache[slots], q_pos, k_pos, sel,
                                     block_size, scale)
        start += n
    return out
