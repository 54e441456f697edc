"""The expert GEMVs selecting for themselves (`kiln.kernels.moe.gated_experts`): the same ids,
weights and output, bit for bit, as the gate kernel followed by `fused_experts`, for both gates,
with and without Inkling's out_conv in the down kernel's epilogue.

"cpu" runs the kernels under Triton's interpreter; "cuda" compiled, at the bench shapes' sizes.
"""

from __future__ import annotations

import pytest
import torch

from kiln import kernels
from tests.kernels.devices import DEVICE_DTYPES
from tests.kernels.test_moe_kernels import _km, _weights

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="needs Triton")


def _case(device, dtype, sink, seed):
    """(x, w13, w2, shared (sw13, sw2), gate module arguments, logits): Inkling's gate (E routed +
    2 shared experts) or MiniMax-M3's (E routed, one shared expert twice as wide)."""
    E, k, H, I = (8, 2, 32, 16) if device == "cpu" else (64, 6, 2048, 512)
    S = 2 if sink else 0
    gen = torch.Generator().manual_seed(seed)
    w13, w2, sw13, sw2 = _weights(E, H, I, dtype, device, gen, shared_inter=(S or 2) * I)
    x = torch.randn(1, H, generator=gen).to(device=device, dtype=dtype)
    router = (torch.randn(E + S, H, generator=gen) / H ** 0.5).to(device)
    bias = (torch.randn(E, generator=gen) * 0.1).to(device)  # large enough to reorder the top-k
    scale = torch.tensor(1.3, device=device)
    logits = torch.nn.functional.linear(x.float(), router)
    return x, w13, w2, (sw13, sw2), (router, bias, scale, E, S, k), logits


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("sink", [True, False], ids=["sink-gate", "minimax-gate"])
def test_gated_experts_equal_gate_then_experts(device, dtype, sink):
    km = _km()
    x, w13, w2, (sw13, sw2), (router, bias, scale, E, S, k), z = _case(device, dtype, sink, seed=3 + sink)
    if sink:
        ids, rw, sw = km.sink_gate(x, router, bias, scale, k, 0.9, logits=z)
    else:
        (ids, rw), sw = km.minimax_gate(x, router, bias, k, 0.9, logits=z), None
    want = km.fused_experts(x, w13, w2, ids, rw, shared=(sw13, sw2, sw))
    gate = km.GateArgs(z, bias, scale if sink else bias, 0.9, E, S, k, sink)
    got, ids2, rw2, sw2_ = km.gated_experts(x, w13, w2, gate, shared=(sw13, sw2))
    assert torch.equal(ids2, ids) and torch.equal(rw2, rw)
    assert (sw2_ is None) if not sink else torch.equal(sw2_, sw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_gated_experts_run_the_out_conv_epilogue(device, dtype):
    """With Inkling's out_conv in the down kernel: the same output and conv state write as the gate
    kernel followed by `fused_experts(..., conv=)`."""
    from tests.kernels.test_moe_gemv import _conv_state

    km = _km()
    x, w13, w2, (sw13, sw2), (router, bias, scale, E, S, k), z = _case(device, dtype, True, seed=11)
    (cw, buf, table, rows, seq_lens, out_locs), _ = _conv_state(x.shape[1], 4, 5, dtype, device, seed=5)
    buf_ref = buf.clone()
    ids, rw, sw = km.sink_gate(x, router, bias, scale, k, 1.0, logits=z)
    want = km.fused_experts(x, w13, w2, ids, rw, shared=(sw13, sw2, sw),
                            conv=(cw, buf_ref, table, rows, seq_lens, out_locs))
    got, *_ = km.gated_experts(x, w13, w2, km.GateArgs(z, bias, scale, 1.0, E, S, k, True), shared=(sw13, sw2),
                               conv=(cw, buf, table, rows, seq_lens, out_locs))
    assert torch.equal(got, want) and torch.equal(buf, buf_ref)


def test_gated_experts_refuse_the_grouped_path():
    km = _km()
    x = torch.zeros(2, 32)
    z = torch.zeros(2, 10)
    with pytest.raises(AssertionError, match="not on the one-token GEMV path"):
        km.gated_experts(x, x, x, km.GateArgs(z, z[0], z[0], 1.0, 8, 2, 2, True))
