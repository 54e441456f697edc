"""The MoE few-token path (kiln.kernels.moe_few, taken by `kiln.kernels.moe.fused_experts` from 2 to
FEW_MAX_TOKENS tokens) against the reference ops and the grouped path, its conv epilogue against
the ShortConv kernels, and the choice of path.

"cpu" runs the kernels under Triton's interpreter (fp32 only: its tl.dot, as the grouped path's,
does not take bf16 there), with small tiles and three down splits; "cuda" compiled, at the bench
shapes' sizes.
"""

from __future__ import annotations

import pytest
import torch

from kiln import kernels
from kiln.ops import moe as ref
from tests.kernels.devices import INTERPRETER_ONLY
from tests.kernels.test_moe_gemv import SUM_CONV_CASES, _Refused
from tests.kernels.test_moe_kernels import _km, _routing, _weights

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="needs Triton")

# (device, dtype)
FEW_PARAMS = [pytest.param("cpu", torch.float32, id="cpu-fp32", marks=INTERPRETER_ONLY),
              pytest.param("cuda", torch.float32, id="cuda-fp32", marks=pytest.mark.gpu),
              pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu)]

# (T, E, k, shared experts S, shared width in routed widths, shared weights given, ragged H and I,
# routing pool: None for all experts, else a few, so that tokens share experts)
FEW_CASES = [pytest.param(2, 8, 2, 2, 1, True, False, None, id="T2-inkling-shared"),
             pytest.param(4, 8, 3, 1, 2, False, False, None, id="T4-minimax-shared"),
             pytest.param(3, 8, 2, 0, 1, False, True, None, id="T3-ragged-no-shared"),
             pytest.param(8, 8, 2, 2, 2, True, False, None, id="T8-wide-weighted-shared"),  # T*k > E: U = E
             pytest.param(5, 8, 3, 2, 1, True, True, [1, 4, 6], id="T5-three-experts-ragged"),
             pytest.param(4, 4, 1, 0, 1, False, False, [2], id="T4-one-expert")]


def _few_case(device, dtype, T, E, k, S, shared_mult, shared_weighted, ragged, pool, seed):
    """Random inputs: (x, w13, w2, ids, w, shared) and the reference sum in fp32."""
    if device == "cuda":
        E, k = E * 8, k * 2
        H, I = (2000, 200) if ragged else (2048, 512)
        pool = None if pool is None else [p * 8 for p in pool] + [p * 8 + 1 for p in pool]
    else:
        H, I = (37, 19) if ragged else (32, 16)  # several interpreter tiles; masked edges when ragged
    gen = torch.Generator().manual_seed(seed)
    w13, w2, sw13, sw2 = _weights(E, H, I, dtype, device, gen, shared_inter=S * I * shared_mult)
    x = torch.randn(T, H, generator=gen).to(device=device, dtype=dtype)
    ids, w = _routing(T, E, min(k, len(pool)) if pool else k, gen, device, pool)
    want = ref.experts_ref(x, w13, w2, ids, w, torch.float32)
    shared = None
    if S:
        sw = (torch.rand(T, S, generator=gen) + 0.1).to(device) if shared_weighted else None
        shared = (sw13, sw2, sw)
        want = want + ref.shared_experts_ref(x, sw13, sw2, sw)
    return (x, w13, w2, ids, w, shared), want


def _tol(dtype):
    # bf16 as the one-token path's: the reference rounds its GEMM outputs to bf16, the kernels keep fp32.
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)


def _refuse_others(m, km):
    """The grouped and one-token kernels must not launch."""
    from kiln.kernels import moe_gemv
    for name in ("_align_kernel", "_gate_up_kernel", "_down_kernel", "_sum_slots_kernel", "_sum_slots_conv_kernel"):
        m.setattr(km, name, _Refused(name))
    for name in ("_expert_up_gemv_kernel", "_expert_down_gemv_kernel"):
        m.setattr(moe_gemv, name, _Refused(name))


@pytest.mark.parametrize("device,dtype", FEW_PARAMS)
@pytest.mark.parametrize("T,E,k,S,shared_mult,shared_weighted,ragged,pool", FEW_CASES)
def test_few_path_matches_reference(device, dtype, T, E, k, S, shared_mult, shared_weighted, ragged, pool,
                                    monkeypatch):
    args, want = _few_case(device, dtype, T, E, k, S, shared_mult, shared_weighted, ragged, pool, seed=T + E + k + S)
    x, w13, w2, ids, w, shared = args
    km = _km()
    with monkeypatch.context() as m:
        _refuse_others(m, km)
        got = km.fused_experts(x, w13, w2, ids, w, shared=shared)
        got32 = km.fused_experts(x, w13, w2, ids, w, out_dtype=torch.float32, shared=shared)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.to(dtype).float(), **_tol(dtype))
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32, want, **_tol(dtype))
    assert (got32 - want).norm() <= 1e-2 * want.norm()


