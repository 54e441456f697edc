"""Inkling's fused attention prologue (`kiln.kernels.conv_qk_norm`) vs the unfused reference ops:
`kiln.ops.shortconv.short_conv` over the history in the paged buffers (as `PagedBackend` gathers
it) plus the buffer writes, `kiln.layers.norm.rms_norm` per head, and the lam scale of q.

v and both buffers must be bit-identical (the conv runs in the reference's order without FMA
contraction); q and k differ from the reference only by the norm's fp32 reduction order.
"cpu" cases run under Triton's interpreter (fp32); "cuda" cases compile in fp32 and bf16.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels.conv_qk_norm import conv_qk_norm  # noqa: E402
from kiln.layers.norm import rms_norm  # noqa: E402
from tests.kernels.devices import DEVICE_DTYPES  # noqa: E402
from tests.kernels.test_shortconv_kernels import Paged  # noqa: E402

FP32 = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=1.6e-2, atol=1e-2)
EPS = 1e-6


class Case:
    """One decode step (extend_lens None) or short chunks per sequence: q, k, v as views of a fused
    qkvr output, two conv sites (k and v buffers sharing the conv table and out_locs, as every
    site of the "conv" space does), norm and conv weights, optionally lam per row."""

    def __init__(self, prefix_lens, hq, hkv, d, k, dtype, device, seed, lam=False, r_dim=8, extend_lens=None):
        gen = torch.Generator().manual_seed(seed)
        extend_lens = extend_lens or [1] * len(prefix_lens)
        b, c = sum(extend_lens), hkv * d
        used = sum(prefix_lens) + b
        self.paged_k = Paged(prefix_lens, extend_lens, c, dtype, device, gen, n_slots=used + b + 7)
        # The new rows are written to slots the table does not map (the engine's are the table's
        # own): a kernel reading a tap inside its chunk from the buffer, rather than from the row
        # before (which another program may not have written yet on a GPU), then reads garbage.
        pk = self.paged_k
        taken = {x for row, p, n in zip(pk.rows.tolist(), prefix_lens, extend_lens) for x in pk.table[row, :p + n].tolist()}
        self.paged_k.out_locs = torch.tensor([x for x in range(used + b + 7) if x not in taken][:b])
        self.paged_v = copy.copy(self.paged_k)
        self.paged_v.buf = torch.randn(self.paged_k.buf.shape, generator=gen).to(dtype)
        qkvr = torch.randn(b, (hq + 2 * hkv) * d + hq * r_dim, generator=gen).to(dtype).to(device)
        self.q, self.k, self.v, _ = qkvr.split([hq * d, c, c, hq * r_dim], dim=-1)
        rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
        self.qn_w, self.kn_w = ((1 + 0.3 * rnd(d)).to(dtype).to(device) for _ in range(2))
        self.kc_w, self.vc_w = ((0.5 * rnd(c, k)).to(dtype).to(device) for _ in range(2))
        self.lam = (1 + rnd(b).abs()).to(device) if lam else None
        lens = torch.tensor(extend_lens)
        # each row's position and request row (the rows of a chunk are consecutive)
        self.positions = torch.cat([p + torch.arange(n) for p, n in zip(prefix_lens, extend_lens)]).to(device)
        self.row_slots = self.paged_k.rows.repeat_interleave(lens).to(device)
        self.hq, self.hkv, self.d, self.dtype = hq, hkv, d, dtype

    def run(self):
        """(q, k, v, k_buf, v_buf) from the kernel."""
        k_buf, table, _, out_locs = self.paged_k.to_device()
        v_buf = self.paged_v.buf.to(k_buf.device)
        q, k, v = conv_qk_norm(self.q, self.k, self.v, self.qn_w, self.kn_w, EPS, EPS, self.kc_w,
                               self.vc_w, k_buf, v_buf, table, self.row_slots, self.positions, out_locs, self.d,
                               q_scale=self.lam)
        return q, k, v, k_buf, v_buf

    def reference(self):
        b = self.q.shape[0]
        k_conv, k_buf = self.paged_k.reference(self.k, self.kc_w)
        v, v_buf = self.paged_v.reference(self.v, self.vc_w)
        q = rms_norm(self.q.reshape(b, self.hq, self.d), self.qn_w, EPS)
        if self.lam is not None:
            q = (q.float() * self.lam[:, None, None]).to(q.dtype)
        k = rms_norm(k_conv.reshape(b, self.hkv, self.d), self.kn_w, EPS)
        return q, k, v, k_buf, v_buf


def _check(case: Case):
    got, want = case.run(), case.reference()
    tol = FP32 if case.dtype == torch.float32 else BF16
    for name, g, w in zip(("q", "k"), got[:2], want[:2]):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        torch.testing.assert_close(g, w, **tol, msg=name)
    for name, g, w in zip(("v", "k_buf", "v_buf"), got[2:], want[2:]):
        assert g.shape == w.shape and torch.equal(g, w), name


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("prefix_lens,hq,hkv,d,k", [
    ([0, 1, 2, 9], 4, 2, 16, 4),  # histories shorter than K-1 read zeros
    ([5, 3], 6, 3, 24, 3),  # head_dim not a power of two, K = 3
    ([7], 16, 4, 32, 4),  # several head blocks of q per sequence
])
@pytest.mark.parametrize("lam", [False, True])
def test_matches_the_unfused_reference(device, dtype, prefix_lens, hq, hkv, d, k, lam):
    _check(Case(prefix_lens, hq, hkv, d, k, dtype, device, seed=len(prefix_lens) + d, lam=lam))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("prefix_lens,extend_lens", [
    ([0, 5, 1, 9], [4, 4, 4, 4]),  # a speculative verify: K + 1 rows per sequence
    ([2, 0, 6], [3, 1, 2]),  # chunks of different lengths, one a single row, taps from both sides
])
@pytest.mark.parametrize("lam", [False, True])
def test_short_chunks_read_their_own_rows(device, dtype, prefix_lens, extend_lens, lam):
    # Taps inside a chunk come from its earlier rows, taps before it from the buffer.
    _check(Case(prefix_lens, 4, 2, 16, 4, dtype, device, seed=7 + len(prefix_lens), lam=lam,
                extend_lens=extend_lens))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("extend_lens,lam,other_cache_dtype", [(None, False, False), ([4, 4, 4, 4], True, False),
                                                            ([3, 1, 2, 2], False, False), (None, True, True)])
def test_store_variant_is_prologue_then_cache_write(device, dtype, extend_lens, lam, other_cache_dtype):
    """`conv_qk_norm_store` = `conv_qk_norm` then `kiln.kernels.kv_store.store_kv` of its k and v
    into the layer's caches (at slots other than the conv buffers'), bit for bit: q, both conv
    buffers, and every cache row, written or not; also with caches of another dtype than the
    model's (k's norm reads the conv result rounded to the model's dtype, the cache gets the
    result cast once more)."""
    from kiln.kernels.conv_qk_norm import conv_qk_norm_store
    from kiln.kernels.kv_store import store_kv

    case = Case([0, 5, 1, 9], 4, 2, 16, 4, dtype, device, seed=11, lam=lam, extend_lens=extend_lens)
    b = case.q.shape[0]
    gen = torch.Generator().manual_seed(3)
    cache_dtype = (torch.bfloat16 if dtype == torch.float32 else torch.float32) if other_cache_dtype else dtype
    caches = [torch.randn(40, case.hkv, case.d, generator=gen).to(cache_dtype).to(device) for _ in range(2)]
    cache_locs = torch.randperm(40, generator=gen)[:b].to(device)
    q, k, v, k_buf, v_buf = case.run()
    want_k, want_v = (c.clone() for c in caches)
    store_kv(k, v.view(b, case.hkv, case.d), want_k, want_v, cache_locs)

    k_buf2, table, _, out_locs = case.paged_k.to_device()
    v_buf2 = case.paged_v.buf.to(k_buf2.device)
    q2 = conv_qk_norm_store(case.q, case.k, case.v, case.qn_w, case.kn_w, EPS, EPS, case.kc_w, case.vc_w, k_buf2,
                            v_buf2, table, case.row_slots, case.positions, out_locs, case.d, case.lam,
                            caches[0], caches[1], cache_locs)
    for name, g, w in (("q", q2, q), ("k_buf", k_buf2, k_buf), ("v_buf", v_buf2, v_buf),
                       ("k_cache", caches[0], want_k), ("v_cache", caches[1], want_v)):
        assert torch.equal(g, w), name


@pytest.mark.gpu
@pytest.mark.parametrize("bsz", [1, 3, 64, 256])
def test_real_shapes_on_cuda(bsz):
    """Inkling's bench preset per layer: Hq=16, Hkv=4, D=128, K=4, bf16, on a full layer (lam)."""
    gen = torch.Generator().manual_seed(bsz)
    prefix = torch.randint(0, 3000, (bsz,), generator=gen).tolist()
    _check(Case(prefix, 16, 4, 128, 4, torch.bfloat16, "cuda", seed=bsz, lam=True, r_dim=32))


