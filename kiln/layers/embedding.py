"""Token embedding and LM head, sharded over the vocabulary for tensor parallelism."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.dist.parallel import SINGLE, ParallelContext


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary; out-of-slice ids contribute zeros
    and an all-reduce sums the slices."""

    def __init__(self, vocab_size: int, hidden_size: int, pc: ParallelContext = SINGLE):
        super().__init__()
        self.pc = pc
        self.vocab_size = vocab_size
        self.per_rank = (vocab_size + pc.tp_size - 1) // pc.tp_size
        self.start = pc.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = loaded[self.start:self.start + self.per_rank]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.pc.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * mask.unsqueeze(-1)
        return self.pc.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = h W^T over this rank's vocab slice, gathered to the full vocabulary."""

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.gather(F.linear(h, self.weight))

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The full vocabulary's logits from this rank's h W^T (`compute_logits` after its product;
        `kiln.layers.decode_gemv.decode_logits` computes that product with the GEMV)."""
        if self.pc.tp_size > 1:
            local = self.pc.all_gather_last_dim(local)
        return local[..., : self.vocab_size]