@pytest.mark.parametrize("device,dtype", FEW_PARAMS)
@pytest.mark.parametrize("T,E,k,S,shared_mult,shared_weighted,ragged,pool",
                         [c for c in FEW_CASES if c.id in ("T2-inkling-shared", "T8-wide-weighted-shared",
                                                           "T5-three-experts-ragged")])
def test_few_path_matches_grouped_path(device, dtype, T, E, k, S, shared_mult, shared_weighted, ragged, pool):
    args, _ = _few_case(device, dtype, T, E, k, S, shared_mult, shared_weighted, ragged, pool, seed=7 + T + E)
    few = _km().fused_experts(*args[:5], out_dtype=torch.float32, shared=args[5])
    grouped = _km().fused_experts(*args[:5], out_dtype=torch.float32, shared=args[5], few_max_tokens=0)
    # Both sum in fp32 and round act to the weights' dtype; only the order of the sums differs.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(few, grouped, **tol)


def test_distinct_experts_are_read_once():
    """The walk's contract, seen from the weights: experts no token selected are never read (NaNs
    there change nothing), and each selected expert reaches exactly the tokens that selected it
    (a change to its down weights moves those tokens' outputs and leaves the others' bits)."""
    args, want = _few_case("cpu", torch.float32, 4, 8, 2, 2, 1, True, False, [0, 3, 5], seed=21)
    x, w13, w2, ids, w, shared = args
    km = _km()
    base = km.fused_experts(x, w13, w2, ids, w, out_dtype=torch.float32, shared=shared)
    unused = sorted(set(range(8)) - set(ids.flatten().tolist()))
    w13n, w2n = w13.clone(), w2.clone()
    w13n[unused] = float("nan")
    w2n[unused] = float("nan")
    assert torch.equal(km.fused_experts(x, w13n, w2n, ids, w, out_dtype=torch.float32, shared=shared), base)
    for e in ids.flatten().unique().tolist():
        w2e = w2.clone()
        w2e[e] += 1.0
        got = km.fused_experts(x, w13, w2e, ids, w, out_dtype=torch.float32, shared=shared)
        hit = (ids == e).any(dim=1)
        assert hit.any() and torch.equal(got[~hit], base[~hit]), e
        assert ((got[hit] - base[hit]).abs().amax(dim=1) > 1e-3).all(), e


def test_few_path_is_taken_between_the_gemv_and_grouped_paths(monkeypatch):
    args, _ = _few_case("cpu", torch.float32, 8, 8, 2, 2, 1, True, False, None, seed=14)
    x, w13, w2, ids, w, shared = args
    km = _km()
    from kiln.kernels import moe_few

    def rows(n):
        return x[:n], w13, w2, ids[:n], w[:n]

    def sh(n):
        return (shared[0], shared[1], shared[2][:n])

    assert km.FEW_MAX_TOKENS == moe_few.MAX_TOKENS
    assert not km.on_few_path(1, 2) and km.on_few_path(2, 2) and km.on_few_path(8, 2) and not km.on_few_path(9, 2)
    assert not km.on_few_path(2, 2, gemv_max_tokens=2) and km.on_few_path(3, 2, gemv_max_tokens=2)
    assert not km.on_few_path(4, 2, few_max_tokens=3) and not km.on_few_path(4, 2, few_max_tokens=0)
    assert not km.on_few_path(8, 9)  # 72 assignments: past MAX_ASSIGNMENTS
    assert not km.on_few_path(4, 2, config=km.pick_config(4, 2, 8, 32, 16))
    # the conv epilogue: the few path takes decode sequences and chunks up to its limit
    assert km.takes_conv(8, chunk=True, top_k=2) and km.takes_conv(8, top_k=2)
    assert not km.takes_conv(8, chunk=True, top_k=2, few_max_tokens=0)  # the grouped sum: 4 at most
    with monkeypatch.context() as m:
        _refuse_others(m, km)
        for n in (2, 5, 8):
            km.fused_experts(*rows(n), shared=sh(n))
        with pytest.raises(AssertionError, match="_align_kernel launched"):
            km.fused_experts(*rows(4), shared=sh(4), few_max_tokens=3)
        with pytest.raises(AssertionError, match="_expert_up_gemv_kernel launched"):
            km.fused_experts(*rows(1), shared=sh(1))
    with monkeypatch.context() as m:  # the few path's kernels do not launch outside it
        for name in ("_few_up_kernel", "_few_down_kernel"):
            m.setattr(moe_few, name, _Refused(name))
        km.fused_experts(*rows(1), shared=sh(1))
        km.fused_experts(*rows(4), shared=sh(4), few_max_tokens=0)
        km.fused_experts(*rows(4), shared=sh(4), gemv_max_tokens=4)


