"""Weight update groups: process groups through which a trainer broadcasts new weights into
running engines (SGLang's `/init_weights_update_group`, `/update_weights_from_distributed` and
`/destroy_weights_update_group`, which Miles and slime drive when rollouts run on other GPUs).

The trainer is rank 0 and hosts the group's store at `master_address:master_port`; an engine's
tensor-parallel rank r joins as rank `rank_offset + r`. An update names the tensors (checkpoint
names, dtypes, shapes) in the order rank 0 then broadcasts them, one broadcast each; every engine
rank receives all of them whole and loads them as `update_weights_from_tensor` does (its own shard
of each). The group is a `ProcessGroup` object of its own, never the default group, so it does
not touch the engines' tensor-parallel groups. NCCL moves device tensors between GPUs; gloo moves
CPU tensors (CPU engines, tests).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

BACKENDS = ("nccl", "gloo")
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name


@dataclass(frozen=True)
class TensorSpec:
    """What one broadcast carries: the checkpoint name, dtype and shape of a tensor."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def parse_dtype(name: str) -> torch.dtype:
    """torch dtype from its name as SGLang's requests send it ("bfloat16" or "torch.bfloat16")."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use a torch dtype name such as 'bfloat16' or 'float32'")
    return dtype


def tensor_specs(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[TensorSpec]:
    """The specs of an update request; ValueError naming the problem if the three lists disagree."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names, dtypes and shapes must have one entry per tensor; got {len(names)}, "
                         f"{len(dtypes)} and {len(shapes)}")
    if not names:
        raise ValueError("names is empty; name at least one tensor to update")
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        if any(int(d) < 0 for d in shape):
            raise ValueError(f"{name}: shape must hold non-negative sizes; got {list(shape)}")
        specs.append(TensorSpec(name, parse_dtype(dtype), tuple(int(d) for d in shape)))
    return specs


def open_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str, timeout_s: float) -> dist.ProcessGroup:
    """This process's member of the group (rank 0 hosts the store). Blocks until all `world_size`
    members have joined or `timeout_s` passes."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of world_size {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore(group_name, store)  # several groups may share one master port's store
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def broadcast_tensors(group: dist.ProcessGroup, tensors: Iterable[torch.Tensor]) -> None:
    """Rank 0's end of an update: one broadcast per tensor, in the order the request names them."""
    for t in tensors:
        group.broadcast([t.contiguous()], dist.BroadcastOptions()).wait()


def receive_tensors(group: dist.ProcessGroup, specs: Sequence[TensorSpec],
                    device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """An engine's end of an update: (name, tensor) pairs as rank 0 broadcast them."""
    out = []
    for spec in specs:
        t = torch.empty(spec.shape, dtype=spec.dtype, device=device)
        group.broadcast([t], dist.BroadcastOptions()).wait()
        out.append((spec.name, t))
    return out


class WeightUpdateGroups:
    """An engine rank's open weight update groups, by name."""

    def __init__(self) -> None:
        self.groups: dict[str, tuple[dist.ProcessGroup, str]] = {}

    def init(self, group_name: str, master_address: str, master_port: int, rank: int, world_size: int,
             backend: str, timeout_s: float) -> None:
        if group_name in self.groups:
            raise ValueError(f"weight update group {group_name!r} is already open; destroy it first or "
                             "use another group_name")
        self.groups[group_name] = (open_group(master_address, master_port, rank, world_size, group_name,
                                              backend, timeout_s), backend)

    def receive(self, group_name: str, specs: Sequence[TensorSpec],
                device: torch.device) -> list[tuple[str, torch.Tensor]]:
        group, backend = self.get(group_name)
        # gloo moves CPU tensors: receive there, and let the weight update copy them over
        where = torch.device("cpu") if backend == "gloo" else device
        try:
            return receive_tensors(group, specs, where)
        except Exception:
            # a broken broadcast (the trainer aborted or died): the group is of no further use, and
            # its name is free for the trainer's next init
            del self.groups[group_name]
            if hasattr(group, "abort"):
                group.abort()
            raise

    def destroy(self, group_name: str) -> None:
        group, _ = self.get(group_name)
        del self.groups[group_name]
        if hasattr(group, "shutdown"):
            group.shutdown()

    def get(self, group_name: str) -> tuple[dist.ProcessGroup, str]:
        if group_name not in self.groups:
            known = ", ".join(repr(n) for n in self.groups) or "none"
            raise ValueError(f"no weight update group {group_name!r} (open: {known}); call "
                             "init_weights_update_group first")
        return self.groups[group_name]

