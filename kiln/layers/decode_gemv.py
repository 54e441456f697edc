"""Projections of a decode step through Kiln's GEMV, with the norm or SwiGLU in front folded in.

At a few rows per forward a decoder layer is four weight streams (qkv, o, gate_up, down) with a
norm or an activation between them. On the engine's kernel path, when the forward has at most
`batch.backend.gemv_max_rows` rows (`--gemv-max-rows`), these helpers run each projection as one
`kiln.kernels.gemv` launch, whose weight stream starts before its predecessor has finished (PDL)
and whose prologue computes the norm (with the residual add) or silu(gate) * up itself:

    norm_linear(norm, linear, h, batch, residual)  = linear(norm(h + residual)), h + residual
    silu_linear(linear, gate_up, batch)             = linear(silu(gate) * up)
    row_linear(linear, x, batch)                    = linear(x)

Anywhere else (the CPU engine, more rows, the trainer, anything autograd records, `--kernel-backend
reference`) they call the modules as before, so those paths do not change by a bit.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

from kiln.kernels import kernel_path
from kiln.layers.activation import silu_and_mul
from kiln.layers.linear import RowParallelLinear
from kiln.layers.norm import RMSNorm


@functools.lru_cache(maxsize=None)
def _kernels():
    # Imported on first use: it needs Triton, which the CPU build of torch does not ship.
    from kiln.kernels import gemv
    return gemv


def gemv_path(batch, x: torch.Tensor, linear: nn.Module) -> bool:
    """Whether `linear` applied to x takes the GEMV: the engine's kernel path, at most
    `gemv_max_rows` rows, and a plain Kiln linear (an adapter's forward, e.g. LoRA's, must run)."""
    rows = getattr(getattr(batch, "backend", None), "gemv_max_rows", 0)
    return (0 < x.shape[0] <= rows and kernel_path(batch, x, linear.weight)
            and not hasattr(linear, "lora_A"))


def _finish(linear: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """What the module's forward does after its matmul: the all-reduce of a row-parallel layer,
    the bias."""
    if isinstance(linear, RowParallelLinear) and linear.reduce_output:
        y = linear.pc.all_reduce(y)
    if linear.bias is not None:
        y = y + linear.bias
    return y


def norm_linear(norm: RMSNorm, linear: nn.Module, h: torch.Tensor, batch,
                residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(h [+ residual])), the new residual stream: h + residual, or h without one)."""
    if gemv_path(batch, h, linear):
        y, r_out = _kernels().gemv(h, linear.weight, prologue=_kernels().PROLOGUE_NORM, norm_weight=norm.weight,
                                   residual=residual, eps=norm.eps)
        return _finish(linear, y), (r_out if residual is not None else h)
    x, residual = (norm(h, batch), h) if residual is None else norm(h, batch, residual)
    return linear(x), residual


def silu_linear(linear: nn.Module, gate_up: torch.Tensor, batch) -> torch.Tensor:
    """linear(silu(gate) * up) for gate_up = [gate | up] on the last dim."""
    if gemv_path(batch, gate_up, linear):
        y, _ = _kernels().gemv(gate_up, linear.weight, prologue=_kernels().PROLOGUE_SILU)
        return _finish(linear, y)
    return linear(silu_and_mul(gate_up, batch))


def row_linear(linear: nn.Module, x: torch.Tensor, batch) -> torch.Tensor:
    """linear(x), through the GEMV when `gemv_path` allows."""
    if gemv_path(batch, x, linear):
        return _finish(linear, _kernels().gemv(x, linear.weight)[0])
    return linear(x)
