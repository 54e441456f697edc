"""Activations used by the MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's inner product: silu(gate) * up, with gate and up stacked on the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
