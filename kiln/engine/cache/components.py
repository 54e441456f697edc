"""State components: what per-token or per-request state a model asks the engine to keep.

A model declares a list of `StateSpec`s (`model.state_specs()`); the engine sizes one pool per
spec and the prefix cache carries one entry per component on every tree node. Pools, the prefix
cache, retraction and (later) HiCache and speculative rollback only ever look at these specs,
never at the model type.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ComponentKind(enum.Enum):
    FULL_KV = "full_kv"  # K and V of every token (full-attention layers)
    SWA_KV = "swa_kv"  # K and V of the last W tokens (sliding-window layers)
    # Per-token vectors a later token reads within a short window: ShortConv inputs (the last K-1
    # tokens per site) and, with speculative decoding, the MTP chain's hidden states (window 1).
    CONV = "conv"
    INDEX_K = "index_k"  # MSA indexer keys of every token
    # With a block drafter (speculative decoding, dflash/dspark): each drafter layer's K and V of
    # the context feature of every token, in the main page space like FULL_KV.
    DRAFT_KV = "draft_kv"


@dataclass(frozen=True)
class StateSpec:
    """One component: its kind, the layers that own it, and the per-token shape per layer
    (for KV: (num_kv_heads, head_dim), stored once for K and once for V).

    For CONV, `layer_ids` are ShortConv site ids (`ShortConv.conv_id`), `shape` is (channels,)
    and one spec groups the sites of one channel size. `window` is how many of the latest tokens'
    entries a request still needs (SWA_KV: W; CONV: K-1); None means every token (FULL_KV).
    """

    kind: ComponentKind
    layer_ids: list[int]
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None  # None: the model's dtype
    window: int | None = None

    def bytes_per_token(self, default_dtype: torch.dtype) -> int:
        """Bytes one token's entry takes across all of this component's layers (or sites)."""
        n = 1
        for s in self.shape:
            n *= s
        per_layer = n * (2 if self.kind in (ComponentKind.FULL_KV, ComponentKind.SWA_KV, ComponentKind.DRAFT_KV) else 1)
        return per_layer * len(self.layer_ids) * (self.dtype or default_dtype).itemsize

    def bytes_per_request(self, default_dtype: torch.dtype) -> int | None:
        """Bytes a request's windowed state takes when kept per request (e.g. a ShortConv state
        slot of K-1 inputs per site); None for components without a window."""
        return None if self.window is None else self.window * self.bytes_per_token(default_dtype)
