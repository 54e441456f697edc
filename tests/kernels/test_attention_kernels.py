"""Triton paged attention kernels vs the reference ops in kiln.ops.attention.

"cpu" cases run the kernels under Triton's interpreter (tiny shapes, fp32); "cuda" cases compile
them for the GPU at real shapes in bf16.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels.attention import decode_attention, extend_attention  # noqa: E402
from kiln.ops.attention import RelProjection, materialized, paged_attention, paged_decode_attention  # noqa: E402
from tests.kernels.devices import DEVICES, INTERPRETER_ONLY, capture_graph  # noqa: E402



def _paged_cache(ctx_lens, hkv, d, dtype, device, gen, index_dtype=torch.int32, page_size=1):
    """Random K/V for sequences of the given context lengths, scattered over a cache with spare
    slots in random page order. Returns k_cache, v_cache, req_to_token and each sequence's row."""
    num_seqs, max_ctx = len(ctx_lens), max(ctx_lens) + 3
    pages_per_seq = [math.ceil(n / page_size) for n in ctx_lens]
    num_pages = sum(pages_per_seq) + 4
    num_slots = num_pages * page_size
    k_cache = torch.randn(num_slots, hkv, d, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(num_slots, hkv, d, generator=gen).to(dtype).to(device)
    page_order = torch.randperm(num_pages, generator=gen)
    rows = torch.randperm(num_seqs + 2, generator=gen)[:num_seqs]  # rows are not 0..B-1
    req_to_token = torch.zeros(num_seqs + 2, max_ctx, dtype=index_dtype)
    used = 0
    for row, n, p in zip(rows.tolist(), ctx_lens, pages_per_seq):
        pages = page_order[used:used + p]
        used += p
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
        req_to_token[row, :n] = slots.to(index_dtype)
    return k_cache, v_cache, req_to_token.to(device), rows.to(device)


def _tol(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype in (torch.bfloat16, torch.float16) else dict(atol=1e-4, rtol=1e-4)


def _rel_projection(b, hq, rel_len, rel_dim, dtype, device, gen, with_lam):
    """Inkling's bias before its projection (`RelProjection`): O(1) logits, lam in [1, 2)."""
    r = torch.randn(b, hq, rel_dim, generator=gen).to(dtype).to(device)
    w = (torch.randn(rel_len, rel_dim, generator=gen) / rel_dim ** 0.5).to(dtype).to(device)
    lam = (1 + torch.rand(b, generator=gen)).to(device) if with_lam else None
    return RelProjection(r, w, lam)


def _check_decode(device, seq_lens, hq, hkv, d, dtype, window=None, rel_len=None, seed=0,
                  index_dtype=torch.int32, page_size=1, merge_here=False, rel_dim=None, with_lam=True, **kw):
    """merge_here: the splits merged inside the attention kernel (split counters, which every
    call must leave zeroed), else by the merge kernel. rel_dim: the bias is given as a
    `RelProjection` (r [B, Hq, rel_dim], P [rel_len, rel_dim], lam when `with_lam`) and the
    reference gets its materialised [B, Hq, rel_len]. With early_kv=True in kw the result must
    also equal the plain kernel's bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, r2t, rows = _paged_cache(seq_lens, hkv, d, dtype, device, gen, index_dtype, page_size)
    b = len(seq_lens)
    q = torch.randn(b, hq, d, generator=gen).to(dtype).to(device)
    if rel_dim is not None:
        rel = _rel_projection(b, hq, rel_len, rel_dim, dtype, device, gen, with_lam)
    else:
        rel = None if rel_len is None else torch.randn(b, hq, rel_len, generator=gen).to(device)
    lens = torch.tensor(seq_lens, device=device)
    scale = d ** -0.5
    counters = torch.zeros(b * hkv + 3, dtype=torch.int32, device=device) if merge_here else None
    want = paged_decode_attention(q, k_cache, v_cache, r2t, rows, lens, scale, window, materialized(rel))
    for _ in range(2 if merge_here else 1):  # a second call finds the counters as the first left them
        with _no_merge_kernel(merge_here):
            got = decode_attention(q, k_cache, v_cache, r2t, rows, lens, scale, window, rel,
                                   split_counters=counters, **kw)
        assert got.dtype == q.dtype and got.shape == q.shape
        torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))
        if merge_here:
            assert not counters.any()
    if kw.get("early_kv"):
        with _no_merge_kernel(merge_here):
            plain = decode_attention(q, k_cache, v_cache, r2t, rows, lens, scale, window, rel,
                                     split_counters=counters, **{**kw, "early_kv": False})
        assert torch.equal(got, plain)


@contextlib.contextmanager
def _no_merge_kernel(active: bool = True):
    """With split counters the splits must merge inside the attention kernel: a launch of the
    merge kernel fails (so a silent fallback cannot pass as the in-kernel merge)."""
    from kiln.kernels import decode_attention as module

    real = module._merge_kernel

    class Refuse:
        def __getitem__(self, grid):
            raise AssertionError("the merge kernel ran: the splits were not merged in the attention kernel")

    if active:
        module._merge_kernel = Refuse()
    try:
        yield
    finally:
        module._merge_kernel = real


def _check_extend(device, seqs, hq, hkv, d, dtype, window=None, rel_len=None, seed=0,
                  index_dtype=torch.int32, page_size=1):
    """seqs: (prefix_len, extend_len) per sequence."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, r2t, rows = _paged_cache([p + n for p, n in seqs], hkv, d, dtype, device, gen,
                                               index_dtype, page_size)
    prefix = [p for p, _ in seqs]
    ext = [n for _, n in seqs]
    t = sum(ext)
    q = torch.randn(t, hq, d, generator=gen).to(dtype).to(device)
    rel = None if rel_len is None else torch.randn(t, hq, rel_len, generator=gen).to(device)
    starts = torch.tensor([0] + ext[:-1], device=device).cumsum(0)
    as_t = lambda xs: torch.tensor(xs, device=device)  # noqa: E731
    scale = d ** -0.5
    got = extend_attention(q, k_cache, v_cache, r2t, rows, as_t(prefix), as_t(ext), starts, scale,
                           window, rel)
    want = paged_attention(q, k_cache, v_cache, r2t, rows.tolist(), prefix, ext, scale, window, rel)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))


