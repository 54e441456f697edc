"""Inkling's MTP chain on packed training sequences (MODELS.md 2.4), teacher-forced.

Layer k at sequence index i reads the token t_{i+k} and the previous layer's state h^{k-1}_i
(h^0 = the main model's final hidden state, after model.norm) and predicts t_{i+k+1}. Only indices
with a token t_{i+k} exist, so layer k has n - k rows per sequence of length n; rows keep their
index i as position, so the relative bias and the window see the same distances as in serving.
"""

from __future__ import annotations

import torch

from kiln.models.reference import packed_batch


def forward_mtp_reference(model, input_ids: torch.Tensor, seq_lens: list[int],
                          hidden: torch.Tensor) -> list[torch.Tensor]:
    """input_ids [T] and the main model's final hidden states [T, H] of packed sequences.

    Returns one fp32 logits tensor per MTP layer k = 1..N: [sum_b max(n_b - k, 0), V], the rows
    i = 0 .. n_b - 1 - k of each sequence in order; row i predicts t_{i+k+1} (the last row of
    each sequence has no target inside the sequence).
    """
    starts = [sum(seq_lens[:b]) for b in range(len(seq_lens))]
    h_prev, prev_lens = hidden, list(seq_lens)
    out = []
    for k, layer in enumerate(model.mtp, start=1):
        lens = [max(n - k, 0) for n in seq_lens]
        dev = input_ids.device
        # Rows i < n - k of the previous layer (which has n - k + 1 rows per sequence) ...
        prev_starts = [sum(prev_lens[:b]) for b in range(len(prev_lens))]
        keep = torch.cat([torch.arange(s, s + n, device=dev) for s, n in zip(prev_starts, lens)])
        # ... and the tokens t_{i+k} at those rows.
        toks = torch.cat([input_ids[s + k:s + k + n] for s, n in zip(starts, lens)])
        batch = packed_batch(toks, lens)
        h_k = layer(model.model.embed_tokens(toks), h_prev[keep], batch)
        out.append(model.lm_head.compute_logits(layer.final_norm(h_k)).float())
        h_prev, prev_lens = h_k, lens
    return out
