"""Reference attention ops in plain PyTorch (the spec that fast kernels are tested against).

Every op computes causal softmax attention with GQA, an optional sliding window (a query at
position i sees keys j with i - W < j <= i), in fp32, per sequence, and an optional
query-conditioned relative-logit bias (Inkling, MODELS.md 2.2): `rel [n, Hq, R]` holds, for each
query row and head, R relative logits, and `rel[i, h, pos_i - pos_j]` is added to the logit
(after q.k * scale) when 0 <= pos_i - pos_j < R. Farther keys get no bias. `key_gap` g (MTP
layer k of MODELS.md 2.4 uses g = k - 1) also hides keys with 0 < pos_i - pos_j < g.

Paged ops read a sequence's keys through `req_to_token[slot, pos + key_offset]`: positions are the
math (masks, window, relative bias), `key_offset` only says where they are stored. The engine
stores MTP layer k's entry for index j at position j + k, the last token it depends on, so that a
page of the prefix cache holds only entries that are functions of the tokens it covers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             loc: torch.Tensor, index_k: Optional[torch.Tensor] = None,
             index_k_cache: Optional[torch.Tensor] = None) -> None:
    """Write this forward's K/V rows into the caches at token slots `loc` [T], cast to the caches'
    dtypes: k_cache[loc] = k, v_cache[loc] = v (k, v [T, Hkv, D]; caches [slots, Hkv, D]); with
    `index_k` also index_k_cache[loc] = index_k (MSA's indexer keys, same slots)."""
    k_cache[loc] = k.to(k_cache.dtype)
    v_cache[loc] = v.to(v_cache.dtype)
    if index_k is not None:
        index_k_cache[loc] = index_k.to(index_k_cache.dtype)


@dataclass(frozen=True)
class RelProjection:
    """Inkling's relative-logit bias before its projection: rel = r P^T (times lam), [T, Hq, R].

    The decode attention kernel computes each key's bias from r and the row of P at the key's
    distance (`kiln.kernels.decode_attention`), which saves the projection's launch and the
    [T, Hq, R] round trip; every other path calls `materialize`, the definition."""

    r: torch.Tensor  # [T, Hq, d_r]
    weight: torch.Tensor  # P [R, d_r], the bias-free projection's weight
    lam: Optional[torch.Tensor] = None  # [T] fp32: full layers' attention scale

    def materialize(self) -> torch.Tensor:
        """[T, Hq, R]: the projection in r's dtype, then (full layers) times lam in fp32."""
        rel = F.linear(self.r, self.weight)
        return rel if self.lam is None else rel.float() * self.lam[:, None, None]


def materialized(rel):
    """A bias tensor from either form (None stays None)."""
    return rel.materialize() if isinstance(rel, RelProjection) else rel


def rel_bias(rel: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """The additive bias [n, Hq, m] (fp32): rel[i, h, q_pos_i - k_pos_j] where that distance is in
    [0, R), else 0. rel: [n, Hq, R]; q_pos [n]; k_pos [m] (or [n, m] per row)."""
    n, hq, r = rel.shape
    dist = q_pos[:, None] - (k_pos if k_pos.dim() == 2 else k_pos[None, :])  # [n, m]
    near = (dist >= 0) & (dist < r)
    idx = dist.clamp(0, r - 1)[:, None, :].expand(n, hq, dist.shape[1])
    return torch.where(near[:, None, :], rel.float().gather(2, idx), 0.0)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
            k_pos: torch.Tensor, scale: float, sliding_window: Optional[int],
            rel: Optional[torch.Tensor] = None, key_gap: int = 0) -> torch.Tensor:
    """q: [n, Hq, D]; k, v: [m, Hkv, D]; positions [n], [m]; rel [n, Hq, R] or None.
    Returns [n, Hq, D] in q's dtype."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    qf = q.float().view(n, hkv, group, d)
    kf, vf = k.float(), v.float()
    scores = torch.einsum("nhgd,mhd->hgnm", qf, kf) * scale
    if rel is not None:
        bias = rel_bias(rel, q_pos, k_pos)  # [n, Hq, m]; head h = g_kv * group + g
        scores = scores + bias.permute(1, 0, 2).reshape(hkv, group, n, k.shape[0])
    visible = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        visible &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
    if key_gap > 1:
        dist = q_pos[:, None] - k_pos[None, :]
        visible &= (dist == 0) | (dist >= key_gap)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgnm,mhd->nhgd", probs, vf)
    return out.reshape(n, hq, d).to(q.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    req_to_token: torch.Tensor, req_slots: Sequence[int], prefix_lens: Sequence[int],
                    extend_lens: Sequence[int], scale: float,
                    sliding_window: Optional[int] = None,
                    rel: Optional[torch.Tensor] = None, key_gap: int = 0,
                    positions: Optional[Sequence[int]] = None, key_offset: int = 0) -> torch.Tensor:
    """Attention of each sequence's new tokens over its cached + new K/V.

    q: [T, Hq, D] (sequences concatenated); k_cache/v_cache: [num_slots, Hkv, D] already holding
    this forward's K/V; req_to_token[slot, pos] = token slot of position pos; rel: [T, Hq, R].
    By default sequence b's queries sit at positions prefix_b .. prefix_b + extend_b - 1;
    `positions` ([T] host ints, ascending per sequence, `prefix_lens` then unused) places them
    anywhere, e.g. the MTP chain's catch-up rows followed by a draft row further ahead. Keys are
    every position up to the sequence's last query, read at `pos + key_offset`, masked per query
    (causal, window, key_gap).
    """
    out = torch.empty_like(q)
    start = 0
    for i, (slot, n) in enumerate(zip(req_slots, extend_lens)):
        if positions is None:
            first, last = prefix_lens[i], prefix_lens[i] + n - 1
            q_pos = torch.arange(first, last + 1, device=q.device)
        else:
            rows = list(positions[start:start + n])
            first, last = rows[0], rows[-1]
            q_pos = torch.tensor(rows, device=q.device)
        lo = 0 if sliding_window is None else max(0, first - sliding_window + 1)
        slots = req_to_token[slot, lo + key_offset:last + 1 + key_offset].long()
        k_pos = torch.arange(lo, last + 1, device=q.device)
        out[start:start + n] = _attend(q[start:start + n], k_cache[slots], v_cache[slots],
                                       q_pos, k_pos, scale, sliding_window,
                                       None if rel is None else rel[start:start + n], key_gap)
        start += n
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           req_to_token: torch.Tensor, req_slots: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, sliding_window: Optional[int] = None,
                           rel: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One new token per sequence, all sequences in one padded SDPA call.

    q: [B, Hq, D] (the token at position seq_len - 1 of each sequence); seq_lens: [B] int64 on
    q's device; rel: [B, Hq, R]. Keys are gathered into [B, max_len] and masked by length (and
    window). With rel, the bias becomes a float mask and the call runs in fp32.
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
    if rel is None:
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2).to(k.dtype), k, v, attn_mask=visible[:, None, None, :], scale=scale,
            enable_gqa=k.shape[1] != hq)
        return out.squeeze(2).to(q.dtype)
    bias = rel_bias(rel, seq_lens - 1, pos[None, :].expand(b, max_len))  # [B, Hq, L]
    mask = bias.masked_fill(~visible[:, None, :], float("-inf"))
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2).float(), k.float(), v.float(), attn_mask=mask[:, :, None, :], scale=scale,
        enable_gqa=k.shape[1] != hq)
    return out.squeeze(2).to(q.dtype)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: Sequence[int],
                     scale: float, sliding_window: Optional[int] = None,
                     rel: Optional[torch.Tensor] = None, key_gap: int = 0,
                     pad_under_grad: bool = False) -> torch.Tensor:
    """Causal attention inside each of several whole sequences packed along dim 0 (positions
    restart at 0 at every sequence start); rel: [T, Hq, R] or None.

    On a GPU the sequences can run together, padded to the longest (`uses_padding`): the
    trainers' passes hold many sequences, and one batched einsum replaces their small launches
    (on an H200 the loop held the SmolLM2 hidden-state pass to ~17K tokens/s and left the policy
    trainer's Inkling micro-batch waiting on the host). `pad_under_grad` pads under autograd
    whatever the lengths (the MTP trainer's few layers). On a CPU the loop is faster (4.5x on 16
    sequences of 90-384 tokens: the padding is compute there). Same math per row."""
    lens = [int(n) for n in seq_lens]
    if uses_padding(lens, q.shape[1], q.device.type, torch.is_grad_enabled() and not pad_under_grad):
        return _padded_packed_attention(q, k, v, lens, scale, sliding_window, key_gap, rel)
    out = torch.empty_like(q)
    start = 0
    for n in lens:
        pos = torch.arange(n, device=q.device)
        sl = slice(start, start + n)
        out[sl] = _attend(q[sl], k[sl], v[sl], pos, pos, scale, sliding_window,
                          None if rel is None else rel[sl], key_gap)
        start += n
    return out


# Largest fp32 score tensor [B, Hq, L, L] the padded path may build (1 GiB).
PADDED_SCORES = 2 ** 28
# Under autograd, how much more the padded path may keep than the loop (the backward keeps the
# probabilities: B * L^2 per head padded, sum n^2 in the loop).
MAX_PADDING_UNDER_GRAD = 1.5


def uses_padding(lens: list[int], heads: int, device_type: str, keeps_memory: bool) -> bool:
    """Whether `packed_attention` runs its sequences padded together: on a GPU, for several
    sequences whose padded scores fit PADDED_SCORES; and when autograd keeps them
    (`keeps_memory`), only if they are at most MAX_PADDING_UNDER_GRAD times what the loop keeps,
    so that a policy trainer's memory does not grow with uneven lengths."""
    if len(lens) < 2 or device_type == "cpu":
        return False
    padded = len(lens) * max(lens) ** 2
    if padded * heads > PADDED_SCORES:
        return False
    return not keeps_memory or padded <= MAX_PADDING_UNDER_GRAD * sum(n * n for n in lens)


def _padded_packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float,
                             sliding_window: Optional[int], key_gap: int,
                             rel: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`packed_attention` with every sequence at once: rows gathered into [B, L, H, D] (padding
    repeats row 0), the visibility rule of `_attend` and `rel_bias` on positions 0..L-1 (the
    same for every sequence, since positions restart at 0), keys past a sequence's end masked."""
    dev, b, L = q.device, len(lens), max(lens)
    n_t = torch.tensor(lens, device=dev)
    starts = torch.cumsum(n_t, 0) - n_t
    pos = torch.arange(L, device=dev)
    valid = pos[None, :] < n_t[:, None]  # [B, L]
    idx = torch.where(valid, starts[:, None] + pos[None, :], 0)
    hq, d, hkv = q.shape[1], q.shape[2], k.shape[1]
    group = hq // hkv
    qf = q.float()[idx].view(b, L, hkv, group, d)
    kf, vf = k.float()[idx], v.float()[idx]  # [B, L, Hkv, D]
    scores = torch.einsum("blhgd,bmhd->bhglm", qf, kf) * scale
    if rel is not None:  # [B, L, Hq, L]; head h = g_kv * group + g, as in _attend
        bias = rel_bias(rel[idx].flatten(0, 1), pos.repeat(b), pos)  # every sequence at 0..L-1
        scores = scores + bias.view(b, L, hkv, group, L).permute(0, 2, 3, 1, 4)
    dist = pos[:, None] - pos[None, :]
    visible = dist >= 0
    if sliding_window is not None:
        visible &= dist < sliding_window
    if key_gap > 1:
        visible &= (dist == 0) | (dist >= key_gap)
    visible = visible[None] & valid[:, None, :]  # [B, L, L]: no key past the sequence's end
    # A padding row keeps its diagonal, so no row is all -inf (NaN would reach the backward).
    visible |= (~valid)[:, :, None] & torch.eye(L, dtype=torch.bool, device=dev)[None]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    out = torch.einsum("bhglm,bmhd->blhgd", torch.softmax(scores, dim=-1), vf)
    return out.reshape(b, L, hq, d)[valid].to(q.dtype)

