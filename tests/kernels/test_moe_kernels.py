"""Triton MoE kernels (kiln.kernels.moe) against the reference ops (kiln.ops.moe), and the MoE
layers' kernel path against their reference path.

"cpu" runs the kernels under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
when there is no GPU) on tiny fp32 shapes; "cuda" runs them compiled, on the bench shapes in bf16.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kiln import kernels
from kiln.ops import moe as ref
from tests.kernels.devices import DEVICES, INTERPRETER_ONLY, capture_graph  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="needs Triton")



def _km():
    from kiln.kernels import moe
    return moe


def _shape(device):
    """(H, I, dtype, atol, rtol): tiny fp32 on the interpreter, the bench MoE in bf16 on CUDA.
    bf16: outputs are O(1) and both sides round differently inside (the reference rounds the GEMM
    outputs to bf16, the kernels keep them fp32), so over millions of elements a few differ by
    a couple of output ulps (2^-7 at 2); a routing bug is off by O(1) on whole rows."""
    if device == "cpu":
        return 32, 16, torch.float32, 1e-5, 1e-5
    return 2048, 512, torch.bfloat16, 5e-2, 2e-2


def _weights(E, H, I, dtype, device, gen, shared_inter=0):
    def rnd(*shape, fan_in):
        return (torch.randn(*shape, generator=gen) / fan_in ** 0.5).to(device=device, dtype=dtype)

    w13, w2 = rnd(E, 2 * I, H, fan_in=H), rnd(E, H, I, fan_in=I)
    sw13, sw2 = rnd(2 * shared_inter, H, fan_in=H), rnd(H, shared_inter, fan_in=I)
    return w13, w2, sw13, sw2


def _routing(T, E, k, gen, device, pool=None):
    """Distinct ids per token drawn from `pool` (default all experts), random fp32 weights."""
    pool = torch.arange(E) if pool is None else torch.tensor(pool)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(T)])
    w = torch.rand(T, k, generator=gen) + 0.1
    return ids.to(device), w.to(device)


def _check_experts(device, T, E, k, S, pool=None, shared_mult=1, shared_weighted=True, seed=0,
                   H=None, I=None):
    h, i, dtype, atol, rtol = _shape(device)
    H, I = H or h, I or i
    gen = torch.Generator().manual_seed(seed)
    w13, w2, sw13, sw2 = _weights(E, H, I, dtype, device, gen, shared_inter=S * I * shared_mult)
    x = torch.randn(T, H, generator=gen).to(device=device, dtype=dtype)
    ids, w = _routing(T, E, k, gen, device, pool)
    want = ref.experts_ref(x, w13, w2, ids, w, torch.float32)
    shared = None
    if S:
        sw = (torch.rand(T, S, generator=gen) + 0.1).to(device) if shared_weighted else None
        shared = (sw13, sw2, sw)
        want = want + ref.shared_experts_ref(x, sw13, sw2, sw)
    got = _km().fused_experts(x, w13, w2, ids, w, shared=shared)
    assert got.dtype == dtype and got.shape == (T, H)
    torch.testing.assert_close(got.float(), want.to(dtype).float(), atol=atol, rtol=rtol)
    # out_dtype=fp32 keeps the fp32 sum (the layers add shared experts / all-reduce in fp32).
    got32 = _km().fused_experts(x, w13, w2, ids, w, out_dtype=torch.float32, shared=shared)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32, want, atol=atol, rtol=rtol)
    assert (got32 - want).norm() <= 1e-2 * want.norm()  # and small overall, not just elementwise


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 3, 37])
@pytest.mark.parametrize("E,k,S", [(4, 1, 0), (8, 2, 2), (8, 3, 1)])
def test_fused_experts_matches_reference(device, T, E, k, S):
    if device == "cuda":
        E, k = E * 8, k * 2  # 32..64 experts, top-2..6 at bench sizes
    _check_experts(device, T, E, k, S, seed=T * 100 + E + k + S)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_experts_all_tokens_to_one_expert(device):
    # k=1 and a pool of one: every token in expert 2's segment, all other experts empty.
    _check_experts(device, 37, 8, 1, 0, pool=[2], seed=1)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_experts_two_full_experts_over_several_align_steps(device, monkeypatch):
    # k=2 over a pool of two: two full segments, the rest empty; plus shared experts. The 130
    # assignments span two of the align kernel's 128-id steps (ranks carried across steps).
    monkeypatch.setattr(_km(), "ALIGN_CHUNK_MAX", 128)
    _check_experts(device, 65, 8, 2, 2, pool=[5, 1], seed=2)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_experts_unused_experts_and_shared_chunks(device):
    # Half the experts get no tokens; a MiniMax-style shared expert twice the routed width
    # (two chunks) with weight 1.
    _check_experts(device, 13, 8, 2, 1, pool=[0, 3, 6, 7], shared_mult=2, shared_weighted=False, seed=3)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_experts_ragged_dims(device):
    # H and I that are not multiples of the tiles: the masked-K and masked-column paths.
    H, I = (48, 24) if device == "cpu" else (2000, 200)
    _check_experts(device, 5, 8, 2, 2, H=H, I=I, seed=4)


@pytest.mark.gpu
def test_fused_experts_prefill_and_fp32_cuda():
    # Prefill-sized T picks the large-tile config; an fp32 model must not fall to TF32.
    _check_experts("cuda", 2048, 64, 6, 2, seed=5)
    gen = torch.Generator().manual_seed(6)
    w13, w2, sw13, sw2 = _weights(8, 64, 32, torch.float32, "cuda", gen, shared_inter=64)
    x = torch.randn(21, 64, generator=gen).cuda()
    ids, w = _routing(21, 8, 2, gen, "cuda")
    sw = torch.rand(21, 2, generator=gen).cuda()
    want = ref.experts_ref(x, w13, w2, ids, w, torch.float32) + ref.shared_experts_ref(x, sw13, sw2, sw)
    got = _km().fused_experts(x, w13, w2, ids, w, shared=(sw13, sw2, sw))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_shared_chunks():
    sw2 = torch.empty(4, 3 * 16)
    assert _km().shared_chunks(16, sw2, torch.empty(2, 3)) == 3
    assert _km().shared_chunks(16, sw2, None) == 3
    assert _km().shared_chunks(16, sw2, torch.empty(2, 2)) == 0  # 48 columns over 2 experts
    assert _km().shared_chunks(32, sw2, None) == 0  # 48 not a multiple of 32


# --- routers -----------------------------------------------------------------------------------

def _gate_inputs(device, T, E, S, gen, ties=False):
    H = 16 if device == "cpu" else 2048
    if ties:
        # Small integers make exact float ties in the logits: many routed experts score the same.
        x = torch.randint(-2, 3, (T, H), generator=gen).float()
        weight = torch.randint(-1, 2, (E + S, H), generator=gen).float()
        weight[1:E:2] = weight[0:E - 1:2]  # pairs of identical routed rows
        bias = torch.zeros(E)
    else:
        x = torch.randn(T, H, generator=gen)
        weight = torch.randn(E + S, H, generator=gen) / H ** 0.5
        bias = torch.randn(E, generator=gen) * 0.05
    if device == "cuda" and not ties:
        x, weight = x.bfloat16(), weight.bfloat16()
    return x.to(device), weight.to(device), bias.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 3, 37])
@pytest.mark.parametrize("E,S,k", [(8, 0, 1), (8, 2, 2), (6, 1, 3)])
@pytest.mark.parametrize("ties", [False, True])
def test_sink_gate_matches_reference(device, T, E, S, k, ties):
    if device == "cuda":
        E, k = E * 8, k * 2
    gen = torch.Generator().manual_seed(T + 10 * E + S + k)
    x, weight, bias = _gate_inputs(device, T, E, S, gen, ties)
    gscale = torch.tensor(0.7, device=device)
    ids, rw, sw = _km().sink_gate(x, weight, bias, gscale, k, 1.5)
    r_ids, r_rw, r_sw = ref.sink_gate_ref(x, weight, bias, gscale, k, 1.5)
    assert ids.dtype == torch.int64 and rw.dtype == sw.dtype == torch.float32
    assert sw.shape == (T, S)
    assert torch.equal(ids, r_ids)
    torch.testing.assert_close(rw, r_rw, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(sw, r_sw, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 3, 37])
@pytest.mark.parametrize("E,k", [(8, 1), (8, 2), (6, 3)])
@pytest.mark.parametrize("ties", [False, True])
def test_minimax_gate_matches_reference(device, T, E, k, ties):
    if device == "cuda":
        E, k = E * 8, k * 2
    gen = torch.Generator().manual_seed(T + 10 * E + k)
    x, weight, bias = _gate_inputs(device, T, E, 0, gen, ties)
    ids, w = _km().minimax_gate(x, weight, bias, k, 2.5)
    r_ids, r_w = ref.minimax_gate_ref(x, weight, bias, k, 2.5)
    assert torch.equal(ids, r_ids)
    torch.testing.assert_close(w, r_w, atol=1e-6, rtol=1e-5)


def _logits_and_sink_gate_match_the_reference(x, weight, bias, k):
    """The router's fp32 logits on the GEMV path (`use_gemv`) to summation order, and the sink
    gate's choices and weights as the reference's. Returns (logits, global scale, the reference's
    (ids, routed weights, shared weights))."""
    from kiln.kernels.moe_gate import router_logits

    z = router_logits(x, weight, use_gemv=True)
    assert z.dtype == torch.float32 and z.shape == (x.shape[0], weight.shape[0])
    torch.testing.assert_close(z, torch.nn.functional.linear(x.float(), weight), atol=1e-5, rtol=1e-5)
    gscale = torch.tensor(0.7, device=x.device)
    ids, rw, sw = _km().sink_gate(x, weight, bias, gscale, k, 1.5, use_gemv=True)
    want = ref.sink_gate_ref(x, weight, bias, gscale, k, 1.5)
    assert torch.equal(ids, want[0])
    torch.testing.assert_close(rw, want[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sw, want[2], atol=1e-5, rtol=1e-5)
    return z, gscale, want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [5, 8, 33])
def test_router_logits_past_four_rows_take_the_gemv(device, T, monkeypatch):
    """More than 4 rows (a batch of 5+ decode steps, a verify of 2+ requests): the router's
    logits still on the GEMV (blocks of 4 widened rows side by side), not a cast and cuBLAS's
    split-K SIMT SGEMM (docs/benchmarks.md, forty-ninth pass); the fp32 logits to summation
    order, and the gates' choices as the reference's."""
    from kiln.kernels import gemv as gemv_module
    from kiln.kernels.moe_gate import router_logits

    calls = []
    real = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda x, w, **kw: (calls.append(x.shape[0]), real(x, w, **kw))[1])
    E, S, k = (8, 2, 3) if device == "cpu" else (64, 2, 6)
    x, weight, bias = _gate_inputs(device, T, E, S, torch.Generator().manual_seed(T))
    x, weight = x.to(torch.float16 if device == "cpu" else torch.bfloat16), weight.float()
    _logits_and_sink_gate_match_the_reference(x, weight, bias, k)
    assert calls == [T, T]
    router_logits(x, weight, use_gemv=False)  # (off the kernel path: F.linear)
    assert calls == [T, T]


@pytest.mark.parametrize("device", DEVICES)
def test_router_logits_of_fp32_rows_past_sixteen_take_cublas(device, monkeypatch):
    """A model served in fp32 (the tiny presets' GPU tests): its rows are not widened, so the GEMV
    takes at most MAX_ROWS of them and a 36-row batch's logits go to F.linear (before the fix the
    GEMV's row check failed there, the fiftieth session's GPU run)."""
    from kiln.kernels import gemv as gemv_module
    from kiln.kernels.gemv_tiles import MAX_ROWS
    from kiln.kernels.moe_gate import router_logits

    calls = []
    real = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda x, w, **kw: (calls.append(x.shape[0]), real(x, w, **kw))[1])
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(10, 32, generator=gen).to(device)
    for t, on_gemv in ((MAX_ROWS, True), (MAX_ROWS + 1, False), (36, False)):
        x = torch.randn(t, 32, generator=gen).to(device)
        torch.testing.assert_close(router_logits(x, weight, use_gemv=True), x @ weight.T, atol=1e-5, rtol=1e-5)
        assert (calls[-1:] == [t]) == on_gemv, (t, calls)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 3, 4])
@pytest.mark.parametrize("ties", [False, True])
def test_gates_with_router_logits_from_the_gemv(device, T, ties):
    """The routers' fp32 logits of a few rows through the GEMV (`use_gemv`, the engine's decode
    and verify rows), alone and fused with the gate (a selection counter): the real layout (fp32
    router weight, half-precision rows widened in the kernel), the reference's ids, and weights to
    fp32 summation-order error. Exact ties (small integers) stay ties, so the lowest ids still
    win them."""
    E, S, k = (8, 2, 3) if device == "cpu" else (64, 2, 6)
    gen = torch.Generator().manual_seed(T + 100 * ties)
    x, weight, bias = _gate_inputs(device, T, E, S, gen, ties)
    # fp16 on the interpreter (it has no bf16); both are exact in fp32
    x, weight = x.to(torch.float16 if device == "cpu" else torch.bfloat16), weight.float()
    z, gscale, (r_ids_sink, r_rw, r_sw) = _logits_and_sink_gate_match_the_reference(x, weight, bias, k)
    ids, w = _km().minimax_gate(x, weight[:E], bias, k, 2.5, use_gemv=True)
    r_ids, r_w = ref.minimax_gate_ref(x, weight[:E], bias, k, 2.5)
    assert torch.equal(ids, r_ids)
    torch.testing.assert_close(w, r_w, atol=1e-5, rtol=1e-5)
    # With a selection counter the logits and the gate are one launch (`_router_gate_kernel`): the
    # same results, and the counter is zero again after each call (twice: the reset is real).
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    for _ in range(2):
        ids, rw, sw = _km().sink_gate(x, weight, bias, gscale, k, 1.5, use_gemv=True, counter=counter)
        assert torch.equal(ids, r_ids_sink) and int(counter) == 0
        torch.testing.assert_close(rw, r_rw, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sw, r_sw, atol=1e-5, rtol=1e-5)
        ids, w = _km().minimax_gate(x, weight[:E], bias, k, 2.5, use_gemv=True, counter=counter)
        assert torch.equal(ids, r_ids) and int(counter) == 0
        torch.testing.assert_close(w, r_w, atol=1e-5, rtol=1e-5)
    # Logits from the caller (the router GEMV with the layer's norm in its prologue): the gates
    # select from them (x is not read; a counter does not make them recompute).
    ids, rw, sw = _km().sink_gate(torch.zeros_like(x), weight, bias, gscale, k, 1.5, use_gemv=True, counter=counter,
                                  logits=z)
    assert torch.equal(ids, r_ids_sink)
    torch.testing.assert_close(rw, r_rw, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sw, r_sw, atol=1e-5, rtol=1e-5)
    ids, w = _km().minimax_gate(torch.zeros_like(x), weight[:E], bias, k, 2.5, use_gemv=True, counter=counter,
                                logits=z[:, :E].contiguous())
    assert torch.equal(ids, r_ids)
    torch.testing.assert_close(w, r_w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_gates_break_all_way_ties_to_the_lowest_ids(device):
    E, S, k = (8, 2, 3) if device == "cpu" else (64, 2, 6)
    x = torch.ones(5, 16, device=device)
    weight = torch.zeros(E + S, 16, device=device)  # every routed logit equal
    bias = torch.zeros(E, device=device)
    ids = _km().sink_gate(x, weight, bias, torch.tensor(1.0, device=device), k, 1.0)[0]
    assert ids.tolist() == [list(range(k))] * 5
    bias[k + 1] = 1e-3  # one expert strictly ahead, the rest still tied
    ids = _km().minimax_gate(x, weight[:E], bias, k, 1.0)[0]
    assert ids.tolist() == [[k + 1] + list(range(k - 1))] * 5


@pytest.mark.gpu
def test_gates_exact_ids_on_many_tokens_cuda():
    # 64 scores for each of 16384 tokens make near-ties certain: the kernel's sigmoid must be
    # bit-identical to torch.sigmoid for the ids to match everywhere.
    gen = torch.Generator().manual_seed(7)
    x, weight, bias = _gate_inputs("cuda", 16384, 64, 2, gen)
    gscale = torch.tensor(1.3, device="cuda")
    ids, rw, sw = _km().sink_gate(x, weight, bias, gscale, 6, 2.0)
    r_ids, r_rw, r_sw = ref.sink_gate_ref(x, weight, bias, gscale, 6, 2.0)
    assert torch.equal(ids, r_ids)
    torch.testing.assert_close(rw, r_rw, atol=1e-6, rtol=1e-5)
    ids, w = _km().minimax_gate(x, weight[:64], bias, 6, 2.5)
    r_ids, r_w = ref.minimax_gate_ref(x, weight[:64], bias, 6, 2.5)
    assert torch.equal(ids, r_ids)
    torch.testing.assert_close(w, r_w, atol=1e-6, rtol=1e-5)


# --- layers ------------------------------------------------------------------------------------

def _cfg(device):
    if device == "cpu":
        return SimpleNamespace(hidden_size=32, num_experts=8, num_experts_per_tok=2, num_shared_experts=2,
                               moe_intermediate_size=16, route_scale=1.5, routed_scaling_factor=2.5)
    return SimpleNamespace(hidden_size=2048, num_experts=64, num_experts_per_tok=6, num_shared_experts=2,
                           moe_intermediate_size=512, route_scale=2.5, routed_scaling_factor=2.5)


def _layer(which, device, seed=0):
    from kiln.layers.moe import MiniMaxMoE, SinkMoE

    cfg = _cfg(device)
    moe = SinkMoE(cfg, moe_index=1) if which == "sink" else MiniMaxMoE(cfg, moe_index=1)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if p.dim() > 0:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        for b in moe.buffers():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.01)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    return moe.to(device=device, dtype=dtype), cfg, dtype


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """Let the layers take their kernel path for CPU tensors (run by the interpreter)."""
    if not kernels.interpreting():  # a GPU machine: CPU tensors cannot reach compiled kernels
        pytest.skip(INTERPRETER_ONLY.kwargs["reason"])
    monkeypatch.setattr(kernels, "kernels_supported", lambda device: True)


class _Spy:
    """Stands in for kiln.kernels.moe in the layers and records which kernels they call."""

    KERNELS = ("sink_gate", "minimax_gate", "fused_experts")

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        fn = getattr(_km(), name)
        if name not in self.KERNELS:
            return fn

        def call(*args, **kwargs):
            self.calls.append(name)
            return fn(*args, **kwargs)
        return call


@pytest.mark.parametrize("which", ["sink", "minimax"])
def test_layer_kernel_path_matches_reference_path(which, kernels_on_cpu, monkeypatch):
    import kiln.layers.moe as layers

    spy = _Spy()
    monkeypatch.setattr(layers, "_kernel_ops", lambda: spy)
    moe, cfg, _ = _layer(which, "cpu")
    gate = "sink_gate" if which == "sink" else "minimax_gate"
    x = torch.randn(11, cfg.hidden_size)
    with torch.no_grad():
        b_kernel = SimpleNamespace(extras={})
        y_kernel = moe(x, b_kernel)
        assert spy.calls == [gate, "fused_experts"]  # shared experts folded into the same call
        with monkeypatch.context() as m:
            m.setattr(kernels, "kernels_supported", lambda device: False)
            b_ref = SimpleNamespace(extras={})
            y_ref = moe(x, b_ref)
        assert len(spy.calls) == 2
    torch.testing.assert_close(y_kernel, y_ref, atol=1e-5, rtol=1e-5)
    captured = b_kernel.extras["routed_experts"][1]
    assert captured.dtype == torch.int32 and torch.equal(captured, b_ref.extras["routed_experts"][1])

    # Replayed ids: the gate takes the reference path (exact ids and weights); experts need no grad.
    spy.calls.clear()
    other = (captured.long() + 1) % cfg.num_experts
    with torch.no_grad():
        b = SimpleNamespace(extras={"replay_experts": {1: other}})
        y_other = moe(x, b)
    assert spy.calls == ["fused_experts"]
    assert torch.equal(b.extras["routed_experts"][1], other.int())
    with torch.no_grad(), monkeypatch.context() as m:
        m.setattr(kernels, "kernels_supported", lambda device: False)
        torch.testing.assert_close(y_other, moe(x, SimpleNamespace(extras={"replay_experts": {1: other}})),
                                   atol=1e-5, rtol=1e-5)

    # Autograd recording through the router: references only, and gradients reach it.
    spy.calls.clear()
    router = moe.router if which == "sink" else moe.gate
    router.weight.requires_grad_(True)
    moe(x, SimpleNamespace(extras={})).sum().backward()
    assert spy.calls == [] and router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_layer_keeps_an_overridden_experts_forward(kernels_on_cpu):
    # LoRA swaps the experts' class for one whose forward adds adapters; the fused path that
    # reads w13/w2 directly must not bypass it.
    from kiln.layers.moe import Experts

    calls = []

    class Adapted(Experts):
        def forward(self, *args, **kwargs):
            calls.append("forward")
            return super().forward(*args, **kwargs)

    moe, cfg, _ = _layer("sink", "cpu")
    moe.experts.__class__ = Adapted
    with torch.no_grad():
        moe(torch.randn(3, cfg.hidden_size))
    assert calls == ["forward"]


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["sink", "minimax"])
@pytest.mark.parametrize("T", [1, 64])
def test_layer_cuda_graph_replay_equals_eager(which, T):
    moe, cfg, dtype = _layer(which, "cuda", seed=T)
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, cfg.hidden_size, generator=gen).to("cuda", dtype)
    batch = SimpleNamespace(extras={})
    with torch.inference_mode():
        graph, out = capture_graph(lambda: moe(x, batch))
        ids_out = batch.extras["routed_experts"][1]
        for step in range(2):  # change the input in place, replay, compare with eager
            x.copy_(torch.randn(T, cfg.hidden_size, generator=gen).to("cuda", dtype))
            graph.replay()
            eager_batch = SimpleNamespace(extras={})
            want = moe(x.clone(), eager_batch)
            assert torch.equal(out, want)
            assert torch.equal(ids_out, eager_batch.extras["routed_experts"][1])
        # The kernel path agrees with the reference path (same ids, bf16 tolerance).
        import kiln.layers.moe as layers
        with pytest.MonkeyPatch.context() as m:
            m.setattr(layers, "_use_kernels", lambda *a: False)
            ref_out = moe(x.clone(), SimpleNamespace(extras={}))
    torch.testing.assert_close(out.float(), ref_out.float(), atol=3e-2, rtol=3e-2)
