"""Triton decode GEMV (`kiln.kernels.gemv`) vs F.linear.

"cpu" cases run under Triton's interpreter (fp32); "cuda" cases compile in fp32 and bf16. Both
inner loops are covered: CUDA-core FMAs for 1..4 rows, one MMA tile for 5..16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kiln.kernels.gemv import gemv  # noqa: E402
from kiln.kernels.gemv_tiles import FMA_MAX_ROWS, MAX_ROWS, WIDEN_MAX_ROWS, fma_tile  # noqa: E402
from tests.kernels.devices import DEVICE_DTYPES, DEVICES, record_launches  # noqa: E402

FP32 = dict(rtol=1e-4, atol=1e-4)
BF16 = dict(rtol=2e-2, atol=2e-2)


def _case(m, n, k, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(device)
    return x, w


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, MAX_ROWS])
@pytest.mark.parametrize("n,k", [(96, 64), (37, 200), (8, 1000)])
def test_gemv_matches_linear(device, dtype, m, n, k):
    """Ragged N and K (not multiples of any tile), every row count of both loops."""
    x, w = _case(m, n, k, dtype, device, seed=m * 1000 + n + k)
    y = gemv(x, w)
    assert y.shape == (m, n) and y.dtype == x.dtype
    torch.testing.assert_close(y, F.linear(x, w), **(FP32 if dtype == torch.float32 else BF16))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(96, 64), (74, 200), (2, 1000)])
def test_gemv_glu_is_gemv_then_silu_and_mul(device, dtype, m, n, k):
    """The fused gate_up + SiLU-and-mul GEMV: bit for bit the two launches it replaces (ragged I
    and K, every FMA row count), and close to the reference SwiGLU."""
    from kiln.kernels.activation import silu_and_mul
    from kiln.layers.activation import silu_and_mul_ref

    x, w = _case(m, n, k, dtype, device, seed=m * 1000 + n + k)
    y = gemv(x, w, glu=True)
    assert y.shape == (m, n // 2) and y.dtype == x.dtype
    torch.testing.assert_close(y, silu_and_mul(gemv(x, w)), rtol=0, atol=0)
    ref = silu_and_mul_ref(F.linear(x.float(), w.float()))
    torch.testing.assert_close(y.float(), ref, **(FP32 if dtype == torch.float32 else BF16))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("m,mma", [(1, False), (2, False), (4, False), (5, False), (MAX_ROWS, False), (1, True),
                                   (3, True), (4, True)])
@pytest.mark.parametrize("n,k", [(96, 64), (37, 200)])
def test_gemv_float_out_is_the_cast_of_its_result(device, dtype, m, mma, n, k):
    """float_out (the LM heads' fp32 logits): bit for bit `.float()` of the result in x's dtype,
    on both loops (the MMA loop at 1..4 rows with `mma`)."""
    x, w = _case(m, n, k, dtype, device, seed=m * 100 + n + k)
    y = gemv(x, w, float_out=True, mma=mma)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, gemv(x, w, mma=mma).float(), rtol=0, atol=0)
    with pytest.raises(AssertionError, match="float_out|glu takes"):
        gemv(x, torch.cat([w, w]), glu=True, float_out=True)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(96, 64), (37, 200)])
def test_gemv_mma_loop_at_few_rows_matches_linear(device, dtype, m, n, k, monkeypatch):
    """`mma` (an LM head of 1..4 rows): the MMA loop's product, its rows padded to 16, close to
    F.linear."""
    from kiln.kernels import gemv as gemv_module

    calls = record_launches(monkeypatch, gemv_module, "_gemv_dot_kernel")
    x, w = _case(m, n, k, dtype, device, seed=m * 10 + n + k)
    y = gemv(x, w, mma=True)
    assert calls, "mma did not take the MMA loop"
    torch.testing.assert_close(y, F.linear(x, w), **(FP32 if dtype == torch.float32 else BF16))
    with pytest.raises(AssertionError, match="plain product"):
        gemv(x, torch.cat([w, w]), glu=True, mma=True)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(28672, 4096), (12288, 2048)])
def test_gemv_glu_real_shapes(n, k):
    """The 8B and Inkling bench gate_up shapes, bf16, at one row (the engine's default)."""
    from kiln.kernels.activation import silu_and_mul

    x, w = _case(1, n, k, torch.bfloat16, "cuda", seed=n)
    torch.testing.assert_close(gemv(x, w, glu=True), silu_and_mul(gemv(x, w)), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (2048, 2048), (12288, 2048)])
def test_gemv_real_shapes(m, n, k):
    """The tiles the engine launches at the 8B and Inkling bench shapes, bf16."""
    x, w = _case(m, n, k, torch.bfloat16, "cuda", seed=n + k + m)
    torch.testing.assert_close(gemv(x, w).float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)


def _output_digest() -> str:
    """SHA-256 of the GEMV's outputs at the 8B qkv shape for 1, 2, 4 and 8 rows (bf16, CUDA)."""
    import hashlib

    h = hashlib.sha256()
    for m in (1, 2, 4, 8):
        x, w = _case(m, 6144, 4096, torch.bfloat16, "cuda", seed=m)
        h.update(gemv(x, w).view(torch.int16).cpu().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.gpu
def test_gemv_is_bitwise_reproducible_across_processes():
    """Another process computes the same bits: the tile does not depend on timing (both loops)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = "from tests.kernels.test_gemv import _output_digest; print(_output_digest())"
    there = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert there.stdout.strip() == _output_digest()


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_gemv_reads_row_strided_inputs(device, dtype):
    """x may be a row-strided view (the attention output slice of a wider buffer)."""
    x, w = _case(3, 48, 64, dtype, device, seed=3)
    view = torch.cat([x, x[:, :16]], dim=1)[:, :64]
    assert not view.is_contiguous()
    torch.testing.assert_close(gemv(view, w), F.linear(x, w), **(FP32 if dtype == torch.float32 else BF16))


def test_gemv_rejects_bad_shapes():
    w = torch.randn(8, 16)
    with pytest.raises(AssertionError, match="rows"):
        gemv(torch.randn(MAX_ROWS + 1, 16), w)
    with pytest.raises(AssertionError, match="does not match"):
        gemv(torch.randn(2, 32), w)
    with pytest.raises(AssertionError, match="differ"):
        gemv(torch.randn(2, 16, dtype=torch.float64), w)
    with pytest.raises(AssertionError, match="rows"):
        gemv(torch.randn(WIDEN_MAX_ROWS + 1, 16, dtype=torch.float16), w)
    with pytest.raises(AssertionError, match="plain product"):  # (widened rows)
        gemv(torch.randn(FMA_MAX_ROWS + 1, 16, dtype=torch.float16), w, float_out=True)
    with pytest.raises(AssertionError, match="glu"):
        gemv(torch.randn(FMA_MAX_ROWS + 1, 16), w, glu=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [3, 5, 8, 33, WIDEN_MAX_ROWS])
def test_gemv_widens_half_rows_for_an_fp32_weight(device, m):
    """Half-precision rows against an fp32 weight (a MoE router): the fp32 `F.linear(x.float(),
    weight)` to summation order, past 4 rows in blocks of 4 side by side (a partial last one at 5
    and 33)."""
    half = torch.float16 if device == "cpu" else torch.bfloat16  # (the interpreter has no bf16)
    x, w = _case(m, 66, 200, torch.float32, device, seed=m)
    x = x.to(half)
    y = gemv(x, w)
    assert y.dtype == torch.float32 and y.shape == (m, 66)
    torch.testing.assert_close(y, F.linear(x.float(), w), **FP32)


def test_gemv_max_rows_flag():
    """--gemv-max-rows: unset by default (the runner resolves it: 1 on one sm_90+ GPU with PDL, else 0), 0..16
    (one MMA tile of rows), a clear error otherwise."""
    import argparse

    from kiln.config import EngineConfig

    def parse(argv):
        p = argparse.ArgumentParser()
        EngineConfig.add_cli_args(p)
        return EngineConfig.from_cli_args(p.parse_args(argv))

    assert parse(["--model-path", "m"]).gemv_max_rows is None
    assert parse(["--model-path", "m", "--gemv-max-rows", "0"]).gemv_max_rows == 0
    for bad in (-1, MAX_ROWS + 1):
        with pytest.raises(ValueError, match="--gemv-max-rows takes 0"):
            EngineConfig(model_path="m", gemv_max_rows=bad)


def test_prefetch_plan_covers_the_span_once():
    """`kiln.kernels.prefetch`: the chunks the first programs issue (program p: chunks p, p + P,
    ...; the last one cut at the span's end, empty ones skipped) tile the span exactly, in
    16-byte units, and a span over the budget is not prefetched."""
    from kiln.kernels.prefetch import ALIGN, CHUNKS_PER_PROGRAM, prefetch_plan

    for span, grid, sms in [(33554432, 2048, 132), (7340032 + 6, 1536, 132), (4096, 3, 132), (48, 1, 132),
                            (2 ** 20, 64, 132), (123456 * 16, 10 ** 5, 132)]:
        plan = prefetch_plan(span, 40 << 20, grid, sms)
        assert plan["PREFETCH"] and plan["PF_PROGRAMS"] == min(grid, sms)
        assert plan["PF_SPAN"] == span // ALIGN * ALIGN and plan["PF_CHUNK"] % ALIGN == 0
        covered = []
        for pid in range(plan["PF_PROGRAMS"]):
            for i in range(CHUNKS_PER_PROGRAM.value):  # the kernel's arithmetic, per lane
                start = (pid + i * plan["PF_PROGRAMS"]) * plan["PF_CHUNK"]
                n = min(max(plan["PF_SPAN"] - start, 0), plan["PF_CHUNK"])
                if n:
                    assert n % ALIGN == 0
                    covered.append((start, start + n))
        covered.sort()
        assert covered[0][0] == 0 and covered[-1][1] == plan["PF_SPAN"]
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), "gaps or overlaps"
    assert not prefetch_plan(41 << 20, 40 << 20, 100, 132)["PREFETCH"]  # over the budget
    assert not prefetch_plan(15, 40 << 20, 100, 132)["PREFETCH"]  # under one 16-byte unit
    assert not prefetch_plan(4096, 0, 100, 132)["PREFETCH"]  # off


def test_prefetch_is_off_where_it_cannot_run():
    """The interpreter (these CPU tests) and CPU tensors never compile the prefetch in, and the
    result is the plain GEMV's."""
    from kiln.kernels.prefetch import prefetch_args

    x, w = _case(1, 37, 200, torch.float32, "cpu", seed=5)
    assert not prefetch_args(w, 1 << 30, 10)["PREFETCH"]
    torch.testing.assert_close(gemv(x, w, prefetch_bytes=1 << 30), gemv(x, w), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,glu", [(1, 2048, 2048, False), (1, 3584, 2048, False), (1, 12288, 2048, True),
                                       (2, 4096, 4096, False), (8, 2048, 2048, False), (1, 37, 200, False)])
def test_gemv_with_l2_prefetch_is_bit_identical(m, n, k, glu):
    """The L2 prefetch compiles in and launches (both loops, the GLU epilogue, a ragged span, a
    weight view with a row stride, an fp32 router weight) and leaves the output bit for bit the
    plain GEMV's. A prefetch is a hint, so this cannot see a wrong range: the span it asks for is
    checked here against the weight's storage, and its chunking by `test_prefetch_plan_...`."""
    from kiln.kernels.prefetch import prefetch_args

    x, w = _case(m, n, k, torch.bfloat16, "cuda", seed=n + k + m)
    plan = prefetch_args(w, 1 << 30, 64)
    assert plan["PREFETCH"] == (torch.cuda.get_device_capability() >= (9, 0))
    if plan["PREFETCH"]:
        assert plan["PF_SPAN"] == (n * k * 2) // 16 * 16 <= w.untyped_storage().nbytes()
    assert not prefetch_args(w, 16, 64)["PREFETCH"]
    torch.testing.assert_close(gemv(x, w, glu=glu, prefetch_bytes=1 << 30), gemv(x, w, glu=glu), rtol=0, atol=0)
    wide = torch.randn(n, k + 64, device="cuda").to(torch.bfloat16)[:, 32:32 + k]  # row stride k + 64
    torch.testing.assert_close(gemv(x, wide, prefetch_bytes=1 << 30), gemv(x, wide), rtol=0, atol=0)
    if m <= FMA_MAX_ROWS and not glu:
        w32 = w.float()
        torch.testing.assert_close(gemv(x, w32, prefetch_bytes=1 << 30), gemv(x, w32), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("prenorm", [False, True])
def test_traced_gemv_is_bit_identical_and_its_times_ordered(prenorm):
    """A traced launch (`kiln.kernels.trace`) computes the same output bit for bit, and every
    program's record is ordered: start <= wait returned <= prologue <= reduced <= stored, on a real SM."""
    from kiln.kernels.gemv import gemv_prenorm
    from kiln.kernels.gemv_tiles import prenorm_tile
    from kiln.kernels.trace import FIELDS, PROLOGUE, REDUCED, SM, START, STORED, WAITED

    x, w = _case(1, 3584, 2048, torch.bfloat16, "cuda", seed=11)
    trace = torch.zeros(4096 * FIELDS, dtype=torch.int64, device="cuda")
    if prenorm:
        ln = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
        res = torch.randn_like(x)
        got = gemv_prenorm(x, res, ln, 1e-5, w, trace=trace)[0]
        want = gemv_prenorm(x, res, ln, 1e-5, w)[0]
        programs = 3584 // prenorm_tile(1, 3584, 2048)["BLOCK_N"]
    else:
        got, want, programs = gemv(x, w, trace=trace), gemv(x, w), 3584 // fma_tile(1, 2048)["BLOCK_N"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    rec = trace.view(-1, FIELDS).cpu()
    assert (rec[:programs, START] > 0).all() and (rec[programs:] == 0).all(), "one record per program"
    rec = rec[:programs]
    assert (rec[:, START] <= rec[:, WAITED]).all() and (rec[:, WAITED] <= rec[:, PROLOGUE]).all()
    assert (rec[:, PROLOGUE] <= rec[:, REDUCED]).all()
    assert (rec[:, REDUCED] <= rec[:, STORED]).all()
    assert rec[:, SM].max() < torch.cuda.get_device_properties(0).multi_processor_count


def test_traced_gemv_is_refused_where_it_cannot_run():
    """The interpreter has no inline PTX: asking for a trace there is a clear error, not a crash."""
    from kiln.kernels import interpreting
    from kiln.kernels.trace import FIELDS, trace_args

    x = torch.zeros(1, 8)
    assert trace_args(None, x, 4) == dict(TR=x, TRACE=False)
    if interpreting():
        with pytest.raises(AssertionError, match="needs a GPU"):
            trace_args(torch.zeros(4 * FIELDS, dtype=torch.int64), x, 4)
    elif torch.cuda.is_available():
        with pytest.raises(AssertionError, match="int64 buffer"):
            trace_args(torch.zeros(3 * FIELDS, dtype=torch.int64, device="cuda"), x, 4)


PRENORM_CASES = [(96, 64, False, False), (74, 200, True, True), (37, 200, False, True)]  # n, k, glu, residual
PRENORM_REAL = [(3328, 2048, False, True), (2048, 2048, True, False), (6144, 4096, False, True)]  # bench, 8B


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("n,k,glu,with_residual", PRENORM_CASES)
@pytest.mark.parametrize("stats_block", [4096, 64])
def test_gemv_prenorm_is_norm_then_gemv(device, dtype, m, n, k, glu, with_residual, stats_block, monkeypatch):
    """The norm in the GEMV's prologue (`gemv_prenorm`) against the norm kernel then the GEMV: the
    residual sum bit for bit, the normed rows and the product within an ulp of the norm's output
    (its statistics are summed in another order; the interpreter: bit for bit), for ragged K,
    with and without a residual (the first layer), plain and with the SiLU-and-mul; the row
    statistics in one step and (stats_block 64) in several."""
    from kiln.kernels import gemv as gemv_module

    monkeypatch.setattr(gemv_module, "PRENORM_MAX_BLOCK", stats_block)
    # the interpreter sums a one-step row as the norm kernel does (numpy); several steps differ
    _check_prenorm(device, dtype, m, n, k, glu, with_residual, exact=device == "cpu" and stats_block == 4096)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("n,k,glu,with_residual", PRENORM_REAL)
def test_gemv_prenorm_real_shapes(m, n, k, glu, with_residual):
    """Inkling bench's qkvr and dense gate_up, the 8B's qkv, in bf16."""
    _check_prenorm("cuda", torch.bfloat16, m, n, k, glu, with_residual, exact=False)


def _check_prenorm(device, dtype, m, n, k, glu, with_residual, exact):
    from kiln.kernels.gemv import gemv_prenorm
    from kiln.kernels.norm import fused_add_rms_norm, rms_norm

    gen = torch.Generator().manual_seed(m * 100 + n + k)
    h, w = _case(m, n, k, dtype, device, seed=m * 100 + n + k + 1)
    res = torch.randn(m, k, generator=gen).to(dtype).to(device) if with_residual else None
    nw = (torch.rand(k, generator=gen) + 0.5).to(dtype).to(device)
    y, summed, normed = gemv_prenorm(h, res, nw, 1e-6, w, glu=glu, keep_normed=True)
    want_x, want_sum = fused_add_rms_norm(h, res, nw, 1e-6) if with_residual else (rms_norm(h, nw, 1e-6), h)
    assert torch.equal(summed, want_sum)
    assert with_residual or summed is h
    tol = dict(rtol=0, atol=0) if exact else (FP32 if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2))
    torch.testing.assert_close(normed, want_x, **tol)
    torch.testing.assert_close(y, gemv(want_x, w, glu=glu), **tol)
    if not exact and dtype == torch.bfloat16:  # at most one bf16 ulp apart, and rarely
        ulp = (want_x.float().abs() * 2 ** -7).clamp_min(2 ** -126)
        assert ((normed.float() - want_x.float()).abs() <= ulp).all()
        assert (normed != want_x).float().mean() < 0.01
    y2, _, none = gemv_prenorm(h, res, nw, 1e-6, w, glu=glu)  # without keep_normed: the same y
    assert none is None and torch.equal(y2, y)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("m,glu", [(1, False), (3, True)])
def test_activation_tiles_ahead_change_no_bit(device, dtype, m, glu):
    """XPIPE (x, and a folded norm's residual and weight, loaded one K step ahead) only moves
    loads: over several K steps the product, the norm prologue's stored sum and normed rows equal
    the kernel loading each tile in its own step, bit for bit."""
    from kiln.kernels.gemv import gemv_prenorm
    from kiln.kernels.gemv_tiles import INTERPRETER_TILE

    x, w = _case(m, 10, 200, dtype, device, seed=m + 7)
    # several K steps on both devices (the rule's tiles cover K = 200 in one)
    base = dict(INTERPRETER_TILE) if device == "cpu" else dict(BLOCK_N=4, BLOCK_K=64, num_warps=4, num_stages=1)
    on, off = dict(base, XPIPE=True), dict(base, XPIPE=False)
    assert 200 > base["BLOCK_K"], "the check needs several K steps"
    assert torch.equal(gemv(x, w, tile=on, glu=glu), gemv(x, w, tile=off, glu=glu))
    res = torch.randn_like(x)
    nw = torch.rand(200, dtype=dtype, device=device) + 0.5
    got = gemv_prenorm(x, res, nw, 1e-6, w, glu=glu, keep_normed=True, tile=on)
    want = gemv_prenorm(x, res, nw, 1e-6, w, glu=glu, keep_normed=True, tile=off)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("n,k,block_k", [(12, 64, 64), (10, 200, 256)])
@pytest.mark.parametrize("glu", [False, True])
def test_one_tile_gemv_matches_linear_and_the_norm_then_gemv(device, dtype, n, k, block_k, glu):
    """A tile whose BLOCK_K covers K takes the kernel's loop-free path (ONE_TILE: the whole row
    loaded before the wait, no accumulator tile): the product as F.linear's (and SiLU-and-mul of
    it), the norm prologue's output as the norm then the same one-tile GEMV, residual stored."""
    from kiln.kernels.gemv import gemv_prenorm
    from kiln.kernels.norm import fused_add_rms_norm

    one = dict(BLOCK_N=2, BLOCK_K=block_k, num_warps=4, num_stages=1)
    x, w = _case(1, n, k, dtype, device, seed=n + k)
    want = F.linear(x.float(), w.float())
    if glu:
        want = F.silu(want[:, : n // 2]) * want[:, n // 2:]
    tol = FP32 if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gemv(x, w, tile=one, glu=glu).float(), want, **tol)
    res = torch.randn_like(x)
    nw = torch.rand(k, dtype=dtype, device=device) + 0.5
    y, summed, normed = gemv_prenorm(x, res, nw, 1e-6, w, glu=glu, keep_normed=True, tile=one)
    want_x, want_sum = fused_add_rms_norm(x, res, nw, 1e-6)
    assert torch.equal(summed, want_sum)
    exact = dict(rtol=0, atol=0) if device == "cpu" else tol
    torch.testing.assert_close(normed, want_x, **exact)
    torch.testing.assert_close(y, gemv(want_x, w, tile=one, glu=glu), **exact)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_prenorm_widens_for_an_fp32_router(m):
    """bf16 rows against an fp32 weight (a MoE router): the fp32 logits of the bf16 normed rows."""
    from kiln.kernels.gemv import gemv_prenorm
    from kiln.kernels.norm import fused_add_rms_norm

    gen = torch.Generator().manual_seed(m)
    h, res = (torch.randn(m, 2048, generator=gen).bfloat16().cuda() for _ in range(2))
    nw = (torch.rand(2048, generator=gen) + 0.5).bfloat16().cuda()
    w = (torch.randn(66, 2048, generator=gen) / 2048 ** 0.5).cuda()
    y, _, normed = gemv_prenorm(h, res, nw, 1e-6, w, keep_normed=True)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(normed.float(), w), **FP32)
    torch.testing.assert_close(normed, fused_add_rms_norm(h, res, nw, 1e-6)[0], rtol=1e-2, atol=1e-2)


def test_gemv_prenorm_rejects_what_it_cannot_fuse():
    from kiln.kernels.gemv import gemv_prenorm

    h, w = _case(5, 8, 64, torch.float32, "cpu", seed=0)
    nw = torch.ones(64)
    with pytest.raises(AssertionError, match="norm prologue"):
        gemv_prenorm(h, None, nw, 1e-6, w)
    with pytest.raises(AssertionError, match="residual must match"):
        gemv_prenorm(h[:2], h[:3], nw, 1e-6, w)
    with pytest.raises(AssertionError):
        gemv_prenorm(h[:2], None, torch.ones(32), 1e-6, w)


def test_decode_prenorm_folds_only_without_hooks_and_with_its_flag():
    """`decode_prenorm` runs the norm in the GEMV's prologue for h at most the backend's
    `fold_norms_max_hidden` wide and a plain RMSNorm; for a narrower limit, or with a hook on the
    norm, the sublayer or its projection (the hooks must see the calls), it runs the norm and
    leaves the projection to the sublayer's call (y None), with the same values (the
    interpreter: bit for bit)."""
    from types import SimpleNamespace

    from kiln.kernels import gemv as gemv_module
    from kiln.layers.decode_gemv import decode_prenorm
    from kiln.layers.linear import ColumnParallelLinear
    from kiln.layers.norm import RMSNorm

    h, w = _case(1, 48, 64, torch.float32, "cpu", seed=4)
    res = torch.randn(1, 64)
    sublayer = torch.nn.Module()
    sublayer.proj = ColumnParallelLinear(64, 48)
    sublayer.proj.weight.data.copy_(w)
    norm = RMSNorm(64)
    norm.weight.data.uniform_(0.5, 1.5)
    folded = []
    real = gemv_module.gemv_prenorm

    def batch(flag):
        return SimpleNamespace(backend=SimpleNamespace(use_kernels=True, gemv_max_rows=4, gemv_prefetch_bytes=0,
                                                       fold_norms_max_hidden=64 if flag else 63))  # h is 64 wide

    def run(flag, residual):
        return decode_prenorm(norm, sublayer, sublayer.proj, h, residual, batch(flag))

    with pytest.MonkeyPatch.context() as m:
        m.setattr(gemv_module, "gemv_prenorm", lambda *a, **kw: (folded.append(1), real(*a, **kw))[1])
        none, want_sum, want_x = run(False, res)
        assert none is None and not folded
        y, summed, x = run(True, res)
        assert folded and x is None
        assert torch.equal(y, gemv(want_x, w)) and torch.equal(summed, want_sum)
        y, summed, _ = run(True, None)  # the first layer: no residual, the sum is h itself
        assert summed is h and torch.equal(y, gemv(norm(h, batch(False)), w))  # the norm kernel's
        for module in (norm, sublayer, sublayer.proj):
            hooked = []
            handle = module.register_forward_pre_hook(lambda *a: hooked.append(1))
            folded.clear()
            none, summed, x = run(True, res)
            assert none is None and not folded and torch.equal(summed, want_sum) and torch.equal(x, want_x)
            assert hooked == ([1] if module is norm else [])  # the sublayer's hook runs when the caller calls it
            handle.remove()


def test_decode_prenorm_off_the_kernel_path_needs_no_triton():
    """On a CPU install without Triton (the package does not require it), `decode_prenorm` runs
    the norm without importing the kernels."""
    import subprocess
    import sys

    code = "\n".join([
        "import sys; sys.modules['triton'] = None",
        "import torch; from types import SimpleNamespace",
        "from kiln.layers.decode_gemv import decode_prenorm",
        "from kiln.layers.linear import ColumnParallelLinear; from kiln.layers.norm import RMSNorm",
        "backend = SimpleNamespace(use_kernels=False, gemv_max_rows=0, fold_norms_max_hidden=2048)",
        "y, s, x = decode_prenorm(RMSNorm(8), torch.nn.Module(), ColumnParallelLinear(8, 4), torch.randn(1, 8),",
        "                         torch.randn(1, 8), SimpleNamespace(backend=backend))",
        "assert y is None and x.shape == (1, 8)",
    ])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
