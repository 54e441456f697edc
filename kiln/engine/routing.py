"""`RoutingCapture`: the routed expert ids of every token, kept per KV slot (RL routing replay).

MoE layers record the ids they used in `batch.extras["routed_experts"][moe_index]` ([T, k]).
After each forward the runner copies them to a host buffer indexed by the tokens' main-space
slots (SGLang's design), so the ids survive chunked prefill, decode, prefix-cache hits (the slot
still holds the cached token) and retraction (recomputed rows are rewritten). A finished request
reads its rows back through its request-to-token row.
"""

from __future__ import annotations

import numpy as np
import torch


class RoutingCapture:
    def __init__(self, num_slots: int, num_moe_layers: int, top_k: int):
        self.num_moe_layers = num_moe_layers
        self.top_k = top_k
        self.buffer = torch.full((num_slots, num_moe_layers, top_k), -1, dtype=torch.int32)

    def record(self, routed: dict, out_cache_loc: torch.Tensor) -> None:
        if not routed:
            return
        ids = torch.stack([routed[i] for i in range(self.num_moe_layers)], dim=1)  # [T, L, k]
        self.buffer[out_cache_loc.cpu()] = ids.to("cpu", torch.int32)

    def gather(self, req_to_token_row: torch.Tensor, num_tokens: int) -> np.ndarray:
        """int32 [num_tokens, num_moe_layers, top_k] for positions 0..num_tokens-1."""
        slots = req_to_token_row[:num_tokens].cpu()
        return self.buffer[slots].numpy().copy()


def moe_shape(model: torch.nn.Module) -> tuple[int, int]:
    """(number of MoE layers, experts per token) of a model; (0, 0) for dense models."""
    gates = [m for m in model.modules() if hasattr(m, "moe_index") and hasattr(m, "top_k")]
    if not gates:
        return 0, 0
    return max(g.moe_index for g in gates) + 1, gates[0].top_k
