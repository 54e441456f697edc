"""The rows of an MTP chain pass from its per-request tables, in one launch.

`kiln.engine.spec.mtp_graph.MTPChainGraph` derives every row's token, position and slots on the
device from per-request tables, so that a pass can follow a verify without the host. As PyTorch
ops (`kiln.ops.mtp_rows.chain_rows`, the reference) that is ~45 launches of a microsecond or two,
each waiting for the last: 0.08 ms of the chain graph's 0.71 at batch 1 on an H100 (forty-fourth
session). One program per request computes its R rows for all K layers here.

`tests/kernels/test_mtp_rows.py` compares the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.launch import pdl_launch, wait_for_previous


# The batch size and the tables' row strides vary with the graph's size (a stride of 1 at batch 1):
# each specialisation Triton would key on them is one more compile at capture.
@triton.jit(do_not_specialize=["stride_tokens", "stride_conv", "stride_swa", "bs"])
def _rows_kernel(count_ptr, first_ptr, tokens_ptr, stride_tokens, conv_ptr, stride_conv, swa_ptr, stride_swa,
                 req_slots_ptr, ids_ptr, hid_ptr, keep_ptr, token_slots_ptr, pos_ptr, swa_out_ptr, ext_ptr,
                 draft_out_ptr, draft_in_ptr, draft_row_ptr, bs,
                 K: tl.constexpr, R: tl.constexpr, C: tl.constexpr, DRAFTS: tl.constexpr, BLOCK_R: tl.constexpr,
                 PDL: tl.constexpr):
    """Program b: request b's rows b * R .. b * R + R - 1 (`chain_rows`'s docstring)."""
    wait_for_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_R)
    ok = i < R
    c = tl.load(count_ptr + b)
    f = tl.load(first_ptr + b)
    live = c > 0
    catch = i < c  # c <= C: every column read below exists
    row = b * R + i
    tl.store(ids_ptr + row, tl.load(tokens_ptr + b * stride_tokens + i, mask=catch, other=0), mask=ok)
    tl.store(hid_ptr + row, tl.load(conv_ptr + b * stride_conv + i, mask=catch, other=0), mask=ok)
    keep_col = 1 + tl.minimum(i, C - 1)
    tl.store(keep_ptr + row, tl.load(conv_ptr + b * stride_conv + keep_col, mask=catch, other=0), mask=ok)
    slot = tl.load(req_slots_ptr + b) * live.to(tl.int64)
    tl.store(token_slots_ptr + row, tl.zeros([BLOCK_R], dtype=tl.int64) + slot, mask=ok)
    swa_catch = tl.load(swa_ptr + b * stride_swa + i, mask=catch, other=0)
    for k in tl.static_range(1, K + 1):
        out = (k - 1) * bs * R + row
        if DRAFTS:
            if k >= 2:  # layer k's draft row, fed with layer k - 1's draft
                draft = (i == c) & live
                swa_draft = tl.load(swa_ptr + b * stride_swa + c - 2 + k)
                pos = tl.where(catch, f + i - k, tl.where(draft, f + c - 2, 0))
                swa = tl.where(catch, swa_catch, tl.where(draft, swa_draft, 0))
                ext = tl.where(live, c + 1, 0)
                draft_out = b * R + tl.where(live, c, 1)
            else:
                pos = tl.where(catch, f + i - k, 0)
                swa = swa_catch
                ext = tl.where(live, c, 0)
                draft_out = b * R + tl.where(live, c, 1) - 1
            tl.store(draft_out_ptr + (k - 1) * bs + b, draft_out)
        else:
            pos = tl.where(catch, f + i - k, 0)
            swa = swa_catch
            ext = tl.where(live, c, 0)
        tl.store(pos_ptr + out, pos, mask=ok)
        tl.store(swa_out_ptr + out, swa, mask=ok)
        tl.store(ext_ptr + (k - 1) * bs + b, ext)
    if DRAFTS:
        draft_in = tl.where(live, c, R - 1)
        tl.store(draft_in_ptr + b, b * R + draft_in)
        tl.store(draft_row_ptr + row, i == draft_in, mask=ok)


def chain_rows(count: torch.Tensor, first: torch.Tensor, tokens: torch.Tensor, conv_slots: torch.Tensor,
               swa_slots: torch.Tensor, req_slots: torch.Tensor, num_layers: int, rows: int,
               drafts: bool) -> dict[str, torch.Tensor]:
    """`kiln.ops.mtp_rows.chain_rows` in one launch (the same arguments and results). The tables
    are int64 with unit column stride; their rows may be strided."""
    bs, K, R = count.shape[0], num_layers, rows
    C = R - 1 if drafts else R
    assert conv_slots.shape == (bs, C + 1) and tokens.shape[1] >= R and swa_slots.shape[1] >= R, \
        (conv_slots.shape, tokens.shape, swa_slots.shape, bs, R)
    assert not drafts or swa_slots.shape[1] >= 2 * K, (swa_slots.shape, K)  # a draft row's slot: column <= 2K - 1
    for t in (count, first, req_slots):
        assert t.dtype == torch.int64 and t.shape == (bs,) and t.is_contiguous(), (t.dtype, t.shape, t.stride())
    for t in (tokens, conv_slots, swa_slots):
        assert t.dtype == torch.int64 and t.stride(1) == 1, (t.dtype, t.stride())
    dev = count.device
    e = lambda *shape: torch.empty(*shape, dtype=torch.int64, device=dev)  # noqa: E731
    out = {"ids": e(bs * R), "hid": e(bs * R), "keep": e(bs * R), "token_slots": e(bs * R),
           "pos": e(K, bs * R), "swa": e(K, bs * R), "ext": e(K, bs)}
    if drafts:
        out.update(draft_out=e(K, bs), draft_in=e(bs), draft_row=torch.empty(bs, R, dtype=torch.bool, device=dev))
    if bs == 0:
        return out
    unused = out["ext"]  # any valid pointer where no draft outputs exist (DRAFTS = False)
    _rows_kernel[(bs,)](count, first, tokens, tokens.stride(0), conv_slots, conv_slots.stride(0), swa_slots,
                        swa_slots.stride(0), req_slots, out["ids"], out["hid"], out["keep"], out["token_slots"],
                        out["pos"], out["swa"], out["ext"], out.get("draft_out", unused),
                        out.get("draft_in", unused), out.get("draft_row", unused), bs, K=K, R=R, C=C,
                        DRAFTS=drafts, BLOCK_R=triton.next_power_of_2(R), **pdl_launch(dev))
    return out
