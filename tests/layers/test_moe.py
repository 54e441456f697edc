"""MoE gates and experts against their MODELS.md formulas, written here independently (fp64 loops)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kiln.layers.moe import Experts, MiniMaxGate, MiniMaxMoE, SinkGate, SinkMoE, moe_param_for
from tests.kernels.devices import INTERPRETER_ONLY

H, E, K, S, I = 32, 8, 2, 2, 16


def _cfg(**kw):
    base = dict(hidden_size=H, num_experts=E, num_experts_per_tok=K, num_shared_experts=S,
                moe_intermediate_size=I, route_scale=1.5, routed_scaling_factor=2.5)
    base.update(kw)
    return SimpleNamespace(**base)


def _batch(replay=None):
    return SimpleNamespace(extras={} if replay is None else {"replay_experts": replay})


def _randomize(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() > 0:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _sink_oracle(x, w, bias, gscale, k, route_scale):
    """Per token: select by sigmoid + bias (argsort; inputs are tie-free), weights s_j / D."""
    z = x.double() @ w.double().T
    s = torch.sigmoid(z)
    ids, rw, sw = [], [], []
    for t in range(x.shape[0]):
        order = sorted(range(E), key=lambda e: -(s[t, e].item() + bias[e].item()))[:k]
        denom = s[t, order].sum() + s[t, E:].sum()
        ids.append(order)
        rw.append((s[t, order] / denom * route_scale * gscale).tolist())
        sw.append((s[t, E:] / denom * route_scale * gscale).tolist())
    return torch.tensor(ids), torch.tensor(rw, dtype=torch.float64), torch.tensor(sw, dtype=torch.float64)


def _swiglu(x, gate, up, down):
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def test_sink_gate_formula():
    gate = SinkGate(H, E, S, K, route_scale=1.5)
    _randomize(gate)
    gate.expert_bias.copy_(torch.randn(E) * 0.1)
    with torch.no_grad():
        gate.global_scale.fill_(0.7)
    x = torch.randn(20, H)
    ids, rw, sw = gate(x)
    o_ids, o_rw, o_sw = _sink_oracle(x, gate.weight, gate.expert_bias, 0.7, K, 1.5)
    assert ids.dtype == torch.int64 and rw.dtype == sw.dtype == torch.float32
    assert torch.equal(ids, o_ids)
    torch.testing.assert_close(rw.double(), o_rw, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(sw.double(), o_sw, atol=1e-6, rtol=1e-5)
    # Shared experts take part of the budget: routed + shared weights sum to route_scale * gscale.
    torch.testing.assert_close((rw.sum(1) + sw.sum(1)), torch.full((20,), 1.5 * 0.7))


def test_minimax_gate_formula():
    gate = MiniMaxGate(H, E, K, routed_scaling_factor=2.5)
    _randomize(gate)
    gate.e_score_correction_bias.copy_(torch.randn(E) * 0.1)
    x = torch.randn(20, H)
    ids, w = gate(x)
    s = torch.sigmoid(x.double() @ gate.weight.double().T)
    for t in range(20):
        order = sorted(range(E), key=lambda e: -(s[t, e].item() + gate.e_score_correction_bias[e].item()))[:K]
        assert ids[t].tolist() == order
        torch.testing.assert_close(w[t].double(), s[t, order] / s[t, order].sum() * 2.5, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("which", ["sink", "minimax"])
def test_ties_go_to_the_lower_id(which):
    gate = SinkGate(H, E, S, 3) if which == "sink" else MiniMaxGate(H, E, 3)
    _randomize(gate)
    with torch.no_grad():
        gate.weight[:E] = -gate.weight[0].abs()  # every routed expert scores the same ...
        gate.weight[6] = gate.weight[0].abs()  # ... except 6, strictly best for positive x
        gate.weight[5] = gate.weight[0].abs()  # 5 ties with 6 and, being lower, comes first
    x = torch.rand(10, H) + 0.1
    ids = gate(x)[0]
    assert ids.tolist() == [[5, 6, 0]] * 10
    # All routed experts tied: ids in increasing order.
    with torch.no_grad():
        gate.weight[:E] = gate.weight[0]
    assert gate(x)[0].tolist() == [[0, 1, 2]] * 10


@pytest.mark.parametrize("which", ["sink", "minimax"])
def test_replay_reuses_ids_and_recomputes_weights(which):
    torch.manual_seed(0)
    moe = SinkMoE(_cfg(), moe_index=3) if which == "sink" else MiniMaxMoE(_cfg(), moe_index=3)
    _randomize(moe)
    x = torch.randn(12, H)
    b = _batch()
    y = moe(x, b)
    captured = b.extras["routed_experts"][3]
    assert captured.dtype == torch.int32 and captured.shape == (12, K)
    # Same ids replayed: identical output; and they are recorded again.
    b2 = _batch({3: captured.long()})
    torch.testing.assert_close(moe(x, b2), y, atol=0, rtol=0)
    assert torch.equal(b2.extras["routed_experts"][3], captured)
    # A replay for another MoE layer does not apply here.
    torch.testing.assert_close(moe(x, _batch({0: (captured.long() + 1) % E})), y, atol=0, rtol=0)
    # Different ids: different output, and the recorded ids are the forced ones.
    other = (captured.long() + 1) % E
    b3 = _batch({3: other})
    assert not torch.allclose(moe(x, b3), y)
    assert torch.equal(b3.extras["routed_experts"][3], other.int())
    # Gradients reach the router under replay.
    router = moe.router if which == "sink" else moe.gate
    router.weight.requires_grad_(True)
    moe(x, _batch({3: other})).square().sum().backward()
    assert router.weight.grad is not None and router.weight.grad[:E].abs().sum() > 0
    if which == "sink":  # the shared rows and the global scale are in the budget too
        assert router.weight.grad[E:].abs().sum() > 0


def _load_from_disk_names(moe, disk):
    params = dict(moe.named_parameters())
    for name, t in disk.items():
        target, shard = moe_param_for("mlp." + name)
        assert target.startswith("mlp.")
        p = params[target[len("mlp."):]]
        p.weight_loader(p, t, shard)


def test_sink_moe_equals_oracle_from_checkpoint_tensors():
    moe = SinkMoE(_cfg(), moe_index=0)
    _randomize(moe, seed=1)
    g = torch.Generator().manual_seed(2)
    disk = {}
    for prefix, n in (("experts.{}.", E), ("shared_experts.{}.", S)):
        for e in range(n):
            disk[prefix.format(e) + "gate_proj.weight"] = torch.randn(I, H, generator=g) * 0.2
            disk[prefix.format(e) + "up_proj.weight"] = torch.randn(I, H, generator=g) * 0.2
            disk[prefix.format(e) + "down_proj.weight"] = torch.randn(H, I, generator=g) * 0.2
    _load_from_disk_names(moe, disk)
    # checkpoint_items gives the same tensors back under the same names.
    back = dict(moe.experts.checkpoint_items("")) | dict(moe.shared_experts.checkpoint_items(""))
    assert back.keys() == disk.keys() and all(torch.equal(back[k], disk[k]) for k in disk)
    x = torch.randn(16, H)
    ids, rw, sw = moe.router(x)
    want = torch.zeros(16, H, dtype=torch.float64)
    d = {k: v.double() for k, v in disk.items()}
    for t in range(16):
        xt = x[t:t + 1].double()
        for j in range(K):
            e = ids[t, j].item()
            want[t] += rw[t, j].double() * _swiglu(xt, d[f"experts.{e}.gate_proj.weight"],
                                                   d[f"experts.{e}.up_proj.weight"],
                                                   d[f"experts.{e}.down_proj.weight"])[0]
        for s in range(S):
            want[t] += sw[t, s].double() * _swiglu(xt, d[f"shared_experts.{s}.gate_proj.weight"],
                                                   d[f"shared_experts.{s}.up_proj.weight"],
                                                   d[f"shared_experts.{s}.down_proj.weight"])[0]
    torch.testing.assert_close(moe(x).double(), want, atol=1e-5, rtol=1e-4)


def test_minimax_moe_equals_oracle():
    moe = MiniMaxMoE(_cfg(num_shared_experts=1), moe_index=0)
    _randomize(moe, seed=3)
    x = torch.randn(9, H)
    ids, w = moe.gate(x)
    sh = moe.shared_experts
    want = _swiglu(x.double(), sh.w13[:I].double(), sh.w13[I:].double(), sh.w2.double())
    for t in range(9):
        for j in range(K):
            e = ids[t, j].item()
            want[t] += w[t, j].double() * _swiglu(x[t:t + 1].double(), moe.experts.w13[e, :I].double(),
                                                  moe.experts.w13[e, I:].double(), moe.experts.w2[e].double())[0]
    torch.testing.assert_close(moe(x).double(), want, atol=1e-5, rtol=1e-4)
    names = dict(moe.shared_experts.checkpoint_items("mlp."))
    assert set(names) == {f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")}


def test_experts_cast_once_in_bf16():
    ex = Experts(E, H, I)
    _randomize(ex, seed=4)
    x = torch.randn(7, H)
    ids = torch.randint(0, E, (7, K))
    w = torch.rand(7, K)
    y32 = ex(x, ids, w)
    ex16 = Experts(E, H, I)
    ex16.load_state_dict(ex.state_dict())
    ex16.to(torch.bfloat16)
    y16 = ex16(x.bfloat16(), ids, w)
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.float(), y32, atol=0.1, rtol=0.05)


def test_checkpoint_name_mapping():
    assert moe_param_for("model.layers.3.mlp.experts.5.up_proj.weight") == \
        ("model.layers.3.mlp.experts.w13", (5, "up"))
    assert moe_param_for("model.layers.3.mlp.shared_experts.1.down_proj.weight") == \
        ("model.layers.3.mlp.shared_experts.w2", (1, "down"))
    assert moe_param_for("model.layers.0.mlp.shared_experts.gate_proj.weight") == \
        ("model.layers.0.mlp.shared_experts.w13", (0, "gate"))
    assert moe_param_for("model.layers.0.mlp.gate_proj.weight") is None
    assert moe_param_for("model.layers.0.mlp.gate.weight") is None


@pytest.mark.parametrize("which", ["sink", "minimax"])
def test_router_weight_stays_fp32_and_recording_can_be_off(which):
    from kiln.loader import cast_parameters

    moe = SinkMoE(_cfg(), moe_index=3) if which == "sink" else MiniMaxMoE(_cfg(), moe_index=3)
    _randomize(moe)
    cast_parameters(moe, torch.bfloat16)
    router = moe.router if which == "sink" else moe.gate
    assert router.weight.dtype == torch.float32  # no per-forward upcast of the router weight
    assert moe.experts.w13.dtype == torch.bfloat16 and moe.shared_experts.w2.dtype == torch.bfloat16
    x = torch.randn(5, H, dtype=torch.bfloat16)
    b = _batch()
    b.record_routing = False  # the engine without --enable-return-routed-experts
    y = moe(x, b)
    assert "routed_experts" not in b.extras
    b2 = _batch()
    torch.testing.assert_close(moe(x, b2), y, atol=0, rtol=0)  # recording changes nothing else
    assert b2.extras["routed_experts"][3].shape == (5, K)


@INTERPRETER_ONLY  # CPU tensors through the kernels: Triton's interpreter
def test_sink_moe_runs_out_conv_in_the_expert_kernels_epilogue(monkeypatch):
    """SinkMoE(x, batch, out_conv): at one decode token on the kernel path (the interpreter here)
    the conv runs in the down GEMV's epilogue (`fused_experts(conv=...)`), with the result of the
    MoE followed by the conv; a hooked conv, or two decode tokens, take the separate call (the hook
    runs). (A verify's chunks run it in the grouped path's sum: tests/kernels/test_moe_gemv.py and
    the engine's GPU tests.)"""
    pytest.importorskip("triton")
    from kiln.kernels import moe as km
    from kiln.kernels.shortconv import short_conv_decode
    from kiln.layers import moe as moe_layer
    from kiln.layers.shortconv import ShortConv
    from tests.kernels.test_moe_gemv import _conv_state

    monkeypatch.setattr(moe_layer, "_use_kernels", lambda *a: True)
    moe = SinkMoE(_cfg(), 0)
    _randomize(moe, seed=5)
    conv = ShortConv(3, H, 4)
    _randomize(conv, seed=6)
    x = torch.randn(1, H)
    args, _ = _conv_state(H, 4, 5, torch.float32, "cpu", seed=8)
    state = [t.clone() for t in args[1:]]  # each call below gets its own copy of the state
    separate, conv_args = [], []

    class Backend:
        def decode_conv_args(self, c, batch):
            return (c.weight, *state)

        def short_conv(self, c, y, batch):
            separate.append(c)
            return short_conv_decode(y, c.weight, *state) if y.shape[0] == 1 else y  # state of one sequence

        def chunk_conv_args(self, c, batch):
            return None  # decode steps only here

    real = km.fused_experts

    def counted(*a, conv=None, **kw):
        conv_args.append(conv)
        return real(*a, conv=conv, **kw)

    monkeypatch.setattr(km, "fused_experts", counted)
    batch = SimpleNamespace(extras={}, backend=Backend())
    with torch.no_grad():
        want = short_conv_decode(moe(x, batch), conv.weight, *[t.clone() for t in args[1:]])
        got = moe(x, batch, out_conv=conv)
        assert conv_args[-1] is not None and not separate  # fused
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        hooked = []
        conv.register_forward_hook(lambda *a: hooked.append(1))
        state = [t.clone() for t in args[1:]]
        torch.testing.assert_close(moe(x, batch, out_conv=conv), want, rtol=0, atol=0)
        assert hooked and conv_args[-1] is None and len(separate) == 1
        conv._forward_hooks.clear()
        state = [t.clone() for t in args[1:]]
        moe(x.expand(2, -1).contiguous(), batch, out_conv=conv)  # two decode tokens: the grouped path, separate conv
        assert conv_args[-1] is None and len(separate) == 2


@INTERPRETER_ONLY  # CPU tensors through the kernels: Triton's interpreter
@pytest.mark.parametrize("which", ["sink", "minimax"])
def test_fused_router_gate_only_with_its_flag(which, monkeypatch):
    """On the router GEMV's path, `--fused-router-gate` (the backend's `fused_router_gate`) runs the
    logits and the gate as one launch (the interpreter here) with the unfused result, and leaves
    the gate's selection counter at zero; without the flag the gate takes two launches."""
    pytest.importorskip("triton")
    from kiln.kernels import moe_gate
    from kiln.layers import moe as moe_layer

    monkeypatch.setattr(moe_layer, "_use_kernels", lambda *a: True)
    gate = SinkGate(H, E, S, K, route_scale=1.5) if which == "sink" else MiniMaxGate(H, E, K, 2.5)
    _randomize(gate, seed=9)
    x = torch.randn(2, H).half()  # the interpreter has no bf16
    fused = []
    real = moe_gate._fused_router_gate
    monkeypatch.setattr(moe_gate, "_fused_router_gate", lambda *a, **k: (fused.append(1), real(*a, **k))[1])

    def run(flag):
        backend = SimpleNamespace(use_kernels=True, gemv_max_rows=1, fused_router_gate=flag)
        with torch.no_grad():
            return gate(x, SimpleNamespace(extras={}, backend=backend))

    want = run(False)
    assert not fused
    got = run(True)
    assert fused and int(gate.selection_counter) == 0
    assert torch.equal(got[0], want[0])
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
