"""The devices every kernel test runs on, in one place.

"cpu": the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when
there is no GPU). On a GPU machine Triton compiles for CUDA and cannot take CPU tensors, so those
cases skip there. "cuda": compiled kernels at real shapes, marked gpu (skipped without CUDA).
"""

import pytest
import torch

from kiln.kernels import interpreting

INTERPRETER_ONLY = pytest.mark.skipif(not interpreting(), reason="CPU tensors run only under Triton's interpreter")
DEVICES = [pytest.param("cpu", marks=INTERPRETER_ONLY), pytest.param("cuda", marks=pytest.mark.gpu)]

# (device, dtype) cases for kernels tested in both precisions: the interpreter runs fp32 only; the
# GPU runs fp32 (tight tolerances) and bf16 (the serving dtype).
DEVICE_DTYPES = [pytest.param("cpu", torch.float32, id="cpu-fp32", marks=INTERPRETER_ONLY),
                 pytest.param("cuda", torch.float32, id="cuda-fp32", marks=pytest.mark.gpu),
                 pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu)]


def record_launches(monkeypatch, module, *names: str) -> list:
    """A list that gains a kernel's name each time `module.<name>[grid](...)` launches from now on,
    for each of `names` (the kernel still runs): which kernels a path took."""
    launched = []

    class Recorded:
        def __init__(self, name):
            self.name, self.kernel = name, getattr(module, name)

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    for name in names:
        monkeypatch.setattr(module, name, Recorded(name))
    return launched


def count_compiles(monkeypatch, kernel_name: str) -> list:
    """A list that gains an entry each time Triton compiles (or loads from its disk cache) a new
    variant of the kernel named `kernel_name` in this process, for the tests that check a kernel
    is not specialised on what changes from batch to batch."""
    import triton.runtime.jit as jit

    compiled = []
    original = jit.JITFunction._do_compile

    def counted(fn, *a, **kw):
        if (getattr(fn, "__name__", None) or fn.fn.__name__) == kernel_name:
            compiled.append(1)
        return original(fn, *a, **kw)

    monkeypatch.setattr(jit.JITFunction, "_do_compile", counted)
    return compiled


def capture_graph(fn):
    """(graph, out): `fn` run once on a side stream (Triton compiles and loads its kernels there,
    outside the capture), then captured in a CUDA graph whose replays rewrite `out`."""
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
