"""Programmatic dependent launch (PDL): a kernel's launch leaves the critical path.

A decode step at small batch is a chain of short dependent kernels, and between two of them the
GPU idles while the second one is launched (about 0.5 us after a Triton kernel, 1 us after a
cuBLAS GEMM on an H200: `python -m benchmarks.kernel_bench.pdl`). On Hopper and later, a kernel
launched with the programmatic-stream-serialization attribute may start while its predecessor
still runs; it must then execute `griddepcontrol.wait` before it reads anything the predecessor
wrote or writes anything the predecessor reads. CUDA graphs keep the attribute (a programmatic
edge), so the captured decode step benefits too.

Every Kiln kernel therefore takes a `PDL` constexpr and calls `wait_for_previous(PDL)` as its
first statement, before any load or store, and its wrapper launches it with
`**pdl_launch(device)`. Waiting first makes the rule hold for every kernel without reasoning
about which buffers its predecessor touches. Safety is transitive: a kernel runs past its wait
only once its predecessor has completed, and the predecessor completed only after passing its
own wait. Three exceptions read something before their wait: the decode GEMV (`kiln.kernels.gemv`)
its weights, which no kernel writes; with the early trigger, the one-token down expert GEMV
(`kiln.kernels.moe_gemv`) the routing its gate/up predecessor also reads; and, in a plain decode
step (`early_kv`), the decode attention (`kiln.kernels.decode_attention`) its lengths, page-table
entries and first block of older keys, which the host and earlier steps wrote (the new token's
K/V row, which its predecessor writes, it reads after the wait), and with Inkling's prologue
inside it the older inputs of the k/v ShortConvs (the raw k and v, which its predecessor
writes, after the wait). A successor launches only once
every program of its predecessor has triggered (after its wait) or exited, so when such a kernel
starts, everything before its predecessor has completed.

By default a kernel does not trigger its successor's launch early
(`griddepcontrol.launch_dependents`): the successor launches when this kernel's programs exit.
With the early trigger every kernel triggers right after its wait, so the successor's programs
become resident while it runs: the decode GEMV then streams weights for the whole of the kernel
before it. It gains 1.5-4% at batch 1 (docs/benchmarks.md, eleventh pass) but cost Inkling 6-20%
at batch 64 (twelfth pass; the hypothesis, not verified: the successor's early programs hold SM
slots the grouped MoE GEMMs' later waves need). So the engine turns it on per CUDA graph: decode
graphs of at most `--pdl-early-trigger-max-tokens` rows are captured inside `early_trigger(True)`
(not with speculative decoding, where it gained nothing: fourteenth pass); everywhere with
`--pdl-early-trigger` (`set_pdl(True, early_trigger=True)`). Correctness does not depend on it:
every kernel still waits for its predecessor's completion before touching memory.

`set_pdl(False)` (the engine's `--disable-pdl`) turns it off for A/B runs; it is off on the CPU
interpreter and on GPUs older than sm_90, where the attribute does not exist.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kiln.kernels import interpreting

_ENABLED = [True, False]  # (PDL, early trigger): process-wide like torch.backends flags; set_pdl sets them
# The interpreter is chosen before any kernel module is imported (kiln/kernels/__init__.py).
_INTERPRETING = interpreting()
# The kernels' PDL constexpr: 0 plain launch, 1 wait for the predecessor, 2 wait then trigger.
_ON = dict(PDL=1, launch_pdl=True)
_ON_TRIGGER = dict(PDL=2, launch_pdl=True)
_OFF = dict(PDL=0, launch_pdl=False)


def set_pdl(enabled: bool, early_trigger: bool = False) -> None:
    """Launch Kiln's kernels with PDL where the GPU supports it (default) or never; with
    `early_trigger`, each kernel also lets its successor launch right after its own wait."""
    _ENABLED[0] = bool(enabled)
    _ENABLED[1] = bool(early_trigger)


@contextlib.contextmanager
def early_trigger(on: bool):
    """Kernels launched (or captured into a CUDA graph) inside the block trigger their successor
    right after their wait when `on`, and do not when not; the process-wide setting is restored
    after. PDL itself stays as `set_pdl` left it."""
    before = _ENABLED[1]
    _ENABLED[1] = bool(on)
    try:
        yield
    finally:
        _ENABLED[1] = before


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
    if not pdl_supported(device):
        return _OFF
    return _ON_TRIGGER if _ENABLED[1] else _ON


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """First statement of every kernel (but for the exceptions of the module docstring): with
    PDL, wait until the previous kernel has completed and its writes are visible; with PDL == 2,
    then let the successor launch. A no-op without PDL."""
    if PDL:
        gdc_wait()
        if PDL == 2:
            gdc_launch_dependents()
