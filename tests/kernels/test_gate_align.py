"""The gate kernels' alignment of a few tokens (`GateAlign`, `kiln.kernels.moe_align.align_in_one_program`)
against the align kernel it replaces, and the MoE layers that hand it from the gate to the experts.

"cpu" runs under Triton's interpreter (fp32, tiny shapes); "cuda" compiled at the bench router's
shape (64 routed experts, top-6, 2 shared chunks).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kiln import kernels
from tests.kernels.devices import DEVICES

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="needs Triton")


def _align_kernel_result(ids: torch.Tensor, T: int, k: int, E: int, chunks: int, block_m: int):
    """(sorted slots up to the last segment's end, segment ends) from `_align_kernel` itself."""
    import triton

    from kiln.kernels.moe_align import _align_kernel, sorted_rows

    e_tot = E + chunks
    slots = torch.full((sorted_rows(T, k, E, chunks, block_m),), -7, dtype=torch.int32, device=ids.device)
    ends = torch.empty(e_tot, dtype=torch.int32, device=ids.device)
    _align_kernel[(e_tot,)](ids, slots, ends, T * k, T, T * (k + chunks), E=E, E_TOT=e_tot, K=k, KS=k + chunks,
                            BLOCK_M=block_m, E_PAD=max(32, triton.next_power_of_2(e_tot)), CHUNK=128, num_warps=4,
                            PDL=False)
    return slots[: int(ends[-1])], ends


def _count_align_launches(monkeypatch) -> list:
    """A list that gains the grid of every `_align_kernel` launch of `fused_experts` from now on."""
    from kiln.kernels import moe

    calls, real = [], moe._align_kernel

    class Counting:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]

    monkeypatch.setattr(moe, "_align_kernel", Counting())
    return calls


def _gate(which: str, T: int, E: int, k: int, device: str, same_rows: bool, align=None):
    """The sink (2 shared logits) or MiniMax gate of T random tokens (all the same with `same_rows`:
    every token then selects the same experts), aligning into `align` when given; returns the ids."""
    from kiln.kernels.moe_gate import minimax_gate, sink_gate

    gen = torch.Generator().manual_seed(T * 100 + E + k + same_rows)
    H, S = 32, 2 if which == "sink" else 0
    x = torch.randn(1 if same_rows else T, H, generator=gen).expand(T, H).contiguous().to(device)
    weight = (torch.randn(E + S, H, generator=gen) / H ** 0.5).to(device)
    bias = (torch.randn(E, generator=gen) * 0.05).to(device)
    if which == "sink":
        return sink_gate(x, weight, bias, torch.tensor(0.7, device=device), k, 1.5, align=align)[0]
    return minimax_gate(x, weight, bias, k, 2.5, align=align)[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", ["sink", "minimax"])
@pytest.mark.parametrize("T,same_rows", [(1, False), (2, False), (3, False), (5, True), (8, False)])
def test_gate_aligns_as_the_align_kernel(device, which, T, same_rows):
    """The sorted slots and segment ends the gate stores equal `_align_kernel`'s on the same ids,
    bit for bit: tokens sharing experts (every token the same with `same_rows`), unused experts,
    the shared chunks' segments and every segment's padding rows."""
    from kiln.kernels.moe_align import GateAlign

    E, k, chunks, block_m = (64, 6, 2, 16) if device == "cuda" else (8, 2, 2, 16)
    align = GateAlign.new(T, k, E, chunks, block_m, torch.device(device))
    ids = _gate(which, T, E, k, device, same_rows, align)
    assert align.filled
    want_slots, want_ends = _align_kernel_result(ids, T, k, E, chunks, block_m)
    assert torch.equal(align.seg_end, want_ends)
    assert torch.equal(align.sorted_slots[: want_slots.numel()], want_slots)
    if same_rows:  # k experts of T rows each, the chunks' T rows each: every segment padded to one block
        assert int(want_ends[-1]) == (k + chunks) * block_m


def test_gate_align_sizes_and_limits():
    """One gate program aligns at most 16 tokens and GATE_ALIGN_MAX_ASSIGNMENTS selections; the
    buffers are the align kernel's (`sorted_rows`), and a gate refuses another layer's buffers."""
    from kiln.kernels.moe_align import GATE_ALIGN_MAX_ASSIGNMENTS, GateAlign, sorted_rows

    cpu = torch.device("cpu")
    assert GateAlign.new(10, 6, 64, 2, 16, cpu) is not None and GateAlign.new(11, 6, 64, 2, 16, cpu) is None
    assert GateAlign.new(16, 2, 8, 2, 16, cpu) is not None and GateAlign.new(17, 1, 8, 2, 16, cpu) is None
    assert GATE_ALIGN_MAX_ASSIGNMENTS == 64 and GateAlign.new(0, 6, 64, 2, 16, cpu) is None
    a = GateAlign.new(4, 6, 64, 2, 16, cpu)
    assert a.sorted_slots.numel() == sorted_rows(4, 6, 64, 2, 16) == 24 + 24 * 15 + 2 * 16
    assert a.seg_end.numel() == 66 and a.num_slots == 4 * 8 and not a.filled
    if kernels.interpreting():
        with pytest.raises(AssertionError, match="alignment is for"):
            _gate("sink", 3, 8, 2, "cpu", False, GateAlign.new(4, 2, 8, 2, 16, cpu))


@pytest.mark.parametrize("device", DEVICES)
def test_fused_experts_on_the_gate_alignment_is_bit_identical(device, monkeypatch):
    """`fused_experts(aligned=)` skips its align launch and computes the same output, bit for bit;
    a filled alignment of other tokens is refused, an unfilled one ignored."""
    from kiln.kernels import moe
    from kiln.kernels.moe_align import GateAlign

    E, k, H, I, S, dt = (64, 6, 2048, 512, 2, torch.bfloat16) if device == "cuda" else (8, 2, 32, 16, 2, torch.float32)
    T = 4
    gen = torch.Generator().manual_seed(3)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).to(device, dt)
    w2 = (torch.randn(E, H, I, generator=gen) / I ** 0.5).to(device, dt)
    sw13 = (torch.randn(2 * S * I, H, generator=gen) / H ** 0.5).to(device, dt)
    sw2 = (torch.randn(H, S * I, generator=gen) / I ** 0.5).to(device, dt)
    x = torch.randn(T, H, generator=gen).to(device, dt)
    chunks = moe.shared_chunk_count(I, S * I, S)
    align = moe.gate_align(T, k, E, chunks, H, I, torch.device(device))
    ids = _gate("sink", T, E, k, device, False, align)
    w = torch.rand(T, k, generator=gen).to(device)
    sw = torch.rand(T, S, generator=gen).to(device)
    calls = _count_align_launches(monkeypatch)
    want = moe.fused_experts(x, w13, w2, ids, w, shared=(sw13, sw2, sw))
    assert len(calls) == 1
    got = moe.fused_experts(x, w13, w2, ids, w, shared=(sw13, sw2, sw), aligned=align)
    assert len(calls) == 1, "a filled alignment needs no align launch"
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    unfilled = moe.gate_align(T, k, E, chunks, H, I, torch.device(device))
    torch.testing.assert_close(moe.fused_experts(x, w13, w2, ids, w, shared=(sw13, sw2, sw), aligned=unfilled),
                               want, rtol=0, atol=0)
    assert len(calls) == 2
    other = moe.gate_align(T - 1, k, E, chunks, H, I, torch.device(device))
    other.filled = True
    with pytest.raises(AssertionError, match="other tokens"):
        moe.fused_experts(x, w13, w2, ids, w, shared=(sw13, sw2, sw), aligned=other)


