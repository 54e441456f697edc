"""`benchmarks/critical_path.py`: its cuts name kernels that exist, make their launches no-ops, and
undo cleanly (the GPU timings it exists for are in docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Loaded from its path: putting benchmarks/ on sys.path would let benchmarks/kernel_bench shadow the
# `kernels` package that transformers probes for, in every later test of this worker.
_spec = importlib.util.spec_from_file_location("critical_path", os.path.join(REPO, "benchmarks", "critical_path.py"))
critical_path = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(critical_path)


def test_every_cut_installs_and_undoes():
    import kiln.kernels.moe as moe

    gates = (moe.sink_gate, moe.minimax_gate)
    undo = critical_path.install(critical_path.CUTS)
    try:
        assert moe.sink_gate is not gates[0] and moe.minimax_gate is not gates[1]
        for kernels in critical_path.KERNELS.values():
            for module, attr in kernels:
                assert vars(getattr(sys.modules[module], attr)).get("run") is critical_path._skip_launch, attr
    finally:
        undo()
    assert (moe.sink_gate, moe.minimax_gate) == gates
    for kernels in critical_path.KERNELS.values():
        for module, attr in kernels:
            assert "run" not in vars(getattr(sys.modules[module], attr)), (module, attr)


def test_cut_kernel_does_not_run():
    from kiln.kernels.norm import rms_norm

    x, w = torch.randn(3, 64), torch.rand(64) + 0.5
    ref = rms_norm(x, w, 1e-6)
    undo = critical_path.install(["norm"])
    try:
        out = rms_norm(x, w, 1e-6)  # a fresh buffer the kernel never wrote
        assert not torch.equal(out, ref)
    finally:
        undo()
    torch.testing.assert_close(rms_norm(x, w, 1e-6), ref)


def test_fixed_gates_route_to_distinct_experts():
    undo = critical_path.install(["gate"])
    try:
        import kiln.kernels.moe as moe
        x = torch.randn(2, 16)
        ids, rw, sw = moe.sink_gate(x, torch.randn(66, 16), torch.zeros(64), torch.ones(()), 6, 1.0, logits=None)
        assert ids.shape == (2, 6) and len(set(ids[0].tolist())) == 6 and int(ids.max()) < 64
        torch.testing.assert_close(rw.sum(1) + sw.sum(1), torch.ones(2))
        ids, w = moe.minimax_gate(x, torch.randn(64, 16), torch.zeros(64), 6, 1.0)
        assert len(set(ids[1].tolist())) == 6
        torch.testing.assert_close(w.sum(1), torch.ones(2))
    finally:
        undo()


def test_unknown_cut_names_the_choices():
    with pytest.raises(ValueError, match="choose from"):
        critical_path.expand(["attn"])
    assert critical_path.expand(["gemv"]) == ["gate", "gemv"]  # garbage logits must not pick experts
    assert critical_path.expand(["norm"]) == ["norm"]
