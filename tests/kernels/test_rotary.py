"""Triton RoPE vs the reference `RotaryEmbedding.forward`: bit-identical (the kernel rounds every
product and sum like the reference's separate ops).

"cpu" cases run under Triton's interpreter (fp32); "cuda" cases compile in fp32 and bf16.
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
