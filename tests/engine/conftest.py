"""Fixtures shared by the engine tests."""

from __future__ import annotations

import json

import pytest

from tests.engine.test_kernel_path import CONFIGS


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def arch_dir(request, tmp_path_factory) -> str:
    """A model directory (config.json only, dummy weights) for each tiny architecture: Llama,
    Inkling and MiniMax-M3 (`test_kernel_path.CONFIGS`)."""
    d = tmp_path_factory.mktemp(request.param)
    (d / "config.json").write_text(json.dumps(CONFIGS[request.param]))
    return str(d)
