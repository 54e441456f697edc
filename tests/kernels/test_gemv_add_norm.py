"""The decode GEMV with the next sublayer's pre-norm in its epilogue (`kiln.kernels.gemv.gemv_add_norm`:
a Llama o_proj or down_proj, then the residual add and RMSNorm) against the GEMV followed by the
fused add + norm kernel.

"cpu" cases run under Triton's interpreter (fp32); "cuda" cases compile in fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels.gemv import gemv, gemv_add_norm  # noqa: E402
from kiln.kernels.norm import fused_add_rms_norm  # noqa: E402
from tests.kernels.devices import DEVICE_DTYPES  # noqa: E402
from tests.kernels.test_gemv import FP32, _case  # noqa: E402


def _check(device, dtype, m, n, k, exact, seed=0):
    h, w = _case(m, n, k, dtype, device, seed=seed + m * 100 + n + k)
    gen = torch.Generator().manual_seed(seed + n)
    res = torch.randn(m, n, generator=gen).to(dtype).to(device)
    nw = (torch.rand(n, generator=gen) + 0.5).to(dtype).to(device)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    f = gemv(h, w)
    want_x, want_sum = fused_add_rms_norm(f, res, nw, 1e-6)
    for _ in range(2):  # the counter is left at zero: a second launch on it is the same
        normed, summed = gemv_add_norm(h, w, res, nw, 1e-6, counter)
        assert torch.equal(summed, want_sum)  # f rounded, then the add rounded, as unfused
        assert counter.item() == 0
        tol = dict(rtol=0, atol=0) if exact else (FP32 if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2))
        torch.testing.assert_close(normed, want_x, **tol)
        if not exact and dtype == torch.bfloat16:  # at most one bf16 ulp apart, and rarely
            ulp = (want_x.float().abs() * 2 ** -7).clamp_min(2 ** -126)
            assert ((normed.float() - want_x.float()).abs() <= ulp).all()
            assert (normed != want_x).float().mean() < 0.01


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("n,k", [(96, 64), (37, 200), (130, 48)])
@pytest.mark.parametrize("norm_block", [4096, 32])
def test_gemv_add_norm_is_gemv_then_add_norm(device, dtype, m, n, k, norm_block, monkeypatch):
    """Ragged N and K over several programs, the last one norming whole rows: the sum bit for bit,
    the normed rows within an ulp of the norm kernel's (the interpreter: bit for bit when the row
    is normed in one step, as the norm kernel does); the rows in one step and (norm_block 32) in
    chunks."""
    from kiln.kernels import gemv as gemv_module

    monkeypatch.setattr(gemv_module, "PRENORM_MAX_BLOCK", norm_block)
    _check(device, dtype, m, n, k, exact=device == "cpu" and norm_block == 4096)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 14336), (2048, 2048)])
def test_gemv_add_norm_real_shapes(m, n, k):
    """The 8B's o_proj and down_proj, a 2048-wide o_proj, in bf16: thousands of programs count
    themselves on one counter."""
    _check("cuda", torch.bfloat16, m, n, k, exact=False)


def test_gemv_add_norm_rejects_a_mismatched_residual():
    h, w = _case(1, 16, 8, torch.float32, "cpu", seed=0)
    counter = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(AssertionError, match="residual"):
        gemv_add_norm(h, w, torch.zeros(1, 8), torch.ones(16), 1e-6, counter)
