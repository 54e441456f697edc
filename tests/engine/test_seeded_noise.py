"""`kiln.engine.seeded_noise`: counter-based noise for seeded requests, drawn for a batch at once.

What the sampler relies on: the values are Exp(1) / U(0, 1) (Kolmogorov-Smirnov against the
exact CDFs, with a negative control), distinct draws are independent, a row's values depend only
on its (seed, draw index), not on the batch or on how many values the batch asks for, and the
CPU and CUDA give the same values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import kstest

from kiln.engine.seeded_noise import CPU_ROWS_PER_CHUNK, SeededStream, exponentials, stream_keys, uniforms


def keys(n: int, seed0: int = 0) -> torch.Tensor:
    return torch.tensor([[seed0 + i, 0] for i in range(n)], dtype=torch.int64)


def test_exponentials_and_uniforms_have_their_distributions():
    e = exponentials(keys(64), 4096).double().flatten().numpy()
    assert kstest(e, "expon").pvalue > 1e-3
    u = uniforms(keys(64, 1000), 4096).double().flatten().numpy()
    assert kstest(u, "uniform").pvalue > 1e-3
    assert 0.0 < u.min() and u.max() < 1.0
    # negative control: the test notices a distribution that is off by 2%
    assert kstest(e * 1.02, "expon").pvalue < 1e-3


def test_draws_are_independent():
    # different seeds, and the same seed's successive draws: no correlation between rows
    k = torch.tensor([[7, 0], [7, 1], [8, 0], [-3, 5], [2 ** 62, 0]], dtype=torch.int64)
    u = uniforms(k, 20000).double().numpy()
    corr = np.corrcoef(u)
    assert np.abs(corr[~np.eye(len(k), dtype=bool)]).max() < 0.03
    # within a row, neighbouring values are not correlated either
    assert abs(np.corrcoef(u[:, :-1].ravel(), u[:, 1:].ravel())[0, 1]) < 0.02


def test_a_rows_values_depend_only_on_its_key():
    k = keys(5, 40)
    full = exponentials(k, 300)
    assert torch.equal(exponentials(k[2:3], 300)[0], full[2])  # alone or in a batch
    assert torch.equal(exponentials(k, 100), full[:, :100])  # whatever width the batch asks for
    assert torch.equal(uniforms(k[[4, 0]], 50), uniforms(k, 50)[[4, 0]])  # wherever the row sits
    many = keys(3 * CPU_ROWS_PER_CHUNK + 1, 7)  # hashed a chunk of rows at a time on the CPU
    assert torch.equal(exponentials(many, 64)[-1], exponentials(many[-1:], 64)[0])
    assert torch.equal(uniforms(many, 64)[CPU_ROWS_PER_CHUNK], uniforms(many[CPU_ROWS_PER_CHUNK:][:1], 64)[0])


def test_streams_count_their_draws_and_take_any_seed():
    a, b = SeededStream(2 ** 70 + 5), SeededStream(-1)
    ka = stream_keys([a, b], "cpu")
    assert ka.shape == (2, 2) and ka[:, 1].tolist() == [0, 0] and (a.draws, b.draws) == (1, 1)
    kb = stream_keys([a], "cpu")
    assert kb[0, 1].item() == 1 and not torch.equal(uniforms(ka[:1], 8), uniforms(kb, 8))
    assert SeededStream(5).seed == SeededStream(5 + 2 ** 64).seed  # seeds are taken modulo 2^64


@pytest.mark.gpu
def test_cpu_and_cuda_draw_the_same_values():
    k = keys(16, 123)
    assert torch.equal(uniforms(k, 1000), uniforms(k.cuda(), 1000).cpu())
    torch.testing.assert_close(exponentials(k, 1000), exponentials(k.cuda(), 1000).cpu(), rtol=1e-6, atol=0)