# ---- decode --------------------------------------------------------------------------------

# Masking cases as (window, rel_len) on the tiny CPU shapes and on the real CUDA shapes: none, a
# window shorter than some contexts, a bias shorter than the contexts, and both with R larger.
CASES = {
    "plain": {"cpu": (None, None), "cuda": (None, None)},
    "window": {"cpu": (7, None), "cuda": (1000, None)},
    "rel": {"cpu": (None, 5), "cuda": (None, 1024)},
    "window_rel_long": {"cpu": (9, 100), "cuda": (4096, 8192)},
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_decode(device, group, case):
    window, rel_len = CASES[case][device]
    if device == "cpu":  # lengths 1 and shorter / longer than the window, in one batch
        _check_decode(device, [1, 23, 40, 6], group * 2, 2, 32, torch.float32, window, rel_len, seed=group)
    else:
        _check_decode(device, [1, 1000, 4097, 300, 8192], 32, 32 // group, 128, torch.bfloat16,
                      window, rel_len, seed=group, page_size=16)


@INTERPRETER_ONLY
@pytest.mark.parametrize("merge_here", [False, True], ids=["merge_kernel", "merge_in_kernel"])
@pytest.mark.parametrize("num_splits", [1, 3, 8, 20])
def test_decode_cpu_splits(num_splits, merge_here):
    # One split writes the output directly; more splits than a short sequence has blocks leave
    # some splits empty, which the merge must skip. (Merges over several tiles: below.)
    _check_decode("cpu", [3, 300, 33], 4, 2, 32, torch.float32, rel_len=20, num_splits=num_splits,
                  merge_here=merge_here)


@INTERPRETER_ONLY
@pytest.mark.parametrize("merge_here", [False, True], ids=["merge_kernel", "merge_in_kernel"])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 32), (6, 2, 48)], ids=["group2", "group3_d48"])
def test_decode_cpu_min_split_keys_and_merge_tiles(merge_here, hq, hkv, d, monkeypatch):
    """Splits of at least 40 keys (rounded up to 48, three key blocks): of 20 splits, the 300-key
    sequence fills 7 (19 by length alone), the 97-key one 3, the short ones 1. The merge walks
    them in tiles of 2 splits (several tiles, the last one part full); group 3 and D 48 leave
    padded heads and head-dim columns in every tile."""
    from kiln.kernels import decode_attention as module
    from kiln.kernels import decode_splits

    block_h, block_d = (2, 32) if d == 32 else (4, 64)
    monkeypatch.setattr(decode_splits, "MERGE_TILE_VALUES", block_h * 2 * block_d)  # BLOCK_H x 2 splits x BLOCK_D
    assert decode_splits.merge_tile(hq // hkv, block_d, 20) == (block_h, 2)
    # Record which partials the attention kernel writes: its scratch starts as NaN.
    written, empty = [], torch.empty

    def nan_empty(*shape, **kw):
        t = empty(*shape, **kw)
        if t.dtype == torch.float32 and t.dim() == 3 and t.shape[2] == 20:  # MidLse [B, Hq, splits]
            written.append(t.fill_(float("nan")))
        return t

    monkeypatch.setattr(torch, "empty", nan_empty)
    _check_decode("cpu", [3, 300, 33, 97], hq, hkv, d, torch.float32, rel_len=20, num_splits=20,
                  min_split_keys=40, merge_here=merge_here)
    filled = (~written[-1].isnan()).sum(-1)  # [B, Hq]: the splits that held keys
    assert filled.tolist() == [[1] * hq, [7] * hq, [1] * hq, [3] * hq]


def test_split_count_never_exceeds_what_the_least_split_fills():
    from kiln.kernels.decode_attention import pick_num_splits

    cpu = torch.device("cpu")
    assert pick_num_splits(1, 2, 1024, cpu) == 8  # 4 programs per "SM" (4 on the CPU) over 2 heads
    assert pick_num_splits(1, 2, 1024, cpu, min_split_keys=256) == 4  # 1024 keys fill 4 such splits


@INTERPRETER_ONLY
@pytest.mark.parametrize("rel_dim,with_lam,window,num_splits,merge_here", [
    (8, True, None, 1, False),    # one split writes the output
    (8, False, 9, 3, True),       # sliding layer (no lam), splits merged in the kernel
    (20, True, None, 4, False),   # d_r not a power of two, the merge kernel
])
def test_decode_cpu_rel_projection(rel_dim, with_lam, window, num_splits, merge_here):
    """The bias computed in the kernel from r and P (and lam) equals attention with the
    materialised bias, also where R is shorter than the context (keys past R get none)."""
    _check_decode("cpu", [1, 23, 40, 6], 8, 2, 32, torch.float32, window, 17, rel_dim=rel_dim,
                  with_lam=with_lam, num_splits=num_splits, merge_here=merge_here, seed=rel_dim)


@INTERPRETER_ONLY
def test_decode_cpu_merge_in_kernel_window():
    # A window's splits start past the sequence start.
    _check_decode("cpu", [1, 23, 40, 6], 8, 2, 32, torch.float32, 7, 5, num_splits=4, merge_here=True)


@INTERPRETER_ONLY
@pytest.mark.parametrize("window,rel_len,rel_dim,num_splits,merge_here", [
    (None, None, None, 1, False),  # one split: the query's block is the first
    (None, None, None, 3, True),   # several blocks per split, merged in the kernel
    (7, 5, None, 4, False),        # a window (splits start past 0) and a bias tail
    (None, 100, None, 8, True),    # the bias over every key: the first block is the biased loop's
    (9, 17, 8, 3, True),           # Inkling's projected bias on a sliding layer
])
def test_decode_cpu_early_kv_is_the_same_attention(window, rel_len, rel_dim, num_splits, merge_here):
    """early_kv (the first block of keys read before the PDL wait, the query's own row after it)
    equals the reference, and the plain kernel bit for bit, for contexts of 1 key (the query
    alone), shorter and longer than a block and the window."""
    _check_decode("cpu", [1, 23, 40, 6, 70], 8, 2, 32, torch.float32, window, rel_len, rel_dim=rel_dim,
                  num_splits=num_splits, merge_here=merge_here, early_kv=True, seed=3)


def test_decode_early_kv_refuses_mtp_layers():
    q = torch.zeros(1, 2, 16)
    cache = torch.zeros(4, 1, 16)
    with pytest.raises(AssertionError, match="not for MTP layers"):
        decode_attention(q, cache, cache, torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
                         torch.ones(1, dtype=torch.int64), 0.25, key_gap=2, early_kv=True)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d,window,rel_len,rel_dim,lens", [
    (32, 8, 128, None, None, None, [1, 1000, 4097, 300, 8192]),  # Llama-3.1-8B
    (16, 4, 128, 4096, 1024, 32, [5000, 100, 4096, 1023, 1]),  # Inkling bench, projected bias
    (16, 4, 128, None, 1024, 32, [1024, 64, 65, 2]),  # Inkling bench, full layer
])
def test_decode_cuda_early_kv_is_bit_identical(hq, hkv, d, window, rel_len, rel_dim, lens):
    """On the GPU the early reads change nothing: bit for bit the plain kernel, with the merge in
    the kernel as the engine runs it and with one split."""
    _check_decode("cuda", lens, hq, hkv, d, torch.bfloat16, window, rel_len, rel_dim=rel_dim, page_size=16,
                  merge_here=True, early_kv=True)
    _check_decode("cuda", lens, hq, hkv, d, torch.bfloat16, window, rel_len, rel_dim=rel_dim, page_size=16,
                  num_splits=1, early_kv=True, seed=1)


