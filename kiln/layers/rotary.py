"""Rotary position embeddings (rotate-half / NeoX layout, as Hugging Face Llama applies them).

The cos/sin table is computed once in fp32 for every position up to the context length and
indexed by each token's absolute position, so prefill, chunked prefill and decode agree exactly.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from kiln.kernels import kernel_path


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict]) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the attention factor for a rope_scaling dict."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"rope_scaling type {kind!r} is not supported yet (supported: default, linear, llama3)")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, D/2] fp32. Rotate-half layout."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: Optional[dict] = None):
        super().__init__()
        inv_freq, self.attention_factor = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos() * self.attention_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * self.attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, batch=None):
        """q [T, Hq, D], k [T, Hk, D] rotated by each token's position. On the engine's kernel path
        (`batch`, see `kiln.kernels.kernel_path`) one Triton launch does both, bit-identically."""
        if kernel_path(batch, q, k):
            from kiln.kernels.rotary import rope  # needs Triton: imported only on the kernel path

            return rope(positions, q, k, self.cos, self.sin)
        cos, sin = self.cos[positions], self.sin[positions]
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
