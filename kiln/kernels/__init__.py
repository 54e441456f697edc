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
