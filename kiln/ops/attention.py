"""Reference attention ops in plain PyTorch (the spec that fast kernels are tested against).

Both ops compute causal softmax attention with GQA, an optional sliding window (a query at
position i sees keys j with i - W < j <= i), in fp32, per sequence.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
            k_pos: torch.Tensor, scale: float, sliding_window: Optional[int]) -> torch.Tensor:
    """q: [n, Hq, D]; k, v: [m, Hkv, D]; positions [n], [m]. Returns [n, Hq, D] in q's dtype."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    qf = q.float().view(n, hkv, group, d)
    kf, vf = k.float(), v.float()
    scores = torch.einsum("nhgd,mhd->hgnm", qf, kf) * scale
    visible = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        visible &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgnm,mhd->nhgd", probs, vf)
    return out.reshape(n, hq, d).to(q.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    req_to_token: torch.Tensor, req_slots: Sequence[int], prefix_lens: Sequence[int],
                    extend_lens: Sequence[int], scale: float,
                    sliding_window: Optional[int] = None) -> torch.Tensor:
    """Attention of each sequence's new tokens over its cached + new K/V.

    q: [T, Hq, D] (sequences concatenated); k_cache/v_cache: [num_slots, Hkv, D] already holding
    this forward's K/V; req_to_token[slot, pos] = token slot of position pos.
    """
    out = torch.empty_like(q)
    start = 0
    for slot, prefix, n in zip(req_slots, prefix_lens, extend_lens):
        total = prefix + n
        lo = 0 if sliding_window is None else max(0, prefix - sliding_window + 1)
        slots = req_to_token[slot, lo:total].long()
        q_pos = torch.arange(prefix, total, device=q.device)
        k_pos = torch.arange(lo, total, device=q.device)
        out[start:start + n] = _attend(q[start:start + n], k_cache[slots], v_cache[slots],
                                       q_pos, k_pos, scale, sliding_window)
        start += n
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           req_to_token: torch.Tensor, req_slots: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, sliding_window: Optional[int] = None) -> torch.Tensor:
    """One new token per sequence, all sequences in one padded SDPA call.

    q: [B, Hq, D] (the token at position seq_len - 1 of each sequence); seq_lens: [B] int64 on
    q's device. Keys are gathered into [B, max_len] and masked by length (and window).
    """
    b, hq, d = q.shape
    max_len = int(seq_lens.max())
    idx = req_to_token[req_slots, :max_len]  # [B, L]
    k = k_cache[idx].transpose(1, 2)  # [B, Hkv, L, D]
    v = v_cache[idx].transpose(1, 2)
    pos = torch.arange(max_len, device=q.device)
    visible = pos[None, :] < seq_lens[:, None]
    if sliding_window is not None:
        visible &= pos[None, :] > (seq_lens[:, None] - 1 - sliding_window)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2).to(k.dtype), k, v, attn_mask=visible[:, None, None, :], scale=scale,
        enable_gqa=k.shape[1] != hq)
    return out.squeeze(2).to(q.dtype)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: Sequence[int],
                     scale: float, sliding_window: Optional[int] = None) -> torch.Tensor:
    """Causal attention inside each of several whole sequences packed along dim 0."""
    out = torch.empty_like(q)
    start = 0
    for n in seq_lens:
        pos = torch.arange(n, device=q.device)
        sl = slice(start, start + n)
        out[sl] = _attend(q[sl], k[sl], v[sl], pos, pos, scale, sliding_window)
        start += n
    return out
