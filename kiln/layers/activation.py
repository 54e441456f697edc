"""Activations used by the MLPs.

`silu_and_mul` has two paths. The reference (`silu_and_mul_ref`: chunk, silu, mul in the input's
dtype) runs on the CPU, whenever autograd records through the input, and in the engine when it
runs without kernels (`--kernel-backend reference`), so those paths are unchanged and the CPU
engine still matches Hugging Face exactly. Otherwise one Triton launch computes it in fp32 with a
single rounding (`kiln.kernels.activation`): inside the engine when its backend uses kernels
(`kernels.kernel_path`, which also covers the interpreter in CPU tests), elsewhere (the trainer
under no_grad, drafters called without a batch) for any CUDA tensor.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kiln.kernels import kernel_path, kernels_supported


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's inner product: silu(gate) * up, with gate and up stacked on the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@functools.lru_cache(maxsize=None)
def _kernels():
    # Imported on first use: it needs Triton, which the CPU build of torch does not ship.
    from kiln.kernels import activation
    return activation


def use_kernel(x: torch.Tensor, batch=None) -> bool:
    """Whether an activation of x takes the Triton kernel (see the module doc): the engine's own
    choice when `batch` comes from it, else CUDA with Triton and no autograd recording through x."""
    if hasattr(getattr(batch, "backend", None), "use_kernels"):
        return kernel_path(batch, x)
    return kernels_supported(x.device) and not (torch.is_grad_enabled() and x.requires_grad)


def silu_and_mul(gate_up: torch.Tensor, batch=None) -> torch.Tensor:
    """silu(gate) * up with gate and up stacked on the last dim, in gate_up's dtype: one fp32
    Triton launch where `use_kernel` allows it, else `silu_and_mul_ref`."""
    if use_kernel(gate_up, batch):
        return _kernels().silu_and_mul(gate_up)
    return silu_and_mul_ref(gate_up)
