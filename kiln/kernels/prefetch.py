"""Weights pulled into L2 while the kernel before runs: a bulk prefetch issued before the PDL wait.

At batch 1 a decode layer alternates weight streams (the GEMVs) with short latency-bound kernels
(norms, the attention prologue, attention itself) during which HBM sits idle: attention at a 1K
context reads ~4 MB in ~9 us, time enough to stream ~38 MB. With PDL's early trigger
(`kiln.kernels.launch`) the next GEMV's programs are resident while such a kernel runs; before
their `griddepcontrol.wait` they may read weights (no kernel writes them), and one
`cp.async.bulk.prefetch.L2` per chunk asks the memory system to copy a whole byte range into L2
without waiting for it. The GEMV then reads that range from L2 instead of HBM.

`l2_prefetch_span` spreads a tensor's byte span over the first `num_programs` programs of a grid
(program p takes chunks p, p + P, p + 2P, ... of one size, the last one cut at the span's end).
Programs beyond them prefetch nothing: if the grid's first wave is resident early, they have
covered the whole matrix by the time the wait returns.

The prefetch changes no value (it is a hint to the cache), so the kernel's results are bit for bit
those without it; only NVIDIA sm_90+ has the instruction, and the interpreter has no inline PTX:
callers pass `prefetch_args(...)`, which says when to compile it in.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kiln.kernels import interpreting
from kiln.kernels.launch import _sm90_or_later

# One chunk per thread of a 4-warp program; an 8-warp program (the GEMV's tile past K = 4096) holds
# each lane twice and issues each prefetch twice (a hint: harmless, a few instructions more).
CHUNKS_PER_PROGRAM = tl.constexpr(128)
ALIGN = 16  # cp.async.bulk: the address and the size are multiples of 16 bytes
_OFF = dict(PREFETCH=False, PF_SPAN=0, PF_CHUNK=0, PF_PROGRAMS=0)  # one dict: launches allocate none when off


@triton.jit
def _bulk_prefetch_l2(ptr, nbytes):
    """One `cp.async.bulk.prefetch.L2.global [ptr], nbytes` per element (none where nbytes is 0)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def l2_prefetch_span(base_ptr, pid, SPAN, CHUNK, NUM_PROGRAMS):
    """Program `pid` (< NUM_PROGRAMS) prefetches its chunks of the SPAN bytes from base_ptr into
    L2 (SPAN and CHUNK multiples of 16, base_ptr 16-byte aligned)."""
    if pid < NUM_PROGRAMS:
        start = (pid + tl.arange(0, CHUNKS_PER_PROGRAM).to(tl.int64) * NUM_PROGRAMS) * CHUNK
        n = tl.minimum(tl.maximum(SPAN - start, 0), CHUNK)
        byte_ptr = base_ptr.to(tl.pointer_type(tl.int8))
        _bulk_prefetch_l2(byte_ptr + tl.where(n > 0, start, 0), n.to(tl.int32))


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def prefetch_plan(span: int, max_bytes: int, grid: int, num_sms: int) -> dict:
    """The launch arguments for a byte span: off (PREFETCH False) when it is empty or over
    `max_bytes`, else the span cut to whole 16-byte units, a chunk size that lets
    min(grid, num_sms) programs of CHUNKS_PER_PROGRAM chunks each cover it, and that program count."""
    span = span // ALIGN * ALIGN
    if max_bytes <= 0 or span == 0 or span > max_bytes:
        return _OFF
    programs = max(1, min(grid, num_sms))
    chunk = triton.cdiv(triton.cdiv(span, programs * CHUNKS_PER_PROGRAM.value), ALIGN) * ALIGN
    return dict(PREFETCH=True, PF_SPAN=span, PF_CHUNK=chunk, PF_PROGRAMS=programs)


def prefetch_args(weight: torch.Tensor, max_bytes: int, grid: int) -> dict:
    """Launch arguments of `l2_prefetch_span` (`prefetch_plan`) for `weight`'s storage span (rows
    of stride `weight.stride(0)`), on for a span of at most `max_bytes` when the GPU is NVIDIA
    sm_90+, the kernels are compiled (not interpreted) and the weight is 16-byte aligned; off
    otherwise (the kernel then compiles the call out)."""
    dev = weight.device
    if max_bytes <= 0 or dev.type != "cuda" or interpreting() or weight.data_ptr() % ALIGN:
        return _OFF
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if not _sm90_or_later(index):
        return _OFF
    span = ((weight.shape[0] - 1) * weight.stride(0) + weight.shape[-1]) * weight.element_size()
    return prefetch_plan(span, max_bytes, grid, _num_sms(index))
