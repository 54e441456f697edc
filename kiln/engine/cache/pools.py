"""Device memory the engine owns: the request-to-token table and the per-token state pools."""

from __future__ import annotations

import torch

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

    def write_pages(self, slot: int, first_page_index: int, pages: list[int], page_size: int) -> None:
        """Point positions of pages [first_page_index, first_page_index + len(pages)) of a request
        at the given pool pages."""
        if not pages:
            return
        offs = torch.arange(page_size)
        slots = (torch.tensor(pages).unsqueeze(1) * page_size + offs).flatten()
        start = first_page_index * page_size
        n = min(slots.numel(), self.max_context - start)
        self.table[slot, start:start + n] = slots[:n].to(self.table.device)


class KVPool:
    """K and V buffers for one FULL_KV (or SWA_KV) component: per layer [num_slots, Hkv, D]."""

    def __init__(self, spec: StateSpec, num_slots: int, dtype: torch.dtype, device):
        assert spec.kind in (ComponentKind.FULL_KV, ComponentKind.SWA_KV)
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

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
