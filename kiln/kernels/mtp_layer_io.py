"""An MTP chain layer's inputs and outputs, one launch each side.

`kiln.engine.spec.mtp_graph.MTPChainGraph` runs, per MTP layer, `eh_proj` and the decoder block
(`kiln.models.mtp.MTPLayer.project`) between two sets of small steps: before, the draft row's
token and hidden state override, the embedding gather, the h^{k-1} gather, the two input norms
and their concatenation; after, the residual add, the store of h^k into the next layer's conv
site, the draft rows' gather and the draft head's final norm. As PyTorch ops these were ~11
dependent launches a layer at a microsecond or a few each. Here:

- `layer_inputs`: one program per row loads its token (or its request's draft token), the
  embedding row and h^{k-1} (or the draft hidden state), norms both in fp32 and stores the
  joined [2H] row and the token;
- `layer_outputs`: one program per row adds the residual, stores h^k and copies it into the conv
  site; one more program per request recomputes its draft row's sum and stores it with its final
  norm.

Both round as the reference does (`kiln.ops.mtp_layer_io`: the sum in the residual's dtype, the
norms in fp32 cast once), so only the norms' fp32 reduction order differs.
`tests/kernels/test_mtp_layer_io.py` compares the two.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kiln.kernels.launch import pdl_launch, wait_for_previous

MAX_HIDDEN = 16384  # a whole row in registers


@triton.jit
def _normed(v, w_ptr, cols, ok, H, eps):
    """rms_norm of an fp32 row as `kiln.layers.norm.rms_norm` computes it (fp32, before the cast)."""
    inv = tl.math.rsqrt(tl.sum(v * v, axis=0) / H + eps)
    # (x * inv) * w: the reference's order of the two products, as `kiln.kernels.norm`
    return (v * inv) * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["T"])
def _inputs_kernel(embed_ptr, ids_ptr, site_ptr, hid_ptr, enorm_ptr, hnorm_ptr, draft_row_ptr, prev_tok_ptr,
                   prev_h_ptr, x_ptr, ids_out_ptr, T, H, eps, stride_e, stride_s, stride_p,
                   R: tl.constexpr, DRAFT: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """Program r: row r's [enorm(Emb(t)) ; hnorm(h)] and t (`layer_inputs`)."""
    wait_for_previous(PDL)
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    ok = cols < H
    tok = tl.load(ids_ptr + r)
    h = tl.load(site_ptr + tl.load(hid_ptr + r) * stride_s + cols, mask=ok, other=0.0)
    if DRAFT:  # the request's draft row takes layer k - 1's draft token and hidden state
        b = r // R
        is_draft = tl.load(draft_row_ptr + r) != 0
        tok = tl.where(is_draft, tl.load(prev_tok_ptr + b).to(tok.dtype), tok)
        h_draft = tl.load(prev_h_ptr + b * stride_p + cols, mask=ok & is_draft, other=0.0)
        h = tl.where(is_draft, h_draft.to(h.dtype), h)
    tl.store(ids_out_ptr + r, tok)
    emb = tl.load(embed_ptr + tok.to(tl.int64) * stride_e + cols, mask=ok, other=0.0)
    dt = x_ptr.dtype.element_ty
    # h in the embedding's dtype before its norm, as the reference's `h.to(emb.dtype)`
    hf = h.to(dt).to(tl.float32)
    tl.store(x_ptr + r * 2 * H + cols, _normed(emb.to(tl.float32), enorm_ptr, cols, ok, H, eps).to(dt), mask=ok)
    tl.store(x_ptr + r * 2 * H + H + cols, _normed(hf, hnorm_ptr, cols, ok, H, eps).to(dt), mask=ok)