@INTERPRETER_ONLY
def test_decode_cpu_int64_table_odd_head_dim_fp16_pages():
    _check_decode("cpu", [12, 30], 6, 3, 48, torch.float16, window=20, index_dtype=torch.int64,
                  page_size=4, max_len=30)


@INTERPRETER_ONLY
@pytest.mark.parametrize("early_kv", [False, True])
def test_decode_cpu_empty_sequence_gives_zeros(early_kv, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, r2t, rows = _paged_cache([5, 9], 2, 16, torch.float32, "cpu", gen)
    q = torch.randn(2, 4, 16)
    # The output starts as NaN, not as whatever empty memory holds: the zeros must be written.
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: empty_like(t, **kw).fill_(float("nan")))
    for splits, counters in ((1, None), (4, None), (4, torch.zeros(4, dtype=torch.int32))):
        with _no_merge_kernel(counters is not None):
            out = decode_attention(q, k_cache, v_cache, r2t, rows, torch.tensor([0, 9]), 0.25,
                                   num_splits=splits, split_counters=counters, early_kv=early_kv)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        want = paged_decode_attention(q[1:], k_cache, v_cache, r2t, rows[1:], torch.tensor([9]), 0.25)
        torch.testing.assert_close(out[1:], want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d,window,rel_len,lens", [
    (32, 8, 128, None, None, [1, 1000, 4097, 300, 8192]),  # Llama-3.1-8B
    (16, 4, 128, 4096, 1024, [5000, 100, 4096, 1023, 1]),  # Inkling bench
    (16, 4, 128, 4096, 8192, [9000, 2]),  # R larger than the window
    (8, 8, 64, None, 64, [777, 31]),  # MHA
    (16, 2, 256, 100, None, [3000, 50]),  # group 8, D 256
    (14, 2, 80, None, None, [513, 2048]),  # odd head dim
])
def test_decode_cuda_shapes(hq, hkv, d, window, rel_len, lens):
    _check_decode("cuda", lens, hq, hkv, d, torch.bfloat16, window, rel_len, page_size=16)
    _check_decode("cuda", lens, hq, hkv, d, torch.bfloat16, window, rel_len, page_size=16, merge_here=True)
    _check_decode("cuda", lens, hq, hkv, d, torch.bfloat16, window, rel_len, seed=1, num_splits=1)
    # the grid of a 128K table (27-32 splits, as in the engine), merged over several tiles
    _check_decode("cuda", lens, hq, hkv, d, torch.bfloat16, window, rel_len, seed=2, page_size=16,
                  min_split_keys=1, merge_here=True, max_len=2 ** 17)


