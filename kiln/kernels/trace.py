"""Per-program timestamps from inside a kernel: where a batch-1 step's latency goes.

A profiler sees a kernel as one interval from its launch to its end, and with PDL (`kiln.kernels.launch`)
that interval starts while the kernel still waits for its predecessor, so it cannot say how long a
GEMV's programs wait, how long their stream takes after the wait, or how late the last wave starts.
A kernel built with `TRACE` writes, for each program, the GPU's global nanosecond timer at a few
points and the SM it ran on into a buffer (`FIELDS` int64 per program); comparing the
buffers of consecutive launches gives the gaps between them. `benchmarks/kernel_bench/gemv_trace.py`
reads them.

NVIDIA only (inline PTX: `%globaltimer`, `%smid`); the interpreter has no inline PTX, so a traced
launch is refused there. Tracing changes no value the kernel computes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels import interpreting

# the fields of one program's record: start, wait returned, prologue done (a norm's statistics;
# without a norm, the prologue's loads issued), products reduced, stores issued (not completed),
# SM id (2 spare)
FIELDS = 8
START, WAITED, PROLOGUE, REDUCED, STORED, SM = range(6)
# the same, for the kernels (a @triton.jit function reads only constexpr globals)
_FIELDS, _START, _WAITED, _PROLOGUE, _REDUCED, _STORED, _SM = (
    tl.constexpr(v) for v in (FIELDS, START, WAITED, PROLOGUE, REDUCED, STORED, SM))


@triton.jit
def global_time(dep):
    """The global timer (ns), read once `dep` (an fp32 scalar) is computed, so the read cannot
    move above the work that produced it."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer; // $1", "=l,f", [dep], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def sm_id():
    """The SM this program runs on."""
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def store_trace(TR, pid, t_start, t_waited, t_prologue, t_reduced, t_stored):
    """Program `pid`'s record (its index in the grid, row-major over a 2-D grid): the five times and
    its SM."""
    base = TR + pid * _FIELDS
    tl.store(base + _START, t_start)
    tl.store(base + _WAITED, t_waited)
    tl.store(base + _PROLOGUE, t_prologue)
    tl.store(base + _REDUCED, t_reduced)
    tl.store(base + _STORED, t_stored)
    tl.store(base + _SM, sm_id().to(tl.int64))


def trace_args(trace, fallback, programs: int) -> dict:
    """Launch arguments: TR = `trace` (an int64 tensor of at least programs * FIELDS values)
    with TRACE on, or `fallback` standing in for the pointer with TRACE off."""
    if trace is None:
        return dict(TR=fallback, TRACE=False)
    assert not interpreting(), "a traced launch needs a GPU: the interpreter has no inline PTX"
    assert trace.dtype == torch.int64 and trace.is_contiguous() and trace.numel() >= programs * FIELDS, \
        f"trace: a contiguous int64 buffer of at least {programs} x {FIELDS} values"
    assert trace.device == fallback.device, f"trace on {trace.device}, the kernel's tensors on {fallback.device}"
    return dict(TR=trace, TRACE=True)

