"""Device memory the engine owns: the request-to-token table and the per-token state pools."""

from __future__ import annotations

import torch

from kiln.engine.batch import host_tensor
from kiln.engine.cache.components import ComponentKind, StateSpec


class ReqToTokenPool:
    """`table[slot, pos]` = token slot holding position `pos` of the request in row `slot`.

    Row 0 is reserved for padding (CUDA graphs); rows 1..max_reqs are handed to requests.
    """

    def __init__(self, max_reqs: int, max_context: int, device: torch.device | str):
        self.max_reqs = max_reqs
        self.max_context = max_context
        self.table = torch.zeros(max_reqs + 1, max_context, dtype=torch.int64, device=device)
        self._free = list(range(max_reqs, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        assert 0 < slot <= self.max_reqs and slot not in self._free, f"bad request slot {slot}"
        self._free.append(slot)

    def write_pages(self, slot: int, first_page_index: int, pages: list, page_size: int) -> None:
        write_pages(self.table, slot, first_page_index, pages, page_size)


def write_pages(table: torch.Tensor, slot: int, first_page_index: int, pages: list, page_size: int) -> None:
    """Point positions of pages [first_page_index, first_page_index + len(pages)) of the request
    in row `slot` at the given pool pages (None entries are skipped).

    The scheduler calls this between queued steps, on the host's critical path of a speculative
    round, so the entries are built in Python and land with one host-to-device copy per run of
    consecutive pages (one run unless a window space skipped pages): a few CUDA calls instead of
    the two dozen small ops that building them as tensors takes."""
    runs: list[tuple[int, list[int]]] = []  # (first position, slot values)
    for pos, first_slot, n in _page_spans(first_page_index, pages, page_size, table.shape[1]):
        if runs and runs[-1][0] + len(runs[-1][1]) == pos:
            runs[-1][1].extend(range(first_slot, first_slot + n))
        else:
            runs.append((pos, list(range(first_slot, first_slot + n))))
    for start, vals in runs:
        table[slot, start:start + len(vals)].copy_(host_tensor(vals, torch.int64, table.device), non_blocking=True)


def write_pages_batched(writes: list[tuple[torch.Tensor, int, int, list]], page_size: int) -> None:
    """Apply `write_pages(table, slot, first_page_index, pages, page_size)` for every entry of
    `writes` with one host-to-device copy and one scatter per table.

    A decode step grows a page for every request that crosses a page boundary (1 in 16 of the
    running requests at 16-token pages: 32 at batch 512), and one small pinned copy each took
    ~10 us of host time on an H200 host. The entries must write disjoint positions (the scatter
    applies duplicates in no defined order): the scheduler batches only the growth of distinct
    requests, at positions beyond what each one held."""
    by_table: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
    for table, slot, first_page_index, pages in writes:
        entry = by_table.get(id(table))
        if entry is None:
            entry = by_table[id(table)] = (table, [], [])
        _, idx, vals = entry
        width = table.shape[1]
        for pos, first_slot, n in _page_spans(first_page_index, pages, page_size, width):
            idx.extend(range(slot * width + pos, slot * width + pos + n))
            vals.extend(range(first_slot, first_slot + n))
    for table, idx, vals in by_table.values():
        if idx:
            both = host_tensor(idx + vals, torch.int64, table.device).to(table.device, non_blocking=True)
            table.view(-1).index_copy_(0, both[:len(idx)], both[len(idx):])


def _page_spans(first_page_index: int, pages: list, page_size: int, width: int):
    """(position, first token slot, length) of each page of `pages` (page i at logical index
    first_page_index + i) inside a table row of `width` positions; None pages are skipped and the
    last page is clipped at the row's end."""
    for i, p in enumerate(pages):
        pos = (first_page_index + i) * page_size
        if p is not None and pos < width:
            yield pos, p * page_size, min(page_size, width - pos)


def position_slots(pages: list, start: int, end: int, page_size: int) -> list[int]:
    """The token slots of positions [start, end) of a request whose page i is `pages[i]` (the host
    copy of its page-table row): one range per page instead of a division per position (the
    scheduler builds these for every row of every step)."""
    out: list[int] = []
    pos = start
    while pos < end:
        i, off = divmod(pos, page_size)
        n = min(page_size - off, end - pos)
        base = pages[i] * page_size + off
        out.extend(range(base, base + n))
        pos += n
    return out


class KVPool:
    """K and V buffers for one FULL_KV (or SWA_KV, DRAFT_KV) component: per layer [num_slots, Hkv, D]."""

    def __init__(self, spec: StateSpec, num_slots: int, dtype: torch.dtype, device):
        assert spec.kind in (ComponentKind.FULL_KV, ComponentKind.SWA_KV, ComponentKind.DRAFT_KV)
        self.spec = spec
        self.num_slots = num_slots
        self.layer_index = {layer: i for i, layer in enumerate(spec.layer_ids)}
        shape = (num_slots,) + tuple(spec.shape)
        dt = spec.dtype or dtype
        self.k = [torch.zeros(shape, dtype=dt, device=device) for _ in spec.layer_ids]
        self.v = [torch.zeros(shape, dtype=dt, device=device) for _ in spec.layer_ids]

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.layer_index[layer_id]
        return self.k[i], self.v[i]

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer indexed by token slot (what HiCache copies page by page)."""
        return self.k + self.v

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class TokenStatePool:
    """One tensor per layer (or ShortConv site) of per-token state: [num_slots, *spec.shape].
    Used for MSA indexer keys (INDEX_K) and ShortConv inputs (CONV)."""

    def __init__(self, spec: StateSpec, num_slots: int, dtype: torch.dtype, device):
        assert spec.kind in (ComponentKind.INDEX_K, ComponentKind.CONV)
        self.spec = spec
        self.num_slots = num_slots
        dt = spec.dtype or dtype
        self.buffers = {i: torch.zeros((num_slots,) + tuple(spec.shape), dtype=dt, device=device)
                        for i in spec.layer_ids}

    def layer(self, layer_id: int) -> torch.Tensor:
        return self.buffers[layer_id]

    def tensors(self) -> list[torch.Tensor]:
        return [self.buffers[i] for i in self.spec.layer_ids]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())


class MergedStatePool:
    """Several `TokenStatePool`s of one page space seen as one (e.g. ShortConv sites of two
    channel sizes)."""

    def __init__(self, pools: list[TokenStatePool]):
        self.pools = pools
        self.by_layer = {i: p for p in pools for i in p.buffers}

    def layer(self, layer_id: int) -> torch.Tensor:
        return self.by_layer[layer_id].layer(layer_id)

    def tensors(self) -> list[torch.Tensor]:
        return [t for p in self.pools for t in p.tensors()]

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.pools)
