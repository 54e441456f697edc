"""A verify forward's static inputs moved on by each request's accepted count: the reference of
`kiln.kernels.verify_moves` (which does it in one launch; see there for where it runs)."""

from __future__ import annotations

import torch


def move_verify_inputs(shift: torch.Tensor, last: torch.Tensor, last_at_shift: bool, drafts: torch.Tensor,
                       positions: torch.Tensor, prefix_lens: torch.Tensor, seq_lens: torch.Tensor,
                       req_slots: torch.Tensor, input_ids: torch.Tensor,
                       slot_maps: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """In place, for n requests of q rows: positions [n, q], prefix_lens and seq_lens [n] += shift
    [n]; out[b, j] = table[req_slots[b], positions[b, j]] for each (table, out [n, q]) of
    `slot_maps`; input_ids[b] = [its last committed token, drafts[b] ([n, q - 1])], the token
    being last[b, shift[b] - 1] if `last_at_shift` (a device round: the verify's samples and
    acceptance counts), else last[b, 0] (the host's [token, drafts] rows)."""
    positions.add_(shift[:, None])
    prefix_lens.add_(shift)
    seq_lens.add_(shift)
    rows = req_slots[:, None]
    for table, out in slot_maps:
        out.copy_(table[rows, positions])
    first = last.gather(1, (shift - 1)[:, None]) if last_at_shift else last[:, :1]
    input_ids[:, :1].copy_(first)
    input_ids[:, 1:].copy_(drafts)
