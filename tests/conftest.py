"""Shared fixtures: the embedded SmolLM2 (converted once to ~/.cache/kiln) and its HF twin."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run under Triton's interpreter; it must be chosen before any
# kernel module is imported (triton.jit reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] == "1":  # the interpreter's own bookkeeping, trimmed (see the module)
        from tests.interpreter_speedups import install as _speed_up_interpreter

        _speed_up_interpreter()

# Under pytest-xdist (`make test` runs 2 workers) the workers share the cores: each worker, and the
# servers and ranks its tests start, gets its share of threads instead of one per core each.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    _threads = max(1, _cores // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)


# CPython keeps a thread's Python frames in a stack of chunks (the first 16 KiB) and frees a chunk
# as soon as the frame that opened it returns. Code whose call depth keeps crossing a chunk's end
# allocates and frees a chunk per call: Triton's interpreter, under pytest's deeper base stack,
# did so millions of times per test (an mmap, a munmap and a few page faults each: about a third
# of an interpreter-bound test's time, 3.7M page faults against 80K in a plain script). Each test
# (setup, call, teardown) therefore runs inside a frame of ~600 KB of (never assigned) locals: it
# opens a chunk of 1 MiB whose ~400 KiB left over hold every frame the test pushes. Only where the
# frames live changes; what runs does not.
_ROOM_SLOTS = 75_000
_room_ns: dict = {}
exec(compile("def _in_room(fn):\n    if fn is None:\n        "
             + " = ".join(f"_{i}" for i in range(_ROOM_SLOTS)) + " = None\n    return fn()\n",
             "<tests/conftest.py: frame room>", "exec"), _room_ns)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    from _pytest.runner import pytest_runtest_protocol as protocol

    return _room_ns["_in_room"](lambda: protocol(item, nextitem))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_source():
    from kiln.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_source):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_source.model_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_source.model_dir, dtype=torch.float32).eval()
    return model, tok
