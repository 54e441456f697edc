"""MiniMax-M3's attention prologue (`kiln.kernels.msa_prologue`) against the reference ops it
replaces: `kiln.layers.norm.rms_norm` per head on q and k, `apply_rotary` on q, k (the attention's
table) and qI, kI (the indexer's), and the cache write of k', v and kI' (`store_kv`).

RoPE-only results (qI, and the v and kI' cache rows) must be bit-identical (no FMA contraction);
q and k' differ from the reference only by the norm's fp32 summation order. Cache rows the step
does not write must not change. "cpu" runs under Triton's interpreter (fp32); "cuda" compiles in
fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels.kv_store import store_kv  # noqa: E402
from kiln.kernels.msa_prologue import DecodeScores, msa_prologue  # noqa: E402
from kiln.kernels.msa_scores import msa_decode_scores  # noqa: E402
from kiln.layers.norm import rms_norm  # noqa: E402
from kiln.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402
from tests.kernels.devices import DEVICE_DTYPES  # noqa: E402

EPS = 1e-6


def _case(t, hq, hk, d, di, dtype, device, seed, cache_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    qkv = rnd(t, (hq + 2 * hk) * d + 7).to(dtype).to(device)  # a fused projection's rows (padded stride)
    q, k, v = (x.view(t, -1, d) for x in qkv[:, :(hq + 2 * hk) * d].split([hq * d, hk * d, hk * d], dim=-1))
    idx = rnd(t, 2 * hk * di).to(dtype).to(device)
    qI, kI = (x.view(t, hk, di) for x in idx.split([hk * di, hk * di], dim=-1))
    qn_w, kn_w = ((1 + 0.3 * rnd(d)).to(dtype).to(device) for _ in range(2))
    rope = RotaryEmbedding(d, 4096, 10000.0).to(device)
    irope = rope if di == d else RotaryEmbedding(di, 4096, 1000000.0).to(device)
    positions = torch.randint(0, 4000, (t,), generator=gen).to(device)
    n_slots = 3 * t + 5
    loc = torch.randperm(n_slots, generator=gen)[:t].to(device)
    cd = cache_dtype or dtype
    caches = [rnd(n_slots, hk, d).to(cd).to(device), rnd(n_slots, hk, d).to(cd).to(device),
              rnd(n_slots, hk, di).to(cd).to(device)]
    return dict(q=q, k=k, v=v, qI=qI, kI=kI, qn_w=qn_w, kn_w=kn_w, rope=rope, irope=irope, positions=positions,
                loc=loc, caches=caches)


def _reference(c):
    pos = c["positions"]
    q = apply_rotary(rms_norm(c["q"], c["qn_w"], EPS), c["rope"].cos[pos], c["rope"].sin[pos])
    k = apply_rotary(rms_norm(c["k"], c["kn_w"], EPS), c["rope"].cos[pos], c["rope"].sin[pos])
    qI = apply_rotary(c["qI"], c["irope"].cos[pos], c["irope"].sin[pos])
    kI = apply_rotary(c["kI"], c["irope"].cos[pos], c["irope"].sin[pos])
    caches = [x.clone() for x in c["caches"]]
    # the cast to the caches' dtype as the cache-write kernel makes it (the interpreter's fp32 ->
    # bf16 rounding is not torch's)
    store_kv(k, c["v"], caches[0], caches[1], c["loc"], kI, caches[2])
    return q, qI, caches


def _run(c):
    caches = [x.clone() for x in c["caches"]]
    q, qI, s = msa_prologue(c["positions"], c["q"], c["k"], c["v"], c["qI"], c["kI"], c["qn_w"], c["kn_w"], EPS,
                            EPS, c["rope"].cos, c["rope"].sin, c["irope"].cos, c["irope"].sin, *caches, c["loc"])
    assert s is None
    return q, qI, caches


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("t,hq,hk,d,di", [
    (1, 4, 2, 16, 16),  # a decode step, the index head dim the attention's (one shared table)
    (5, 6, 2, 32, 16),  # the indexer's own table and head dim; more q heads than one block
    (3, 16, 4, 128, 128),  # MiniMax-M3 bench's heads
    (2, 8, 8, 128, 64),  # several blocks of k / v and of qI / kI heads
])
def test_matches_the_reference(device, dtype, t, hq, hk, d, di):
    c = _case(t, hq, hk, d, di, dtype, device, seed=t + d)
    got, want = _run(c), _reference(c)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got[0], want[0], **tol, msg="q")
    assert torch.equal(got[1], want[1]), "qI"
    loc = c["loc"]
    k_got, v_got, ki_got = got[2]
    k_want, v_want, ki_want = want[2]
    torch.testing.assert_close(k_got[loc], k_want[loc], **tol, msg="k'")
    assert torch.equal(v_got, v_want) and torch.equal(ki_got, ki_want), "v / kI' rows"
    others = torch.ones(k_got.shape[0], dtype=torch.bool, device=loc.device)
    others[loc] = False
    assert torch.equal(k_got[others], c["caches"][0][others]), "k' written outside loc"


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_cache_of_another_dtype(device, dtype):
    """Rows reach a cache of another dtype as the reference's rounded results, cast once more."""
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    c = _case(4, 4, 2, 16, 16, dtype, device, seed=3, cache_dtype=other)
    got, want = _run(c), _reference(c)
    assert torch.equal(got[2][1], want[2][1]) and torch.equal(got[2][2], want[2][2])


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("programs", [1, 3])
def test_decode_scores_in_the_same_launch(device, dtype, programs):
    """With `scores`, the launch also gives MSA's decode block scores: on every block selection
    reads (the history of rows with more than N causal blocks) what `msa_decode_scores` gives on
    the stored qI' and the caches after the step; the prologue's own results do not change. Rows
    of 2, 4 (exactly N), 8 and 12 blocks of 4; each of `programs` programs per (row, head) scores
    every programs-th block."""
    block, n, max_len, rows = 4, 4, 48, 4
    c = _case(rows, 4, 2, 16, 16, dtype, device, seed=9)
    gen = torch.Generator().manual_seed(10)
    n_slots = 7 * max_len
    c["caches"] = [torch.randn(n_slots, 2, 16, generator=gen).to(dtype).to(device) for _ in range(3)]
    table = torch.randperm(n_slots, generator=gen)[:6 * max_len].view(6, max_len).to(device)
    req_slots = torch.randperm(6, generator=gen)[:rows].to(device)
    c["positions"] = torch.tensor([5, 13, 30, 47], device=device)
    c["loc"] = table[req_slots, c["positions"]]
    want = _reference(c)
    caches = [x.clone() for x in c["caches"]]
    q, qI, s = msa_prologue(c["positions"], c["q"], c["k"], c["v"], c["qI"], c["kI"], c["qn_w"], c["kn_w"], EPS, EPS,
                            c["rope"].cos, c["rope"].sin, c["irope"].cos, c["irope"].sin, *caches, c["loc"],
                            scores=DecodeScores(table, req_slots, block, n, programs=programs))
    assert torch.equal(qI, want[1]) and torch.equal(caches[1], want[2][1]) and torch.equal(caches[2], want[2][2])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(caches[0], want[2][0], **tol)  # k': the norm's summation order
    s_want = msa_decode_scores(want[1], want[2][2], table, req_slots, c["positions"], block, select_blocks=n)
    assert s.shape == s_want.shape == (rows, 2, max_len // block)
    for r, p in enumerate(c["positions"].tolist()):
        history = p // block if p // block + 1 > n else 0  # blocks selection reads
        torch.testing.assert_close(s[r, :, :history], s_want[r, :, :history], rtol=1e-6, atol=1e-6)
        if device == "cpu":
            assert torch.equal(s[r, :, :history], s_want[r, :, :history])
    assert sum(p // block for p in c["positions"].tolist() if p // block + 1 > n) > 0


@pytest.mark.gpu
def test_captures_in_a_cuda_graph():
    c = _case(4, 16, 4, 128, 128, torch.bfloat16, "cuda", seed=1)
    caches = c["caches"]

    def call():
        return msa_prologue(c["positions"], c["q"], c["k"], c["v"], c["qI"], c["kI"], c["qn_w"], c["kn_w"], EPS, EPS,
                            c["rope"].cos, c["rope"].sin, c["irope"].cos, c["irope"].sin, *caches, c["loc"])

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, qI, _ = call()
    fresh = _case(4, 16, 4, 128, 128, torch.bfloat16, "cuda", seed=2)
    for name in ("q", "k", "v", "qI", "kI", "positions"):
        c[name].copy_(fresh[name])
    graph.replay()
    torch.cuda.synchronize()
    want = _reference({**c, "caches": [x.clone() for x in caches]})
    torch.testing.assert_close(q, want[0], rtol=1.6e-2, atol=1e-2)
    assert torch.equal(qI, want[1])
