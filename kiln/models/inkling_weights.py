"""Inkling checkpoint names (MODELS.md 2) <-> the model's parameters, both directions.

Differences between disk and memory:
- `mlp.gate_proj` / `mlp.up_proj` of dense MLPs are stacked into `mlp.gate_up_proj`;
- routed experts `mlp.experts.{e}.*` are stacked into `mlp.experts.w13 / w2`, shared experts
  `mlp.shared_experts.{s}.*` linearised into `mlp.shared_experts.w13 / w2` (`kiln.layers.moe`);
- MTP layer k is `mtp.{k}.` on disk (k = 1..N) and `mtp.{k-1}.` in the ModuleList;
- `self_attn.qkvr_proj.weight` is one matrix on both sides (this rank's heads in memory).
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch

from kiln.layers.moe import Experts, SharedExperts, moe_param_for
from kiln.loader.weights import copy_into_param
from kiln.models.mtp import shift_mtp as _shift_mtp

_DENSE_STACKED = [(".mlp.gate_proj.", ".mlp.gate_up_proj.", 0), (".mlp.up_proj.", ".mlp.gate_up_proj.", 1)]


def param_for(name: str) -> tuple[str, Optional[object]]:
    """On-disk tensor name -> (our parameter or buffer name, shard_id for its weight_loader)."""
    name = _shift_mtp(name, -1)
    moe = moe_param_for(name)
    if moe is not None:
        return moe
    for disk, ours, shard in _DENSE_STACKED:
        if disk in name:
            return name.replace(disk, ours), shard
    return name, None


def load_inkling_weights(model, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> set[str]:
    params = dict(model.named_parameters(remove_duplicate=False))
    persistent = model.state_dict(keep_vars=True).keys()  # router biases; not the selection counters
    buffers = {n: b for n, b in model.named_buffers() if n in persistent}
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    seen: set[str] = set()
    for disk_name, tensor in weights:
        if disk_name == "lm_head.weight" and tied:
            continue
        if disk_name.startswith("mtp.") and int(disk_name.split(".")[1]) > len(model.mtp):
            raise KeyError(f"checkpoint tensor {disk_name!r}: the config has {len(model.mtp)} MTP layers")
        name, shard = param_for(disk_name)
        if name in buffers:  # router biases stay fp32
            buffers[name].copy_(tensor)
            loaded.add(name)
            seen.add(disk_name)
            continue
        if name not in params:
            raise KeyError(f"checkpoint tensor {disk_name!r} has no parameter in {type(model).__name__}")
        copy_into_param(params[name], tensor, shard)
        loaded.add(name)
        seen.add(disk_name)
    # Stacked parameters fill from several tensors, so check completeness by on-disk name.
    missing = {n for n, _ in _disk_items(model, buffers=False)} - seen
    if missing and strict:
        raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]}")
    return loaded


def _disk_items(model, buffers: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(on-disk name, view of our tensor) for every weight (and router buffer); no copies."""
    for mod_name, mod in model.named_modules():
        if isinstance(mod, (Experts, SharedExperts)):
            prefix = mod_name.rsplit(".", 1)[0] + "."
            for name, t in mod.checkpoint_items(prefix):
                yield _shift_mtp(name, +1), t
    for name, p in model.named_parameters():  # the tied head appears once, as the embedding
        if ".experts.w" in name or ".shared_experts.w" in name:
            continue
        if ".mlp.gate_up_proj." in name:
            gate, up = p.chunk(2, dim=0)
            yield _shift_mtp(name.replace(".gate_up_proj.", ".gate_proj."), +1), gate
            yield _shift_mtp(name.replace(".gate_up_proj.", ".up_proj."), +1), up
        else:
            yield _shift_mtp(name, +1), p
    if buffers:  # the persistent ones: not the gates' selection counters
        persistent = model.state_dict(keep_vars=True).keys()
        for name, b in model.named_buffers():
            if name in persistent:
                yield _shift_mtp(name, +1), b


def inkling_checkpoint_state_dict(model) -> dict[str, torch.Tensor]:
    """Every weight and router buffer under its on-disk name, as contiguous copies (safetensors
    refuses shared storage). Single-rank models only."""
    assert model.pc.tp_size == 1, "export a tensor-parallel model from an unsharded copy"
    return {name: t.detach().clone().contiguous() for name, t in _disk_items(model)}
