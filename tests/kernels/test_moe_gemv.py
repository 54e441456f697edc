"""The MoE one-token path (kiln.kernels.moe_gemv, taken by `kiln.kernels.moe.fused_experts` at
one token) against the reference ops and against the grouped path, and the choice between them.

"cpu" runs the kernels under Triton's interpreter; "cuda" compiled, at the bench shapes' sizes.
"""

from __future__ import annotations

import pytest
import torch

from kiln import kernels
from kiln.ops import moe as ref
from tests.kernels.devices import DEVICES, INTERPRETER_ONLY
from tests.kernels.test_moe_kernels import _check_experts, _km, _routing, _weights

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="needs Triton")

# (device, dtype): the GEMV kernels widen every weight to fp32 before multiplying, so unlike the
# grouped path's tl.dot they also run bf16 under the interpreter.
GEMV_DTYPES = [pytest.param("cpu", torch.float32, id="cpu-fp32", marks=INTERPRETER_ONLY),
               pytest.param("cpu", torch.bfloat16, id="cpu-bf16", marks=INTERPRETER_ONLY),
               pytest.param("cuda", torch.float32, id="cuda-fp32", marks=pytest.mark.gpu),
               pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu)]

# (E, k, shared experts S, shared width in routed widths, shared weights given, ragged H and I)
GEMV_CASES = [pytest.param(4, 1, 0, 1, False, False, id="k1"),
              pytest.param(8, 3, 0, 1, False, False, id="k3"),
              pytest.param(8, 2, 2, 1, True, False, id="inkling-shared"),
              pytest.param(8, 2, 1, 2, False, False, id="minimax-shared"),
              pytest.param(8, 2, 2, 2, True, False, id="wide-weighted-shared"),  # 2 chunks per weight
              pytest.param(8, 2, 2, 1, True, True, id="ragged-shared"),
              pytest.param(8, 1, 0, 1, False, True, id="ragged-k1")]


def _one_token(device, dtype, E, k, S, shared_mult, shared_weighted, ragged, seed):
    """Random one-token inputs: (x, w13, w2, ids, w, shared) and the reference sum in fp32."""
    if device == "cuda":
        E, k = E * 8, k * 2
        H, I = (2000, 200) if ragged else (2048, 512)
    else:
        H, I = (37, 19) if ragged else (32, 16)  # several interpreter tiles; masked edges when ragged
    gen = torch.Generator().manual_seed(seed)
    w13, w2, sw13, sw2 = _weights(E, H, I, dtype, device, gen, shared_inter=S * I * shared_mult)
    x = torch.randn(1, H, generator=gen).to(device=device, dtype=dtype)
    ids, w = _routing(1, E, k, gen, device)
    want = ref.experts_ref(x, w13, w2, ids, w, torch.float32)
    shared = None
    if S:
        sw = (torch.rand(1, S, generator=gen) + 0.1).to(device) if shared_weighted else None
        shared = (sw13, sw2, sw)
        want = want + ref.shared_experts_ref(x, sw13, sw2, sw)
    return (x, w13, w2, ids, w, shared), want


def _tol(dtype):
    # bf16 as in _shape: the reference rounds its GEMM outputs to bf16, the kernels keep fp32.
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("device,dtype", GEMV_DTYPES)
@pytest.mark.parametrize("E,k,S,shared_mult,shared_weighted,ragged", GEMV_CASES)
def test_one_token_path_matches_reference(device, dtype, E, k, S, shared_mult, shared_weighted, ragged):
    args, want = _one_token(device, dtype, E, k, S, shared_mult, shared_weighted, ragged, seed=E + k + S)
    x, w13, w2, ids, w, shared = args
    got = _km().fused_experts(x, w13, w2, ids, w, shared=shared)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.to(dtype).float(), **_tol(dtype))
    got32 = _km().fused_experts(x, w13, w2, ids, w, out_dtype=torch.float32, shared=shared)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32, want, **_tol(dtype))
    assert (got32 - want).norm() <= 1e-2 * want.norm()


