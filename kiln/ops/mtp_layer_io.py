"""What an MTP chain pass does around each layer's projection and block: the reference of
`kiln.kernels.mtp_layer_io` (one launch each side).

Around layer k's `eh_proj` and decoder block (`kiln.models.mtp.MTPLayer.project`) the pass of
`kiln.engine.spec.mtp_graph` gathers and joins its inputs, and stores and picks its outputs. As
PyTorch ops that is ~11 launches of 1-4 us each per layer, each waiting for the one before:
~0.06 ms of a K = 3 round at batch 1 on an H100 (forty-fifth session).

- `layer_inputs`: row r's token (layer k - 1's draft token in its request's draft row, else the
  row's own), its embedding and h^{k-1} (layer k - 1's draft hidden state in the draft row, else
  the conv site's row), both normed: x = [enorm(Emb(t)) ; hnorm(h)], as `MTPLayer.forward` joins
  them.
- `layer_outputs`: h^k = residual + f (in the model's dtype, as `MTPLayer.forward` adds), stored
  into the next layer's conv site at each row's slot, and per request the draft row's h^k and
  final_norm(h^k), which the draft head reads.
"""

from __future__ import annotations

from typing import Optional

import torch

from kiln.layers.norm import rms_norm


def layer_inputs(embed: torch.Tensor, ids: torch.Tensor, site: torch.Tensor, hid: torch.Tensor,
                 enorm_w: torch.Tensor, hnorm_w: torch.Tensor, eps: float,
                 draft_row: Optional[torch.Tensor] = None, prev_tok: Optional[torch.Tensor] = None,
                 prev_h: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer k's inputs for T = bs * R rows -> (x [T, 2H] in embed's dtype, the rows' tokens [T]).

    embed [V, H] (the whole vocabulary's embedding), ids [T] and hid [T] (each row's token and the
    conv slot of its h^{k-1} in `site` [slots, H]). For k >= 2 of a drafting pass, draft_row
    [bs, R] (bool: each request's draft row), prev_tok [bs] and prev_h [bs, H] (layer k - 1's
    draft token and hidden state) override that row's token and h^{k-1}."""
    h = site[hid]
    if draft_row is not None:
        bs, R = draft_row.shape
        ids = torch.where(draft_row, prev_tok.to(ids.dtype)[:, None], ids.view(bs, R)).view(-1)
        h = torch.where(draft_row.view(-1, 1), prev_h.to(h.dtype).repeat_interleave(R, 0), h)
    emb = embed[ids]
    x = torch.cat([rms_norm(emb, enorm_w, eps), rms_norm(h.to(emb.dtype), hnorm_w, eps)], dim=-1)
    return x, ids


def layer_outputs(f: torch.Tensor, residual: torch.Tensor, site: Optional[torch.Tensor],
                  keep: torch.Tensor, draft_out: Optional[torch.Tensor], final_w: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Layer k's outputs for T rows -> (h^k [T, H], the draft rows' h^k [bs, H], their
    final_norm [bs, H]).

    h^k = residual + f goes into `site` [slots, H] (layer k + 1's h^{k-1}; None for the last layer)
    at row r's slot keep[r] (padding rows: the scratch slot 0). draft_out [bs]: each request's row
    whose h^k makes its draft (None: a pass that drafts nothing, and the last two results are
    None)."""
    h = residual + f
    if site is not None:
        site[keep] = h.to(site.dtype)
    if draft_out is None:
        return h, None, None
    draft_h = h.index_select(0, draft_out)
    return h, draft_h, rms_norm(draft_h, final_w, eps)
