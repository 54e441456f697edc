"""Data-parallel GRPO training with PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`).

Design (the simplest one that is exactly the single-process step):

- One process per trainer device, started by `torchrun --nproc-per-node N -m kiln rl ...` (or
  `kiln rl --num-gpus N`, which re-launches itself under torchrun). `DataParallel.from_env()`
  reads torchrun's RANK / WORLD_SIZE / LOCAL_RANK and joins the process group: NCCL on CUDA, gloo
  on CPU (the CPU path exists for tests).
- Every rank builds the same `PolicyTrainer` and shards it: one FSDP unit per decoder layer, then
  the root (embeddings, final norm, LM head and anything else). The optimizer is built over the
  sharded (DTensor) parameters, so its state is sharded too.
- Rank 0 alone owns the rollout backend (the colocated engine on its GPU, or the remote servers):
  it samples, scores and computes the advantages, then broadcasts the step's samples to every rank.
- Each rank recomputes the logprobs of its share of the samples (`shard_range`) and backpropagates
  its share of the loss. FSDP2 averages gradients over ranks, so the local loss is scaled by
  `world * local_denominator / global_denominator` (`loss_scale`): the sum over ranks is then
  exactly the single-process loss (token-mean or sequence-mean aggregation alike). Every rank has
  all samples, so the global denominators need no communication.
- Weight sync: every rank enters `full_weights(model)`, which swaps each sharded parameter for
  `DTensor.full_tensor()` (an all-gather every rank joins); rank 0 then pushes the whole tensors
  into the engine through the unchanged single-process sync code; the shards come back on exit.
  Peak memory during the sync is one full copy of the weights per rank.

Checkpoints under FSDP: rank 0 writes the full weights (gathered the same way); each rank writes
its optimizer shard (`optimizer-rank{r}.pt`), so a resume needs the same number of ranks.
"""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist


@dataclass
class DataParallel:
    """This process's place in the trainer's process group."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device: Optional[str] = None) -> Optional["DataParallel"]:
        """Join the process group torchrun described (WORLD_SIZE > 1), else None (one process).

        `device`: None picks cuda:LOCAL_RANK when CUDA is available, else cpu. The backend is NCCL
        for CUDA devices and gloo for cpu."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        if device is None or device == "auto":
            device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
        dev = torch.device(device)
        if dev.type == "cuda":
            if dev.index is None:
                dev = torch.device("cuda", local)
            torch.cuda.set_device(dev)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        return cls(rank=rank, world_size=world, local_rank=local, device=dev)

    # ---- collectives -----------------------------------------------------------------------
    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (pickled; use for step payloads, not weights)."""
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()

    def close(self, barrier: bool = True) -> None:
        """Leave the process group; with `barrier` (a normal exit) only once every rank is done, so
        no rank tears gloo/NCCL down under another's last collective. Skip it on errors (the other
        ranks may never arrive).

        Drop every reference to the sharded model first: a garbage collection runs here so that it
        is freed while the interpreter is fully alive. Left to interpreter exit, a gloo rank died in
        about one run in ten here with "terminate called without an active exception" (SIGABRT)
        after all its work was done (torch 2.13, CPU); with the model freed first, 0 in 12."""
        gc.collect()
        if dist.is_initialized():
            if barrier:
                dist.barrier()
            dist.destroy_process_group()


def shard_range(n: int, rank: int, world: int) -> range:
    """The contiguous block of `n` samples that `rank` trains on (sizes differ by at most one)."""
    if n < world:
        raise ValueError(f"{n} samples per step cannot be split over {world} trainer ranks: raise "
                         "prompts_per_step * samples_per_prompt to at least the number of ranks")
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def loss_scale(local_denominator: float, global_denominator: float, world: int) -> float:
    """Factor for a rank's loss so that FSDP's gradient average over `world` ranks equals the
    gradient of the single-process loss: world * local / global (denominators of the aggregation:
    masked tokens for token-mean, rows for sequence-mean; a zero denominator counts as 1, as
    `kiln.rl.loss.masked_aggregate` does)."""
    return world * max(float(local_denominator), 1.0) / max(float(global_denominator), 1.0)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a Kiln causal LM (`model.model.layers`), the FSDP units."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no model.layers ModuleList: FSDP sharding "
                        "needs the decoder layers to wrap")
    return list(layers)


def shard_model(model: torch.nn.Module, mesh: Any = None) -> list[torch.nn.Parameter]:
    """fully_shard every decoder layer, then the root (PyTorch >= 2.6 `torch.distributed.fsdp`).

    Parameters become DTensors sharded on dim 0 over `mesh` (default: all ranks of the default
    process group, on the current device type). Build the optimizer afterwards.

    FSDP2 cannot shard 0-dim parameters (it raises "fully_shard doesn't support scalar
    parameters"; Inkling's routers have a learnable scalar `global_scale`), so those stay
    replicated plain tensors, passed as `ignored_params`; FSDP neither shards nor reduces them, so
    `reduce_replicated_grads` must average their gradients before the optimizer step. Returns them."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as e:  # torch < 2.6 has it only under torch.distributed._composable.fsdp
        raise ImportError(f"FSDP2 needs torch >= 2.6 (torch.distributed.fsdp.fully_shard); this is "
                          f"torch {torch.__version__}: `pip install -U torch`") from e
    replicated = [p for p in model.parameters() if p.dim() == 0]
    ignored = set(replicated) or None
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, ignored_params=ignored)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    return replicated


