"""Per-row metadata reaches the kernels as contiguous 1-D tensors (`kiln.kernels.assert_rows`): a
strided view, which the kernels would read at `ptr + row` as if it were not, is refused by name."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import assert_rows


def test_assert_rows_names_the_strided_tensor():
    assert_rows(a=torch.arange(4), b=None, one=torch.zeros(1).expand(1), empty=torch.zeros(0))
    with pytest.raises(AssertionError, match="seq_lens must be a contiguous 1-D tensor"):
        assert_rows(req_slots=torch.arange(3), seq_lens=torch.tensor([5]).expand(1, 3).reshape(-1))
    with pytest.raises(AssertionError, match="positions"):
        assert_rows(positions=torch.arange(6)[::2])
    with pytest.raises(AssertionError, match="shape \\(2, 3\\)"):
        assert_rows(rows=torch.zeros(2, 3))


def test_a_kernel_wrapper_refuses_a_strided_row_input():
    pytest.importorskip("triton")
    from kiln.kernels.shortconv import short_conv_decode

    b, c, k = 3, 8, 4
    x, w = torch.randn(b, c), torch.randn(c, k)
    buf, table = torch.zeros(16, c), torch.arange(16).view(2, 8).repeat(2, 1)
    slots = torch.tensor([0]).expand(1, b).reshape(-1)  # one request's slot over three rows: stride 0
    with pytest.raises(AssertionError, match="req_slots"):
        short_conv_decode(x, w, buf, table, slots, torch.full((b,), 5), torch.arange(b))
