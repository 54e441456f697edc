"""Triton SiLU-and-mul (SwiGLU's inner product) in one launch.

    silu_and_mul(gate_up) = silu(gate) * up,   gate, up = gate_up.chunk(2, dim=-1)

The reference (`kiln.layers.activation.silu_and_mul_ref`) runs a chunk, a silu and a mul, the
silu's [T, I] result going through memory in between; in bf16 it also rounds silu(gate) before
the product. Here each program reads its gate and up columns straight from the fused gate_up GEMM
output, computes silu(g) * u in fp32 (silu = g / (1 + exp(-g)), the formula torch's CUDA silu
uses) and rounds once to the output dtype: the input's by default, or fp32 for the MoE experts,
whose activation product is fp32 (`kiln.ops.moe.swiglu_act`).

Rows are the leading dims flattened, read through their row stride (the last dim must be
contiguous). No host sync, the grid depends only on shapes: CUDA-graph capturable. Inference only.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kiln.kernels.launch import pdl_launch, wait_for_previous


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, I, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Row pid0, columns pid1*BLOCK .. +BLOCK of the [N, I] output."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    src = x_ptr + row * stride_x + cols
    g = tl.load(src, mask=m, other=0.0).to(tl.float32)
    u = tl.load(src + I, mask=m, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def silu_and_mul(gate_up: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2I] (gate then up on the last dim, any row stride) ->
    a new contiguous [..., I] in `out_dtype` (default: gate_up's dtype), computed in fp32."""
    two_i = gate_up.shape[-1]
    assert two_i % 2 == 0, gate_up.shape
    inter = two_i // 2
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    x = gate_up.reshape(-1, two_i)  # a view for the usual [T, 2I] GEMM output (or a row-strided slice)
    out = torch.empty(gate_up.shape[:-1] + (inter,), dtype=out_dtype or gate_up.dtype, device=gate_up.device)
    n = x.shape[0]
    if n == 0 or inter == 0:
        return out
    # Few rows (decode): smaller column blocks put more programs on the SMs.
    block = min(triton.next_power_of_2(inter), 1024 if n >= 64 else 256)
    _silu_and_mul_kernel[(n, triton.cdiv(inter, block))](
        x, out, inter, x.stride(0), inter, BLOCK=block, num_warps=4 if block >= 512 else 2,
        **pdl_launch(x.device),
    )
    return out
