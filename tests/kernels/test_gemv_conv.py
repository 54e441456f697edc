"""The decode GEMV's ShortConv epilogue (`kiln.kernels.gemv.gemv(conv=...)`, Inkling's o_proj +
o_conv in one launch) against the GEMV followed by the ShortConv kernels: over decode sequences
and over a speculative verify's short chunks (`conv_chunk`), and `decode_linear_conv`'s routing.

"cpu" cases run under Triton's interpreter (fp32, bit for bit); "cuda" cases compile in fp32 and
bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kiln.kernels.gemv import gemv  # noqa: E402
from tests.kernels.devices import DEVICE_DTYPES  # noqa: E402
from tests.kernels.test_gemv import BF16, FP32, _case  # noqa: E402


def _conv_case(m, n, k, kc, dtype, device, seed):
    """x [m, k], W [n, k], a ShortConv [n, kc] over paged decode state (histories shorter and longer
    than kc - 1): (x, W, conv args for `gemv(conv=...)`, the Paged state)."""
    from tests.kernels.test_shortconv_kernels import Paged

    x, w = _case(m, n, k, dtype, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    prefix = [0, 1, 5, 2][:m]
    paged = Paged(prefix, [1] * m, n, dtype, device, gen)
    cw = (0.5 * torch.randn(n, kc, generator=gen)).to(dtype).to(device)
    buf, table, rows, out_locs = paged.to_device()
    seq_lens = torch.tensor([p + 1 for p in prefix], device=device)
    return x, w, (cw, buf, table, rows, seq_lens, out_locs), paged


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k,kc", [(96, 64, 4), (37, 200, 3), (8, 1000, 2), (40, 64, 1)])
def test_gemv_conv_epilogue_is_gemv_then_short_conv(device, dtype, m, n, k, kc):
    """The decode ShortConv in the GEMV's epilogue (Inkling's o_proj + o_conv) against the GEMV
    followed by `short_conv_decode` on the same state: equal outputs (fp32, the interpreter: bit
    for bit; compiled: within an ulp, the conv's adds may become FMAs) and the same state writes."""
    from kiln.kernels.shortconv import short_conv_decode

    x, w, conv, paged = _conv_case(m, n, k, kc, dtype, device, seed=m * 100 + n + kc)
    cw, buf, table, rows, seq_lens, out_locs = conv
    buf_ref = buf.clone()
    want = short_conv_decode(gemv(x, w), cw, buf_ref, table, rows, seq_lens, out_locs)
    got = gemv(x, w, conv=conv)
    exact = device == "cpu"
    tol = dict(rtol=0, atol=0) if exact else (FP32 if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2))
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(buf, buf_ref)  # the state: the rounded projection at out_locs, nothing else
    ref_y, ref_buf = paged.reference(F.linear(x.float(), w.float()).to(dtype), cw)
    torch.testing.assert_close(got, ref_y, **(FP32 if dtype == torch.float32 else BF16))


