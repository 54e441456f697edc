"""Triton greedy argmax (`kiln.kernels.argmax`) vs torch.argmax: the same index, ties included."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels.argmax import argmax  # noqa: E402
from tests.kernels.devices import DEVICE_DTYPES  # noqa: E402


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 5), (4, 1000), (2, 4097), (5, 49216)])
def test_argmax_is_torch_argmax(device, dtype, rows, vocab):
    gen = torch.Generator().manual_seed(rows * 7 + vocab)
    x = torch.randn(rows, vocab, generator=gen).to(dtype).to(device)
    torch.testing.assert_close(argmax(x), x.argmax(dim=-1), rtol=0, atol=0)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_argmax_takes_the_first_maximum(device, dtype):
    # ties inside a lane, across lanes of a chunk and across chunks; rows of -inf and of constants;
    # a strided view (a logits slice)
    v = 9000
    x = torch.full((6, v), -3.0)
    x[0, [17, 4096 + 17, 8000]] = 5.0  # the same maximum in three chunks
    x[1, [1025, 1]] = 2.0  # two lanes of one chunk
    x[2] = float("-inf")
    x[3] = 0.5
    x[4, v - 1] = 1.0  # the last token
    x[5, [3, 4]] = float("inf")
    x = x.to(dtype).to(device)
    torch.testing.assert_close(argmax(x), x.argmax(dim=-1), rtol=0, atol=0)
    wide = torch.randn(3, 2 * v, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    torch.testing.assert_close(argmax(wide[:, ::2]), wide[:, ::2].argmax(dim=-1), rtol=0, atol=0)
    torch.testing.assert_close(argmax(wide[:, :v]), wide[:, :v].argmax(dim=-1), rtol=0, atol=0)
    assert argmax(x[:0]).shape == (0,)


@pytest.mark.gpu
def test_greedy_ids_takes_the_kernel_on_cuda(monkeypatch):
    # The engine's greedy tokens (sampler, drafters) go through the kernel on CUDA, any leading dims.
    from kiln.engine.sampler import greedy_ids
    from kiln.kernels import argmax as argmax_module

    calls = []
    real = argmax_module.argmax
    monkeypatch.setattr(argmax_module, "argmax", lambda x: (calls.append(x.shape), real(x))[1])
    x = torch.randn(3, 2, 49216, device="cuda")
    torch.testing.assert_close(greedy_ids(x), x.argmax(dim=-1), rtol=0, atol=0)
    assert calls == [(6, 49216)]
    assert torch.equal(greedy_ids(x.cpu()), x.cpu().argmax(dim=-1))  # the CPU keeps torch's
