"""Attention with Inkling's relative-logit bias (and windows): every op against a dense loop oracle
written here, and the batched decode op against the per-sequence reference."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kiln.engine.batch import ForwardBatch, ForwardMode
from kiln.engine.paged_backend import PagedBackend
from kiln.layers.attention import Attention, PackedAttentionBackend
from kiln.ops.attention import packed_attention, paged_attention, paged_decode_attention


def _paged(seq_lens, hkv, d, page_size=4, seed=0):
    """Random K/V caches and a req_to_token table whose pages are scattered (rows 1..B)."""
    g = torch.Generator().manual_seed(seed)
    num_pages = sum((n + page_size - 1) // page_size for n in seq_lens) + 1
    k_cache = torch.randn(num_pages * page_size, hkv, d, generator=g)
    v_cache = torch.randn(num_pages * page_size, hkv, d, generator=g)
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(seq_lens) + 1, max(seq_lens) + page_size, dtype=torch.long)
    for i, n in enumerate(seq_lens):
        for p in range((n + page_size - 1) // page_size):
            page = perm.pop()
            table[i + 1, p * page_size:(p + 1) * page_size] = torch.arange(page * page_size, (page + 1) * page_size)
    return k_cache, v_cache, table


def _oracle(q, k, v, rel, q_pos, scale, window):
    """One sequence, plain loops: q [n, Hq, D] at positions q_pos, k/v [m, Hkv, D] at 0..m-1."""
    n, hq, d = q.shape
    hkv, r = k.shape[1], rel.shape[2]
    out = torch.zeros(n, hq, d, dtype=torch.float64)
    for a in range(n):
        i = int(q_pos[a])
        for h in range(hq):
            g = h // (hq // hkv)
            js = [j for j in range(i + 1) if window is None or i - j < window]
            logits = []
            for j in js:
                x = float(q[a, h].double() @ k[j, g].double()) * scale
                if i - j < r:
                    x += float(rel[a, h, i - j])
                logits.append(x)
            mx = max(logits)
            p = [math.exp(x - mx) for x in logits]
            tot = sum(p)
            for j, pj in zip(js, p):
                out[a, h] += pj / tot * v[j, g].double()
    return out


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("r", [3, 40])
def test_packed_with_rel_equals_oracle(window, r):
    g = torch.Generator().manual_seed(0)
    seq_lens = [9, 14]
    t, hq, hkv, d = sum(seq_lens), 4, 2, 8
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    rel = torch.randn(t, hq, r, generator=g) * 2
    got = packed_attention(q, k, v, seq_lens, 0.3, window, rel)
    start = 0
    for n in seq_lens:
        sl = slice(start, start + n)
        want = _oracle(q[sl], k[sl], v[sl], rel[sl], torch.arange(n), 0.3, window)
        torch.testing.assert_close(got[sl].double(), want, atol=1e-5, rtol=1e-5)
        start += n
    # The bias matters, and zeros reproduce the unbiased op exactly.
    assert not torch.allclose(got, packed_attention(q, k, v, seq_lens, 0.3, window))
    torch.testing.assert_close(packed_attention(q, k, v, seq_lens, 0.3, window, torch.zeros_like(rel)),
                               packed_attention(q, k, v, seq_lens, 0.3, window))


@pytest.mark.parametrize("window", [None, 6])
def test_paged_extend_with_rel_and_prefix_equals_oracle(window):
    seq_lens, prefixes = [13, 21], [4, 17]
    hq, hkv, d, r = 6, 2, 8, 10
    k_cache, v_cache, table = _paged(seq_lens, hkv, d, seed=2)
    g = torch.Generator().manual_seed(3)
    ext = [n - p for n, p in zip(seq_lens, prefixes)]
    q = torch.randn(sum(ext), hq, d, generator=g)
    rel = torch.randn(sum(ext), hq, r, generator=g)
    got = paged_attention(q, k_cache, v_cache, table, [1, 2], prefixes, ext, 0.25, window, rel)
    start = 0
    for slot, n, p in zip([1, 2], seq_lens, prefixes):
        sl = slice(start, start + n - p)
        kk, vv = k_cache[table[slot, :n]], v_cache[table[slot, :n]]
        want = _oracle(q[sl], kk, vv, rel[sl], torch.arange(p, n), 0.25, window)
        torch.testing.assert_close(got[sl].double(), want, atol=1e-5, rtol=1e-5)
        start += n - p


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
def test_decode_op_with_rel_equals_reference(window, hq, hkv):
    seq_lens = [1, 7, 13, 30]
    d, r = 16, 9
    k_cache, v_cache, table = _paged(seq_lens, hkv, d)
    q = torch.randn(len(seq_lens), hq, d)
    rel = torch.randn(len(seq_lens), hq, r) * 3
    slots = list(range(1, len(seq_lens) + 1))
    ref = paged_attention(q, k_cache, v_cache, table, slots, [n - 1 for n in seq_lens], [1] * len(seq_lens),
                          0.25, window, rel)
    got = paged_decode_attention(q, k_cache, v_cache, table, torch.tensor(slots), torch.tensor(seq_lens),
                                 0.25, window, rel)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    for b, n in enumerate(seq_lens):
        kk, vv = k_cache[table[slots[b], :n]], v_cache[table[slots[b], :n]]
        want = _oracle(q[b:b + 1], kk, vv, rel[b:b + 1], torch.tensor([n - 1]), 0.25, window)
        torch.testing.assert_close(got[b:b + 1].double(), want, atol=1e-5, rtol=1e-5)


def test_backends_pass_rel_through_mixed_batches():
    """A paged mixed batch (decodes + an extend) and the packed backend on the same sequences."""
    hq, hkv, d, r, window = 4, 2, 8, 6, 5
    layer = Attention(0, hq, hkv, d, sliding_window=window, rel_extent=r)
    seq_lens = [1, 7, 1, 12]
    k_cache, v_cache, table = _paged(seq_lens, hkv, d, seed=5)
    g = torch.Generator().manual_seed(6)
    # Whole sequences in one forward (prefix 0): K/V written by the backend at out_cache_loc.
    t = sum(seq_lens)
    q, k, v = (torch.randn(t, h * d, generator=g) for h in (hq, hkv, hkv))
    rel = torch.randn(t, hq, r, generator=g)
    slots = torch.tensor([1, 2, 3, 4])
    loc = torch.cat([table[s, :n] for s, n in zip(slots.tolist(), seq_lens)])
    common = dict(input_ids=torch.zeros(t, dtype=torch.long),
                  positions=torch.cat([torch.arange(n) for n in seq_lens]), prefix_lens=[0] * 4,
                  extend_lens=seq_lens, logits_indices=torch.arange(t))
    pool = SimpleNamespace(layer=lambda i: (k_cache, v_cache))
    paged = ForwardBatch(ForwardMode.EXTEND, req_slots=slots, out_cache_loc=loc,
                         backend=PagedBackend(pool, {"main": table}), **common)
    packed = ForwardBatch(ForwardMode.TRAIN, backend=PackedAttentionBackend(), **common)
    got = layer(q, k, v, paged, rel=rel.view(t, -1))
    want = layer(q, k, v, packed, rel=rel)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(want, layer(q, k, v, packed))


@pytest.mark.parametrize("gap", [0, 1, 2, 4])
def test_key_gap_hides_near_keys_but_not_self(gap):
    """MTP layer k (gap = k - 1): query i sees j == i or i - j >= gap (and the window)."""
    g = torch.Generator().manual_seed(9)
    n, hq, hkv, d, r, window = 12, 4, 2, 8, 5, 7
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hkv, hkv))
    rel = torch.randn(n, hq, r, generator=g)
    got = packed_attention(q, k, v, [n], 0.3, window, rel, key_gap=gap)
    # Oracle: the loop above with the hidden keys' values replaced by -inf logits.
    for i in range(n):
        want = torch.zeros(hq, d, dtype=torch.float64)
        for h in range(hq):
            js = [j for j in range(i + 1) if i - j < window and (j == i or i - j >= gap)]
            logits = torch.stack([q[i, h].double() @ k[j, h // 2].double() * 0.3
                                  + (float(rel[i, h, i - j]) if i - j < r else 0.0) for j in js])
            p = torch.softmax(logits, 0)
            want[h] = sum(p[a] * v[j, h // 2].double() for a, j in enumerate(js))
        torch.testing.assert_close(got[i].double(), want, atol=1e-5, rtol=1e-5)