@pytest.mark.gpu
@pytest.mark.parametrize("with_lam,window", [(True, None), (False, 4096)], ids=["full", "sliding"])
def test_decode_cuda_rel_projection(with_lam, window):
    """Inkling bench shapes: R = 1024, d_r = 32, bf16, the bias computed per key in the kernel."""
    lens = [5000, 100, 4096, 1023, 1]
    _check_decode("cuda", lens, 16, 4, 128, torch.bfloat16, window, 1024, page_size=16, rel_dim=32,
                  with_lam=with_lam, merge_here=True)
    _check_decode("cuda", lens, 16, 4, 128, torch.bfloat16, window, 1024, page_size=16, rel_dim=32,
                  with_lam=with_lam, seed=1, num_splits=1)


@pytest.mark.gpu
def test_decode_cuda_fp32_is_exact():
    # fp32 caches use IEEE dots (no TF32), so the kernel matches the reference tightly.
    _check_decode("cuda", [300, 1200], 8, 2, 128, torch.float32, 512, 64, page_size=16)


@pytest.mark.gpu
@pytest.mark.parametrize("merge_here", [False, True], ids=["merge_kernel", "merge_in_kernel"])
@pytest.mark.parametrize("window,rel_len", [(None, None), (256, 64)])
def test_decode_cuda_graph_capture(window, rel_len, merge_here):
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, max_len = 32, 8, 128, 2048
    k_cache, v_cache, r2t, rows = _paged_cache([max_len] * 4, hkv, d, torch.bfloat16, "cuda", gen, page_size=16)
    q = torch.randn(4, hq, d, generator=gen).to("cuda", torch.bfloat16)
    rel = None if rel_len is None else torch.randn(4, hq, rel_len, generator=gen).cuda()
    lens = torch.tensor([10, 2000, 700, 1], device="cuda")
    counters = torch.zeros(32, dtype=torch.int32, device="cuda") if merge_here else None
    run = lambda: decode_attention(q, k_cache, v_cache, r2t, rows, lens, 0.1, window, rel,  # noqa: E731
                                   max_len=max_len, split_counters=counters)
    graph, out = capture_graph(run)
    for new_lens in ([2048, 3, 1500, 64], [1, 1, 1, 1], [100, 1025, 2048, 513]):
        lens.copy_(torch.tensor(new_lens))
        q.copy_(torch.randn(4, hq, d, generator=gen).to(torch.bfloat16))
        if rel is not None:
            rel.copy_(torch.randn(4, hq, rel_len, generator=gen))
        graph.replay()
        want = paged_decode_attention(q, k_cache, v_cache, r2t, rows, lens, 0.1, window, rel)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
        assert counters is None or not counters.any()


