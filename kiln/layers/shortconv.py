"""`ShortConv`: a causal depthwise convolution over tokens with the residual inside (MODELS.md 2.1).

The layer owns only the weight; `batch.backend.short_conv(conv, x, batch)` runs it, because the
backend knows where each sequence's previous K-1 inputs live (the engine's per-site state, or
nothing for packed training sequences). `conv_id` numbers every ShortConv site of a model so the
engine can keep one state slot per site (Inkling: layer l has sites 4l .. 4l+3).
"""

from __future__ import annotations

import torch
from torch import nn


class ShortConv(nn.Module):
    """weight [C, K] (the depthwise conv1d weight [C, 1, K] squeezed); w[:, K-1] is the current
    token's tap. `row_start` is where this rank's channels begin in the on-disk weight (tensor
    parallelism shards the K/V convs by KV head)."""

    def __init__(self, conv_id: int, channels: int, kernel_size: int, row_start: int = 0):
        super().__init__()
        self.conv_id = conv_id
        self.channels = channels
        self.kernel_size = kernel_size
        self.row_start = row_start
        self.weight = nn.Parameter(torch.empty(channels, kernel_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.dim() == 3:  # a conv1d checkpoint layout [C, 1, K]
            loaded = loaded.squeeze(1)
        param.data.copy_(loaded[self.row_start:self.row_start + self.channels])

    def forward(self, x: torch.Tensor, batch) -> torch.Tensor:
        """x [T, C] -> [T, C]."""
        return batch.backend.short_conv(self, x, batch)

    def extra_repr(self) -> str:
        return f"conv_id={self.conv_id}, channels={self.channels}, kernel_size={self.kernel_size}"
