"""Counter-based sampling noise in one launch: `kiln.engine.seeded_noise` on the GPU.

The reference hashes (seed, draw index, column) with the splitmix64 finaliser in int64 torch ops:
about twenty elementwise launches over [S, V] int64 temporaries per draw (the mixes, the masked
shifts, the conversion, the logarithm). A decode step of seeded requests (every RL sample has a
seed) draws V values per row, and a speculative round with sampled drafts draws once per MTP layer
inside the chain graph, so on the GPU those launches and their 8-byte temporaries were a visible
share of a sampled step. `_noise_kernel` computes the same words in registers, one program per
(row, block of columns), and writes the float32 values only.

The integer part is exact (uint64 arithmetic wraps like torch's int64 and shifts logically), so
uniforms are bit-identical to the reference; exponentials take -log of the same float64 uniform,
so they match it to float64 rounding of the logarithm before the float32 cast (identical in every
test). Reference: `kiln.engine.seeded_noise.exponentials` / `uniforms` (torch ops);
`tests/kernels/test_seeded_noise_kernel.py` compares them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.launch import pdl_launch, wait_for_previous

BLOCK = 1024


@triton.jit
def _mix(x):
    """The splitmix64 finaliser on uint64 values (see kiln.engine.seeded_noise._mix)."""
    x ^= x >> 30
    x *= 0xBF58476D1CE4E5B9
    x ^= x >> 27
    x *= 0x94D049BB133111EB
    x ^= x >> 31
    return x


@triton.jit
def _noise_kernel(keys_ptr, out_ptr, width, stride_key, stride_out, EXPONENTIAL: tl.constexpr, BLOCK: tl.constexpr,
                  PDL: tl.constexpr):
    """Program (row, block): values [block * BLOCK, + BLOCK) of the row's draw keyed (seed, index)."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(keys_ptr + row * stride_key).to(tl.uint64, bitcast=True)
    draw = tl.load(keys_ptr + row * stride_key + 1).to(tl.uint64, bitcast=True)
    key = _mix(seed * 0x9E3779B97F4A7C15 + draw)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = _mix(key + cols.to(tl.uint64) * 0x9E3779B97F4A7C15)
    if EXPONENTIAL:  # u in (0, 1) from the top 53 bits, then -log(u) in float64
        u = ((x >> 11).to(tl.float64) + 0.5) * (2.0 ** -53)
        val = (-tl.log(u)).to(tl.float32)
    else:  # an odd multiple of 2^-24 from the top 23 bits
        val = (((x >> 41).to(tl.float64) + 0.5) * (2.0 ** -23)).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, val, mask=cols < width)


def noise(keys: torch.Tensor, width: int, exponential: bool) -> torch.Tensor:
    """[S, width] float32 values of the draws keyed `keys` [S, 2] int64 (seed, draw index; rows
    may be strided): Exp(1) values when `exponential`, else U(0, 1)."""
    assert keys.dim() == 2 and keys.shape[1] == 2 and keys.dtype == torch.int64 and keys.stride(1) == 1, \
        f"keys must be [S, 2] int64 rows, got {tuple(keys.shape)} {keys.dtype}"
    s = keys.shape[0]
    out = torch.empty(s, width, dtype=torch.float32, device=keys.device)
    if s and width:
        _noise_kernel[(s, triton.cdiv(width, BLOCK))](keys, out, width, keys.stride(0), out.stride(0),
                                                      EXPONENTIAL=exponential, BLOCK=BLOCK, num_warps=4,
                                                      **pdl_launch(keys.device))
    return out
