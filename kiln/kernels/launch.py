"""Programmatic dependent launch (PDL): a kernel's launch leaves the critical path.

A decode step at small batch is a chain of short dependent kernels, and between two of them the
GPU idles while the second one is launched (about 0.5 us after a Triton kernel, 1 us after a
cuBLAS GEMM on an H200: `python -m benchmarks.kernels.pdl`). On Hopper and later, a kernel
launched with the programmatic-stream-serialization attribute may start while its predecessor
still runs; it must then execute `griddepcontrol.wait` before it reads anything the predecessor
wrote or writes anything the predecessor reads. CUDA graphs keep the attribute (a programmatic
edge), so the captured decode step benefits too.

Every Kiln kernel therefore takes a `PDL` constexpr and calls `wait_for_previous(PDL)` as its
first statement, before any load or store (the one exception: the decode GEMV,
`kiln.kernels.gemv`, first starts loading its weights, which no kernel writes), and its wrapper
launches it with `**pdl_launch(device)`. Waiting first makes the rule hold for every kernel
without reasoning about which buffers its predecessor touches. Safety is transitive: a kernel
runs past its wait only once its predecessor has completed, and the predecessor completed only
after passing its own wait.

A kernel does not trigger its successor's launch early (`griddepcontrol.launch_dependents`): the
successor launches when this kernel's programs exit. An early trigger right after the wait made
the decode GEMV faster (branch `experiment/pdl-early-trigger`), and is left out until a GPU test
failure first seen with it is understood (it also occurs without it; docs/benchmarks.md, eighth
pass).

`set_pdl(False)` (the engine's `--disable-pdl`) turns it off for A/B runs; it is off on the CPU
interpreter and on GPUs older than sm_90, where the attribute does not exist.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kiln.kernels import interpreting

_ENABLED = [True]  # a process-wide switch like torch.backends flags; set_pdl changes it
# The interpreter is chosen before any kernel module is imported (kiln/kernels/__init__.py).
_INTERPRETING = interpreting()
_ON = dict(PDL=True, launch_pdl=True)
_OFF = dict(PDL=False, launch_pdl=False)


def set_pdl(enabled: bool) -> None:
    """Launch Kiln's kernels with PDL where the GPU supports it (default) or never."""
    _ENABLED[0] = bool(enabled)


@functools.lru_cache(maxsize=None)
def _sm90_or_later(index: int) -> bool:
    # NVIDIA only: ROCm reports its own (major, minor), and the wait is PTX
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL now: enabled, CUDA, sm_90+, not interpreting."""
    if not _ENABLED[0] or device.type != "cuda" or _INTERPRETING:
        return False
    return _sm90_or_later(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch: `kernel[grid](..., **pdl_launch(x.device))`. Called
    on every eager launch, so it allocates nothing."""
    return _ON if pdl_supported(device) else _OFF


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """First statement of every kernel (after `kiln.kernels.gemv`'s weight prefetch, which reads
    nothing any kernel writes): with PDL, wait until the previous kernel has completed and its
    writes are visible. A no-op when launched without PDL."""
    if PDL:
        gdc_wait()
