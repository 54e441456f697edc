"""`MSAAttention`: MiniMax-M3's attention layer (MODELS.md 3.1), GQA + qk-norm + RoPE, attending
sparsely to the top-N key blocks chosen per KV head by a small indexer.

The layer computes its projections and hands everything that touches cached state to the batch's
backend, like `Attention` does:

    o = batch.backend.msa_attention(layer, q, k, v, qI, kI, batch)
        layer: this module; reads layer.layer_id, num_heads, num_kv_heads, head_dim, scale,
               index_head_dim, block_size (B), topk_blocks (N)
        q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]: after q/k norm and RoPE
        qI [T, Hkv, DI], kI [T, Hkv, DI]: the indexer query/key, after RoPE
        returns o [T, Hq, D]

The engine's paged backend implements it by storing, per token slot (`batch.out_cache_loc`), K and
V in the layer's FULL_KV pool and kI in its INDEX_K pool (shape (Hkv, DI)); then, for each
sequence's new queries at positions prefix..prefix+n-1, it selects blocks from kI of positions
0..prefix+n-1 and attends over their K/V: `kiln.ops.msa.paged_msa_attention` is that reference
(absolute positions make chunked prefill and decode select what a whole-sequence forward
selects). qI is never cached.

The trainer's `PackedAttentionBackend` implements it with `kiln.ops.msa.packed_msa_attention`
(whole packed sequences, no cache).

On the engine's kernel path the norms, both RoPEs and the cache write run as one launch
(`kiln.kernels.msa_prologue`) when the backend `fuses_msa_prologue`: the layer then hands it the
raw projections instead,

    o = batch.backend.msa_prologue_attention(layer, positions, q, k, v, qI, kI, batch)
        q, k, v, qI, kI as above but before the norms and RoPE; layer also gives q_norm, k_norm,
        rotary and index_rotary
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kiln.dist.parallel import SINGLE, ParallelContext
from kiln.engine.batch import ForwardBatch
from kiln.layers.decode_gemv import decode_linear, gemv_path, hooked
from kiln.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kiln.layers.norm import RMSNorm
from kiln.layers.rotary import RotaryEmbedding
from kiln.layers.stacked_weights import stack_weights, stacked_weight


class MSAIndexer(nn.Module):
    """One indexer head per KV head: qI, kI = a W_qi^T, a W_ki^T, both [T, Hkv, DI]. The two
    weights are stacked (`qk_proj`; on disk `indexer.q_proj` / `indexer.k_proj`), so that a decode
    step reads them in one GEMV launch."""

    def __init__(self, hidden: int, num_kv_heads: int, index_head_dim: int, pc: ParallelContext):
        super().__init__()
        # The indexer heads follow the KV heads, so they shard the same way; replicating KV heads
        # across ranks (Hkv < tp_size) is not supported here yet.
        assert num_kv_heads % pc.tp_size == 0, "MSA indexer needs num_key_value_heads % tp_size == 0"
        n = num_kv_heads * index_head_dim
        self.qk_proj = MergedColumnParallelLinear(hidden, [n, n], pc=pc)
        self.index_head_dim = index_head_dim

    def forward(self, x: torch.Tensor, batch=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(qI, kI), each a [T, Hkv, DI] view of the stacked projection's rows."""
        t = x.shape[0]
        qk = decode_linear(self.qk_proj, x, batch)
        q, k = qk.split(self.qk_proj.out_sizes_per_rank, dim=-1)
        return q.view(t, -1, self.index_head_dim), k.view(t, -1, self.index_head_dim)