# ---- extend --------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_extend(device, group, case):
    # Prefix 0 and > 0, single-token and multi-block extends; each window is shorter than some
    # extend, so the window edge moves inside a query block.
    window, rel_len = CASES[case][device]
    if device == "cpu":
        window = None if window is None else window - 2
        seqs = [(0, 21), (17, 6), (4, 1), (30, 18)]
        _check_extend(device, seqs, 8 if group == 8 else group * 2, 1 if group == 8 else 2, 32,
                      torch.float32, window, rel_len, seed=group)
    else:
        seqs = [(0, 1500), (2000, 129), (64, 1), (5000, 700)]
        _check_extend(device, seqs, 32, 32 // group, 128, torch.bfloat16, window, rel_len,
                      seed=group, page_size=16)


@INTERPRETER_ONLY
def test_extend_cpu_int64_table_odd_head_dim_fp16_pages():
    _check_extend("cpu", [(9, 12), (0, 5)], 4, 2, 48, torch.float16, window=6, rel_len=4,
                  index_dtype=torch.int64, page_size=4)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d,window,rel_len,seqs", [
    (32, 8, 128, None, None, [(0, 700), (1500, 129), (64, 1), (0, 1)]),  # Llama-3.1-8B
    (16, 4, 128, 4096, 1024, [(0, 5000), (3000, 300), (4100, 64)]),  # Inkling bench
    (16, 4, 128, 100, 8192, [(0, 333), (900, 257)]),  # window < extend, R > context
    (8, 8, 64, None, 32, [(200, 77), (0, 256)]),  # MHA
    (16, 2, 256, None, None, [(100, 300), (0, 65)]),  # group 8, D 256
    (14, 2, 80, 64, None, [(40, 200)]),  # odd head dim
])
def test_extend_cuda_shapes(hq, hkv, d, window, rel_len, seqs):
    _check_extend("cuda", seqs, hq, hkv, d, torch.bfloat16, window, rel_len, page_size=16)


