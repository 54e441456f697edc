"""`ParallelContext`: which tensor-parallel rank a module is, passed explicitly (no global state).

Layers take a `ParallelContext` at construction and shard their weights by it; with `tp_size == 1`
every collective is a no-op, so the same model code runs on one CPU and on several GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Optional[object] = None  # a torch.distributed ProcessGroup when tp_size > 1
    # A gloo group over the same ranks for host-side objects (scheduler messages, pool sizes):
    # NCCL moves only device tensors.
    cpu_group: Optional[object] = None

    def __post_init__(self) -> None:
        assert 0 <= self.tp_rank < self.tp_size, (self.tp_rank, self.tp_size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the tensor-parallel ranks (in place), e.g. after a row-parallel matmul."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's shard along the last dimension (e.g. vocab-parallel logits)."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Rank `src`'s `obj` on every rank (pickled through the CPU group)."""
        if self.tp_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.cpu_group or self.tp_group)
        return box[0]

    def broadcast_int(self, value: int, src: int = 0) -> int:
        """Rank `src`'s `value` on every rank (one int64 through the CPU group; cheaper than
        `broadcast_object`'s pickling), e.g. a choice only one rank's clock may make."""
        if self.tp_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(t, src=src, group=self.cpu_group or self.tp_group)
        return int(t.item())

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks (e.g. KV pool sizes, which must agree)."""
        if self.tp_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group or self.tp_group)
        return int(t.item())

    def shard(self, size: int) -> tuple[int, int]:
        """(start, length) of this rank's equal shard of a dimension of `size`."""
        assert size % self.tp_size == 0, f"dimension {size} is not divisible by tp_size {self.tp_size}"
        n = size // self.tp_size
        return self.tp_rank * n, n


SINGLE = ParallelContext()
