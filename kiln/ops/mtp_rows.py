"""The rows of an MTP chain pass from its per-request tables: the reference of
`kiln.kernels.mtp_rows` (one launch; as the ~45 small PyTorch ops below it was a tenth of the
chain graph's time at batch 1, forty-fourth session). `kiln.engine.spec.mtp_graph` says what the
rows are."""

from __future__ import annotations

import torch


def chain_rows(count: torch.Tensor, first: torch.Tensor, tokens: torch.Tensor, conv_slots: torch.Tensor,
               swa_slots: torch.Tensor, req_slots: torch.Tensor, num_layers: int, rows: int,
               drafts: bool) -> dict[str, torch.Tensor]:
    """Every row's inputs for `bs` requests (the tables' first dimension; c = count[b] catch-up
    rows from F = first[b]) and K = `num_layers` layers of R = `rows` rows per request: flattened
    [bs * R] per row, [K, ...] per layer. Row i of request b is a catch-up row (stored position
    F + i) when i < c, layer k >= 2's draft row (index F + c - 2, stored F + c - 2 + k) when i == c
    and `drafts`, else padding. tokens [bs, >= R], conv_slots [bs, C + 1] (positions F - 1 ..
    F + C - 1; C = R - 1 with drafts, else R), swa_slots [bs, >= R] (positions F ..), req_slots [bs].

    Returns ids, hid (the conv slot of h^{k-1} at p - 1), keep (of h^k at p), token_slots; pos and
    swa [K, bs * R]; ext [K, bs] (each request's rows in attention); with `drafts` also draft_out
    [K, bs] (the row whose output is layer k's draft), draft_in [bs] (the row layer k + 1's draft
    goes in) and draft_row [bs, R] (draft_in as a mask)."""
    bs, dev = count.shape[0], count.device
    K, R = num_layers, rows
    C = R - 1 if drafts else R
    c, first = count[:, None], first[:, None]  # [bs, 1]
    i = torch.arange(R, device=dev)[None, :]  # [1, R]
    layer = torch.arange(1, K + 1, device=dev)
    k, k_col = layer[:, None, None], layer[:, None]  # [K, 1, 1], [K, 1]
    live = c > 0
    catch = i < c  # [bs, R]
    zero = torch.zeros_like(catch, dtype=torch.int64)
    hid = torch.where(catch, conv_slots[:, :R], zero)  # h^{k-1} at p - 1 (conv column i = position F - 1 + i)
    # h^k at p
    keep = torch.where(catch, conv_slots[:, 1:].gather(1, i.clamp(max=C - 1).expand(bs, R)), zero)
    out = {
        "ids": torch.where(catch, tokens[:, :R], zero).reshape(-1),
        "hid": hid.reshape(-1), "keep": keep.reshape(-1),
        # contiguous: a kernel indexes it with stride 1 (at bs 1 the expand would stay a stride-0 view)
        "token_slots": (req_slots[:, None] * live).expand(bs, R).contiguous().view(-1),
    }
    swa_catch = torch.where(catch, swa_slots[:, :R], zero)
    if not drafts:  # the late catch-up graph: catch-up rows and padding only
        out.update(pos=torch.where(catch, first + i - k, 0).reshape(K, -1),
                   swa=swa_catch.expand(K, bs, R).reshape(K, -1),
                   ext=torch.where(live.t(), c.t(), 0).expand(K, bs).contiguous())
        return out
    draft = (i == c) & live & (k >= 2)  # [K, bs, R]
    pos = torch.where(catch, first + i - k, torch.where(draft, first + c - 2, 0))
    swa_draft = swa_slots.gather(1, (c - 2 + layer[None, :]).clamp(min=0)).t()  # [K, bs]
    swa = torch.where(catch, swa_catch, torch.where(draft, swa_draft[:, :, None], 0))
    base = torch.arange(bs, device=dev)[:, None] * R
    draft_in = torch.where(live, c, R - 1)  # [bs, 1]; padding requests: their last row
    out.update(pos=pos.reshape(K, -1), swa=swa.reshape(K, -1),
               ext=torch.where(live.t(), c.t() + (k_col >= 2), 0),  # [K, bs]
               draft_out=base.t() + torch.where(live, c, 1).t() - (k_col == 1).long(),  # [K, bs]; padding: own block
               draft_in=(base + draft_in).reshape(bs), draft_row=i == draft_in)
    return out