# ---- MTP addressing: explicit positions, key_gap, key_offset ---------------------------------

def _check_mtp(kernel, device, rows_per_seq, hq, hkv, d, dtype, window, rel_len, key_gap, key_offset, seed=0,
               page_size=1, num_splits=None, split_counters=None):
    """rows_per_seq: ascending query positions per sequence, with jumps (catch-up rows then a
    draft row further ahead, as the MTP drafter builds them). kernel "extend": the extend kernel
    with `positions`; "decode": the decode kernel with one query per row and the positions as its
    lengths less `len_offset` (how the engine runs a decode round's pass and a verify). Both
    against the reference op."""
    gen = torch.Generator().manual_seed(seed)
    ctx = [r[-1] + 1 + key_offset for r in rows_per_seq]
    k_cache, v_cache, r2t, slots = _paged_cache(ctx, hkv, d, dtype, device, gen, page_size=page_size)
    ext = [len(r) for r in rows_per_seq]
    positions = [p for r in rows_per_seq for p in r]
    q = torch.randn(len(positions), hq, d, generator=gen).to(dtype).to(device)
    rel = None if rel_len is None else torch.randn(len(positions), hq, rel_len, generator=gen).to(device)
    as_t = lambda xs: torch.tensor(xs, device=device)  # noqa: E731
    mtp = dict(key_gap=key_gap, key_offset=key_offset)
    if kernel == "extend":
        got = extend_attention(q, k_cache, v_cache, r2t, slots, as_t([0] * len(ext)), as_t(ext),
                               as_t([0] + ext[:-1]).cumsum(0), d ** -0.5, window, rel, positions=as_t(positions), **mtp)
    else:
        with _no_merge_kernel(split_counters is not None):
            # the positions with len_offset 1, as the engine passes them (every other decode test
            # passes lengths with the default 0)
            got = decode_attention(q, k_cache, v_cache, r2t, torch.repeat_interleave(slots, as_t(ext)),
                                   as_t(positions), d ** -0.5, window, rel, num_splits=num_splits,
                                   split_counters=split_counters, len_offset=1, **mtp)
        assert split_counters is None or not split_counters.any()
    want = paged_attention(q, k_cache, v_cache, r2t, slots.tolist(), [0] * len(ext), ext, d ** -0.5, window, rel,
                           positions=positions, **mtp)
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))


MTP_CPU_SEQS = [[5, 6, 7, 10], [30], list(range(3, 24)), [12, 13, 16]]  # catch-up rows, a lone draft row, ...
MTP_CUDA_SEQS = [[900, 901, 902, 905], [3000], list(range(100, 230)), [4500, 4501, 4504]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key_gap,key_offset", [(0, 1), (2, 3), (4, 5)])
def test_extend_mtp_addressing(device, key_gap, key_offset):
    if device == "cpu":
        _check_mtp("extend", device, MTP_CPU_SEQS, 4, 2, 32, torch.float32, 9, 6, key_gap, key_offset, seed=key_gap)
    else:
        _check_mtp("extend", device, MTP_CUDA_SEQS, 16, 4, 128, torch.bfloat16, 4096, 1024, key_gap, key_offset,
                   seed=key_gap, page_size=16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key_gap,key_offset", [(0, 1), (2, 3), (4, 5)])
def test_decode_mtp_addressing(device, key_gap, key_offset):
    if device == "cpu":
        # One split, and splits whose last blocks hold only hidden keys (merged by the merge
        # kernel, then inside the attention kernel).
        for splits, counters in ((1, None), (3, None), (3, torch.zeros(64, dtype=torch.int32))):
            _check_mtp("decode", device, MTP_CPU_SEQS[:2] + [list(range(3, 12))] + MTP_CPU_SEQS[3:], 4, 2, 32,
                       torch.float32, 9, 6, key_gap, key_offset, seed=key_gap, num_splits=splits,
                       split_counters=counters)
    else:
        _check_mtp("decode", device, MTP_CUDA_SEQS[:2] + [list(range(100, 110))] + MTP_CUDA_SEQS[3:], 16, 4, 128,
                   torch.bfloat16, 4096, 1024, key_gap, key_offset, seed=key_gap, page_size=16)
