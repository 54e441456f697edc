"""Weights of several linear layers laid back to back in one storage, read as one matrix.

Two projections of the same input (MiniMax-M3's qkv_proj and its indexer's qk_proj) cost a decode
step two GEMV launches, and the second waits for the first. Stacking them into one parameter would
make them one launch, but they are different parameters to the trainer (the indexer is frozen in
RL), to checkpoints and to adapters. Here they stay separate `Parameter`s whose `.data` are views
of one new storage (`stack_weights`), so one GEMV can read both as one [N1 + N2, K] matrix
(`stacked_weight`), with no copy per step.

Anything that gives a parameter new data (`PinnedWeights` moving weights to the host and back,
`cast_parameters`) separates the views again; in-place writes (weight loading, RL weight updates)
keep them. So `stacked_weight` checks, on every call, that the weights still lie back to back and
returns None otherwise (the caller then runs the layers one by one: correct, one launch more),
and the engine stacks again after it moves weights (`ModelRunner.resume_weights`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def stack_weights(*linears: nn.Module) -> bool:
    """Give the 2-D weights of `linears` (same dtype, device and number of columns) one new
    contiguous storage, in order, each parameter's `.data` a view of its rows; values unchanged.
    Returns False (and changes nothing) when they do not fit together."""
    ws = [m.weight for m in linears]
    w0 = ws[0]
    if any(w.dim() != 2 or w.dtype != w0.dtype or w.device != w0.device or w.shape[1] != w0.shape[1] for w in ws):
        return False
    if stacked_weight(*linears) is not None:
        return True
    with torch.no_grad():
        buf = torch.cat([w.data for w in ws])
    start = 0
    for w in ws:
        w.data = buf[start:start + w.shape[0]]
        start += w.shape[0]
    return True


def stacked_weight(*linears: nn.Module) -> Optional[torch.Tensor]:
    """The weights of `linears` as one [sum of rows, K] matrix, a view of their common storage,
    when they still lie back to back in it (`stack_weights`); else None."""
    ws = [m.weight for m in linears]
    w0 = ws[0]
    if not all(w.dim() == 2 and w.is_contiguous() and w.dtype == w0.dtype and w.shape[1] == w0.shape[1] for w in ws):
        return None
    storage = w0.untyped_storage()
    offset = w0.storage_offset()
    for w in ws:
        if w.untyped_storage().data_ptr() != storage.data_ptr() or w.storage_offset() != offset:
            return None
        offset += w.numel()
    rows = sum(w.shape[0] for w in ws)
    return w0.detach().new_empty(0).set_(storage, w0.storage_offset(), (rows, w0.shape[1]), (w0.shape[1], 1))
