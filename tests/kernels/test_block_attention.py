"""`block_attention` (a block drafter's rows sharing their request's keys) vs the reference
`paged_decode_attention`, which treats every row as a sequence of its own."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels.block_attention import block_attention, rows_per_program  # noqa: E402
from kiln.ops.attention import paged_decode_attention  # noqa: E402
from tests.kernels.devices import DEVICES, INTERPRETER_ONLY, capture_graph, record_launches  # noqa: E402
from tests.kernels.test_attention_kernels import _paged_cache, _tol  # noqa: E402


def _blocks(device, block_lens, rows_per_block, hq, hkv, d, dtype, seed=0, page_size=1):
    """Random paged K/V for one request per block (lengths `block_lens`) and q for every block's
    rows; per-row req_slots / seq_lens repeat each block's. Returns the kernel's arguments."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, r2t, req_rows = _paged_cache(block_lens, hkv, d, dtype, device, gen, page_size=page_size)
    n = len(block_lens) * rows_per_block
    q = torch.randn(n, hq, d, generator=gen).to(dtype).to(device)
    slots = req_rows.repeat_interleave(rows_per_block)
    lens = torch.tensor(block_lens, device=device).repeat_interleave(rows_per_block)
    return q, k_cache, v_cache, r2t, slots, lens


def _check(device, block_lens, rows_per_block, hq, hkv, d, dtype, seed=0, page_size=1, **kw):
    q, k_cache, v_cache, r2t, slots, lens = _blocks(device, block_lens, rows_per_block, hq, hkv, d, dtype, seed,
                                                     page_size)
    scale = d ** -0.5
    want = paged_decode_attention(q, k_cache, v_cache, r2t, slots, lens, scale)
    got = block_attention(q, k_cache, v_cache, r2t, slots, lens, scale, rows_per_block, **kw)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))


def test_rows_per_program_divides_the_block_and_fits_the_tile():
    assert rows_per_program(16, 4) == 16  # DSpark `bench`: 16 rows x 4 heads = one 64-row tile
    assert rows_per_program(16, 8) == 8
    assert rows_per_program(16, 64) == 1
    assert rows_per_program(12, 8) == 6  # a divisor of the block, not a power of two
    assert rows_per_program(7, 16) == 1  # 7 is prime and 7 x 16 > 64
    assert rows_per_program(1, 1) == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hq,hkv,rows_per_block", [(4, 2, 4), (4, 4, 3), (8, 2, 16), (32, 1, 3)],
                         ids=["group2", "mha", "group4_b16", "group32_b3"])
def test_block_attention_equals_per_row_decode(device, hq, hkv, rows_per_block):
    d = 16 if device == "cpu" else 128
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    lens = [5, 37, 70] if device == "cpu" else [17, 1040, 8208]
    _check(device, lens, rows_per_block, hq, hkv, d, dtype)


@INTERPRETER_ONLY
@pytest.mark.parametrize("num_splits,min_split_keys", [(1, None), (3, None), (8, None), (8, 40)])
def test_block_attention_cpu_splits(num_splits, min_split_keys):
    # 8 splits over 70 keys in blocks of 16: some splits hold no keys and must be skipped; at
    # least 40 keys a split (rounded up to 48): two splits hold them all
    _check("cpu", [5, 70, 33, 1], 4, 4, 2, 16, torch.float32, num_splits=num_splits, page_size=4,
           min_split_keys=min_split_keys)


@INTERPRETER_ONLY
def test_block_attention_cpu_empty_run_gives_zeros():
    q, k_cache, v_cache, r2t, slots, lens = _blocks("cpu", [9, 20], 2, 4, 2, 16, torch.float32)
    lens[2:] = 0
    for splits in (1, 3):
        got = block_attention(q, k_cache, v_cache, r2t, slots, lens, 0.25, 2, num_splits=splits)
        assert not got[2:].any()
        want = paged_decode_attention(q[:2], k_cache, v_cache, r2t, slots[:2], lens[:2], 0.25)
        torch.testing.assert_close(got[:2], want, atol=1e-4, rtol=1e-4)


@INTERPRETER_ONLY
def test_block_attention_one_program_per_run_and_kv_head(monkeypatch):
    """The point of the kernel: a run's rows share one program per KV head and split, where
    `decode_attention` launches one per row."""
    from kiln.kernels import block_attention as module

    grids = []
    real = module._block_attention_kernel

    class Recorded:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(module, "_block_attention_kernel", Recorded())
    launched = record_launches(monkeypatch, module, "_merge_kernel")
    _check("cpu", [12, 30], 8, 8, 2, 16, torch.float32, num_splits=2)
    assert grids == [(2, 2, 2)], grids  # 2 runs of 8 rows (8 x 4 heads = 32 tile rows), 2 KV heads
    assert launched == ["_merge_kernel"]


@INTERPRETER_ONLY
def test_block_attention_refuses_rows_not_in_whole_runs():
    q, k_cache, v_cache, r2t, slots, lens = _blocks("cpu", [9, 20], 4, 4, 2, 16, torch.float32)
    with pytest.raises(AssertionError):
        block_attention(q, k_cache, v_cache, r2t, slots, lens, 0.25, 3)


@pytest.mark.gpu
def test_block_attention_cuda_graph_replays_new_lengths():
    """Captured once, replayed with other anchors (lengths) per block, as the block pass does."""
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, B, max_len = 16, 4, 128, 16, 4096
    k_cache, v_cache, r2t, req_rows = _paged_cache([max_len] * 2, hkv, d, torch.bfloat16, "cuda", gen,
                                                   page_size=16)
    slots = req_rows.repeat_interleave(B)
    lens = torch.full((2 * B,), 64, device="cuda")
    q = torch.randn(2 * B, hq, d, generator=gen).to("cuda", torch.bfloat16)
    run = lambda: block_attention(q, k_cache, v_cache, r2t, slots, lens, 0.1, B, max_len=max_len)  # noqa: E731
    graph, out = capture_graph(run)
    for a, b in ((4096, 17), (1, 1040), (2000, 513)):
        lens.copy_(torch.tensor([a] * B + [b] * B))
        q.copy_(torch.randn(2 * B, hq, d, generator=gen).to(torch.bfloat16))
        graph.replay()
        want = paged_decode_attention(q, k_cache, v_cache, r2t, slots, lens, 0.1)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_block_splits_aim_at_programs_per_sm_within_the_caps():
    from kiln.kernels import block_attention as module

    cpu = torch.device("cpu")  # 4 "SMs" off CUDA
    assert module.pick_block_splits(1, 1, 10_000, cpu, 64) == 4 * module.PROGRAMS_PER_SM
    assert module.pick_block_splits(1, 1, 100, cpu, 64) == 2  # no more splits than 64-key chunks
    assert module.pick_block_splits(8, 4, 10_000, cpu, 64) == 1
    assert module.pick_block_splits(0, 4, 0, cpu, 64) == 1
