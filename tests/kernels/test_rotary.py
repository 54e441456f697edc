"""Triton RoPE vs the reference `RotaryEmbedding.forward`: bit-identical (the kernel rounds every
product and sum like the reference's separate ops).

"cpu" cases run under Triton's interpreter (fp32); "cuda" cases compile in fp32 and bf16. The
last tests cover RoPE and the cache write in the qkv GEMV's epilogue (`rope_epilogue`).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels.rotary import rope, rope_store  # noqa: E402
from kiln.ops.attention import store_kv  # noqa: E402
from kiln.layers.rotary import RotaryEmbedding  # noqa: E402
from tests.kernels.devices import DEVICE_DTYPES, DEVICES  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def _check(device, dtype, t, hq, hk, d, scaling=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rot = RotaryEmbedding(d, 1000, 10000.0, scaling).to(device)
    # q and k as views of one fused projection, like the models hand them over.
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype).to(device)
    q = qkv[:, :hq * d].reshape(t, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].reshape(t, hk, d)
    positions = torch.randint(0, 1000, (t,), generator=gen).to(device)
    got_q, got_k = rope(positions, q, k, rot.cos, rot.sin)
    want_q, want_k = rot(positions, q, k)
    assert got_q.dtype == dtype and got_q.shape == q.shape and got_k.shape == k.shape
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=0)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=0)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("t,hq,hk,d", [(1, 4, 2, 16), (7, 32, 8, 128), (64, 8, 8, 64), (5, 6, 3, 96)])
def test_rope_matches_reference(device, dtype, t, hq, hk, d):
    _check(device, dtype, t, hq, hk, d, seed=t + d)


@pytest.mark.parametrize("device", DEVICES)
def test_rope_llama3_scaling_many_heads_and_empty(device):
    _check(device, torch.float32, 3, 80, 1, 32, scaling=LLAMA3)  # more heads than one block
    rot = RotaryEmbedding(16, 8, 10000.0).to(device)
    q, k = torch.zeros(0, 2, 16, device=device), torch.zeros(0, 1, 16, device=device)
    got_q, got_k = rope(torch.zeros(0, dtype=torch.long, device=device), q, k, rot.cos, rot.sin)
    assert got_q.shape == q.shape and got_k.shape == k.shape


def _check_store(device, dtype, cache_dtype, t, hq, hk, d, seed=0):
    """rope_store against the reference RoPE followed by the reference cache write: q, and every
    cache row (written and untouched), bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    rot = RotaryEmbedding(d, 1000, 10000.0, LLAMA3).to(device)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype).to(device)
    q = qkv[:, :hq * d].reshape(t, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].reshape(t, hk, d)
    v = qkv[:, (hq + hk) * d:].reshape(t, hk, d)
    positions = torch.randint(0, 1000, (t,), generator=gen).to(device)
    slots = 3 * t + 5
    loc = torch.randperm(slots, generator=gen)[:t].to(torch.int32).to(device)
    base = torch.randn(slots, hk, d, generator=gen).to(cache_dtype).to(device)
    got_k, got_v, want_k, want_v = base.clone(), base.clone(), base.clone(), base.clone()
    got_q = rope_store(positions, q, k, v, rot.cos, rot.sin, got_k, got_v, loc)
    want_q, rk = rot(positions, q, k)
    store_kv(rk, v, want_k, want_v, loc.long())
    assert got_q.dtype == dtype and got_q.shape == q.shape and got_q.is_contiguous()
    for got, want in ((got_q, want_q), (got_k, want_k), (got_v, want_v)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("t,hq,hk,d", [(1, 4, 2, 16), (7, 32, 8, 128), (5, 6, 3, 96)])
def test_rope_store_matches_rope_then_store(device, dtype, t, hq, hk, d):
    _check_store(device, dtype, dtype, t, hq, hk, d, seed=t + d)


@pytest.mark.parametrize("device", DEVICES)
def test_rope_store_casts_like_the_reference_and_handles_no_tokens(device):
    # An fp32 projection into a narrower cache: rounded to fp32 first (the rotated tensor), then
    # to the cache's dtype, as storing the rotated k would. The interpreter has no bf16: fp16.
    cache_dtype = torch.float16 if device == "cpu" else torch.bfloat16
    _check_store(device, torch.float32, cache_dtype, 4, 8, 2, 32, seed=3)
    rot = RotaryEmbedding(16, 8, 10000.0).to(device)
    empty = torch.zeros(0, 2, 16, device=device)
    cache = torch.zeros(4, 2, 16, device=device)
    out = rope_store(torch.zeros(0, dtype=torch.long, device=device), torch.zeros(0, 4, 16, device=device),
                     empty, empty, rot.cos, rot.sin, cache, cache.clone(), torch.zeros(0, dtype=torch.long,
                                                                                         device=device))
    assert out.shape == (0, 4, 16) and not cache.any()


@pytest.mark.gpu
def test_rope_bf16_prefill_shape():
    _check("cuda", torch.bfloat16, 4096, 32, 8, 128, scaling=LLAMA3, seed=1)


# ---- RoPE and the cache write in the qkv GEMV's epilogue (`gemv(rope=)`, `rope_epilogue`) ------

def _check_rope_epilogue(device, dtype, m, hq, hk, d, k, prenorm, exact):
    """`gemv(rope=)` (or `gemv_prenorm(rope=)`) against the GEMV then `rope_store`: q, the k cache
    rows and the v cache rows, and no other cache row touched."""
    from kiln.kernels.gemv import gemv, gemv_prenorm

    n = (hq + 2 * hk) * d
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(device)
    rot = RotaryEmbedding(d, 4096, 10000.0).to(device)
    gen = torch.Generator().manual_seed(m + d)
    positions = torch.randint(0, 4096, (m,), generator=gen).to(device)
    loc = torch.randperm(64, generator=gen)[:m].to(device)
    kc, vc = (torch.randn(64, hk, d, generator=gen).to(dtype).to(device) for _ in range(2))
    caches = [kc, vc, kc.clone(), vc.clone()]  # the reference's, then the epilogue's
    nw = (torch.rand(k, generator=gen) + 0.5).to(dtype).to(device)
    if prenorm:
        qkv, _, _ = gemv_prenorm(x, None, nw, 1e-6, w)
        got_q, _, _ = gemv_prenorm(x, None, nw, 1e-6, w, rope=(rot.cos, rot.sin, positions, loc, *caches[2:]))
    else:
        qkv = gemv(x, w)
        got_q = gemv(x, w, rope=(rot.cos, rot.sin, positions, loc, *caches[2:]))
    q, kk, v = qkv.split([hq * d, hk * d, hk * d], dim=1)
    want_q = rope_store(positions, q.view(m, hq, d), kk.view(m, hk, d), v.view(m, hk, d), rot.cos, rot.sin,
                        caches[0], caches[1], loc)
    close = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    tol = dict(rtol=0, atol=0) if exact else close
    assert got_q.shape == (m, hq * d)
    torch.testing.assert_close(got_q, want_q.view(m, -1), **tol)
    torch.testing.assert_close(caches[2], caches[0], **tol)  # k rows rotated, the rest untouched
    assert torch.equal(caches[3], caches[1])  # v rows copied


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("hq,hk,d,k,prenorm", [(4, 2, 16, 64, False), (6, 2, 8, 200, True), (2, 2, 32, 40, False)])
def test_gemv_rope_epilogue_is_gemv_then_rope_store(device, dtype, m, hq, hk, d, k, prenorm):
    """The qkv GEMV with RoPE and the cache write in its epilogue: what the GEMV then `rope_store`
    give, bit for bit under the interpreter (GQA, ragged K, with the norm in the prologue too)."""
    _check_rope_epilogue(device, dtype, m, hq, hk, d, k, prenorm, exact=device == "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("hq,hk,d,k,prenorm", [(32, 8, 128, 4096, False), (32, 8, 64, 2048, True),
                                               (9, 3, 64, 576, True)])
def test_gemv_rope_epilogue_real_shapes(m, hq, hk, d, k, prenorm):
    """Llama-3.1-8B, Llama-3.2-1B (norm folded), SmolLM2-135M (norm folded), bf16."""
    _check_rope_epilogue("cuda", torch.bfloat16, m, hq, hk, d, k, prenorm, exact=False)
