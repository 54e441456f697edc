"""Greedy argmax over vocabulary rows in two short launches, for decode.

torch.argmax reduces a [B, V] row with few thread blocks per row: on an H200 it took 13 us for
one 49K-token fp32 row, five times per speculative round (the verify's and each draft layer's
greedy tokens; docs/benchmarks.md, nineteenth pass). Here `_chunk_max_kernel` runs one program
per (row, chunk of CHUNK tokens), each keeping per lane the first maximum of its strided
elements, then the chunk's first maximum; `_merge_kernel` takes per row the chunk with the
largest value, the earliest on ties (chunks are in id order). So the result is the first index
of the row's maximum, as torch.argmax. NaN counts as +inf (torch ranks NaN above +inf; rows of
logits hold neither). Grids depend only on shapes: CUDA-graph capturable, no host sync.

Reference: `torch.argmax(x, dim=-1)`; `tests/kernels/test_argmax.py` compares the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.launch import pdl_launch, wait_for_previous

CHUNK = 4096  # tokens per program: 13 programs per row at V = 49K, 32 at 128K
BLOCK = 1024
_NO_ID = tl.constexpr(2147483647)


@triton.jit
def _chunk_max_kernel(x_ptr, part_v_ptr, part_i_ptr, V, stride_x, n_chunks, CHUNK: tl.constexpr,
                      BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (row, chunk): the chunk's largest value and its first index into the partials."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_id = tl.full([BLOCK], _NO_ID, dtype=tl.int32)
    for sub in range(0, CHUNK, BLOCK):
        offs = chunk * CHUNK + sub + tl.arange(0, BLOCK)
        ok = offs < V
        x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)
        # strict: each lane keeps its first maximum; its first element always counts (a row of -inf)
        take = ok & ((x > best) | (best_id == _NO_ID))
        best_id = tl.where(take, offs, best_id)
        best = tl.where(take, x, best)
    m = tl.max(best, axis=0)
    tl.store(part_v_ptr + row * n_chunks + chunk, m)
    tl.store(part_i_ptr + row * n_chunks + chunk, tl.min(tl.where(best == m, best_id, _NO_ID), axis=0))


@triton.jit
def _merge_kernel(part_v_ptr, part_i_ptr, ids_ptr, n_chunks, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Per row: the first index of the largest chunk value (the earliest chunk on ties)."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < n_chunks
    v = tl.load(part_v_ptr + row * n_chunks + c, mask=ok, other=float("-inf"))
    i = tl.load(part_i_ptr + row * n_chunks + c, mask=ok, other=_NO_ID)
    m = tl.max(v, axis=0)
    tl.store(ids_ptr + row, tl.min(tl.where((v == m) & ok, i, _NO_ID), axis=0).to(tl.int64))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of a 2-D float tensor [B, V] (last dim contiguous): [B] int64."""
    assert x.dim() == 2 and x.is_floating_point(), f"argmax takes [B, V] float rows, got {tuple(x.shape)} {x.dtype}"
    x = x if x.stride(-1) == 1 else x.contiguous()
    n, v = x.shape
    ids = torch.empty(n, dtype=torch.int64, device=x.device)
    if n == 0:
        return ids
    assert v > 0, "argmax of an empty row"
    chunk = min(CHUNK, triton.next_power_of_2(v))
    block = min(BLOCK, chunk)
    n_chunks = triton.cdiv(v, chunk)
    part_v = torch.empty(n, n_chunks, dtype=torch.float32, device=x.device)
    part_i = torch.empty(n, n_chunks, dtype=torch.int32, device=x.device)
    _chunk_max_kernel[(n, n_chunks)](x, part_v, part_i, v, x.stride(0), n_chunks, CHUNK=chunk, BLOCK=block,
                                     num_warps=4, **pdl_launch(x.device))
    _merge_kernel[(n,)](part_v, part_i, ids, n_chunks, BLOCK=triton.next_power_of_2(n_chunks), num_warps=1,
                        **pdl_launch(x.device))
    return ids
