"""Triton SiLU-and-mul vs the references `kiln.layers.activation.silu_and_mul_ref` (output in the
input's dtype) and `kiln.ops.moe.swiglu_act` (fp32 output, the MoE experts).

The kernel computes in fp32 and rounds once, so besides matching the reference (which in bf16
rounds silu(gate) before the product) it must lie within one rounding of the exact fp32 value.
"cpu" cases run under Triton's interpreter (fp32); "cuda" cases compile in fp32 and bf16.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels.activation import silu_and_mul  # noqa: E402
from kiln.layers import activation  # noqa: E402
from kiln.layers.activation import silu_and_mul_ref  # noqa: E402
from kiln.ops.moe import swiglu_act  # noqa: E402
from tests.kernels.devices import DEVICE_DTYPES, DEVICES  # noqa: E402

FP32 = dict(rtol=1e-5, atol=1e-6)
BF16 = dict(rtol=1.6e-2, atol=1e-2)  # the reference's two bf16 roundings vs the kernel's one


def _gate_up(shape, dtype, device, seed, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def _check(gate_up):
    got = silu_and_mul(gate_up)
    assert got.dtype == gate_up.dtype and got.shape == gate_up.shape[:-1] + (gate_up.shape[-1] // 2,)
    assert got.is_contiguous()
    exact = swiglu_act(gate_up)  # fp32 math on the same (rounded) inputs
    if gate_up.dtype == torch.float32:
        torch.testing.assert_close(got, silu_and_mul_ref(gate_up), **FP32)
    else:
        torch.testing.assert_close(got, silu_and_mul_ref(gate_up), **BF16)
        # One round-to-nearest of the fp32 value: relative error <= 2^-9 (slack for exp's ulps).
        torch.testing.assert_close(got.float(), exact, rtol=2 ** -8, atol=1e-30)
    torch.testing.assert_close(silu_and_mul(gate_up, torch.float32), exact, **FP32)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("t,inter", [(1, 64), (7, 200), (65, 300)])
def test_silu_and_mul_matches_reference(device, dtype, t, inter):
    _check(_gate_up((t, 2 * inter), dtype, device, seed=t + inter))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_strided_rows_and_leading_dims(device, dtype):
    """A row-strided slice of a wider output and [B, T, 2I] inputs read without a copy first."""
    wide = _gate_up((9, 2 * 96 + 40), dtype, device, seed=1)
    part = wide[:, :2 * 96]
    assert not part.is_contiguous()
    _check(part)
    _check(_gate_up((2, 3, 2 * 50), dtype, device, seed=2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's NumPy exp
def test_extreme_gates_and_empty(device):
    """exp(-g) overflows to inf for very negative gates: silu -> 0, not NaN; T = 0 launches nothing."""
    gate_up = _gate_up((3, 2 * 40), torch.float32, device, seed=3)
    gate_up[0, :40] = -1e4
    gate_up[1, :40] = 1e4
    gate_up[2, :40] = 0.0
    got = silu_and_mul(gate_up)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, silu_and_mul_ref(gate_up), **FP32)
    assert silu_and_mul(gate_up[:0]).shape == (0, 40)


def test_paths():
    """The CPU reference path is the reference bit for bit; the engine's kernel path (the
    interpreter in tests) takes the kernel; an engine batch without kernels keeps the reference."""
    gate_up = _gate_up((5, 2 * 24), torch.float32, "cpu", seed=4)
    want = silu_and_mul_ref(gate_up)
    no_kernels = SimpleNamespace(backend=SimpleNamespace(use_kernels=False))
    packed = SimpleNamespace(backend=object())  # the trainer's backend: no use_kernels
    for batch in (None, no_kernels, packed):
        assert not activation.use_kernel(gate_up, batch)
        assert torch.equal(activation.silu_and_mul(gate_up, batch), want)
    engine = SimpleNamespace(backend=SimpleNamespace(use_kernels=True))
    assert activation.use_kernel(gate_up, engine)
    assert not activation.use_kernel(gate_up.requires_grad_(), engine)  # autograd records: no kernel
    if torch.cuda.is_available():
        assert activation.use_kernel(gate_up.detach().cuda())


@pytest.mark.gpu
def test_real_shapes_on_cuda():
    """Llama-3.1-8B's intermediate size at decode and prefill batch sizes."""
    for t in (1, 3, 64, 2048):
        _check(_gate_up((t, 2 * 14336), torch.bfloat16, "cuda", seed=t))


@pytest.mark.gpu
def test_captures_in_a_cuda_graph():
    gate_up = _gate_up((8, 2 * 14336), torch.bfloat16, "cuda", seed=5)
    silu_and_mul(gate_up)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = silu_and_mul(gate_up)
    for seed in range(6, 9):
        gate_up.copy_(_gate_up((8, 2 * 14336), torch.bfloat16, "cuda", seed=seed))
        graph.replay()
        torch.testing.assert_close(out, silu_and_mul_ref(gate_up), **BF16)
