"""`experts_ref` and `experts_grouped` under autograd (the RL trainer's MoE): their output and every
gradient equal a per-token oracle's, with experts that get no token, one token, and many; the
grouped form runs only where torch's grouped GEMM does, and the dispatch falls back elsewhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.ops import moe as ref_ops
from kiln.ops.moe import experts_grouped, experts_ref, experts_torch, grouped_mm_supported


def _oracle(x, w13, w2, ids, w):
    inter = w13.shape[1] // 2
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=x.dtype)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = F.silu(w13[e, :inter] @ x[t]) * (w13[e, inter:] @ x[t])
            acc = acc + w[t, j] * (w2[e] @ h)
        rows.append(acc)
    return torch.stack(rows)


@pytest.mark.parametrize("experts", [experts_ref, experts_grouped])
def test_experts_output_and_gradients_equal_the_per_token_oracle(experts):
    g = torch.Generator().manual_seed(0)
    T, E, K, H, I = 23, 7, 2, 8, 4
    x, w13, w2 = torch.randn(T, H, generator=g), torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])  # expert E-1 gets no token
    ids[0, 0] = 5 if 5 not in ids[0] else ids[0, 0]
    w = torch.rand(T, K, generator=g)
    grads = []
    for fn in (experts, _oracle):
        leaves = [t.clone().requires_grad_(True) for t in (x, w13, w2, w)]
        y = fn(leaves[0], leaves[1], leaves[2], ids, leaves[3]).float() if fn is _oracle else \
            fn(leaves[0], leaves[1], leaves[2], ids, leaves[3], torch.float32)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        grads.append([y.detach()] + [t.grad for t in leaves])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (grads[0][2][E - 1] == 0).all() and (grads[0][3][E - 1] == 0).all()  # the idle expert's gradients


def _problem(T=40, E=9, K=3, H=16, I=8, dtype=torch.float32, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / 4, torch.randn(E, H, I, generator=g) / 4
    ids = torch.stack([torch.randperm(E - 2, generator=g)[:K] for _ in range(T)])  # two idle experts
    w = torch.rand(T, K, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (x, w13, w2)] + [ids.to(device), w.to(device)]


def _run(fn, x, w13, w2, ids, w):
    leaves = [t.clone().requires_grad_(True) for t in (x, w13, w2, w)]
    y = fn(leaves[0], leaves[1], leaves[2], ids, leaves[3], torch.float32)
    (y * torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y)).sum().backward()
    return [y.detach()] + [t.grad for t in leaves]


def test_grouped_experts_equal_the_loop_in_fp32_and_bf16():
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        prob = _problem(dtype=dtype)
        assert grouped_mm_supported(*prob[:3]), "this torch's CPU build has a grouped GEMM"
        for got, want in zip(_run(experts_grouped, *prob), _run(experts_ref, *prob)):
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_the_support_probe_answers_the_same_from_an_engine_forward():
    """The probe runs once per device and dtype and is cached: a first caller under
    inference_mode (the engine's forward on the CPU) must not record 'unsupported' for the
    trainer that comes after it in the same process."""
    ref_ops._grouped_mm_works.cache_clear()
    try:
        with torch.inference_mode():
            x, w13, w2, _, _ = _problem()
            first = grouped_mm_supported(x, w13, w2)
        assert first and grouped_mm_supported(*_problem()[:3])
    finally:
        ref_ops._grouped_mm_works.cache_clear()


def test_grouped_gemm_needs_rows_of_16_bytes_and_one_dtype():
    x, w13, w2, ids, w = _problem(H=16, I=6)  # fp32 rows of 24 bytes in w2
    assert not grouped_mm_supported(x, w13, w2)
    assert not grouped_mm_supported(x.double(), w13, w2)
    # The dispatch falls back to the loop there, and gives the loop's result.
    for got, want in zip(_run(experts_torch, x, w13, w2, ids, w), _run(experts_ref, x, w13, w2, ids, w)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_dispatch_takes_the_grouped_gemm_where_supported(monkeypatch):
    calls = []
    monkeypatch.setattr(ref_ops, "experts_grouped", lambda *a: calls.append("grouped") or experts_grouped(*a))
    monkeypatch.setattr(ref_ops, "experts_ref", lambda *a: calls.append("loop") or experts_ref(*a))
    x, w13, w2, ids, w = _problem()
    ref_ops.experts_torch(x, w13, w2, ids, w)
    ref_ops.experts_torch(x[:, :6], w13[:, :, :6], w2[:, :6], ids, w)  # hidden 6: 24-byte rows
    assert calls == ["grouped", "loop"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_experts_on_cuda_equal_the_loop(dtype):
    """On Hopper the grouped GEMM runs in both dtypes (torch 2.11 on the H200: measured); on
    other GPUs `experts_torch` may fall back to the loop. Either way it equals the loop."""
    prob = _problem(T=300, E=16, K=4, H=256, I=128, dtype=dtype, device="cuda")
    if torch.cuda.get_device_capability() >= (9, 0):
        assert grouped_mm_supported(*prob[:3])
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    for got, want in zip(_run(experts_torch, *prob), _run(experts_ref, *prob)):
        torch.testing.assert_close(got.float(), want.float(), atol=tol * want.abs().max().item(), rtol=tol)
