"""`RoutingCapture`: the routed expert ids of every token, kept per KV slot (RL routing replay).

MoE layers record the ids they used in `batch.extras["routed_experts"][moe_index]` ([T, k]).
After each forward the runner copies them to a host buffer indexed by the tokens' main-space
slots (SGLang's design), so the ids survive chunked prefill, decode, prefix-cache hits (the slot
still holds the cached token) and retraction (recomputed rows are rewritten). A finished request
reads its rows back through the slots of its pages.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from kiln.engine.cache.pools import position_slots


class RoutingCapture:
    """Host buffer [slots, MoE layers, k] of the expert ids each KV slot's token was routed to.

    On CUDA a forward's ids reach the host by an asynchronous copy into pinned memory, applied to
    the buffer once it has landed: a blocking copy after every forward made each decode step wait
    for the device, which undid overlap scheduling whenever routing was captured (RL rollouts of
    MoE models). `gather` waits only for copies that write the slots it reads.
    """

    def __init__(self, num_pages: int, page_size: int, num_moe_layers: int, top_k: int):
        self.page_size = page_size
        self.num_moe_layers = num_moe_layers
        self.top_k = top_k
        self.buffer = torch.full((num_pages * page_size, num_moe_layers, top_k), -1, dtype=torch.int32)
        self._in_flight: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]] = []  # (ids, slots, copied)

    def record(self, routed: dict, out_cache_loc: torch.Tensor, slots: Optional[list] = None) -> None:
        """Store a forward's ids under its tokens' slots (`slots`: the same as `out_cache_loc`, from
        the host, so that no device value is read here)."""
        if not routed:
            return
        ids = torch.stack([routed[i] for i in range(self.num_moe_layers)], dim=1).to(torch.int32)  # [T, L, k]
        slots_t = torch.tensor(slots, dtype=torch.long) if slots is not None else out_cache_loc.cpu()
        if not ids.is_cuda:
            self.buffer[slots_t] = ids
            return
        host_ids = torch.empty(ids.shape, dtype=torch.int32, pin_memory=True)
        host_ids.copy_(ids, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._in_flight.append((host_ids, slots_t, copied))
        self._apply(wait_for=None)

    def _apply(self, wait_for: Optional[torch.Tensor]) -> None:
        """Write the copies that have landed into the buffer, in forward order (a later forward's
        ids win a reused slot); wait for a pending one only if it writes one of `wait_for`'s slots
        (or a later one does)."""
        while self._in_flight:
            host_ids, slots, copied = self._in_flight[0]
            if not copied.query():
                if wait_for is None or not any(bool(torch.isin(s, wait_for).any()) for _, s, _ in self._in_flight):
                    return
                copied.synchronize()
            self.buffer[slots] = host_ids
            self._in_flight.pop(0)

    def gather(self, slots: list[int]) -> np.ndarray:
        """int32 [len(slots), num_moe_layers, top_k]: the ids filed under these slots."""
        slots_t = torch.as_tensor(slots, dtype=torch.long)
        self._apply(wait_for=slots_t)
        return self.buffer[slots_t].numpy().copy()

    def of_request(self, pages: list[int], num_tokens: int) -> np.ndarray:
        """The ids of a request's positions 0..num_tokens-1, through the host copy of its pages
        (reading its device page-table row would wait for the GPU)."""
        return self.gather(position_slots(pages, 0, num_tokens, self.page_size))


def moe_shape(model: torch.nn.Module) -> tuple[int, int]:
    """(number of MoE layers, experts per token) of a model; (0, 0) for dense models."""
    gates = [m for m in model.modules() if hasattr(m, "moe_index") and hasattr(m, "top_k")]
    if not gates:
        return 0, 0
    return max(g.moe_index for g in gates) + 1, gates[0].top_k
