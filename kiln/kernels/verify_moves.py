"""A verify forward's static inputs moved on by each request's accepted count, in one launch.

A verify queued ahead (`kiln.engine.spec.verify_ahead`) replays the last verify's CUDA graph with
every request b moved on by shift[b] tokens: its positions, prefix and sequence lengths advance
by shift[b], its write slots are looked up in the page tables at the new positions (the main
space and every window space), and its rows read [its last committed token, its drafts]. As
PyTorch ops that is ~13 small launches (adds, table gathers and copies, the token gather and
concatenation) queued on the GPU right before the verify: an H200 measured MTP K = 3 rounds at
batch 1 2.79 ms with the verify queued ahead that way against 2.64 without. `_move_kernel` does it
all in one program per request, and the same rounds took 2.64 ms queued ahead, and 4-16% less than
without at batch 8 and 32 (docs/benchmarks.md, thirty-third pass).

The last committed token is last[b, shift[b] - 1] when `last_at_shift` (a device round: `last`
is the verify's samples [n, K + 1], shift its acceptance counts), else last[b, 0] (prompt lookup:
the host sent [last token, drafts] rows).

Reference: `kiln.ops.verify_moves.move_verify_inputs`; `tests/kernels/test_verify_moves.py`
compares them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.launch import pdl_launch, wait_for_previous

MAX_SLOT_MAPS = 4  # the main page space and up to three window spaces (Inkling: sliding window, conv)


# The strides and q vary with the batch and the draft length (a stride of 1 at batch 1): each
# specialisation Triton would key on them is one more compile, first met while serving.
@triton.jit(do_not_specialize=["stride_last", "stride_drafts", "q"])
def _move_kernel(shift_ptr, last_ptr, stride_last, drafts_ptr, stride_drafts, pos_ptr, prefix_ptr, seq_ptr,
                 slots_ptr, ids_ptr, t0, s0, o0, t1, s1, o1, t2, s2, o2, t3, s3, o3, q,
                 N_MAPS: tl.constexpr, LAST_AT_SHIFT: tl.constexpr, BLOCK_Q: tl.constexpr, PDL: tl.constexpr):
    """Program b: request b's q rows (module docstring). (t_i, s_i, o_i): slot map i's table, its
    row stride and its output."""
    wait_for_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_Q)
    ok = j < q
    s = tl.load(shift_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b * q + j, mask=ok, other=0) + s
    tl.store(pos_ptr + b * q + j, pos, mask=ok)
    tl.store(prefix_ptr + b, tl.load(prefix_ptr + b) + s)
    tl.store(seq_ptr + b, tl.load(seq_ptr + b) + s)
    row = tl.load(slots_ptr + b).to(tl.int64)
    tl.store(o0 + b * q + j, tl.load(t0 + row * s0 + pos, mask=ok), mask=ok)
    if N_MAPS > 1:
        tl.store(o1 + b * q + j, tl.load(t1 + row * s1 + pos, mask=ok), mask=ok)
    if N_MAPS > 2:
        tl.store(o2 + b * q + j, tl.load(t2 + row * s2 + pos, mask=ok), mask=ok)
    if N_MAPS > 3:
        tl.store(o3 + b * q + j, tl.load(t3 + row * s3 + pos, mask=ok), mask=ok)
    if LAST_AT_SHIFT:
        first = tl.load(last_ptr + b * stride_last + s - 1)
    else:
        first = tl.load(last_ptr + b * stride_last)
    d = tl.load(drafts_ptr + b * stride_drafts + j - 1, mask=ok & (j > 0), other=0)
    tl.store(ids_ptr + b * q + j, tl.where(j == 0, first, d).to(tl.int64), mask=ok)


def move_verify_inputs(shift: torch.Tensor, last: torch.Tensor, last_at_shift: bool, drafts: torch.Tensor,
                       positions: torch.Tensor, prefix_lens: torch.Tensor, seq_lens: torch.Tensor,
                       req_slots: torch.Tensor, input_ids: torch.Tensor,
                       slot_maps: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """`kiln.ops.verify_moves.move_verify_inputs` in one launch. The per-token buffers (positions,
    input_ids, every map's output) are contiguous [n, q] int64 views, as the graph runner's static
    buffers; `last` and `drafts` may be strided by row."""
    n, q = positions.shape
    assert 1 <= len(slot_maps) <= MAX_SLOT_MAPS, len(slot_maps)
    assert tuple(drafts.shape) == (n, q - 1) and last.shape[0] == n, (drafts.shape, last.shape, n, q)
    for t in (positions, input_ids, *(o for _, o in slot_maps)):
        assert t.is_contiguous() and tuple(t.shape) == (n, q) and t.dtype == torch.int64, (t.shape, t.dtype)
    for t in (shift, prefix_lens, seq_lens, req_slots):
        assert t.is_contiguous() and tuple(t.shape) == (n,), (t.shape, t.stride())
    for t in (prefix_lens, seq_lens, *(tab for tab, _ in slot_maps)):
        assert t.dtype == torch.int64, t.dtype
    assert all(tab.stride(1) == 1 for tab, _ in slot_maps), [tab.stride() for tab, _ in slot_maps]
    # a column of one has any stride (torch calls a [n, 1] transpose contiguous: MTP's drafts at K = 1)
    assert all(t.shape[1] <= 1 or t.stride(1) == 1 for t in (last, drafts)), (last.stride(), drafts.stride())
    if n == 0:
        return
    maps = [(tab, tab.stride(0), out) for tab, out in slot_maps]
    maps += [maps[0]] * (MAX_SLOT_MAPS - len(maps))  # unused (N_MAPS): any valid pointers
    _move_kernel[(n,)](shift, last, last.stride(0), drafts, drafts.stride(0), positions, prefix_lens, seq_lens,
                       req_slots, input_ids, *[x for m in maps for x in m], q, N_MAPS=len(slot_maps),
                       LAST_AT_SHIFT=last_at_shift, BLOCK_Q=triton.next_power_of_2(q), **pdl_launch(positions.device))
