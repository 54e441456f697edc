"""Triton paged attention: `decode_attention` (one query per sequence, flash-decoding, CUDA-graph
safe) and `extend_attention` (flash attention for prefill / extend), the fast paths of
`kiln.ops.attention.paged_decode_attention` and `kiln.ops.attention.paged_attention`."""

from kiln.kernels.decode_attention import decode_attention
from kiln.kernels.extend_attention import extend_attention

__all__ = ["decode_attention", "extend_attention"]
