"""`kiln.kernels.attn_scale`: Inkling's full-layer attention scale in one launch equals the
reference (`kiln.models.inkling.attn_scale`), bit for bit on the GPU, on positions from padding's
-1 to past a million, several floors and betas; and the engine's forward takes it on the kernel
path only where the floor is integral."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels import attn_scale as kernels  # noqa: E402
from kiln.models.inkling import attn_scale, forward_attn_scale  # noqa: E402
from tests.kernels.devices import DEVICES  # noqa: E402


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("floor,beta", [(8, 0.5), (8192, 0.1), (1, 1.0), (3, 0.37)])
@pytest.mark.parametrize("n", [1, 5, 300])
def test_attn_scale_equals_reference(device, floor, beta, n):
    g = torch.Generator().manual_seed(n * floor)
    pos = torch.randint(0, 1 << 21, (n,), generator=g)
    pos[: min(n, 4)] = torch.tensor([-1, 0, floor - 2, floor - 1])[: min(n, 4)]  # the step's edges, padding
    pos = pos.to(device)
    want = attn_scale(pos, beta, floor)
    got = kernels.attn_scale(pos, beta, floor)
    assert got.dtype == torch.float32 and got.shape == (n,)
    # the interpreter stands in numpy's log(1 + x) for libdevice's log1pf: within an ulp there
    exact = device == "cuda"
    torch.testing.assert_close(got, want, rtol=0 if exact else 2.5e-7, atol=0)
    assert torch.equal(got > 1, pos + 1 >= floor)  # the scale steps up at position floor - 1


def test_forward_takes_the_kernel_only_where_it_applies(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "attn_scale", lambda *a: calls.append(a) or attn_scale(*a))
    pos = torch.arange(10)
    backend = lambda kernels_on: SimpleNamespace(use_kernels=kernels_on)  # noqa: E731
    batch = lambda kernels_on: SimpleNamespace(positions=pos, backend=backend(kernels_on))  # noqa: E731
    torch.testing.assert_close(forward_attn_scale(batch(True), 0.5, 4), attn_scale(pos, 0.5, 4))
    assert len(calls) == 1
    forward_attn_scale(batch(False), 0.5, 4)  # the reference path
    forward_attn_scale(batch(True), 0.5, 2.5)  # a fractional floor: the reference's float division
    assert len(calls) == 1
    assert not kernels.supported(2.5) and kernels.supported(8192)