class MSAAttention(nn.Module):
    """self_attn of a MiniMax-M3 layer: takes the normed hidden state [T, H], returns o_proj's [T, H]."""

    def __init__(self, cfg, layer_id: int, rotary: RotaryEmbedding, index_rotary: RotaryEmbedding,
                 pc: ParallelContext = SINGLE):
        super().__init__()
        d = cfg.head_dim
        self.layer_id = layer_id
        # q/k/v are separate on disk (self_attn.{q,k,v}_proj); the loader stacks them here.
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, pc=pc)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, pc=pc)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.indexer = MSAIndexer(cfg.hidden_size, cfg.num_key_value_heads, cfg.index_head_dim, pc)
        self.rotary = rotary
        self.index_rotary = index_rotary
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.scale = d ** -0.5
        self.index_head_dim = cfg.index_head_dim
        self.block_size = cfg.index_block_size
        self.topk_blocks = cfg.index_topk_blocks

    def stack_decode_weights(self) -> None:
        """Lay qkv_proj's and the indexer's weights back to back in memory, so that a decode step
        projects both in one GEMV (`qkv_index_weight`; `kiln.layers.stacked_weights`)."""
        stack_weights(self.qkv_proj, self.indexer.qk_proj)

    def qkv_index_weight(self, batch, x: torch.Tensor) -> Optional[torch.Tensor]:
        """qkv_proj's weight with the indexer's rows after it, one [Nqkv + 2 Hkv DI, H] matrix, when
        this forward's qkv projection of x may compute the indexer's too: the weights lie back to
        back (`stack_decode_weights`), the indexer is a plain `MSAIndexer` without hooks whose
        projection is on the GEMV path (the qkv projection's own conditions are its caller's).
        None otherwise: the indexer projects x itself."""
        ix = self.indexer
        if type(ix).forward is not MSAIndexer.forward or hooked(ix) or not gemv_path(batch, x, ix.qk_proj):
            return None
        return stacked_weight(self.qkv_proj, ix.qk_proj)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        w = self.qkv_index_weight(batch, x)
        return self.attend(positions, decode_linear(self.qkv_proj, x, batch, weight=w), x, batch)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, x: Optional[torch.Tensor],
               batch: ForwardBatch) -> torch.Tensor:
        """The attention from its qkv projection of x on: what `forward` does after its first GEMV.
        When that GEMV also projected the indexer (`qkv_index_weight`: qkv has its rows after q, k
        and v) x may be None; otherwise x feeds the indexer."""
        t, d = qkv.shape[0], self.head_dim
        nqkv = self.qkv_proj.weight.shape[0]
        if qkv.shape[-1] > nqkv:  # the indexer's rows came with it
            qkv, qk = qkv[:, :nqkv], qkv[:, nqkv:]
            qI, kI = (y.view(t, -1, self.index_head_dim) for y in qk.split(self.indexer.qk_proj.out_sizes_per_rank, -1))
        else:
            qI, kI = self.indexer(x, batch)
        q, k, v = self.qkv_proj.split(qkv)
        backend = getattr(batch, "backend", None)
        if getattr(backend, "fuses_msa_prologue", None) is not None and backend.fuses_msa_prologue(batch):
            o = backend.msa_prologue_attention(self, positions, q.view(t, self.num_heads, d),
                                               k.view(t, self.num_kv_heads, d), v.view(t, self.num_kv_heads, d),
                                               qI, kI, batch)
            return decode_linear(self.o_proj, o.reshape(t, self.num_heads * d), batch)
        q = self.q_norm(q.reshape(t, self.num_heads, d), batch)
        k = self.k_norm(k.reshape(t, self.num_kv_heads, d), batch)
        q, k = self.rotary(positions, q, k, batch)
        v = v.reshape(t, self.num_kv_heads, d)
        qI, kI = self.index_rotary(positions, qI, kI, batch)
        o = self._attend(q, k, v, qI, kI, batch)
        return decode_linear(self.o_proj, o.reshape(t, self.num_heads * d), batch)

    def _attend(self, q, k, v, qI, kI, batch: ForwardBatch) -> torch.Tensor:
        return batch.backend.msa_attention(self, q, k, v, qI, kI, batch)
