"""Inkling's attention prologue inside the decode attention (`decode_attention(prologue=...)`)
against the two launches it replaces: `conv_qk_norm_store` (k/v ShortConvs, q/k norms, lam, the
K/V cache write) then `decode_attention` on the normed q.

The conv buffers must be bit-identical (raw copies); the cache rows k' and v' too under the
interpreter (the same helpers in the same order; on a GPU the fused conv may contract into FMAs,
hence a tolerance there); the attention output differs by summation order only (the new key is
attended from registers, after the cached ones). The new token's cache slots start as NaN, so a
program that read them instead of its registers would fail. "cpu" runs under Triton's
interpreter (fp32); "cuda" at Inkling `bench` shapes in bf16.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels.conv_qk_norm import AttentionPrologue, conv_qk_norm_store  # noqa: E402
from kiln.kernels.decode_attention import decode_attention  # noqa: E402
from kiln.ops.attention import RelProjection  # noqa: E402
from tests.kernels.devices import DEVICE_DTYPES  # noqa: E402
from tests.kernels.test_attention_kernels import _no_merge_kernel  # noqa: E402
from tests.kernels.test_conv_qk_norm import EPS, Case  # noqa: E402


class Step:
    """One decode step of one Inkling attention layer: `Case`'s qkvr rows and conv state, plus the
    layer's K/V caches and page table (rows shared with the conv table), the new token's slots NaN."""

    def __init__(self, prefix_lens, hq, hkv, d, dtype, device, seed, lam, rel):
        self.case = c = Case(prefix_lens, hq, hkv, d, 4, dtype, device, seed, lam=lam, r_dim=8)
        gen = torch.Generator().manual_seed(seed + 100)
        b = len(prefix_lens)
        seq_lens = [p + 1 for p in prefix_lens]
        n_slots = sum(seq_lens) + 9
        self.k_cache = torch.randn(n_slots, hkv, d, generator=gen).to(dtype).to(device)
        self.v_cache = torch.randn(n_slots, hkv, d, generator=gen).to(dtype).to(device)
        rows = c.paged_k.rows
        table = torch.randint(0, n_slots, (int(rows.max()) + 1, max(seq_lens) + 5), generator=gen)
        perm, used = torch.randperm(n_slots, generator=gen), 0
        for row, n in zip(rows.tolist(), seq_lens):
            table[row, :n] = perm[used:used + n]
            used += n
        self.table = table.to(device)
        self.new_slots = torch.stack([table[row, n - 1] for row, n in zip(rows.tolist(), seq_lens)]).to(device)
        for cache in (self.k_cache, self.v_cache):
            cache[self.new_slots] = float("nan")
        self.rows = rows.to(device)
        self.seq_lens = torch.tensor(seq_lens, device=device)
        self.rel = None
        if rel == "proj":
            r = torch.randn(b, hq, 8, generator=gen).to(dtype).to(device)
            w = (torch.randn(24, 8, generator=gen) / 8 ** 0.5).to(dtype).to(device)
            self.rel = RelProjection(r, w, c.lam)
        elif rel == "dense":
            self.rel = torch.randn(b, hq, 24, generator=gen).to(device)
        self.hq, self.d = hq, d

    def _run(self, fused: bool, **kw):
        c = self.case
        k_buf, conv_table, _, out_locs = c.paged_k.to_device()
        v_buf = c.paged_v.buf.to(k_buf.device)
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        b = c.q.shape[0]
        if fused:
            pro = AttentionPrologue(c.k, c.v, c.qn_w, c.kn_w, EPS, EPS, c.kc_w, c.vc_w, k_buf, v_buf, conv_table,
                                    c.positions, out_locs, c.lam)
            out = decode_attention(c.q.view(b, self.hq, self.d), k_cache, v_cache, self.table, self.rows,
                                   self.seq_lens, self.d ** -0.5, rel=self.rel, prologue=pro, **kw)
        else:
            q = conv_qk_norm_store(c.q, c.k, c.v, c.qn_w, c.kn_w, EPS, EPS, c.kc_w, c.vc_w, k_buf, v_buf, conv_table,
                                   c.row_slots, c.positions, out_locs, self.d, c.lam, k_cache, v_cache,
                                   self.new_slots)
            kw = {k: v for k, v in kw.items() if k != "early_kv"}
            out = decode_attention(q, k_cache, v_cache, self.table, self.rows, self.seq_lens, self.d ** -0.5,
                                   rel=self.rel, **kw)
        return out, k_cache, v_cache, k_buf, v_buf

    def check(self, **kw):
        merge_here = kw.get("split_counters") is not None
        with _no_merge_kernel(merge_here) if merge_here else contextlib.nullcontext():
            got = self._run(True, **kw)
        want = self._run(False, **kw)
        exact = got[0].device.type == "cpu"
        tol = dict(atol=1e-4, rtol=1e-4) if self.case.dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        out, want_out = got[0], want[0]
        assert out.shape == want_out.shape and out.dtype == want_out.dtype
        assert not out.isnan().any()
        torch.testing.assert_close(out.float(), want_out.float(), **tol)
        for name, g, w in zip(("k_cache", "v_cache"), got[1:3], want[1:3]):
            if exact:
                assert torch.equal(g.nan_to_num(7.0), w.nan_to_num(7.0)), name
            else:
                torch.testing.assert_close(g[self.new_slots].float(), w[self.new_slots].float(), **tol, msg=name)
        for name, g, w in zip(("k_buf", "v_buf"), got[3:], want[3:]):
            assert torch.equal(g, w), name
        if merge_here:
            assert not kw["split_counters"].any()


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("rel,lam", [(None, False), ("proj", True), ("proj", False), ("dense", False)])
@pytest.mark.parametrize("splits", [1, 3])
def test_equals_prologue_then_attention(device, dtype, rel, lam, splits):
    """Histories shorter than the conv (0, 1, 2) and longer ones; one split per sequence (the
    program is the new token's) or three (its keys' last split holds it)."""
    step = Step([0, 1, 2, 9, 40], 4, 2, 16, dtype, device, seed=splits + len(str(rel)), lam=lam, rel=rel)
    step.check(num_splits=splits)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("early_kv", [False, True])
def test_new_token_alone_in_its_split_merged_in_kernel(device, dtype, early_kv):
    """17 keys in splits of 16 (the interpreter's key block): the second split holds only the new
    token, which it attends from registers alone; the splits merge inside the kernel, and with
    early_kv every program's first block is read before the wait."""
    step = Step([16, 16, 5], 6, 2, 16, dtype, device, seed=5, lam=True, rel="proj")
    counters = torch.zeros(16, dtype=torch.int32, device=device)
    step.check(num_splits=2, split_counters=counters, early_kv=early_kv)
    step.check(num_splits=2, split_counters=counters, early_kv=early_kv)  # the counters left at zero


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_sliding_window(device, dtype):
    step = Step([3, 30, 12], 4, 2, 16, dtype, device, seed=9, lam=False, rel="proj")
    step.check(num_splits=2, sliding_window=8)


@pytest.mark.gpu
@pytest.mark.parametrize("bsz", [1, 8])
def test_bench_shapes_on_cuda(bsz):
    """Inkling `bench` per layer (Hq 16, Hkv 4, D 128, bf16) on a full layer at a 1K context."""
    gen = torch.Generator().manual_seed(bsz)
    prefix = torch.randint(900, 1100, (bsz,), generator=gen).tolist()
    step = Step(prefix, 16, 4, 128, torch.bfloat16, "cuda", seed=bsz, lam=True, rel="proj")
    counters = torch.zeros(bsz * 4, dtype=torch.int32, device="cuda")
    step.check(split_counters=counters, early_kv=True)
