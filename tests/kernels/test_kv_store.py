"""Triton K/V cache write vs the reference `kiln.ops.attention.store_kv` (index_put per tensor).

A copy with a cast: every case must be bit-identical, including the cache rows it must not touch.
"cpu" cases run under Triton's interpreter (fp32); "cuda" cases compile in fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels.kv_store import store_kv  # noqa: E402
from kiln.ops.attention import store_kv as store_kv_ref  # noqa: E402
from tests.kernels.devices import DEVICE_DTYPES, DEVICES  # noqa: E402


def _case(t, hq, hkv, d, slots, dtype, cache_dtype, device, seed, loc_dtype=torch.int64):
    """k contiguous (RoPE's output), v a view of a fused QKV projection (row stride of the whole
    projection), random caches, distinct random slots."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(device)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype).to(device)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    caches = [torch.randn(slots, hkv, d, generator=gen).to(cache_dtype).to(device) for _ in range(2)]
    loc = torch.randperm(slots, generator=gen)[:t].to(loc_dtype).to(device)
    return k, v, caches, loc


def _check(k, v, caches, loc, extra=None):
    want = [c.clone() for c in caches]
    got = [c.clone() for c in caches]
    if extra is None:
        store_kv_ref(k, v, *want, loc)
        store_kv(k, v, *got, loc)
    else:
        e, ec = extra
        want_e, got_e = ec.clone(), ec.clone()
        store_kv_ref(k, v, *want, loc, e, want_e)
        store_kv(k, v, *got, loc, e, got_e)
        assert torch.equal(got_e, want_e)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 4, 2, 16), (5, 3, 3, 80), (9, 8, 1, 96)])
@pytest.mark.parametrize("loc_dtype", [torch.int64, torch.int32])
def test_store_kv_matches_reference(device, dtype, t, hq, hkv, d, loc_dtype):
    k, v, caches, loc = _case(t, hq, hkv, d, 23, dtype, dtype, device, seed=t + d, loc_dtype=loc_dtype)
    assert t == 1 or not v.is_contiguous()
    _check(k, v, caches, loc)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_casts_to_the_cache_dtype(device, dtype):
    """fp32 activations into a narrower cache: rounded like `.to` (nearest even). The interpreter
    has no bf16, so the CPU case narrows to fp16."""
    cache_dtype = torch.float16 if device == "cpu" else torch.bfloat16
    k, v, caches, loc = _case(6, 2, 2, 48, 17, torch.float32, cache_dtype, device, seed=5)
    _check(k, v, caches, loc)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_index_keys_in_the_same_launch(device, dtype):
    """MSA: the indexer keys [T, Hkv, DI] go to their own cache at the same slots."""
    k, v, caches, loc = _case(7, 4, 2, 40, 31, dtype, dtype, device, seed=9)
    gen = torch.Generator().manual_seed(10)
    e = torch.randn(7, 2, 24, generator=gen).to(dtype).to(device)
    ec = torch.randn(31, 2, 24, generator=gen).to(dtype).to(device)
    _check(k, v, caches, loc, (e, ec))


@pytest.mark.parametrize("device", DEVICES)
def test_strided_loc_head_views_and_empty(device):
    """loc a strided view, k with a non-unit head stride and a transposed (non-contiguous last
    dim) v; T = 0 launches nothing."""
    t, hkv, d, slots = 4, 3, 20, 19
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(t, 2 * hkv, d, generator=gen).to(device)
    k = base[:, ::2]  # head stride 2 * d
    v = torch.randn(t, d, hkv, generator=gen).to(device).transpose(1, 2)
    caches = [torch.randn(slots, hkv, d, generator=gen).to(device) for _ in range(2)]
    loc = torch.randperm(slots, generator=gen)[:2 * t].to(device)[::2]
    _check(k, v, caches, loc)
    _check(k[:0], v[:0], caches, loc[:0])


@pytest.mark.gpu
def test_real_shapes_on_cuda():
    """Llama-3.1-8B's K/V rows at decode and prefill sizes, bf16, into a large pool."""
    for t in (1, 64, 4099):
        k, v, caches, loc = _case(t, 32, 8, 128, 8192, torch.bfloat16, torch.bfloat16, "cuda", seed=t)
        _check(k, v, caches, loc)


@pytest.mark.gpu
def test_captures_in_a_cuda_graph():
    k, v, caches, loc = _case(8, 32, 8, 128, 1024, torch.bfloat16, torch.bfloat16, "cuda", seed=1)
    store_kv(k, v, *caches, loc)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_kv(k, v, *caches, loc)
    for seed in range(2, 5):
        nk, nv, _, nloc = _case(8, 32, 8, 128, 1024, torch.bfloat16, torch.bfloat16, "cuda", seed=seed)
        k.copy_(nk)
        v.copy_(nv)
        loc.copy_(nloc)
        want = [c.clone() for c in caches]
        store_kv_ref(k, v, *want, loc)
        graph.replay()
        for g, w in zip(caches, want):
            assert torch.equal(g, w)