@pytest.mark.gpu
def test_captures_in_a_cuda_graph():
    case = Case([10, 0, 33, 2], 16, 4, 128, 4, torch.bfloat16, "cuda", seed=1, lam=True)
    k_buf, table, _, out_locs = case.paged_k.to_device()
    v_buf = case.paged_v.buf.to("cuda")
    args = lambda: (case.q, case.k, case.v, case.qn_w, case.kn_w, EPS, EPS, case.kc_w, case.vc_w,  # noqa: E731
                    k_buf, v_buf, table, case.row_slots, case.positions, out_locs, case.d)
    conv_qk_norm(*args(), q_scale=case.lam)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, k, v = conv_qk_norm(*args(), q_scale=case.lam)
    for seed in range(2, 4):
        fresh = Case([10, 0, 33, 2], 16, 4, 128, 4, torch.bfloat16, "cuda", seed=seed, lam=True)
        for name in ("q", "k", "v", "lam"):  # new activations in the captured input buffers
            getattr(case, name).copy_(getattr(fresh, name))
        k_buf.copy_(case.paged_k.buf)
        v_buf.copy_(case.paged_v.buf)
        graph.replay()
        want = case.reference()
        torch.testing.assert_close(q, want[0], **BF16)
        torch.testing.assert_close(k, want[1], **BF16)
        assert torch.equal(v, want[2]) and torch.equal(k_buf, want[3]) and torch.equal(v_buf, want[4])