# fp32 only under the interpreter: the grouped path's bf16 tl.dot does not run there.
@pytest.mark.parametrize("device,dtype", [p for p in GEMV_DTYPES if p.id != "cpu-bf16"])
@pytest.mark.parametrize("E,k,S,shared_mult,shared_weighted,ragged", GEMV_CASES)
def test_one_token_path_matches_grouped_path(device, dtype, E, k, S, shared_mult, shared_weighted, ragged,
                                             monkeypatch):
    args, _ = _one_token(device, dtype, E, k, S, shared_mult, shared_weighted, ragged, seed=7 + E + k + S)
    gemv = _km().fused_experts(*args[:5], out_dtype=torch.float32, shared=args[5])
    monkeypatch.setattr(_km(), "GEMV_MAX_TOKENS", 0)
    grouped = _km().fused_experts(*args[:5], out_dtype=torch.float32, shared=args[5])
    # Both sum in fp32 and round act to the weights' dtype; only the order of the sums differs
    # (and with it, rarely, an act element's rounding in bf16).
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gemv, grouped, **tol)


class _Refused:
    """Stands in for a kernel that must not launch."""

    def __init__(self, name):
        self.name = name

    def __getitem__(self, grid):
        raise AssertionError(f"{self.name} launched")


@pytest.mark.parametrize("device", DEVICES)
def test_one_token_path_is_taken_at_one_token_only(device, monkeypatch):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    args, want = _one_token(device, dtype, 8, 2, 2, 1, True, False, seed=11)
    x, w13, w2, ids, w, shared = args
    km = _km()
    from kiln.kernels import moe_gemv
    with monkeypatch.context() as m:  # one token: the GEMV kernels only
        for name in ("_align_kernel", "_gate_up_kernel", "_down_kernel", "_sum_slots_kernel"):
            m.setattr(km, name, _Refused(name))
        got = km.fused_experts(x, w13, w2, ids, w, out_dtype=torch.float32, shared=shared)
        torch.testing.assert_close(got, want, **_tol(dtype))
        with pytest.raises(AssertionError, match="_align_kernel launched"):  # two tokens: grouped
            km.fused_experts(x.expand(2, -1), w13, w2, ids.expand(2, -1), w.expand(2, -1), shared=shared)
        cfg = km.pick_config(1, ids.shape[1], w13.shape[0], x.shape[1], w2.shape[2])
        with pytest.raises(AssertionError, match="_align_kernel launched"):  # an explicit config: grouped
            km.fused_experts(x, w13, w2, ids, w, shared=shared, config=cfg)
    with monkeypatch.context() as m:  # two tokens never launch the GEMV kernels
        for name in ("_expert_up_gemv_kernel", "_expert_down_gemv_kernel"):
            m.setattr(moe_gemv, name, _Refused(name))
        sw2 = shared[2].expand(2, -1)
        got = km.fused_experts(x.expand(2, -1), w13, w2, ids.expand(2, -1), w.expand(2, -1),
                               out_dtype=torch.float32, shared=(shared[0], shared[1], sw2))
        torch.testing.assert_close(got, want.expand(2, -1), **_tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_gemv_path_takes_several_tokens(device, monkeypatch):
    # The GEMV kernels take any T (what `benchmarks/kernel_bench/moe.py --gemv T` times), shared and not.
    monkeypatch.setattr(_km(), "GEMV_MAX_TOKENS", 4)
    for name in ("_align_kernel", "_gate_up_kernel", "_down_kernel", "_sum_slots_kernel"):
        monkeypatch.setattr(_km(), name, _Refused(name))
    _check_experts(device, 3, 8, 2, 2, seed=12)
    _check_experts(device, 4, 8, 3, 1, shared_mult=2, shared_weighted=False, seed=13)


@pytest.mark.parametrize("device", DEVICES)
def test_gemv_max_tokens_picks_the_path(device, monkeypatch):
    # The engine's --moe-gemv-max-tokens reaches `fused_experts` as gemv_max_tokens: up to it the
    # expert GEMVs (the grouped kernels refuse to launch), past it the grouped path.
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    args, want = _one_token(device, dtype, 8, 2, 2, 1, True, False, seed=14)
    x, w13, w2, ids, w, shared = args
    x4, ids4, w4 = x.expand(4, -1), ids.expand(4, -1), w.expand(4, -1)
    shared4 = (shared[0], shared[1], shared[2].expand(4, -1))
    km = _km()
    assert km.takes_conv(4, gemv_max_tokens=4) and not km.takes_conv(5, gemv_max_tokens=4)
    # the grouped path's sum takes a conv too; the GEMV path's down kernel decode sequences only
    assert km.takes_conv(1, gemv_max_tokens=0, chunk=True) and not km.takes_conv(5, gemv_max_tokens=8, chunk=True)
    with monkeypatch.context() as m:
        for name in ("_align_kernel", "_gate_up_kernel", "_down_kernel", "_sum_slots_kernel"):
            m.setattr(km, name, _Refused(name))
        got = km.fused_experts(x4, w13, w2, ids4, w4, out_dtype=torch.float32, shared=shared4, gemv_max_tokens=4)
        torch.testing.assert_close(got, want.expand(4, -1), **_tol(dtype))
        with pytest.raises(AssertionError, match="_align_kernel launched"):
            km.fused_experts(x4, w13, w2, ids4, w4, shared=shared4, gemv_max_tokens=3)


def _conv_state(h, kc, prefix, dtype, device, seed):
    """A ShortConv [h, kc] over paged decode state of one sequence with `prefix` earlier tokens:
    (conv args for `fused_experts(conv=...)`, the Paged state)."""
    from tests.kernels.test_shortconv_kernels import Paged

    gen = torch.Generator().manual_seed(seed)
    paged = Paged([prefix], [1], h, dtype, device, gen)
    cw = (0.5 * torch.randn(h, kc, generator=gen)).to(dtype).to(device)
    buf, table, rows, out_locs = paged.to_device()
    return (cw, buf, table, rows, torch.tensor([prefix + 1], device=device), out_locs), paged


@pytest.mark.parametrize("device,dtype", GEMV_DTYPES)
@pytest.mark.parametrize("E,k,S,shared_mult,shared_weighted,ragged",
                         [c for c in GEMV_CASES if c.id in ("k1", "inkling-shared", "minimax-shared", "ragged-shared")])
@pytest.mark.parametrize("kc,prefix", [(4, 5), (2, 0), (1, 3)])  # history longer / none / width 1
def test_one_token_conv_epilogue_is_experts_then_short_conv(device, dtype, E, k, S, shared_mult, shared_weighted,
                                                            ragged, kc, prefix):
    """Inkling's out_conv in the down GEMV's epilogue against `fused_experts` followed by
    `short_conv_decode` on the same state: equal outputs (the interpreter: bit for bit; compiled:
    within an ulp, the conv's adds may become FMAs) and the same state write (the rounded sum)."""
    from kiln.kernels.shortconv import short_conv_decode

    args, want_sum = _one_token(device, dtype, E, k, S, shared_mult, shared_weighted, ragged, seed=E + kc + prefix)
    x, w13, w2, ids, w, shared = args
    conv, paged = _conv_state(x.shape[1], kc, prefix, dtype, device, seed=kc * 10 + prefix)
    cw, buf, table, rows, seq_lens, out_locs = conv
    buf_ref = buf.clone()
    want = short_conv_decode(_km().fused_experts(x, w13, w2, ids, w, shared=shared), cw, buf_ref, table, rows,
                             seq_lens, out_locs)
    got = _km().fused_experts(x, w13, w2, ids, w, shared=shared, conv=conv)
    exact = device == "cpu"
    tol = dict(rtol=0, atol=0) if exact else (dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32
                                               else dict(rtol=1e-2, atol=1e-2))
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(buf, buf_ref)  # the state: the rounded sum at out_locs, nothing else
    ref_y, _ = paged.reference(want_sum.to(dtype), cw)
    torch.testing.assert_close(got.float(), ref_y.float(), **_tol(dtype))


def test_conv_epilogue_is_refused_where_no_kernel_holds_it():
    # The one-token path's down GEMV takes decode sequences only; the grouped path's sum at most
    # SUM_CONV_MAX_TOKENS tokens.
    args, _ = _one_token("cpu", torch.float32, 8, 2, 2, 1, True, False, seed=3)
    x, w13, w2, ids, w, shared = args
    conv, _ = _conv_state(x.shape[1], 4, 2, torch.float32, "cpu", seed=4)
    with pytest.raises(AssertionError, match="decode sequences only"):
        _km().fused_experts(x, w13, w2, ids, w, shared=shared, conv=conv, conv_chunk=True)
    n = _km().SUM_CONV_MAX_TOKENS + 1
    many = (x.expand(n, -1), w13, w2, ids.expand(n, -1), w.expand(n, -1))
    with pytest.raises(AssertionError, match="conv epilogue"):
        _km().fused_experts(*many, shared=(shared[0], shared[1], shared[2].expand(n, -1)), conv=conv)
    assert not _km().takes_conv(n) and _km().takes_conv(n - 1, chunk=True) and not _km().takes_conv(1, chunk=True)


# (prefix, extend) per sequence: decode sequences (extend 1), a K = 3 verify at batch 1, two K = 1
# verifies, a chunk at the sequence start
SUM_CONV_CASES = {"decode-3": ([4, 0, 7], [1, 1, 1]), "verify-b1": ([6], [4]), "verify-b2": ([2, 9], [2, 2]),
                  "start": ([0], [3])}


@pytest.mark.parametrize("device,dtype", [p for p in GEMV_DTYPES if p.id != "cpu-bf16"])
@pytest.mark.parametrize("case", list(SUM_CONV_CASES), ids=list(SUM_CONV_CASES))
@pytest.mark.parametrize("kc", [4, 1])
def test_grouped_conv_epilogue_is_experts_then_short_conv(device, dtype, case, kc):
    """Inkling's out_conv in the grouped path's sum (a few decode sequences, or a verify's short
    chunks: `conv_chunk`) against `fused_experts` followed by the ShortConv kernel on the same
    state: equal outputs (the interpreter: bit for bit) and the same state writes."""
    from kiln.kernels.shortconv import short_conv_decode, short_conv_extend
    from tests.kernels.test_shortconv_kernels import Paged

    prefix, ext = SUM_CONV_CASES[case]
    decode = all(e == 1 for e in ext)
    T = sum(ext)
    E, k, S = (64, 4, 2) if device == "cuda" else (8, 2, 2)
    H, I = (2048, 512) if device == "cuda" else (80, 16)  # CPU: three hidden tiles of SUM_CONV_BLOCK_H, one ragged
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
    got = _km().fused_experts(x, w13, w2, ids, w, shared=shared, conv=conv, conv_chunk=not decode)
    # compiled, the epilogue's conv adds may contract into FMAs (the ShortConv kernel forbids that)
    tol = dict(rtol=0, atol=0) if device == "cpu" else (dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32
                                                         else dict(rtol=1e-2, atol=1e-2))
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(buf, buf_ref)



@pytest.mark.gpu
def test_traced_expert_gemvs_are_bit_identical_and_their_times_ordered():
    """Both one-token expert GEMVs with `kiln.kernels.trace` buffers: the same output bit for bit,
    one ordered record per program (start <= wait returned <= prologue <= reduced <= stored)."""
    from kiln.kernels.trace import FIELDS, PROLOGUE, REDUCED, START, STORED, WAITED

    args, _ = _one_token("cuda", torch.bfloat16, 8, 3, 2, 1, True, False, seed=5)
    x, w13, w2, ids, w, shared = args
    up, down = (torch.zeros(8192 * FIELDS, dtype=torch.int64, device="cuda") for _ in range(2))
    want = _km().fused_experts(x, w13, w2, ids, w, shared=shared)
    got = _km().fused_experts(x, w13, w2, ids, w, shared=shared, trace=(up, down))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for buf in (up, down):
        rec = buf.view(-1, FIELDS).cpu()
        rec = rec[rec[:, START] != 0]
        assert len(rec) > 0
        for a, b in ((START, WAITED), (WAITED, PROLOGUE), (PROLOGUE, REDUCED), (REDUCED, STORED)):
            assert (rec[:, a] <= rec[:, b]).all(), (a, b)