@pytest.mark.parametrize("device,dtype", FEW_PARAMS)
@pytest.mark.parametrize("case", list(SUM_CONV_CASES) + ["decode-8"])
@pytest.mark.parametrize("kc", [4, 1])
def test_few_conv_epilogue_is_experts_then_short_conv(device, dtype, case, kc, monkeypatch):
    """Inkling's out_conv in the few path's down kernel (decode sequences, or a verify's short
    chunks: `conv_chunk`) against the same path without it followed by the ShortConv kernel on the
    same state: equal outputs (the interpreter: bit for bit) and the same state writes."""
    from kiln.kernels.shortconv import short_conv_decode, short_conv_extend
    from tests.kernels.test_shortconv_kernels import Paged

    prefix, ext = SUM_CONV_CASES[case] if case in SUM_CONV_CASES else ([3, 0, 5, 1, 9, 2, 4, 6], [1] * 8)
    decode = all(e == 1 for e in ext)
    T = sum(ext)
    E, k, S = (64, 4, 2) if device == "cuda" else (8, 2, 2)
    H, I = (2048, 512) if device == "cuda" else (37, 16)  # CPU: three hidden tiles of 16, one ragged
    gen = torch.Generator().manual_seed(T * 10 + kc)
    w13, w2, sw13, sw2 = _weights(E, H, I, dtype, device, gen, shared_inter=S * I)
    x = torch.randn(T, H, generator=gen).to(device=device, dtype=dtype)
    ids, w = _routing(T, E, k, gen, device)
    shared = (sw13, sw2, (torch.rand(T, S, generator=gen) + 0.1).to(device))
    paged = Paged(prefix, ext, H, dtype, device, gen)
    cw = (0.5 * torch.randn(H, kc, generator=gen)).to(dtype).to(device)
    buf, table, rows, out_locs = paged.to_device()
    buf_ref = buf.clone()
    moe = _km().fused_experts(x, w13, w2, ids, w, shared=shared)
    if decode:
        lens = torch.tensor([p + 1 for p in prefix], device=device)
        want = short_conv_decode(moe, cw, buf_ref, table, rows, lens, out_locs)
        conv = (cw, buf, table, rows, lens, out_locs)
    else:
        prefix_t, ext_t, starts, token_rows, positions = paged.chunk_tensors()
        want = short_conv_extend(moe, cw, buf_ref, table, rows, prefix_t, ext_t, starts, out_locs)
        conv = (cw, buf, table, token_rows, positions, out_locs)
    with monkeypatch.context() as m:
        _refuse_others(m, _km())
        got = _km().fused_experts(x, w13, w2, ids, w, shared=shared, conv=conv, conv_chunk=not decode)
    # compiled, the epilogue's conv adds may contract into FMAs (the ShortConv kernel forbids that)
    tol = dict(rtol=0, atol=0) if device == "cpu" else (dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32
                                                         else dict(rtol=1e-2, atol=1e-2))
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(buf, buf_ref)


def _capture(fn):
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.gpu
@pytest.mark.parametrize("T", [2, 4, 8])
def test_few_path_cuda_graph_replay_equals_eager_with_new_routing(T):
    """A graph captured once replays new routings (the distinct experts are found on the device)
    to the eager bits, and its arrival counts are zeroed on every replay."""
    args, _ = _few_case("cuda", torch.bfloat16, T, 8, 3, 2, 1, True, False, None, seed=T)
    x, w13, w2, ids, w, shared = args
    gen = torch.Generator().manual_seed(T + 1)
    graph, out = _capture(lambda: _km().fused_experts(x, w13, w2, ids, w, shared=shared))
    for case in ("random", "three shared", "one shared"):
        if case == "random":
            new_ids = torch.rand(T, 64, generator=gen).argsort(dim=1)[:, :6]
        elif case == "three shared":  # the same three experts in each token's own order, then three more
            perm = torch.stack([torch.tensor([3, 9, 17])[torch.randperm(3, generator=gen)] for _ in range(T)])
            new_ids = torch.cat([perm, torch.tensor([[50, 51, 52]]).expand(T, 3)], dim=1)
        else:  # every token the same six
            new_ids = torch.arange(40, 46).expand(T, 6)
        ids.copy_(new_ids)
        w.copy_(torch.rand(T, 6, generator=gen).to("cuda") + 0.1)
        x.copy_(torch.randn(T, x.shape[1], generator=gen).to("cuda", x.dtype))
        graph.replay()
        assert torch.equal(out, _km().fused_experts(x, w13, w2, ids, w, shared=shared)), case
