"""Shared fixtures: the embedded SmolLM2 (converted once to ~/.cache/kiln) and its HF twin."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run under Triton's interpreter; it must be chosen before any
# kernel module is imported (triton.jit reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test` runs 2 workers) the workers share the cores: each worker, and the
# servers and ranks its tests start, gets its share of threads instead of one per core each.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    _threads = max(1, _cores // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)


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
