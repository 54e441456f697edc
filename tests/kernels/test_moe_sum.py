"""The grouped MoE's slot sum in the down GEMM's last programs (`fused_experts(sum_counter=...)`,
`kiln.kernels.moe_sum`) against the sum's own launch, and the MoE layers passing their counters.

"cpu" runs the kernels under Triton's interpreter on tiny fp32 shapes; "cuda" compiled, at the
bench shapes in bf16. Either way the two homes of the sum give the same bits: the same loads in
the same order, one cast.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kiln import kernels
from tests.kernels.devices import DEVICES
from tests.kernels.test_moe_gemv import _Refused
from tests.kernels.test_moe_kernels import _km, _layer, _routing, _shape, _weights, kernels_on_cpu  # noqa: F401

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="needs Triton")


def _inputs(device, T, E, k, S, pool=None, shared_mult=1, shared_weighted=True, seed=0):
    """(x, w13, w2, ids, w, shared) for `fused_experts` on the grouped path, and H. The
    interpreter's H = 40 makes three hidden tiles of `_config`'s down GEMM, the last one ragged."""
    H, I, dtype, _, _ = _shape(device)
    if device == "cuda":
        E, k, pool = E * 8, min(k * 2, 6), None
    else:
        H = 40
    gen = torch.Generator().manual_seed(seed)
    w13, w2, sw13, sw2 = _weights(E, H, I, dtype, device, gen, shared_inter=S * I * shared_mult)
    x = torch.randn(T, H, generator=gen).to(device=device, dtype=dtype)
    ids, w = _routing(T, E, k, gen, device, pool)
    sw = (torch.rand(T, S, generator=gen) + 0.1).to(device) if S and shared_weighted else None
    return (x, w13, w2, ids, w, (sw13, sw2, sw) if S else None), H


def _config(device):
    """The interpreter: 16-column down tiles (three over H = 40); CUDA: the shipped tiles."""
    return _km().MoEConfig(16, (16, 16, 4, 1), (16, 16, 4, 1)) if device == "cpu" else None


CASES = [
    dict(T=2, E=8, k=2, S=2),  # decode at batch 2, Inkling's weighted shared experts
    dict(T=4, E=8, k=3, S=1, shared_mult=2, shared_weighted=False),  # a verify's 4 rows, 2 unweighted chunks
    dict(T=17, E=8, k=2, S=2, pool=[0, 3, 6, 7]),  # two steps of the token walk, empty experts
    dict(T=32, E=8, k=1, S=0),  # the limit, routed experts only
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=["b2", "verify4", "t17", "t32"])
@pytest.mark.parametrize("inline", [True, False], ids=["rows-in-registers", "align-kernel"])
def test_down_gemm_sum_equals_its_own_launch(device, case, inline, monkeypatch):
    km = _km()
    if not inline:
        monkeypatch.setattr(km, "INLINE_ALIGN_MAX_IDS", 0)
    (x, w13, w2, ids, w, shared), H = _inputs(device, seed=case["T"], **case)
    cfg = _config(device)
    want = km.fused_experts(x, w13, w2, ids, w, shared=shared, config=cfg)
    # one tile more than the down GEMM has: a program counting on the wrong tile leaves it non-zero
    counter = torch.zeros(km.sum_counter_size(H) + 1, dtype=torch.int32, device=device)
    monkeypatch.setattr(km, "_sum_slots_kernel", _Refused("_sum_slots_kernel"))
    for _ in range(2):  # the counter comes back zeroed, so a second call sums again
        got = km.fused_experts(x, w13, w2, ids, w, shared=shared, sum_counter=counter, config=cfg)
        assert torch.equal(got, want)
        assert not counter.any()
    assert got.abs().amax() > 0


@pytest.mark.parametrize("device", DEVICES)
def test_separate_sum_runs_past_the_limit_or_without_a_counter(device, monkeypatch):
    km = _km()
    n = km.DOWN_SUM_MAX_TOKENS + 1
    (x, w13, w2, ids, w, shared), H = _inputs(device, n, 8, 2, 2, seed=5)
    counter = torch.zeros(km.sum_counter_size(H), dtype=torch.int32, device=device)
    monkeypatch.setattr(km, "_sum_slots_kernel", _Refused("_sum_slots_kernel"))
    with pytest.raises(AssertionError, match="_sum_slots_kernel launched"):
        km.fused_experts(x, w13, w2, ids, w, shared=shared, sum_counter=counter)
    with pytest.raises(AssertionError, match="_sum_slots_kernel launched"):
        km.fused_experts(x[:2], w13, w2, ids[:2], w[:2], shared=(shared[0], shared[1], shared[2][:2]))
    short = torch.zeros(km.sum_counter_size(H) // 8, dtype=torch.int32, device=device)
    with pytest.raises(AssertionError, match="sum_counter"):
        km.fused_experts(x[:2], w13, w2, ids[:2], w[:2], shared=(shared[0], shared[1], shared[2][:2]),
                         sum_counter=short)


@pytest.mark.parametrize("which", ["sink", "minimax"])
def test_layers_sum_in_the_down_gemm(which, kernels_on_cpu, monkeypatch):  # noqa: F811
    # Both MoE layers hand `fused_experts` their counter: at a few tokens no separate sum launches,
    # the output is the reference path's, and the counter is zero again after the call.
    km = _km()
    moe, cfg, _ = _layer(which, "cpu")
    x = torch.randn(5, cfg.hidden_size)
    with torch.no_grad():
        with monkeypatch.context() as m:
            m.setattr(km, "_sum_slots_kernel", _Refused("_sum_slots_kernel"))
            got = moe(x, SimpleNamespace(extras={}))
        monkeypatch.setattr(kernels, "kernels_supported", lambda device: False)
        want = moe(x, SimpleNamespace(extras={}))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    counters = moe.experts.sum_counters
    assert counters.numel() >= km.sum_counter_size(cfg.hidden_size) and not counters.any()
    assert "experts.sum_counters" not in moe.state_dict()
