"""`kiln.kernels.mtp_layer_io`: an MTP chain layer's inputs and outputs in one launch each equal the
PyTorch reference (`kiln.ops.mtp_layer_io`) on random rows: with and without the draft rows'
override, padding rows on the scratch slot, a site in another dtype than the model's, row-strided
inputs, the last layer (no site) and the late catch-up pass (no draft rows)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels import mtp_layer_io as kernels  # noqa: E402
from kiln.ops import mtp_layer_io as reference  # noqa: E402
from kiln.ops.mtp_rows import chain_rows  # noqa: E402
from tests.kernels.devices import DEVICE_DTYPES  # noqa: E402

EPS = 1e-6


def _tol(dtype):
    # the norms' fp32 sums run in another order: an ulp of the output dtype at most
    return dict(rtol=0, atol=0) if dtype is None else (
        dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2))


def _rows(bs: int, K: int, seed: int, device):
    """A drafting pass's rows (`kiln.ops.mtp_rows.chain_rows`) over random tables: padding requests
    included, so draft rows, padding rows and scratch slots all occur."""
    g = torch.Generator().manual_seed(seed)
    R, C = K + 2, K + 1
    count = torch.randint(1, C + 1, (bs,), generator=g)
    count[torch.rand(bs, generator=g) < 0.25] = 0
    r = lambda hi, *shape: torch.randint(1, hi, shape, generator=g)  # noqa: E731
    # distinct conv slots, 1..63 (0 is the scratch slot): no two live rows store h^k to one slot
    conv_slots = torch.randperm(63, generator=g)[:bs * (C + 1)].view(bs, C + 1) + 1
    tables = dict(count=count, first=r(40, bs) + 4, tokens=r(90, bs, R), conv_slots=conv_slots,
                  swa_slots=r(60, bs, max(2 * K, R)), req_slots=r(8, bs))
    return chain_rows(**{k: v.to(device) for k, v in tables.items()}, num_layers=K, rows=R, drafts=True), R


SMALL = [(1, 64, False), (3, 48, True), (5, 200, True)]


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("bs,H,site_fp32", SMALL)
def test_layer_inputs_equal_reference(device, dtype, bs, H, site_fp32):
    _check_inputs(device, dtype, bs, H, site_fp32)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("bs,H,site_fp32", SMALL)
def test_layer_outputs_equal_reference(device, dtype, bs, H, site_fp32):
    _check_outputs(device, dtype, bs, H, site_fp32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_io_at_the_bench_hidden_size(dtype):
    # Inkling bench's H = 2048, batch 8: the engine's shapes (the interpreter runs the small ones)
    _check_inputs("cuda", dtype, 8, 2048, False)
    _check_outputs("cuda", dtype, 8, 2048, False)


def _check_inputs(device, dtype, bs, H, site_fp32):
    K, V = 3, 97
    g = torch.Generator().manual_seed(bs * 1000 + H)
    rows, R = _rows(bs, K, seed=H, device=device)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    embed = rnd(V, H).to(dtype)
    site = rnd(64, H).to(torch.float32 if site_fp32 else dtype)
    enorm_w, hnorm_w = (1 + 0.1 * rnd(H)).to(dtype), (1 + 0.1 * rnd(H)).to(dtype)
    # layer k - 1's draft token and hidden state: rows of bigger buffers (strided as index_select's aren't,
    # but as a graph's static slices can be)
    prev_tok = torch.randint(0, V, (bs,), generator=g).to(device)
    prev_h = rnd(bs, H + 16).to(dtype)[:, :H]
    for k, draft in ((1, False), (2, True)):
        args = (embed, rows["ids"], site, rows["hid"], enorm_w, hnorm_w, EPS)
        kw = dict(draft_row=rows["draft_row"], prev_tok=prev_tok, prev_h=prev_h) if draft else {}
        want_x, want_ids = reference.layer_inputs(*args, **kw)
        got_x, got_ids = kernels.layer_inputs(*args, **kw)
        assert got_x.shape == (bs * R, 2 * H) and got_x.dtype == dtype
        assert got_ids.tolist() == want_ids.tolist(), k
        torch.testing.assert_close(got_x, want_x, **_tol(dtype))
    # the draft rows really took the override (the test would pass trivially if none existed)
    assert rows["draft_row"].any()


def _check_outputs(device, dtype, bs, H, site_fp32):
    K = 3
    g = torch.Generator().manual_seed(7 * bs + H)
    rows, R = _rows(bs, K, seed=H + 1, device=device)
    T = bs * R
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    f, residual = rnd(T, H + 8).to(dtype)[:, :H], rnd(T, H).to(dtype)
    final_w = (1 + 0.1 * rnd(H)).to(dtype)
    site_dtype = torch.float32 if site_fp32 else dtype
    for k in (1, K):  # the last layer stores no site
        site = None if k == K else rnd(64, H).to(site_dtype)
        site_want = None if site is None else site.clone()
        keep, draft_out = rows["keep"], rows["draft_out"][k - 1].contiguous()
        want = reference.layer_outputs(f, residual, site_want, keep, draft_out, final_w, EPS)
        got = kernels.layer_outputs(f, residual, site, keep, draft_out, final_w, EPS)
        torch.testing.assert_close(got[0], want[0], **_tol(None))  # the sum: rounded once, both ways
        torch.testing.assert_close(got[1], want[1], **_tol(None))
        torch.testing.assert_close(got[2], want[2], **_tol(dtype))
        if site is not None:
            live = keep != 0  # the scratch slot 0 takes every padding row: any of them may land last
            torch.testing.assert_close(site[keep[live]], site_want[keep[live]], **_tol(None))
            untouched = torch.ones(site.shape[0], dtype=torch.bool, device=device)
            untouched[keep] = False
            torch.testing.assert_close(site[untouched], site_want[untouched], **_tol(None))
    # the late catch-up pass: no draft rows
    h, draft_h, normed = kernels.layer_outputs(f, residual, None, rows["keep"], None, final_w, EPS)
    assert draft_h is None and normed is None
    torch.testing.assert_close(h, residual + f, **_tol(None))
