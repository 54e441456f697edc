"""The batched decode attention op against the per-sequence reference, on random paged inputs."""

from __future__ import annotations

import pytest
import torch

from kiln.ops.attention import packed_attention, paged_attention, paged_decode_attention


def _paged(seq_lens, hkv, d, page_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_pages = sum((n + page_size - 1) // page_size for n in seq_lens) + 1
    k_cache = torch.randn(num_pages * page_size, hkv, d, generator=g)
    v_cache = torch.randn(num_pages * page_size, hkv, d, generator=g)
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()  # scattered pages
    table = torch.zeros(len(seq_lens) + 1, max(seq_lens) + page_size, dtype=torch.long)
    for i, n in enumerate(seq_lens):
        for p in range((n + page_size - 1) // page_size):
            page = perm.pop()
            table[i + 1, p * page_size:(p + 1) * page_size] = torch.arange(page * page_size, (page + 1) * page_size)
    return k_cache, v_cache, table


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
def test_decode_op_equals_reference(window, hq, hkv):
    seq_lens = [1, 7, 13, 30]
    d = 16
    k_cache, v_cache, table = _paged(seq_lens, hkv, d)
    q = torch.randn(len(seq_lens), hq, d)
    slots = list(range(1, len(seq_lens) + 1))
    ref = paged_attention(q, k_cache, v_cache, table, slots, [n - 1 for n in seq_lens], [1] * len(seq_lens),
                          0.25, window)
    got = paged_decode_attention(q, k_cache, v_cache, table, torch.tensor(slots), torch.tensor(seq_lens),
                                 0.25, window)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_paged_extend_equals_packed_when_no_prefix():
    seq_lens = [5, 11]
    k_cache, v_cache, table = _paged(seq_lens, 2, 8, seed=1)
    slots = [1, 2]
    k = torch.cat([k_cache[table[s, :n]] for s, n in zip(slots, seq_lens)])
    v = torch.cat([v_cache[table[s, :n]] for s, n in zip(slots, seq_lens)])
    q = torch.randn(sum(seq_lens), 4, 8)
    got = paged_attention(q, k_cache, v_cache, table, slots, [0, 0], seq_lens, 0.3)
    torch.testing.assert_close(got, packed_attention(q, k, v, seq_lens, 0.3))


@pytest.mark.parametrize("gap", [0, 2, 3])
def test_paged_rows_at_explicit_positions_with_key_gap_and_offset(gap):
    """MTP layers: queries at explicit positions (catch-up rows then a draft row further ahead),
    keys stored at position + offset, key_gap visibility. Equals packed attention over the same
    keys with the same mask, row for row."""
    offset, window = 3, 6
    n = 20  # positions 0..19; stored at 3..22
    k_cache, v_cache, table = _paged([n + offset], 2, 8, seed=2)
    q_rows = [12, 13, 14, 19]  # catch-up 12..14, then a draft row at 19
    q_all = torch.randn(n, 4, 8, generator=torch.Generator().manual_seed(3))
    rel = torch.randn(n, 4, 5)
    got = paged_attention(q_all[q_rows], k_cache, v_cache, table, [1], [0], [len(q_rows)], 0.3, window,
                          rel[q_rows], key_gap=gap, positions=q_rows, key_offset=offset)
    stored = table[1, offset:offset + n]
    want = packed_attention(q_all, k_cache[stored], v_cache[stored], [n], 0.3, window, rel, key_gap=gap)[q_rows]
    torch.testing.assert_close(got, want)
    if gap > 1:  # the mask matters: without it the draft row sees the keys the gap hides
        plain = paged_attention(q_all[q_rows], k_cache, v_cache, table, [1], [0], [len(q_rows)], 0.3, window,
                                rel[q_rows], positions=q_rows, key_offset=offset)
        assert (plain[-1] - got[-1]).abs().max() > 1e-3


def _packed_inputs(device="cpu"):
    lens = [1, 9, 4, 13]
    g = torch.Generator().manual_seed(0)
    return lens, [torch.randn(sum(lens), h, 8, generator=g).to(device) for h in (6, 2, 2)]


def _attention_and_grads(fn, q, k, v):
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = fn(qq, kk, vv)
    (out * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum().backward()
    return [t.detach().cpu() for t in (out, qq.grad, kk.grad, vv.grad)]


@pytest.mark.parametrize("window,gap,with_rel", [(None, 0, False), (4, 0, False), (None, 3, False), (6, 2, False),
                                                  (None, 0, True), (4, 0, True), (6, 2, True)])
def test_padded_packed_attention_equals_the_per_sequence_loop(window, gap, with_rel):
    """All sequences in one einsum against the per-sequence loop (what packed_attention runs on a
    CPU): outputs and gradients (rel's too), GQA, a 1-token sequence, windows, the MTP key gap and
    Inkling's relative bias (R = 5: shorter than some sequences, longer than others)."""
    from kiln.ops.attention import _padded_packed_attention

    lens, (q, k, v) = _packed_inputs()
    rel = torch.randn(sum(lens), q.shape[1], 5, generator=torch.Generator().manual_seed(4)) if with_rel else None

    def run(fn):
        r = None if rel is None else rel.clone().requires_grad_(True)
        out = _attention_and_grads(lambda *t: fn(*t, r), q, k, v)
        return out + ([] if r is None else [r.grad])

    padded = run(lambda q_, k_, v_, r: _padded_packed_attention(q_, k_, v_, lens, 0.3, window, gap, r))
    loop = run(lambda q_, k_, v_, r: packed_attention(q_, k_, v_, lens, 0.3, window, r, key_gap=gap))
    assert len(padded) == (5 if with_rel else 4)
    for got, want in zip(padded, loop):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # both fp32 inside


def test_padding_is_chosen_on_a_gpu_and_bounded_under_autograd():
    from kiln.ops.attention import MAX_PADDING_UNDER_GRAD, PADDED_SCORES, uses_padding

    even, uneven = [300] * 8, [300] + [100] * 7  # padded 8 * 300^2 against 9e4 + 7e4
    assert not uses_padding(even, 16, "cpu", False)  # the loop is faster on a CPU
    assert not uses_padding([300], 16, "cuda", False)  # one sequence: nothing to batch
    assert uses_padding(even, 16, "cuda", False) and uses_padding(uneven, 16, "cuda", False)
    assert uses_padding(even, 16, "cuda", True)  # equal lengths keep what the loop keeps
    assert 8 * 300 ** 2 > MAX_PADDING_UNDER_GRAD * (300 ** 2 + 7 * 100 ** 2)
    assert not uses_padding(uneven, 16, "cuda", True)  # the padding would grow the trainer's memory
    big = int((PADDED_SCORES / 16 / 8) ** 0.5) + 1
    assert not uses_padding([big] * 8, 16, "cuda", False)  # past the scores' cap


@pytest.mark.gpu
def test_packed_attention_on_cuda_takes_the_padded_path_without_autograd(monkeypatch):
    import kiln.ops.attention as A

    calls = []
    real = A._padded_packed_attention
    monkeypatch.setattr(A, "_padded_packed_attention", lambda *a: calls.append(1) or real(*a))
    lens, (q, k, v) = _packed_inputs()
    with torch.no_grad():
        cuda = A.packed_attention(q.cuda(), k.cuda(), v.cuda(), lens, 0.3, 4, key_gap=2).cpu()
        cpu = A.packed_attention(q, k, v, lens, 0.3, 4, key_gap=2)
    assert calls == [1]  # the CPU run took the loop
    torch.testing.assert_close(cuda, cpu, atol=1e-4, rtol=1e-4)  # TF32 may be on
    A.packed_attention(q.cuda().requires_grad_(True), k.cuda(), v.cuda(), lens, 0.3, 4, key_gap=2)
    assert calls == [1]  # under autograd with uneven lengths: the loop (its memory) ...
    padded = _attention_and_grads(lambda *t: A.packed_attention(*t, lens, 0.3, 4, key_gap=2, pad_under_grad=True),
                                  q.cuda(), k.cuda(), v.cuda())
    assert calls == [1, 1]  # ... unless asked (the MTP trainer)
    loop = _attention_and_grads(lambda *t: A.packed_attention(*t, lens, 0.3, 4, key_gap=2), q, k, v)
    for got, want in zip(padded, loop):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
