"""softmax(logits / T) per row for the sampler, in two launches over (row, chunk) programs.

`_softmax_stats_kernel` takes each chunk's max m of logits / T and its sum of exp(x - m);
`_softmax_kernel` merges the row's (m, s) pairs into its max M and sum S and writes
exp(x - M) / S over its chunk. torch's division and softmax took 18.7 us for one 49K-token row on
an H100 (its softmax runs one thread block per row), these two launches 5.9 us (docs/benchmarks.md,
thirty-ninth pass). The division is IEEE as torch's; the exponential and the row's sum are
Triton's, so the values differ from torch's by float rounding (equal logits still give equal
probabilities). Grids depend only on shapes (CUDA-graph capturable), no host sync.

Reference: `torch.softmax(logits.float() / T, -1)` with T = 0 read as 1 (the first steps of
`kiln.engine.sampler.filtered_probs`); `tests/kernels/test_sampling_kernels.py` compares them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.launch import pdl_launch, wait_for_previous

SOFTMAX = dict(CHUNK=1024, num_warps=4)


@triton.jit
def _scaled_chunk(logits_ptr, t_ptr, row, chunk, V, stride, CHUNK: tl.constexpr):
    """The chunk's logits / T as float32 (T = 0 read as 1; -inf past the row), and its offsets."""
    t = tl.load(t_ptr + row)
    t = tl.where(t == 0, 1.0, t)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = offs < V
    x = tl.load(logits_ptr + row * stride + offs, mask=ok, other=0.0).to(tl.float32)
    return tl.where(ok, tl.math.div_rn(x, t), float("-inf")), offs, ok


@triton.jit
def _softmax_stats_kernel(logits_ptr, t_ptr, part_m_ptr, part_s_ptr, V, stride, n_chunks, CHUNK: tl.constexpr,
                          PDL: tl.constexpr):
    """Program (row, chunk): the chunk's max m of logits / T and sum of exp(x - m)."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    x, _, _ = _scaled_chunk(logits_ptr, t_ptr, row, chunk, V, stride, CHUNK)
    m = tl.max(x, axis=0)
    tl.store(part_m_ptr + row * n_chunks + chunk, m)
    # a chunk of -inf logits alone (off a draft token map) has no mass, not exp(-inf - -inf) = NaN
    tl.store(part_s_ptr + row * n_chunks + chunk, tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), axis=0))


@triton.jit
def _softmax_kernel(logits_ptr, t_ptr, part_m_ptr, part_s_ptr, out_ptr, V, stride, n_chunks, CHUNK: tl.constexpr,
                    CP2: tl.constexpr, PDL: tl.constexpr):
    """Program (row, chunk): the row's max M and sum S from the chunks' (m, s), then
    exp(x - M) / S over the chunk."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    c = tl.arange(0, CP2)
    c_ok = c < n_chunks
    m = tl.load(part_m_ptr + row * n_chunks + c, mask=c_ok, other=float("-inf"))
    s = tl.load(part_s_ptr + row * n_chunks + c, mask=c_ok, other=0.0)
    big = tl.max(m, axis=0)
    total = tl.sum(tl.where(c_ok, s * tl.exp(m - big), 0.0), axis=0)
    x, offs, ok = _scaled_chunk(logits_ptr, t_ptr, row, chunk, V, stride, CHUNK)
    tl.store(out_ptr + row * V + offs, tl.math.div_rn(tl.exp(x - big), total), mask=ok)



def temperature_softmax(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """softmax(logits / T) per row (T = 0 read as 1) of [N, V] logits (any float dtype, last
    dimension contiguous), as [N, V] float32."""
    n, v = logits.shape
    assert logits.stride(1) == 1 and temperatures.shape == (n,)
    out = torch.empty(n, v, dtype=torch.float32, device=logits.device)
    if n == 0:
        return out
    chunk = min(SOFTMAX["CHUNK"], triton.next_power_of_2(v))
    n_chunks = triton.cdiv(v, chunk)
    part_m = torch.empty(n, n_chunks, dtype=torch.float32, device=logits.device)
    part_s = torch.empty_like(part_m)
    t = temperatures.float().contiguous()  # read at t_ptr + row: rows of a strided view would read other memory
    _softmax_stats_kernel[(n, n_chunks)](logits, t, part_m, part_s, v, logits.stride(0), n_chunks, CHUNK=chunk,
                                         num_warps=SOFTMAX["num_warps"], **pdl_launch(logits.device))
    _softmax_kernel[(n, n_chunks)](logits, t, part_m, part_s, out, v, logits.stride(0), n_chunks, CHUNK=chunk,
                                   CP2=triton.next_power_of_2(n_chunks), num_warps=SOFTMAX["num_warps"],
                                   **pdl_launch(logits.device))
    return out