def reduce_replicated_grads(params: list[torch.nn.Parameter], world: int) -> None:
    """Average the gradients of the parameters FSDP left replicated over the ranks (what FSDP's
    reduce-scatter does for the sharded ones), so every rank's optimizer applies the same update."""
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(world)


@torch.no_grad()
def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """The global gradient norm over sharded (DTensor) and replicated gradients, with one
    all-reduce; grads are scaled by min(1, max_norm / (norm + 1e-6)) when `max_norm` > 0, the
    rule of torch.nn.utils.clip_grad_norm_ (which cannot mix DTensor and plain tensors)."""
    from torch.distributed.tensor import DTensor

    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    grads = [p.grad for p in params if p.grad is not None]
    for g in grads:
        if isinstance(g, DTensor):
            sharded += g.to_local().double().pow(2).sum().cpu()
        else:
            replicated += g.double().pow(2).sum().cpu()
    dev = next((g.to_local().device for g in grads if isinstance(g, DTensor)), torch.device("cpu"))
    sharded = sharded.to(dev)
    dist.all_reduce(sharded, op=dist.ReduceOp.SUM)
    norm = (sharded.cpu() + replicated).sqrt().float()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device) if not isinstance(g, DTensor) else coef.item())
    return norm


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


@contextmanager
def full_weights(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within the block, every sharded parameter of `model` is its whole tensor
    (`DTensor.full_tensor()`, a collective: every rank must enter, in the same order), so
    single-process code (`kiln.rl.sync.checkpoint_views`, `lora_state_dict`) sees a plain model.
    The sharded parameters are put back on exit. Read-only: writes to the full tensors are lost.

    A no-op for an unsharded model."""
    from torch.distributed.tensor import DTensor

    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    full: dict[int, torch.nn.Parameter] = {}  # by id: tied weights stay one tensor
    try:
        with torch.no_grad():
            for mod in model.modules():
                for name, p in list(mod._parameters.items()):
                    if isinstance(p, DTensor):
                        if id(p) not in full:
                            full[id(p)] = torch.nn.Parameter(p.full_tensor(), requires_grad=False)
                        swapped.append((mod, name, p))
                        mod._parameters[name] = full[id(p)]
        yield model
    finally:
        for mod, name, p in swapped:
            mod._parameters[name] = p


def scalar(x: Any) -> float:
    """A python float of a tensor or DTensor scalar (clip_grad_norm_ returns a DTensor under FSDP)."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        x = x.full_tensor()
    return float(x)
