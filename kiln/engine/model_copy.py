"""Weights copied between two instances of one Kiln model definition (the colocated trainer's
model into the engine's): tensor for tensor by in-memory name, so each stacked parameter (q/k/v,
gate/up, the experts) is one copy instead of a split into checkpoint tensors and a re-stack."""

from __future__ import annotations

import torch


class WeightLayoutMismatch(ValueError):
    """The two models do not hold the same tensors (names or shapes): use the checkpoint-name path."""


def matched_weights(dst: torch.nn.Module, src: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(dst tensor, src tensor) for every parameter and persistent buffer of `dst`, matched by name.

    `src` may carry LoRA tensors (`lora_*`), which are left out, and other dtypes or devices
    (the copy casts). Raises WeightLayoutMismatch when a name is missing on either side or a shape
    differs (a sharded model, another architecture or size). Tied tensors are listed once."""
    from kiln.rl.lora import is_lora_name  # the adapter's naming is the trainer's

    theirs = {n: t for n, t in src.state_dict(keep_vars=True).items() if not is_lora_name(n)}
    ours = dst.state_dict(keep_vars=True)
    if set(ours) != set(theirs):
        missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
        raise WeightLayoutMismatch(f"the models hold different tensors: missing {missing[:4]}, extra {extra[:4]}")
    pairs, seen = [], set()
    for name, d in ours.items():
        s = theirs[name]
        if tuple(d.shape) != tuple(s.shape):
            raise WeightLayoutMismatch(f"{name}: shape {tuple(s.shape)}, expected {tuple(d.shape)}")
        if d.data_ptr() not in seen:
            seen.add(d.data_ptr())
            pairs.append((d.detach(), s.detach()))
    return pairs


@torch.no_grad()
def copy_weights(dst: torch.nn.Module, src: torch.nn.Module) -> int:
    """Copy `src`'s weights into `dst`'s in place (`matched_weights`; nothing is copied when they
    do not match). Returns the bytes written."""
    pairs = matched_weights(dst, src)
    for d, s in pairs:
        d.copy_(s)
    return sum(d.numel() * d.element_size() for d, _ in pairs)
