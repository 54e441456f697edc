"""The attention layer and the backends that execute it.

`Attention` is what a model calls with projected q/k/v; it hands them to `batch.backend`,
which knows where K/V live: `kiln.engine.paged_backend.PagedBackend` (the engine: writes this
forward's state into the paged pools and attends over each sequence's cache) or
`PackedAttentionBackend` (the trainer: whole packed sequences, no cache). Both call the reference ops in `kiln.ops.attention`; GPU kernels plug
in behind the same backend interface.

Backend interface (what an engine backend implements for the models here):
- `attention(layer, q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D], batch, rel=None) -> [T,Hq,D]`, where
  `rel [T,Hq,R]` is Inkling's per-query relative-logit bias (see `kiln.ops.attention`);
- `short_conv(conv, x [T,C], batch) -> [T,C]` for `kiln.layers.shortconv.ShortConv` sites;
- optionally `conv_qk_norm_attention(layer, q, k, v, batch, q_scale, rel)`: Inkling's attention
  prologue fused (k/v ShortConv, q/k norms, lam, the cache write) then attention, which
  `PagedBackend` offers on its kernel path for decode steps and short extends
  (`fuses_conv_qk_norm`; `InklingAttention` uses it only there).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kiln.engine.batch import ForwardBatch
from kiln.kernels import kernel_path
from kiln.ops import attention as ref_ops
from kiln.ops import msa as msa_ops
from kiln.ops import shortconv as conv_ops


class Attention(nn.Module):
    """Softmax attention over (q, k, v) heads; `layer_id` indexes the KV pool. `rel_extent` (R)
    documents the width of the relative-logit bias the layer is called with (None: no bias).
    `key_gap` g > 1 also hides keys at distances 1..g-1 (Inkling's MTP layer k: g = k - 1).
    `cache_offset`: the engine stores this layer's entry for position p at p + cache_offset
    (MTP layer k: k, see `kiln.ops.attention`); the packed backend has no cache and ignores it."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: Optional[float] = None, sliding_window: Optional[int] = None,
                 rel_extent: Optional[int] = None, key_gap: int = 0, cache_offset: int = 0):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.sliding_window = sliding_window
        self.rel_extent = rel_extent
        self.key_gap = key_gap
        self.cache_offset = cache_offset

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                rel: Optional[torch.Tensor] = None, rope: Optional[tuple] = None) -> torch.Tensor:
        """q: [T, Hq*D] (or [T, Hq, D]), k/v: [T, Hkv*D] (or [T, Hkv, D]), rel: [T, Hq, R] (or
        [T, Hq*R]), a `kiln.ops.attention.RelProjection` of one, or None -> [T, Hq*D].
        `rope` = (RotaryEmbedding, positions [T]) rotates q and k first: given here rather than
        applied by the model, the engine's kernel path fuses the rotation with the cache write
        (`PagedBackend.rope_attention`)."""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if rope is not None:
            rotary, positions = rope
            if rel is None and hasattr(batch.backend, "rope_attention") and kernel_path(batch, q, k, v):
                o = batch.backend.rope_attention(self, rotary, positions, q, k, v, batch)
                return o.reshape(t, self.num_heads * self.head_dim)
            q, k = rotary(positions, q, k, batch)
        if isinstance(rel, ref_ops.RelProjection):  # the backend computes the bias (or materialises it)
            o = batch.backend.attention(self, q, k, v, batch, rel=rel)
        elif rel is not None:
            rel = rel.view(t, self.num_heads, rel.shape[-1] // (self.num_heads if rel.dim() == 2 else 1))
            o = batch.backend.attention(self, q, k, v, batch, rel=rel)
        else:
            o = batch.backend.attention(self, q, k, v, batch)
        return o.reshape(t, self.num_heads * self.head_dim)


    def attend_stored(self, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Attention of q [T, Hq*D] (already rotated) whose step's K/V a kernel before has written
        into the cache itself (the qkv GEMV's RoPE epilogue: `PagedBackend.decode_rope_args`)."""
        t = q.shape[0]
        o = batch.backend.attend_stored(self, q.view(t, self.num_heads, self.head_dim), batch)
        return o.reshape(t, self.num_heads * self.head_dim)


class PackedAttentionBackend:
    """Trainer / reference backend: whole sequences packed along the token dim, no cache.
    `pad_under_grad`: on a GPU, run the sequences as one padded batch under autograd too
    (`kiln.ops.attention.packed_attention`)."""

    def __init__(self, pad_under_grad: bool = False):
        self.pad_under_grad = pad_under_grad

    def attention(self, layer: Attention, q, k, v, batch: ForwardBatch, rel=None) -> torch.Tensor:
        assert all(p == 0 for p in batch.prefix_lens), "packed attention has no cache"
        return ref_ops.packed_attention(q, k, v, batch.extend_lens, layer.scale, layer.sliding_window,
                                        ref_ops.materialized(rel), getattr(layer, "key_gap", 0),
                                        pad_under_grad=self.pad_under_grad)

    def short_conv(self, conv, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Whole sequences: taps before each sequence start read zeros."""
        assert all(p == 0 for p in batch.prefix_lens), "packed short conv has no state"
        return conv_ops.short_conv(x, conv.weight, batch.extend_lens, None)

    def msa_attention(self, layer, q, k, v, qI, kI, batch: ForwardBatch) -> torch.Tensor:
        """MiniMax-M3's sparse attention over whole packed sequences (selection recomputed)."""
        assert all(p == 0 for p in batch.prefix_lens), "packed MSA has no cache"
        return msa_ops.packed_msa_attention(q, k, v, qI, kI, batch.extend_lens, layer.block_size,
                                            layer.topk_blocks, layer.scale)
