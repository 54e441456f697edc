"""Triton RMSNorm kernels vs the reference `kiln.layers.norm.rms_norm` (and `x + residual` in the
model's dtype for the fused add).

"cpu" cases run the kernels under Triton's interpreter (fp32); "cuda" cases compile them in fp32 and
bf16. The residual sum must be bit-identical everywhere; the norm differs from the reference only
by the fp32 reduction order and rsqrt, so fp32 is compared to ~1e-5 and bf16 to one bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels import norm as norm_kernels  # noqa: E402
from kiln.layers.norm import rms_norm as rms_norm_ref  # noqa: E402
from tests.kernels.devices import DEVICE_DTYPES, DEVICES  # noqa: E402

FP32 = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=1.6e-2, atol=1e-2)  # one bf16 rounding of values of order 1..4


def _inputs(shape, dtype, device, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)
    r = (torch.randn(shape, generator=gen) * 3).to(dtype).to(device)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=gen)).to(dtype).to(device)
    return x, r, w


def _tol(dtype):
    return FP32 if dtype == torch.float32 else BF16


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("h", [64, 576, 4096, 5120])
@pytest.mark.parametrize("t", [1, 7, 64])
def test_rms_norm_matches_reference(device, dtype, h, t):
    x, _, w = _inputs((t, h), dtype, device, seed=h + t)
    got = norm_kernels.rms_norm(x, w, 1e-6)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got, rms_norm_ref(x, w, 1e-6), **_tol(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("h", [64, 576, 4096, 5120])
@pytest.mark.parametrize("t", [1, 7, 64])
def test_fused_add_rms_norm_matches_reference(device, dtype, h, t):
    x, r, w = _inputs((t, h), dtype, device, seed=10 * h + t)
    x0, r0 = x.clone(), r.clone()
    out, res = norm_kernels.fused_add_rms_norm(x, r, w, 1e-5)
    want_res = r + x  # the models' `h + attn_out`, in the model's dtype
    torch.testing.assert_close(res, want_res, rtol=0, atol=0)
    torch.testing.assert_close(out, rms_norm_ref(want_res, w, 1e-5), **_tol(dtype))
    assert torch.equal(x, x0) and torch.equal(r, r0)  # inputs untouched: results are new tensors


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_per_head_norm_on_a_strided_view(device, dtype):
    """qk-norm: q split out of a fused qkv projection is a [T, heads, D] view whose rows are not
    contiguous; the kernel reads it in place."""
    t, heads, kv_heads, d = 9, 8, 2, 128
    qkv, _, w = _inputs((t, (heads + 2 * kv_heads) * d), dtype, device, seed=3)
    w = w[:d].contiguous()
    q = qkv[:, :heads * d].reshape(t, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].reshape(t, kv_heads, d)
    assert not q.is_contiguous()
    for part in (q, k):
        got = norm_kernels.rms_norm(part, w, 1e-6)
        assert got.shape == part.shape
        torch.testing.assert_close(got, rms_norm_ref(part, w, 1e-6), **_tol(dtype))
    x4 = qkv[:, :heads * d].reshape(t, 2, heads // 2, d)  # more leading dims are flattened
    torch.testing.assert_close(norm_kernels.rms_norm(x4, w, 1e-6), rms_norm_ref(x4, w, 1e-6), **_tol(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_two_pass_loop_over_wide_rows(device, dtype, monkeypatch):
    """Rows wider than MAX_BLOCK_H take the two-pass loop; lower the limit to reach it cheaply
    (on the GPU also at a real width)."""
    shapes = [(5, 300), (3, 1000)]
    if device == "cuda":
        shapes.append((4, 16384 + 100))
    monkeypatch.setattr(norm_kernels, "MAX_BLOCK_H", 128 if device == "cpu" else 8192)
    for i, shape in enumerate(shapes):
        if device == "cpu" or shape[1] > 8192:
            x, r, w = _inputs(shape, dtype, device, seed=i)
            torch.testing.assert_close(norm_kernels.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **_tol(dtype))
            out, res = norm_kernels.fused_add_rms_norm(x, r, w, 1e-6)
            torch.testing.assert_close(res, r + x, rtol=0, atol=0)
            torch.testing.assert_close(out, rms_norm_ref(r + x, w, 1e-6), **_tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_large_and_tiny_magnitudes_and_empty(device):
    """The statistics are fp32 whatever the scale; zero rows give zeros (eps); T = 0 launches nothing."""
    x, r, w = _inputs((6, 256), torch.float32, device, seed=7)
    x[0] *= 1e4
    x[1] *= 1e-4
    x[2] = 0
    got = norm_kernels.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got, rms_norm_ref(x, w, 1e-6), **FP32)
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    empty = x[:0]
    assert norm_kernels.rms_norm(empty, w, 1e-6).shape == (0, 256)
    out, res = norm_kernels.fused_add_rms_norm(empty, r[:0], w, 1e-6)
    assert out.shape == res.shape == (0, 256)


@pytest.mark.gpu
def test_fp32_weight_with_bf16_activations():
    """Weights may stay fp32 while activations are bf16 (the reference casts w to fp32 either way)."""
    x, r, w = _inputs((33, 4096), torch.bfloat16, "cuda", seed=11)
    w = w.float()
    out, res = norm_kernels.fused_add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(res, r + x, rtol=0, atol=0)
    torch.testing.assert_close(out, rms_norm_ref(r + x, w, 1e-6), **BF16)


@pytest.mark.gpu
def test_captures_in_a_cuda_graph():
    x, r, w = _inputs((8, 4096), torch.bfloat16, "cuda", seed=12)
    norm_kernels.fused_add_rms_norm(x, r, w, 1e-6)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = norm_kernels.fused_add_rms_norm(x, r, w, 1e-6)
    for seed in range(13, 16):
        nx, nr, _ = _inputs((8, 4096), torch.bfloat16, "cuda", seed=seed)
        x.copy_(nx)
        r.copy_(nr)
        graph.replay()
        torch.testing.assert_close(res, r + x, rtol=0, atol=0)
        torch.testing.assert_close(out, rms_norm_ref(r + x, w, 1e-6), **BF16)
