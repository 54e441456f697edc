"""RMSNorm as the model contract defines it: statistics and scaling in fp32, one cast back.

`RMSNorm(x, batch, residual)` also takes the residual add in front of it (vLLM's pattern): the
decoder layers carry the residual stream separately from each sublayer's output, and every norm
after the first computes `residual = x + residual; out = norm(residual)`. On the engine's kernel
path (`batch.backend.use_kernels`: CUDA with Triton, or the interpreter in tests) both run as one
Triton launch (`kiln.kernels.norm`); elsewhere (the CPU engine, `--kernel-backend reference`, the
trainer, anything autograd records) the reference ops below run, the add in the model's dtype as
before, so those paths are bit-identical to the plain `h = h + f(norm(h))` formulation.
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch
from torch import nn

from kiln.kernels import kernel_path


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, computed in fp32 and cast back once."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


@functools.lru_cache(maxsize=None)
def _kernels():
    # Imported on first use: it needs Triton, which the CPU build of torch does not ship.
    from kiln.kernels import norm
    return norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        # Counts the programs of a decode GEMV that runs this norm in its epilogue
        # (`kiln.layers.decode_gemv.decode_linear_norm`); zero between launches. A norm runs once
        # per forward, and forwards run in stream order, so no two launches share it at once.
        self.register_buffer("epilogue_counter", torch.zeros(1, dtype=torch.int32), persistent=False)

    def forward(self, x: torch.Tensor, batch=None, residual: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """norm(x) over the last dim; with `residual`: (norm(x + residual), x + residual).
        `batch` only chooses the path (see the module doc); without one the reference runs."""
        fast = kernel_path(batch, x, residual, self.weight)
        if residual is None:
            return _kernels().rms_norm(x, self.weight, self.eps) if fast else rms_norm(x, self.weight, self.eps)
        if fast:
            return _kernels().fused_add_rms_norm(x, residual, self.weight, self.eps)
        residual = residual + x  # the models' `h + f`, in the model's dtype
        return rms_norm(residual, self.weight, self.eps), residual
