"""`kiln.kernels.mtp_rows`: an MTP chain pass's rows in one launch equal the PyTorch reference, for
the drafting pass (R = K + 2 rows per request) and the late catch-up pass (R = C), with padding
requests, every catch-up count from 1 to C and row-strided tables as the graph's static slices."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels.mtp_rows import chain_rows  # noqa: E402
from kiln.ops.mtp_rows import chain_rows as chain_rows_reference  # noqa: E402
from tests.kernels.devices import DEVICES  # noqa: E402


def random_tables(bs: int, K: int, drafts: bool, seed: int, device: str, C_late: int = 10):
    """Tables as `MTPChainGraph._pass` leaves them: the first `bs` rows of buffers sized for more
    requests (row-strided slices), counts 1..C for live requests and 0 for padding ones."""
    g = torch.Generator().manual_seed(seed)
    C = K + 1 if drafts else C_late
    R = C + 1 if drafts else C
    swa_width = max(2 * K, R) if drafts else C
    n = bs + 3  # the static buffers hold more requests than this pass's
    count = torch.randint(1, C + 1, (n,), generator=g)
    count[torch.rand(n, generator=g) < 0.25] = 0  # padding requests
    r = lambda hi, *shape: torch.randint(0, hi, shape, generator=g)  # noqa: E731
    tables = dict(count=count, first=r(5000, n) + 2, tokens=r(50_000, n, R), conv_slots=r(90_000, n, C + 1),
                  swa_slots=r(90_000, n, swa_width), req_slots=r(64, n))
    return {k: v.to(device)[:bs] for k, v in tables.items()}, R


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bs,K,drafts", [(1, 3, True), (4, 3, True), (8, 1, True), (5, 8, True), (3, 2, True),
                                         (1, 3, False), (6, 3, False)])
def test_rows_kernel_equals_reference(device, bs, K, drafts):
    for seed in range(3):
        tables, R = random_tables(bs, K, drafts, seed, device)
        want = chain_rows_reference(**tables, num_layers=K, rows=R, drafts=drafts)
        got = chain_rows(**tables, num_layers=K, rows=R, drafts=drafts)
        assert sorted(got) == sorted(want)
        for name in want:
            assert got[name].shape == want[name].shape and got[name].dtype == want[name].dtype, name
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_reference_layout(device):
    # one live request, c = 2, K = 3, drafts: the rows the chain's docstring names
    K, R, F = 3, 5, 100
    t = dict(count=torch.tensor([2]), first=torch.tensor([F]), tokens=torch.tensor([[11, 12, 0, 0, 0]]),
             conv_slots=torch.tensor([[20, 21, 22, 23, 24]]), swa_slots=torch.tensor([[30, 31, 32, 33, 34, 35]]),
             req_slots=torch.tensor([7]))
    for fn in (chain_rows_reference, chain_rows):
        out = fn(**{k: v.to(device) for k, v in t.items()}, num_layers=K, rows=R, drafts=True)
        out = {k: v.cpu().tolist() for k, v in out.items()}
        assert out["ids"] == [11, 12, 0, 0, 0]
        assert out["hid"] == [20, 21, 0, 0, 0] and out["keep"] == [21, 22, 0, 0, 0]
        assert out["token_slots"] == [7] * R
        # layer k: catch-up rows at positions F + i - k; layers 2, 3: the draft row (i = c) at F + c - 2
        assert out["pos"] == [[F - 1, F, 0, 0, 0], [F - 2, F - 1, F, 0, 0], [F - 3, F - 2, F, 0, 0]]
        # its sliding-window slot: column c - 2 + k (stored position F + c - 2 + k)
        assert out["swa"] == [[30, 31, 0, 0, 0], [30, 31, 32, 0, 0], [30, 31, 33, 0, 0]]
        assert out["ext"] == [[2], [3], [3]]
        assert out["draft_out"] == [[1], [2], [2]] and out["draft_in"] == [2]
        assert out["draft_row"] == [[False, False, True, False, False]]