# (prefix, extend) per request: one chunk of 4 (a K = 3 verify at batch 1), two of 2 (K = 1 at
# batch 2), chunks of 3 and 1, a chunk at the sequence start (taps before it are zeros)
CHUNKS = {"verify-b1": ([6], [4]), "verify-b2": ([3, 9], [2, 2]), "3+1": ([1, 5], [3, 1]), "start": ([0], [3])}


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("chunks", list(CHUNKS), ids=list(CHUNKS))
@pytest.mark.parametrize("n,k,kc", [(96, 64, 4), (37, 200, 3), (40, 64, 1)])
def test_gemv_conv_epilogue_over_chunks_is_gemv_then_short_conv_extend(device, dtype, chunks, n, k, kc):
    """The ShortConv of a speculative verify's rows (short chunks, `conv_chunk=True`) in the GEMV's
    epilogue against the GEMV followed by `short_conv_extend` on the same paged state: taps inside
    a chunk come from the program's own rows, earlier ones from the buffer. Equal outputs (the
    interpreter: bit for bit) and the same state writes."""
    from kiln.kernels.shortconv import short_conv_extend
    from tests.kernels.test_shortconv_kernels import Paged

    prefix, ext = CHUNKS[chunks]
    m = sum(ext)
    x, w = _case(m, n, k, dtype, device, seed=m * 10 + n + kc)
    gen = torch.Generator().manual_seed(n + kc)
    paged = Paged(prefix, ext, n, dtype, device, gen)
    cw = (0.5 * torch.randn(n, kc, generator=gen)).to(dtype).to(device)
    buf, table, rows, out_locs = paged.to_device()
    prefix_t, ext_t, starts, token_rows, positions = paged.chunk_tensors()
    buf_ref = buf.clone()
    want = short_conv_extend(gemv(x, w), cw, buf_ref, table, rows, prefix_t, ext_t, starts, out_locs)
    got = gemv(x, w, conv=(cw, buf, table, token_rows, positions, out_locs), conv_chunk=True)
    exact = device == "cpu"
    tol = dict(rtol=0, atol=0) if exact else (FP32 if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2))
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(buf, buf_ref)
    ref_y, _ = paged.reference(F.linear(x.float(), w.float()).to(dtype), cw)
    torch.testing.assert_close(got, ref_y, **(FP32 if dtype == torch.float32 else BF16))


def test_gemv_conv_epilogue_rejects_what_it_cannot_fuse():
    x, w, conv, _ = _conv_case(2, 96, 64, 4, torch.float32, "cpu", seed=1)
    with pytest.raises(AssertionError, match="conv epilogue"):
        gemv(x, torch.cat([w, w]), glu=True, conv=conv)
    x5 = torch.randn(5, 64)
    with pytest.raises(AssertionError, match="conv epilogue"):
        gemv(x5, w, conv=conv)


def test_decode_linear_conv_fuses_only_a_plain_conv():
    """`decode_linear_conv` runs the conv in the GEMV's epilogue for a plain ShortConv whose state
    has x's dtype; a hooked conv, or state of another dtype, takes the two separate calls (the
    hook runs), with the same result."""
    from types import SimpleNamespace

    from kiln.layers.decode_gemv import decode_linear_conv
    from kiln.layers.linear import RowParallelLinear
    from kiln.layers.shortconv import ShortConv

    x, w, conv_args, _ = _conv_case(2, 96, 64, 4, torch.float32, "cpu", seed=3)
    linear = RowParallelLinear(64, 96)
    linear.weight.data.copy_(w)
    conv = ShortConv(0, 96, 4)
    conv.weight.data.copy_(conv_args[0])
    fused, separate = [], []

    class Backend:
        use_kernels, gemv_max_rows, gemv_prefetch_bytes = True, 4, 0

        def decode_conv_args(self, c, batch):
            fused.append(c)
            return (c.weight, *state)

        def short_conv(self, c, y, batch):
            from kiln.kernels.shortconv import short_conv_decode
            separate.append(c)
            return short_conv_decode(y, c.weight, *state)

    batch = SimpleNamespace(backend=Backend())
    state = [t.clone() for t in conv_args[1:]]
    want = decode_linear_conv(linear, conv, x, batch)
    assert len(fused) == 1 and not separate
    hooked = []
    conv.register_forward_hook(lambda *a: hooked.append(1))
    state = [t.clone() for t in conv_args[1:]]
    torch.testing.assert_close(decode_linear_conv(linear, conv, x, batch), want, rtol=0, atol=0)
    assert hooked and len(separate) == 1 and len(fused) == 1  # the hook ran: not fused
    conv._forward_hooks.clear()
    state = [t.clone() for t in conv_args[1:]]
    state[0] = state[0].double()  # state kept in another dtype than x
    with torch.no_grad():
        decode_linear_conv(linear, conv, x, batch)
    assert len(fused) == 2 and len(separate) == 2  # asked, then declined
