"""`kiln.kernels.greedy_accept`: a greedy round's committed counts in one launch equal the PyTorch
reference, for every accepted prefix from none to all K, K from 1 to 8, and the drafts as the
engine passes them (a strided view of the verify's input ids)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.engine.spec.verify import committed_counts as reference  # noqa: E402
from kiln.kernels.greedy_accept import committed_counts  # noqa: E402
from tests.kernels.devices import DEVICES  # noqa: E402


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,K", [(1, 3), (8, 3), (5, 1), (3, 8), (16, 4)])
def test_committed_counts_equal_reference(device, n, K):
    g = torch.Generator().manual_seed(n * 10 + K)
    samples = torch.randint(0, 50, (n, K + 1), generator=g)
    ids = torch.randint(0, 50, (n, K + 1), generator=g)  # the verify's inputs: last token, then the drafts
    accept = torch.randint(0, K + 1, (n,), generator=g)
    accept[: min(n, 2)] = torch.tensor([0, K])[: min(n, 2)]  # none and all
    for b in range(n):  # drafts equal to the samples up to the chosen prefix, then one that differs
        ids[b, 1:accept[b] + 1] = samples[b, :accept[b]]
        if accept[b] < K:
            ids[b, accept[b] + 1] = samples[b, accept[b]] + 1
    samples, ids = samples.to(device), ids.to(device)
    drafts = ids[:, 1:]  # strided, as `_device_round` passes them
    got = committed_counts(samples, drafts)
    assert got.dtype == torch.int64
    assert got.tolist() == reference(samples, drafts).tolist() == (accept + 1).tolist()
