"""MSA reference ops against an independent oracle written from MODELS.md 3.1 with plain loops."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.ops.attention import packed_attention
from kiln.ops.msa import (block_scores, dense_masked_attention, packed_msa_attention, paged_msa_attention,
                          select, select_blocks, sparse_attention)

TOL = 1e-4  # near-tie tolerance on block scores when comparing selected sets


def _oracle_scores(qI, kI, q_pos, k_pos, bsz):
    """S[g][i][b] by loops: max over keys t of block b with t <= p_i; None when no such key."""
    n, g, di = qI.shape
    out = []
    for h in range(g):
        rows = []
        for i in range(n):
            p = int(q_pos[i])
            best = {}
            for j in range(kI.shape[0]):
                t = int(k_pos[j])
                if t > p:
                    continue
                s = float(torch.dot(qI[i, h].double(), kI[j, h].double())) / math.sqrt(di)
                b = t // bsz
                best[b] = max(best.get(b, -math.inf), s)
            rows.append(best)
        out.append(rows)
    return out


def _check_selection(sel, scores, q_pos, bsz, big_n):
    """`sel` [G, n, N] against oracle scores, as sets with a near-tie tolerance."""
    g, n, _ = sel.shape
    for h in range(g):
        for i in range(n):
            p = int(q_pos[i])
            n_i = p // bsz + 1
            row = sel[h, i].tolist()
            valid = [b for b in row if b >= 0]
            assert row == valid + [-1] * (big_n - len(valid)), f"-1 padding must trail: {row}"
            assert valid[-1] == n_i - 1, f"local block must be the last valid entry: {row}"
            if n_i <= big_n:
                assert row[:n_i] == list(range(n_i)), row
                continue
            assert len(set(valid)) == big_n, row
            hist = {b: s for b, s in scores[h][i].items() if b < n_i - 1}
            chosen = valid[:-1]
            assert all(b < n_i - 1 for b in chosen), row
            threshold = sorted(hist.values(), reverse=True)[big_n - 2]  # the (N-1)-th best
            assert all(hist[b] >= threshold - TOL for b in chosen), (row, threshold)
            assert all(b in chosen for b, s in hist.items() if s > threshold + TOL), (row, hist)


def _inputs(n, g=2, di=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, g, di, generator=gen), torch.randn(n, g, di, generator=gen)


def test_block_scores_equal_oracle():
    qI, kI = _inputs(45)
    pos = torch.arange(45)
    got = block_scores(qI, kI, pos, pos, 8)
    ref = _oracle_scores(qI, kI, pos, pos, 8)
    for h in range(2):
        for i in range(45):
            for b in range(got.shape[-1]):
                want = ref[h][i].get(b)
                if want is None:
                    assert got[h, i, b] == float("-inf")
                else:
                    assert abs(float(got[h, i, b]) - want) < 1e-5


@pytest.mark.parametrize("n,bsz,big_n", [(70, 8, 4), (100, 8, 4), (37, 4, 3), (20, 8, 4)])
def test_selection_equals_oracle(n, bsz, big_n):
    qI, kI = _inputs(n, seed=n)
    pos = torch.arange(n)
    sel = select(qI, kI, pos, pos, bsz, big_n)
    assert sel.dtype == torch.int64 and sel.shape == (2, n, big_n)
    _check_selection(sel, _oracle_scores(qI, kI, pos, pos, bsz), pos, bsz, big_n)


def test_ties_go_to_the_lower_block_id():
    # Every history block scores the same: the N-1 lowest ids win, then the local block.
    scores = torch.zeros(1, 1, 10)
    sel = select_blocks(scores, torch.tensor([75]), 8, 4)
    assert sel.tolist() == [[[0, 1, 2, 9]]]
    scores[0, 0, 5] = scores[0, 0, 7] = 1.0  # two clear winners, then ties among the rest
    assert select_blocks(scores, torch.tensor([75]), 8, 4).tolist() == [[[5, 7, 0, 9]]]


@pytest.mark.parametrize("hq,g,bsz,big_n", [(4, 2, 8, 4), (6, 3, 4, 3), (2, 2, 8, 2)])
def test_sparse_equals_dense_masked(hq, g, bsz, big_n):
    n, d = 77, 16
    gen = torch.Generator().manual_seed(hq * 10 + g)
    q, k, v = (torch.randn(n, h, d, generator=gen) for h in (hq, g, g))
    qI, kI = _inputs(n, g=g, seed=3)
    pos = torch.arange(n)
    sel = select(qI, kI, pos, pos, bsz, big_n)
    got = sparse_attention(q, k, v, pos, pos, sel, bsz, 0.25)
    want = dense_masked_attention(q, k, v, pos, pos, sel, bsz, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_sparse_gradients_equal_dense_masked():
    n = 50
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, h, 8, generator=gen, requires_grad=True) for h in (4, 2, 2))
    pos = torch.arange(n)
    sel = select(*_inputs(n, seed=6), pos, pos, 4, 3)
    w = torch.randn(n, 4, 8, generator=gen)
    grads = []
    for fn in (sparse_attention, dense_masked_attention):
        (fn(q, k, v, pos, pos, sel, 4, 0.3) * w).sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_short_sequence_equals_dense_causal():
    """n <= N*B: every causal block is selected, so MSA is exactly causal attention."""
    bsz, big_n = 8, 4
    for n in (1, 9, 32):
        gen = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(n, h, 16, generator=gen) for h in (4, 2, 2))
        qI, kI = _inputs(n, seed=n)
        got = packed_msa_attention(q, k, v, qI, kI, [n], bsz, big_n, 0.25)
        torch.testing.assert_close(got, packed_attention(q, k, v, [n], 0.25), atol=1e-6, rtol=1e-6)


def test_chunk_and_decode_select_like_the_whole_sequence():
    """Queries at positions [s, e) against the keys cached so far (chunked prefill, decode)."""
    n, bsz, big_n = 90, 8, 4
    qI, kI = _inputs(n, seed=11)
    pos = torch.arange(n)
    whole = select(qI, kI, pos, pos, bsz, big_n)
    oracle = _oracle_scores(qI, kI, pos, pos, bsz)
    for s, e in [(0, 30), (30, 47), (47, 48), (48, 89), (89, 90)]:
        part = select(qI[s:e], kI[:e], pos[s:e], pos[:e], bsz, big_n)
        _check_selection(part, [rows[s:e] for rows in oracle], pos[s:e], bsz, big_n)
        same = [set(a) == set(b) for a, b in zip(part.flatten(0, 1).tolist(), whole[:, s:e].flatten(0, 1).tolist())]
        assert all(same)


def test_chunk_attention_equals_whole_sequence():
    n, bsz, big_n = 60, 8, 4
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, h, 16, generator=gen) for h in (4, 2, 2))
    qI, kI = _inputs(n, seed=2)
    pos = torch.arange(n)
    whole = packed_msa_attention(q, k, v, qI, kI, [n], bsz, big_n, 0.25)
    s, e = 41, 53
    sel = select(qI[s:e], kI[:e], pos[s:e], pos[:e], bsz, big_n)
    part = sparse_attention(q[s:e], k[:e], v[:e], pos[s:e], pos[:e], sel, bsz, 0.25)
    torch.testing.assert_close(part, whole[s:e], atol=1e-6, rtol=1e-6)


def test_keys_in_any_order_with_gaps():
    """Keys addressed by position, not by row: shuffled rows and missing positions."""
    n, bsz = 50, 4
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(n, h, 8, generator=gen) for h in (2, 1, 1))
    k_pos = torch.randperm(80, generator=gen)[:n]
    q_pos = k_pos[:10]
    sel = select_blocks(torch.randn(1, 10, 80 // bsz, generator=gen), q_pos, bsz, 3)
    got = sparse_attention(q[:10], k, v, q_pos, k_pos, sel, bsz, 0.3)
    torch.testing.assert_close(got, dense_masked_attention(q[:10], k, v, q_pos, k_pos, sel, bsz, 0.3),
                               atol=1e-5, rtol=1e-5)


def test_packed_sequences_equal_each_alone():
    lens, bsz, big_n = [70, 5, 41], 8, 4
    gen = torch.Generator().manual_seed(4)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, 16, generator=gen) for h in (4, 2, 2))
    qI, kI = _inputs(t, seed=4)
    packed = packed_msa_attention(q, k, v, qI, kI, lens, bsz, big_n, 0.25)
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        alone = packed_msa_attention(q[sl], k[sl], v[sl], qI[sl], kI[sl], [n], bsz, big_n, 0.25)
        torch.testing.assert_close(packed[sl], alone, atol=0, rtol=0)
        start += n


def test_paged_equals_packed_for_chunks_and_decodes():
    """Scattered pages, two sequences: a chunk with a cached prefix and a decode, in one call."""
    bsz, big_n, page = 8, 4, 4
    lens = [61, 45]
    gen = torch.Generator().manual_seed(12)
    seqs = [[torch.randn(n, h, 16, generator=gen) for h in (4, 2, 2, 2, 2)] for n in lens]  # q k v qI kI
    whole = [packed_msa_attention(q, k, v, qi, ki, [n], bsz, big_n, 0.25) for n, (q, k, v, qi, ki) in zip(lens, seqs)]
    num_pages = sum(-(-n // page) for n in lens) + 1
    k_cache, v_cache = torch.zeros(num_pages * page, 2, 16), torch.zeros(num_pages * page, 2, 16)
    ki_cache = torch.zeros(num_pages * page, 2, 16)
    table = torch.zeros(3, 64, dtype=torch.long)
    free = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    for row, (n, (q, k, v, qi, ki)) in enumerate(zip(lens, seqs), start=1):
        for p in range(-(-n // page)):
            pg = free.pop()
            table[row, p * page:(p + 1) * page] = torch.arange(pg * page, (pg + 1) * page)
        slots = table[row, :n]
        k_cache[slots], v_cache[slots], ki_cache[slots] = k, v, ki
    prefixes, news = [33, 44], [28, 1]  # sequence 1: chunk 33..60; sequence 2: decode at 44
    q = torch.cat([s[0][p:p + e] for s, p, e in zip(seqs, prefixes, news)])
    qi = torch.cat([s[3][p:p + e] for s, p, e in zip(seqs, prefixes, news)])
    got = paged_msa_attention(q, qi, k_cache, v_cache, ki_cache, table, [1, 2], prefixes, news, bsz, big_n, 0.25)
    want = torch.cat([w[p:p + e] for w, p, e in zip(whole, prefixes, news)])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
