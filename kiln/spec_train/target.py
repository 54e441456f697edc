"""The frozen target of `kiln train-draft`: its checkpoint's weights loaded into a Kiln model."""

from __future__ import annotations

import torch

DRAFTER_PREFIXES = ("mtp.", "dspark.")  # drafters inside a checkpoint are not the target


def load_frozen(model: torch.nn.Module, source) -> torch.nn.Module:
    """Load the target's tensors of `source` into `model` (every parameter outside the drafter
    prefixes must be found: ValueError otherwise) and freeze every parameter."""
    from kiln.loader import iter_weights

    weights = ((n, t) for n, t in iter_weights(source) if not n.startswith(DRAFTER_PREFIXES))
    loaded = model.load_weights(weights, strict=False)
    missing = [n for n, _ in model.named_parameters() if n not in loaded and not n.startswith(DRAFTER_PREFIXES)]
    if missing:
        raise ValueError(f"the target checkpoint lacks {missing[:4]}")
    for p in model.parameters():
        p.requires_grad_(False)
    return model
