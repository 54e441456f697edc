"""Trainer -> engine weight sync, and the on-disk naming both sides share.

- `checkpoint_views(model)`: (on-disk name, tensor) for every weight of a Kiln model, with stacked
  parameters (q/k/v, gate/up, routed and shared experts) split back into their checkpoint tensors.
  Views, not copies, where the model allows it (Llama family, Inkling, MiniMax-M3 all do), so a
  bucketed sync holds at most one bucket of extra memory. The engine's `load_weights` accepts
  every name it yields. LoRA parameters (`*.lora_*`) are never yielded.
- `sync_full(trainer, engine)`: every weight, in place in the engine (which flushes its prefix
  cache): copied model to model when both are in this process with one layout
  (`update_weights_from_model`), else in buckets of `bucket_bytes` through `update_weights_from_tensor`.
- `sync_lora(trainer, engine, name)`: only the adapter; the engine merges it into its weights from a
  kept copy of the base (`load_lora_from_model` colocated: one delta per stacked tensor; else
  PEFT tensors through `EngineCore.load_lora_adapter`, one per projection and expert).

`engine` is a `kiln.offline.Engine` or an `EngineCore` (both have the two methods). Colocated,
single process: tensors move by reference/copy, no serialisation. Cross-process transports (CUDA
IPC, NCCL broadcast) are future work and would plug in behind the same two calls.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import torch

from kiln.rl.lora import is_lora_name
from kiln.server.client import buckets as weight_buckets


def checkpoint_views(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(on-disk name, detached tensor) for every weight and persistent buffer of `model`.

    Single rank only (tp_size 1): the names are those of whole checkpoint tensors."""
    assert model.pc.tp_size == 1, "checkpoint_views yields whole tensors: use an unsharded model"
    from kiln.layers.moe import Experts, SharedExperts
    from kiln.models.mtp import shift_mtp

    if model.config.model_type == "inkling":
        # Inkling's own exporter (MTP prefix shift, stacked dense MLPs, experts), views only.
        from kiln.models.inkling_weights import _disk_items

        for name, t in _disk_items(model):
            if not is_lora_name(name):
                yield name, t.detach()
        return
    done: set[str] = set()
    for mname, mod in model.named_modules():
        if isinstance(mod, (Experts, SharedExperts)):
            for name, t in mod.checkpoint_items(mname.rsplit(".", 1)[0] + "."):
                yield name, t.detach()
            done |= {f"{mname}.w13", f"{mname}.w2"}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    # state_dict: parameters and persistent buffers (MiniMax's router correction bias).
    for name, t in model.state_dict(keep_vars=True).items():
        if name in done or is_lora_name(name) or (tied and name == "lm_head.weight"):
            continue
        t = t.detach()
        disk = shift_mtp(name, +1)  # MTP layer k is mtp.{k-1} in memory, mtp.{k} on disk
        if ".qkv_proj." in name:  # weight [q+k+v, H] or bias [q+k+v]: split rows
            mod = model.get_submodule(name.rsplit(".", 2)[0] + ".qkv_proj")
            parts = t.split([mod.q_size, mod.kv_size, mod.kv_size], dim=0)
            for part, p in zip(("q", "k", "v"), parts):
                yield disk.replace(".qkv_proj.", f".{part}_proj."), p
        elif ".gate_up_proj." in name:
            gate, up = t.chunk(2, dim=0)
            yield disk.replace(".gate_up_proj.", ".gate_proj."), gate
            yield disk.replace(".gate_up_proj.", ".up_proj."), up
        else:
            yield disk, t


@torch.no_grad()
def sync_full(trainer: Any, engine: Any, bucket_bytes: int = 512 * 1024**2) -> dict[str, float]:
    """Push every trainer weight into the engine.

    Colocated with an unsharded trainer, the engine copies the trainer model's tensors directly
    (`update_weights_from_model`: one copy per stacked tensor, no checkpoint split); otherwise
    checkpoint tensors go `bucket_bytes` at a time through `update_weights_from_tensor`.
    Returns {"seconds", "bytes", "tensors", "buckets", "path"} (path "model" or "checkpoint";
    buckets 0 on the model path). The engine must be idle (no requests)."""
    from kiln.engine.model_copy import WeightLayoutMismatch

    t0 = time.perf_counter()
    direct = getattr(engine, "update_weights_from_model", None)
    if direct is not None and not getattr(trainer, "sharded", False):
        try:
            nbytes = direct(trainer.model)
            tensors = sum(1 for n in trainer.model.state_dict() if not is_lora_name(n))
            return {"seconds": time.perf_counter() - t0, "bytes": nbytes, "tensors": tensors, "buckets": 0,
                    "path": "model"}
        except WeightLayoutMismatch:
            pass  # e.g. an engine with tensor parallelism: the checkpoint names below map any layout
    total, tensors, buckets = 0, 0, 0
    for bucket in weight_buckets(trainer.named_weights_for_sync(), bucket_bytes):
        engine.update_weights_from_tensor(bucket)
        total += sum(t.numel() * t.element_size() for _, t in bucket)
        tensors += len(bucket)
        buckets += 1
    return {"seconds": time.perf_counter() - t0, "bytes": total, "tensors": tensors, "buckets": buckets,
            "path": "checkpoint"}


@torch.no_grad()
def sync_lora(trainer: Any, engine: Any, name: str = "policy") -> dict[str, float]:
    """Send only the trainer's LoRA adapter to the engine, which merges it into its weights under
    adapter `name` (replacing an earlier version of the same adapter): colocated with an unsharded
    trainer, from the trainer's model by stacked tensor (`load_lora_from_model`), else as PEFT
    tensors and config (`load_lora_adapter`).

    Returns {"seconds", "bytes", "tensors", "path"} ("model" or "checkpoint")."""
    from kiln.engine.model_copy import WeightLayoutMismatch
    from kiln.rl.lora import adapter_config, lora_parameters, lora_state_dict

    if not hasattr(trainer.model, "lora_targets"):
        raise ValueError("sync_lora: the trainer has no LoRA adapter (call trainer.enable_lora first)")
    t0 = time.perf_counter()
    direct = getattr(engine, "load_lora_from_model", None)
    if direct is not None and not getattr(trainer, "sharded", False):
        try:
            direct(name, trainer.model)
            params = lora_parameters(trainer.model)
            return {"seconds": time.perf_counter() - t0, "tensors": len(params),
                    "bytes": sum(p.numel() * p.element_size() for p in params), "path": "model"}
        except WeightLayoutMismatch:
            pass  # another layout: PEFT tensors below, merged by checkpoint name
    state = lora_state_dict(trainer.model)
    engine.load_lora_adapter(name, {"state_dict": state, "config": adapter_config(trainer.model)})
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return {"seconds": time.perf_counter() - t0, "bytes": nbytes, "tensors": len(state), "path": "checkpoint"}
