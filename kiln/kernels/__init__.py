"""Triton kernels: the GPU fast path of the ops in `kiln.ops`.

Every kernel module here exposes plain functions with the same arguments and results as a
reference op in `kiln.ops` (or documents the difference), and a test in `tests/kernels/` compares
the two on random inputs. The references stay the spec; kernels only make them fast.

Kernels take only device tensors and launch on grids whose size does not depend on tensor
*values*, so that the decode step can be captured in a CUDA graph (no `.item()`, no `.tolist()`,
no data-dependent shapes inside).

On the CPU the engine runs the reference ops. The kernels still run there under Triton's
interpreter (`TRITON_INTERPRET=1`, set by `tests/conftest.py` when there is no GPU), which is how
CI checks them without a GPU; it must be set before a kernel module is imported.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def triton_available() -> bool:
    """Triton is importable (the CUDA builds of torch ship it; the CPU build does not)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Kernels run under Triton's CPU interpreter (tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernels_supported(device: torch.device | str) -> bool:
    """Whether the engine should use Triton kernels for tensors on `device`: CUDA with Triton.
    The interpreter is for tests only; the CPU engine keeps the reference ops."""
    return torch.device(device).type == "cuda" and triton_available()


def kernel_path(batch, *tensors) -> bool:
    """Whether a layer op (RMSNorm, RoPE, SiLU-and-mul) takes its kernel: the forward runs on the
    engine's kernel path (`batch.backend.use_kernels`: CUDA with Triton, or the interpreter in
    tests; never the trainer's packed backend) and autograd records nothing through `tensors`
    (kernels have no backward)."""
    if batch is None or not getattr(batch.backend, "use_kernels", False):
        return False
    return not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in tensors)


def _patch_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and turns them into Python ints
    with int(array), which NumPy >= 2.4 refuses, so `range(start, end)` over tensor bounds fails
    there. Make its tensor __index__ use .item() (the compiled path is unaffected)."""
    import numpy as np
    from triton.runtime import interpreter

    try:
        int(np.ones(1, dtype=np.int32))
        return  # older NumPy: nothing to fix
    except TypeError:
        pass
    original = interpreter._patch_lang_tensor
    if getattr(original, "kiln_patched", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch_lang_tensor.kiln_patched = True
    interpreter._patch_lang_tensor = patch_lang_tensor


# Every kernel module imports this package first, so the interpreter is fixed before any kernel
# runs under it.
if interpreting() and triton_available():
    _patch_interpreter_scalar_index()


def assert_rows(**tensors) -> None:
    """Per-row metadata (lengths, request slots, positions, cache slots) is read at `ptr + row`:
    each named tensor must be 1-D with unit stride. A strided view, such as `expand(...).reshape(-1)`
    at one row (stride 0), would hand rows 1.. other memory without any error; the forty-first
    session's first `DraftSampling.draw_block` did that to the sampling kernels. None is skipped."""
    for name, t in tensors.items():
        assert t is None or (t.dim() == 1 and (t.shape[0] <= 1 or t.stride(0) == 1)), \
            f"{name} must be a contiguous 1-D tensor (one entry per row), got shape {tuple(t.shape)} " \
            f"strides {t.stride()}"
