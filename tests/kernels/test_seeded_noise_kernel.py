"""The one-launch noise kernel (`kiln.kernels.seeded_noise`) against the torch reference
(`kiln.engine.seeded_noise`): the same values for the same (seed, draw index) keys."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.engine import seeded_noise as ref  # noqa: E402
from kiln.engine.seeded_noise import SeededStream, stream_keys  # noqa: E402
from kiln.kernels.seeded_noise import noise  # noqa: E402
from tests.kernels.devices import DEVICES  # noqa: E402

# seeds across the int64 range (SeededStream folds Python ints to int64), draw indices past 2^32
SEEDS = [0, 1, 5, 2 ** 31 + 7, 2 ** 63 - 1, 2 ** 63 + 11, 2 ** 64 - 1]


def _keys(device) -> torch.Tensor:
    streams = [SeededStream(s) for s in SEEDS]
    streams[2].draws = 2 ** 33 + 5
    return stream_keys(streams, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [1, 1000, 1024, 5003])
def test_kernel_noise_equals_the_reference(device, width):
    keys = _keys(device)
    want_u, want_e = ref._uniforms_ref(keys, width), ref._exponentials_ref(keys, width)
    assert torch.equal(noise(keys, width, exponential=False), want_u)
    got_e = noise(keys, width, exponential=True)
    torch.testing.assert_close(got_e, want_e, rtol=1e-7, atol=0)
    assert (got_e == want_e).float().mean() > 0.999  # float64 log rounding only, before the fp32 cast
    assert bool((got_e > 0).all()) and bool((noise(keys, width, False) > 0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_strided_keys_and_empty_draws(device):
    # a column of a [S, K, 2] key table (the chain graph's layer k), and nothing to draw
    table = torch.stack([_keys(device), _keys(device).flip(0)], dim=1)  # [S, 2, 2]
    for k in range(2):
        assert torch.equal(noise(table[:, k], 300, exponential=False), ref._uniforms_ref(table[:, k].contiguous(), 300))
    assert noise(table[:0, 0], 300, True).shape == (0, 300)
    assert noise(table[:, 0], 0, True).shape == (len(SEEDS), 0)
