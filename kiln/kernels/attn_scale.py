"""Inkling's full-layer attention scale from the positions, in one launch.

lam_i = 1 + beta * ln(floor((i + 1) / floor_scale) + 1) (`kiln.models.inkling.attn_scale`, the
reference, MODELS.md 2.1). As PyTorch ops that is six launches at the start of every forward
(add, floor division, cast, log1p, mul, add): ~9 us of a batch-1 decode step's ~1.3 ms on an
H100, each op a device-wide hand-off (forty-fifth session). Here one program per block of
positions computes it in registers.

Bit for bit as PyTorch's CUDA ops: the floor division in integers, libdevice's log1pf (what
`torch.log1p` calls), and the product and sum rounded separately (`enable_fp_fusion=False`: no
FMA). Integral `floor_scale` only (every checkpoint's); the reference handles the rest. Under
Triton's CPU interpreter (tests) libdevice is unavailable and numpy's log(1 + n) stands in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kiln.kernels import interpreting
from kiln.kernels.launch import pdl_launch, wait_for_previous

BLOCK = 128


@triton.jit(do_not_specialize=["n"])
def _attn_scale_kernel(pos_ptr, out_ptr, n, beta, FLOOR: tl.constexpr, BLOCK: tl.constexpr,
                       PRECISE: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    p = tl.load(pos_ptr + i, mask=ok, other=0).to(tl.int64) + 1
    q = p // FLOOR
    q = tl.where((p % FLOOR != 0) & (p < 0), q - 1, q)  # floor, as torch's rounding_mode="floor" (p < 0: padding)
    x = q.to(tl.float32)
    if PRECISE:
        ln = libdevice.log1p(x)
    else:
        ln = tl.log(1.0 + x)
    tl.store(out_ptr + i, 1.0 + beta * ln, mask=ok)


def supported(floor_scale: float) -> bool:
    """Whether `attn_scale` takes this floor (integral ones)."""
    return float(floor_scale).is_integer() and floor_scale >= 1


def attn_scale(positions: torch.Tensor, beta: float, floor_scale: float) -> torch.Tensor:
    """`kiln.models.inkling.attn_scale` ([T] fp32) in one launch; `supported(floor_scale)` must hold."""
    assert supported(floor_scale), floor_scale
    assert positions.dim() == 1 and positions.is_contiguous(), (positions.shape, positions.stride())
    n = positions.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=positions.device)
    if n == 0:
        return out
    _attn_scale_kernel[(triton.cdiv(n, BLOCK),)](positions, out, n, beta, FLOOR=int(floor_scale), BLOCK=BLOCK,
                                                 PRECISE=not interpreting(), enable_fp_fusion=False,
                                                 num_warps=1, **pdl_launch(positions.device))
    return out
