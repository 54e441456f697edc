"""benchmarks/kernel_bench/persistent_chain.py's kernel on the CPU (Triton's interpreter runs its
programs one after another, so program 0 takes every ticket in order): the chain equals the
fp32 reference, every GEMV's tiles counted themselves done, and each ticket was taken once."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from benchmarks.kernel_bench.persistent_chain import persistent_chain, reference_chain  # noqa: E402


@pytest.mark.parametrize("layers,m,n,k,block_n,programs", [(3, 1, 32, 32, 4, 3), (4, 4, 48, 16, 8, 2),
                                                            (2, 2, 16, 16, 16, 1)])
def test_persistent_chain_equals_the_reference(layers, m, n, k, block_n, programs):
    g = torch.Generator().manual_seed(layers * 100 + n)
    weights = (torch.randn(layers, n, k, generator=g) / k ** 0.5).to(torch.bfloat16)
    x0 = torch.randn(m, k, generator=g).to(torch.bfloat16)
    out = torch.full((layers, m, n), float("nan"), dtype=torch.bfloat16)
    counters = torch.zeros(layers + 1, dtype=torch.int32)
    persistent_chain(weights, x0, out, counters, programs, block_n)
    want = reference_chain(weights, x0)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
    tiles = n // block_n
    assert counters[:layers].tolist() == [tiles] * layers
    assert counters[layers].item() == layers * tiles + programs  # every program's last ticket ran past the end