def test_gate_align_only_where_the_grouped_path_runs_it():
    """`gate_align`: none on the one-token GEMV path (nothing to align), nor past one gate program."""
    from kiln.kernels import moe

    cpu = torch.device("cpu")
    assert moe.gate_align(1, 6, 64, 2, 2048, 512, cpu) is None  # GEMV_MAX_TOKENS = 1
    assert moe.gate_align(1, 6, 64, 2, 2048, 512, cpu, gemv_max_tokens=0).block_m == 16
    assert moe.gate_align(4, 6, 64, 2, 2048, 512, cpu, gemv_max_tokens=4) is None
    assert moe.gate_align(8, 6, 64, 2, 2048, 512, cpu).num_tokens == 8
    assert moe.gate_align(11, 6, 64, 2, 2048, 512, cpu) is None


@pytest.mark.parametrize("which", ["sink", "minimax"])
@pytest.mark.parametrize("limit", [0, 8])
def test_layer_gate_aligns_up_to_its_flag(which, limit, monkeypatch):
    """On the kernel path a MoE layer of at most `--moe-gate-align-max-tokens` tokens has its gate
    align them (no align launch) and computes what the align kernel's path computes, and what the
    reference path computes; 0 keeps the align kernel."""
    if not kernels.interpreting():
        pytest.skip("CPU tensors run only under Triton's interpreter")
    from tests.kernels.test_moe_kernels import _layer

    layer, cfg, _ = _layer(which, "cpu")
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    calls = _count_align_launches(monkeypatch)
    with torch.no_grad():
        with monkeypatch.context() as m:
            m.setattr(kernels, "kernels_supported", lambda device: True)
            got = layer(x, SimpleNamespace(extras={}, backend=SimpleNamespace(moe_gate_align_max_tokens=limit)))
        want = layer(x, SimpleNamespace(extras={}))  # the reference path
    assert len(calls) == (0 if limit else 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_gate_align_flag():
    """`--moe-gate-align-max-tokens`: off by default (not yet timed on a GPU), 0..16 (one gate
    program's tokens), a clear error otherwise; the runner hands it to the backend."""
    import argparse

    from kiln.config import EngineConfig

    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    assert EngineConfig.from_cli_args(p.parse_args(["--model-path", "m"])).moe_gate_align_max_tokens == 0
    assert EngineConfig.from_cli_args(p.parse_args(["--model-path", "m", "--moe-gate-align-max-tokens", "8"])
                                      ).moe_gate_align_max_tokens == 8
    for bad in (-1, 17):
        with pytest.raises(ValueError, match="--moe-gate-align-max-tokens takes 0 to 16"):
            EngineConfig(model_path="m", moe_gate_align_max_tokens=bad)