@triton.jit(do_not_specialize=["T"])
def _outputs_kernel(f_ptr, res_ptr, site_ptr, keep_ptr, draft_out_ptr, final_ptr, h_ptr, draft_h_ptr, normed_ptr,
                    T, H, eps, stride_f, stride_r, stride_s,
                    HAS_SITE: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """Program p < T: row p's h^k, stored and copied into the site; program T + b: request b's
    draft row's h^k and its final norm (`layer_outputs`)."""
    wait_for_previous(PDL)
    p = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    ok = cols < H
    dt = h_ptr.dtype.element_ty
    if p < T:
        row = p
    else:
        row = tl.load(draft_out_ptr + p - T)
    f = tl.load(f_ptr + row * stride_f + cols, mask=ok, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
    h = (res + f).to(dt)  # rounded once, as the reference's add in the model's dtype
    if p < T:
        tl.store(h_ptr + p * H + cols, h, mask=ok)
        if HAS_SITE:
            tl.store(site_ptr + tl.load(keep_ptr + p) * stride_s + cols, h.to(site_ptr.dtype.element_ty), mask=ok)
    else:
        b = p - T
        tl.store(draft_h_ptr + b * H + cols, h, mask=ok)
        tl.store(normed_ptr + b * H + cols, _normed(h.to(tl.float32), final_ptr, cols, ok, H, eps).to(dt), mask=ok)


def _block(H: int) -> dict:
    assert H <= MAX_HIDDEN, f"hidden size {H} > {MAX_HIDDEN}: the MTP layer kernels keep a row in registers"
    return dict(BLOCK_H=triton.next_power_of_2(H), num_warps=4 if H <= 2048 else 8)


def layer_inputs(embed: torch.Tensor, ids: torch.Tensor, site: torch.Tensor, hid: torch.Tensor,
                 enorm_w: torch.Tensor, hnorm_w: torch.Tensor, eps: float,
                 draft_row: Optional[torch.Tensor] = None, prev_tok: Optional[torch.Tensor] = None,
                 prev_h: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`kiln.ops.mtp_layer_io.layer_inputs` in one launch (the same arguments and results)."""
    T, H = ids.shape[0], embed.shape[1]
    assert site.shape[1] == H and site.stride(1) == 1 and embed.stride(1) == 1, (site.shape, embed.shape)
    assert ids.is_contiguous() and hid.is_contiguous() and hid.shape == (T,), (ids.shape, hid.shape)
    x = torch.empty(T, 2 * H, dtype=embed.dtype, device=embed.device)
    ids_out = torch.empty_like(ids)
    draft = draft_row is not None
    R = 1
    if draft:
        bs, R = draft_row.shape
        assert bs * R == T and draft_row.is_contiguous() and prev_tok.is_contiguous(), (draft_row.shape, T)
        assert prev_h.shape == (bs, H) and prev_h.stride(1) == 1, prev_h.shape
    if T == 0:
        return x, ids_out
    unused = ids  # any valid pointer where there is no draft row
    _inputs_kernel[(T,)](embed, ids, site, hid, enorm_w, hnorm_w, draft_row if draft else unused,
                         prev_tok if draft else unused, prev_h if draft else site, x, ids_out, T, H, eps,
                         embed.stride(0), site.stride(0), prev_h.stride(0) if draft else 0,
                         R=R, DRAFT=draft, **_block(H), **pdl_launch(embed.device))
    return x, ids_out


def layer_outputs(f: torch.Tensor, residual: torch.Tensor, site: Optional[torch.Tensor],
                  keep: torch.Tensor, draft_out: Optional[torch.Tensor], final_w: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """`kiln.ops.mtp_layer_io.layer_outputs` in one launch (the same arguments and results)."""
    T, H = f.shape
    assert residual.shape == f.shape and residual.dtype == f.dtype, (residual.shape, residual.dtype, f.dtype)
    assert f.stride(1) == 1 and residual.stride(1) == 1 and keep.is_contiguous(), (f.stride(), residual.stride())
    dev = f.device
    h = torch.empty(T, H, dtype=f.dtype, device=dev)
    nb = 0 if draft_out is None else draft_out.shape[0]
    draft_h = normed = None
    if draft_out is not None:
        assert draft_out.is_contiguous(), draft_out.stride()
        draft_h = torch.empty(nb, H, dtype=f.dtype, device=dev)
        normed = torch.empty(nb, H, dtype=f.dtype, device=dev)
    if site is not None:
        assert site.shape[1] == H and site.stride(1) == 1, site.shape
    if T + nb == 0:
        return h, draft_h, normed
    _outputs_kernel[(T + nb,)](f, residual, site if site is not None else h, keep,
                               draft_out if draft_out is not None else keep, final_w, h,
                               draft_h if draft_h is not None else h, normed if normed is not None else h,
                               T, H, eps, f.stride(0), residual.stride(0), site.stride(0) if site is not None else 0,
                               HAS_SITE=site is not None, **_block(H), **pdl_launch(dev))
    return h, draft_h, normed
