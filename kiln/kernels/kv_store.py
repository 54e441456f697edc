"""Triton K/V cache write: a layer's new K and V rows (and MSA's indexer keys) in one launch.

Computes exactly `kiln.ops.attention.store_kv`:

    k_cache[loc] = k.to(k_cache.dtype); v_cache[loc] = v.to(v_cache.dtype)
    (index_k_cache[loc] = index_k.to(index_k_cache.dtype), when given)

The reference is one index_put (plus a cast kernel when the dtypes differ) per tensor, every
layer, every step; at batch-1 decode those launches cost more than the bytes they move. Here one
program per token loads its slot from `loc` (any integer dtype, on the device) and copies each
tensor's [heads, D] row, casting on the store (round to nearest even, like `.to`), so the cache
holds bit-identical values.

Sources are read in place through their token and head strides (v is usually a view of a fused
QKV projection whose rows are the whole projection wide); only the last dim must be contiguous.
D need not be a power of two (masked). Caches are written through their own strides, never
copied. No host sync, the grid depends only on the token count: CUDA-graph capturable.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kiln.kernels.launch import pdl_launch, wait_for_previous


@triton.jit
def _copy_row(src_ptr, dst_ptr, t, slot, H, D, stride_st, stride_sh, stride_ds, stride_dh,
              BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """dst[slot, :H, :D] = src[t, :H, :D], cast to dst's dtype."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        m = (h < H)[:, None] & d_ok[None, :]
        x = tl.load(src_ptr + t * stride_st + h[:, None] * stride_sh + d[None, :], mask=m)
        tl.store(dst_ptr + slot * stride_ds + h[:, None] * stride_dh + d[None, :],
                 x.to(dst_ptr.dtype.element_ty), mask=m)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, e_ptr, ec_ptr, loc_ptr,
    H, D, HE, DE, stride_loc,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcs, stride_kch, stride_vcs, stride_vch,
    stride_et, stride_eh, stride_ecs, stride_ech,
    HAS_EXTRA: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HE: tl.constexpr, BLOCK_DE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + t * stride_loc).to(tl.int64)
    _copy_row(k_ptr, kc_ptr, t, slot, H, D, stride_kt, stride_kh, stride_kcs, stride_kch, BLOCK_H, BLOCK_D)
    _copy_row(v_ptr, vc_ptr, t, slot, H, D, stride_vt, stride_vh, stride_vcs, stride_vch, BLOCK_H, BLOCK_D)
    if HAS_EXTRA:
        _copy_row(e_ptr, ec_ptr, t, slot, HE, DE, stride_et, stride_eh, stride_ecs, stride_ech,
                  BLOCK_HE, BLOCK_DE)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """A source as [T, heads, D] with a contiguous last dim ([T, W] is one head of W)."""
    if x.dim() == 2:
        x = x.unsqueeze(1)
    assert x.dim() == 3, x.shape
    return x if x.stride(-1) == 1 else x.contiguous()


def _as_cache(c: torch.Tensor) -> torch.Tensor:
    """A cache as [slots, heads, D], a view (a copy would drop the writes)."""
    if c.dim() == 2:
        c = c.unsqueeze(1)
    assert c.dim() == 3 and c.stride(-1) == 1, (c.shape, c.stride())
    return c


def _blocks(h: int, d: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(d)
    # About 2K elements per tile: a decode row of 8 KV heads x 128 is one iteration.
    return max(1, min(triton.next_power_of_2(h), 2048 // block_d)), block_d


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             loc: torch.Tensor, index_k: Optional[torch.Tensor] = None,
             index_k_cache: Optional[torch.Tensor] = None) -> None:
    """`kiln.ops.attention.store_kv` in one launch: k, v [T, Hkv, D] (any token/head strides)
    into k_cache / v_cache [slots, Hkv, D] at rows loc [T] (any integer dtype, on the device),
    cast to the caches' dtypes; with `index_k` [T, H', D'] also index_k_cache[loc] = index_k.
    2-D [T, W] sources with [slots, W] caches work too."""
    k, v, kc, vc = _as_rows(k), _as_rows(v), _as_cache(k_cache), _as_cache(v_cache)
    t, h, d = k.shape
    assert v.shape == k.shape and kc.shape[1:] == vc.shape[1:] == (h, d), (k.shape, v.shape, kc.shape, vc.shape)
    assert loc.shape == (t,) and not loc.is_floating_point(), (loc.shape, loc.dtype)
    has_extra = index_k is not None
    if has_extra:
        e, ec = _as_rows(index_k), _as_cache(index_k_cache)
        assert e.shape[0] == t and ec.shape[1:] == e.shape[1:], (e.shape, ec.shape)
    else:
        e, ec = k, kc  # unused (HAS_EXTRA=False)
    if t == 0:
        return
    block_h, block_d = _blocks(h, d)
    block_he, block_de = _blocks(e.shape[1], e.shape[2])
    _store_kv_kernel[(t,)](
        k, v, kc, vc, e, ec, loc,
        h, d, e.shape[1], e.shape[2], loc.stride(0),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
        e.stride(0), e.stride(1), ec.stride(0), ec.stride(1),
        HAS_EXTRA=has_extra, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_HE=block_he, BLOCK_DE=block_de,
        num_warps=4, **pdl_launch(k.device),
    )
