"""Linear layers that know how to shard themselves for tensor parallelism.

Megatron-style: a `ColumnParallelLinear` splits the output dimension (no communication), a
`RowParallelLinear` splits the input dimension and all-reduces its output. The fused variants
(`QKVParallelLinear`, `MergedColumnParallelLinear`) hold several checkpoint matrices stacked along
the output dimension; each parameter carries a `weight_loader(param, tensor, shard_id)` that copies
one checkpoint tensor into the right slice of this rank's shard.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kiln.dist.parallel import SINGLE, ParallelContext


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's output rows split across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 pc: ParallelContext = SINGLE):
        super().__init__()
        self.pc = pc
        self.in_features = in_features
        self.out_features = out_features
        _, self.out_per_rank = pc.shard(out_features)
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        start, n = self.pc.shard(loaded.shape[0])
        param.data.copy_(loaded.narrow(0, start, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shard^T) + b with W's input columns split across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 pc: ParallelContext = SINGLE, reduce_output: bool = True):
        super().__init__()
        self.pc = pc
        self.reduce_output = reduce_output
        self.in_features = in_features
        self.out_features = out_features
        _, self.in_per_rank = pc.shard(in_features)
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = lambda p, t, s=None: p.data.copy_(t)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        start, n = self.pc.shard(loaded.shape[1])
        param.data.copy_(loaded.narrow(1, start, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.reduce_output:
            y = self.pc.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked along the output dim (e.g. gate and up)."""

    def __init__(self, in_features: int, out_sizes: Sequence[int], bias: bool = False,
                 pc: ParallelContext = SINGLE):
        self.out_sizes = list(out_sizes)
        super().__init__(in_features, sum(out_sizes), bias, pc)
        self.out_sizes_per_rank = [pc.shard(s)[1] for s in self.out_sizes]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int] = None) -> None:
        if shard_id is None:  # already stacked on disk
            return super().weight_loader(param, loaded)
        offset = sum(self.out_sizes_per_rank[:shard_id])
        n = self.out_sizes_per_rank[shard_id]
        start, _ = self.pc.shard(loaded.shape[0])
        param.data.narrow(0, offset, n).copy_(loaded.narrow(0, start, n))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections stacked; heads are split across ranks (KV heads replicated when
    there are fewer KV heads than ranks)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, pc: ParallelContext = SINGLE):
        assert num_heads % pc.tp_size == 0, f"{num_heads} heads not divisible by tp_size {pc.tp_size}"
        self.head_dim = head_dim
        self.num_heads = num_heads // pc.tp_size
        if num_kv_heads >= pc.tp_size:
            assert num_kv_heads % pc.tp_size == 0
            self.num_kv_heads = num_kv_heads // pc.tp_size
            self.kv_replicas = 1
        else:
            assert pc.tp_size % num_kv_heads == 0
            self.num_kv_heads = 1
            self.kv_replicas = pc.tp_size // num_kv_heads
        total_out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * pc.tp_size
        super().__init__(hidden_size, total_out, bias, pc)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[str] = None) -> None:
        assert shard_id in ("q", "k", "v"), shard_id
        if shard_id == "q":
            offset, n, rank_idx = 0, self.q_size, self.pc.tp_rank
        else:
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            n, rank_idx = self.kv_size, self.pc.tp_rank // self.kv_replicas
        param.data.narrow(0, offset, n).copy_(loaded.narrow(0, rank_idx * n, n))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
