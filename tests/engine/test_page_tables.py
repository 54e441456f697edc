"""`write_pages` (and `write_pages_batched`): the page-table rows the scheduler writes as requests grow, against the obvious
per-position loop (runs split by skipped window pages, pages clipped at the table's width)."""

from __future__ import annotations

import random

import pytest
import torch

from kiln.engine.cache.pools import position_slots, write_pages, write_pages_batched


def reference(table: torch.Tensor, slot: int, first: int, pages: list, ps: int) -> None:
    for i, p in enumerate(pages):
        for j in range(ps):
            pos = (first + i) * ps + j
            if p is not None and pos < table.shape[1]:
                table[slot, pos] = p * ps + j


@pytest.mark.parametrize("seed", range(6))
def test_write_pages_equals_the_position_loop(seed):
    rng = random.Random(seed)
    ps = rng.choice([1, 4, 16])
    width = rng.randint(ps, 12 * ps)  # not always a whole number of pages
    got = torch.full((3, width), -1, dtype=torch.int64)
    want = got.clone()
    for _ in range(8):
        slot, first = rng.randint(0, 2), rng.randint(0, width // ps + 1)
        pages = [None if rng.random() < 0.3 else rng.randint(0, 50) for _ in range(rng.randint(0, 5))]
        write_pages(got, slot, first, pages, ps)
        reference(want, slot, first, pages, ps)
        assert torch.equal(got, want), (ps, width, slot, first, pages)


def test_write_pages_leaves_skipped_pages_alone():
    t = torch.full((1, 16), -1, dtype=torch.int64)
    write_pages(t, 0, 0, [None, 3, None, 1], 4)
    assert t[0].tolist() == [-1] * 4 + [12, 13, 14, 15] + [-1] * 4 + [4, 5, 6, 7]


@pytest.mark.gpu
def test_write_pages_on_cuda_equals_the_position_loop():
    # the pinned, non-blocking copies land before anything later on the stream reads the table
    rng = random.Random(7)
    got = torch.full((4, 300), -1, dtype=torch.int64, device="cuda")
    want = torch.full((4, 300), -1, dtype=torch.int64)
    for _ in range(50):
        slot, first = rng.randint(0, 3), rng.randint(0, 20)
        pages = [None if rng.random() < 0.2 else rng.randint(0, 500) for _ in range(rng.randint(1, 6))]
        write_pages(got, slot, first, pages, 16)
        reference(want, slot, first, pages, 16)
    assert torch.equal(got.cpu(), want)


def _disjoint_writes(rng, tables, ps):
    """Writes to distinct (table, slot) rows, as the scheduler batches them (one per request)."""
    writes = []
    for table in tables:
        for slot in rng.sample(range(table.shape[0]), k=table.shape[0] - 1):
            first = rng.randint(0, table.shape[1] // ps + 1)
            writes.append((table, slot, first, [None if rng.random() < 0.3 else rng.randint(0, 50)
                                                for _ in range(rng.randint(0, 4))]))
    rng.shuffle(writes)
    return writes


@pytest.mark.parametrize("seed", range(6))
def test_write_pages_batched_equals_one_write_pages_each(seed):
    rng = random.Random(seed)
    ps = rng.choice([1, 4, 16])
    tables = [torch.full((5, rng.randint(ps, 12 * ps)), -1, dtype=torch.int64) for _ in range(2)]
    want = [t.clone() for t in tables]
    writes = _disjoint_writes(rng, tables, ps)
    write_pages_batched(writes, ps)
    for table, slot, first, pages in writes:
        write_pages(want[[id(t) for t in tables].index(id(table))], slot, first, pages, ps)
    for got, ref in zip(tables, want):
        assert torch.equal(got, ref)
    write_pages_batched([], ps)  # nothing to write: no copy


@pytest.mark.gpu
def test_write_pages_batched_on_cuda_equals_one_write_pages_each():
    rng = random.Random(3)
    tables = [torch.full((6, 300), -1, dtype=torch.int64, device="cuda") for _ in range(2)]
    want = [t.clone() for t in tables]
    writes = _disjoint_writes(rng, tables, 16)
    write_pages_batched(writes, 16)
    for table, slot, first, pages in writes:
        write_pages(want[[id(t) for t in tables].index(id(table))], slot, first, pages, 16)
    for got, ref in zip(tables, want):
        assert torch.equal(got.cpu(), ref.cpu())


@pytest.mark.parametrize("seed", range(4))
def test_position_slots_equals_the_position_loop(seed):
    rng = random.Random(seed)
    ps = rng.choice([1, 4, 16])
    pages = [rng.randint(0, 99) for _ in range(8)]
    for _ in range(20):
        start = rng.randint(0, 8 * ps - 1)
        end = rng.randint(start, 8 * ps)
        want = [pages[p // ps] * ps + p % ps for p in range(start, end)]
        assert position_slots(pages, start, end, ps) == want


def test_chain_slots_map_missing_pages_to_the_scratch_slot():
    # the MTP chain graph's per-request tables: positions before 0, past the pages or on a
    # trimmed (None) page read and write the scratch slot 0
    from kiln.engine.spec.mtp_graph import _slots_or_scratch

    rng = random.Random(0)
    for _ in range(500):
        ps = rng.choice([1, 4, 16])
        view = [None if rng.random() < 0.3 else rng.randint(1, 50) for _ in range(rng.randint(0, 6))]
        start = rng.randint(-3, 7 * ps)
        end = rng.randint(start, 8 * ps)
        want = [0 if p < 0 or p // ps >= len(view) or view[p // ps] is None else view[p // ps] * ps + p % ps
                for p in range(start, end)]
        assert _slots_or_scratch(view, start, end, ps) == want


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.bool])
def test_host_tensor_equals_torch_tensor(dtype):
    from kiln.engine.batch import host_tensor

    rng = random.Random(0)
    cases = [[], [rng.randint(-2**40, 2**40) if dtype == torch.int64 else rng.randint(-999, 999) for _ in range(37)],
             [[rng.random() * 8, rng.randint(0, 5)] for _ in range(4)], [(1, 2, 3), (4, 5, 6)],
             [[1, 2], [3]] if dtype == torch.bool else [[]], [True, False, 3], [1.5, -2.25] if dtype.is_floating_point else [7]]
    for data in cases:
        try:
            want = torch.tensor(data, dtype=dtype)
        except (ValueError, TypeError):
            continue  # ragged: torch.tensor refuses it, and so does host_tensor
        got = host_tensor(data, dtype, "cpu")
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), data
    with pytest.raises((ValueError, TypeError)):
        host_tensor([[1, 2], [3]], dtype, "cpu")  # ragged rows go to torch.tensor, which refuses them
