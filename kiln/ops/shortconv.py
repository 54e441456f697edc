"""Reference ShortConv ops (MODELS.md 2.1) for packed sequences, with optional carried-in state.

    y_t[c] = x_t[c] + sum_{j=0..K-1} w[c, j] * x_{t-K+1+j}[c]

`w[:, K-1]` multiplies the current token. Taps before a sequence's first token read `prev` (the
last K-1 inputs before this chunk, oldest first) or zeros. Accumulation is fp32, the residual is
added last, and the result is cast once. Prefill, chunked prefill and decode (one token with the
state of the previous K-1 inputs) are all this one function.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def _history_buffer(x: torch.Tensor, seq_lens: Sequence[int], k: int,
                    prev: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleave each sequence's K-1 inputs of history before its tokens:
    buf = [hist_0; x_0; hist_1; x_1; ...] in fp32. Returns (buf, seq index of every token).

    Built with two row copies whatever the number of sequences (a trainer's micro-batch packs
    many: one slice and concatenation per sequence made its launches wait on the host)."""
    c, t, b = x.shape[1], x.shape[0], len(seq_lens)
    lens = torch.tensor(list(seq_lens), device=x.device)
    assert int(lens.sum()) == t, f"seq_lens sum to {int(lens.sum())}, x has {t} rows"
    seq_of_token = torch.repeat_interleave(torch.arange(b, device=x.device), lens)
    # Token i of the batch, in sequence s, sits at row i + (s + 1)(K-1): after s + 1 histories.
    rows = torch.arange(t, device=x.device) + (seq_of_token + 1) * (k - 1)
    buf = x.new_zeros(t + b * (k - 1), c, dtype=torch.float32).index_copy(0, rows, x.float())
    if prev is not None:  # sequence s's history rows start at its first token's start + s(K-1)
        first = torch.cumsum(lens, 0) - lens + torch.arange(b, device=x.device) * (k - 1)
        hist = (first[:, None] + torch.arange(k - 1, device=x.device)[None, :]).reshape(-1)
        buf = buf.index_copy(0, hist, prev.float().reshape(-1, c))
    return buf, seq_of_token


def short_conv(x: torch.Tensor, w: torch.Tensor, seq_lens: Sequence[int],
               prev: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [T, C] (sequences packed along dim 0), w [C, K], prev [B, K-1, C] or None -> y [T, C]."""
    k = w.shape[1]
    buf, seq = _history_buffer(x, seq_lens, k, prev)
    # Token t of sequence b sits at buf row t + (b + 1)(K-1); its tap j reads row t + b(K-1) + j.
    base = torch.arange(x.shape[0], device=x.device) + seq * (k - 1)
    wf = w.float()
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in range(k):
        acc = acc + wf[:, j] * buf[base + j]
    return (acc + x.float()).to(x.dtype)


def short_conv_final_state(x: torch.Tensor, seq_lens: Sequence[int],
                           prev: Optional[torch.Tensor] = None, kernel_size: Optional[int] = None
                           ) -> torch.Tensor:
    """The last K-1 inputs of each sequence, oldest first, reaching back into `prev` (or zeros)
    when a sequence is shorter than K-1: the state the next chunk or decode step needs.

    x [T, C]; prev [B, K-1, C] or None (then pass `kernel_size`). Returns [B, K-1, C] in x's dtype.
    """
    k = prev.shape[1] + 1 if prev is not None else kernel_size
    assert k is not None, "pass prev or kernel_size"
    buf, _ = _history_buffer(x, seq_lens, k, prev)
    # Sequence b's last token sits at buf row end_b + (b + 1)(K-1) - 1, end_b = its exclusive end.
    ends = torch.cumsum(torch.tensor(list(seq_lens), device=x.device), 0)
    last = ends + torch.arange(1, len(seq_lens) + 1, device=x.device) * (k - 1) - 1
    idx = last[:, None] - (k - 2) + torch.arange(k - 1, device=x.device)[None, :]  # [B, K-1]
    return buf[idx].to(x.dtype)
