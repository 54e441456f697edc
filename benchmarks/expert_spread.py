"""How many distinct routed experts a forward touches, by its number of rows (`decode_batch.py
--count-experts`).

A batch-1 decode step routes one token to top-k experts; a speculative verify of K + 1 rows routes
K + 1 tokens, and what it reads is the union of their experts. This counts that union per MoE
layer and forward, grouped by the forward's row count, so a round's expert bytes can be read off
(distinct experts x bytes per expert) instead of assumed from uniform routing.

Forward hooks on the routers run only in eager forwards (a replayed CUDA graph skips Python), so
the run must pass --disable-cuda-graph. Each hook reads the ids back (a host sync): a diagnostic,
not a timing run.
"""

from __future__ import annotations

from collections import defaultdict

import torch


class ExpertSpread:
    """Forward hooks on every router (a module with `moe_index`) that count the distinct routed
    expert ids of each forward, grouped by the forward's row count."""

    def __init__(self, model: torch.nn.Module):
        self.counts: dict[int, list[int]] = defaultdict(list)  # rows -> distinct ids per (layer, forward)
        self.num_experts = None
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules() if hasattr(m, "moe_index")]
        if not self.handles:
            raise ValueError("--count-experts: the model has no MoE routers")

    def _hook(self, module, inputs, out) -> None:
        ids = out[0]
        self.num_experts = self.num_experts or getattr(module, "num_experts", None)
        self.counts[ids.shape[0]].append(int(torch.unique(ids).numel()))

    def report(self, max_rows: int = 64) -> str:
        """One line per row count up to `max_rows` (prefill chunks are left out)."""
        lines = []
        for rows in sorted(r for r in self.counts if r <= max_rows):
            c = self.counts[rows]
            lines.append(f"  forwards of {rows} rows: {sum(c) / len(c):.2f} distinct routed experts per MoE layer "
                         f"(of {self.num_experts}; min {min(c)}, max {max(c)}; {len(c)} layer-forwards)")
        return "\n".join(lines)
