"""Starting tensor parallelism: one process per rank, joined over torch.distributed.

Each rank runs its own scheduler on the same inputs (SGLang's layout): the scheduling decisions,
the cache bookkeeping and the sampled tokens are identical on every rank because they are pure
functions of the same messages and the same (all-gathered) logits, so ranks exchange only
activations (NCCL all-reduce / all-gather inside the model) and, in the server, the incoming
messages (rank 0 broadcasts them over a gloo group).

Two ways in:
- `kiln serve --tp N` spawns the N scheduler processes itself (`init_tensor_parallel`);
- `torchrun --nproc-per-node N script.py` for offline use (benchmarks): `from_torchrun_env()`
  reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, and every rank builds an `EngineCore`
  and submits the same requests.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from kiln.dist.parallel import SINGLE, ParallelContext

# An idle server's followers wait in a broadcast for as long as no request arrives.
_TIMEOUT = datetime.timedelta(days=7)


def init_tensor_parallel(tp_rank: int, tp_size: int, init_method: str, device_type: str) -> ParallelContext:
    """Join the group (NCCL for CUDA tensors, gloo on the CPU) and return this rank's context.
    On CUDA, rank r uses GPU r."""
    if tp_size == 1:
        return SINGLE
    if device_type == "cuda":
        if torch.cuda.device_count() < tp_size:
            raise RuntimeError(f"--tp {tp_size} needs {tp_size} GPUs; this machine has {torch.cuda.device_count()}")
        torch.cuda.set_device(tp_rank)
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=tp_rank, world_size=tp_size, timeout=_TIMEOUT)
    group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=_TIMEOUT) if backend == "nccl" else group
    return ParallelContext(tp_rank=tp_rank, tp_size=tp_size, tp_group=group, cpu_group=cpu_group)


def from_torchrun_env(device_type: str) -> ParallelContext:
    """This process's context under torchrun (SINGLE when not launched by it)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return SINGLE
    return init_tensor_parallel(int(os.environ["RANK"]), size, "env://", device_type)


def shutdown(pc: ParallelContext) -> None:
    if pc.tp_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
