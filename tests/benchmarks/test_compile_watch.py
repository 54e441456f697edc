"""benchmarks/compile_watch.py on the CPU: Triton's compile entry is replaced by a fake (nothing
compiles under the interpreter), and the report must name the phase a variant first ran in and
what sets it apart from the kernel's earlier variants."""

from __future__ import annotations

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

jit = pytest.importorskip("triton.runtime.jit")
import compile_watch  # noqa: E402


class _Kernel:
    __name__ = "_decode_kernel"


def _use(n_divisible: bool, block: int) -> None:
    signature = {"Q": "*bf16", "n": "i32", "BLOCK": "constexpr"}
    attrs = {(0,): [["tt.divisibility", 16]]}
    if n_divisible:
        attrs[(1,)] = [["tt.divisibility", 16]]
    jit.JITFunction._do_compile(_Kernel(), "key", signature, "cuda:0", {(2,): block}, None, attrs, False)


def test_a_variant_first_used_while_serving_is_reported_with_its_difference(monkeypatch):
    monkeypatch.setattr(jit.JITFunction, "_do_compile", lambda *a: "compiled")
    watch = compile_watch.CompileWatch()
    watch.phase = "build"
    _use(True, 64)
    watch.phase = "batch 8 warm-up"
    _use(True, 128)
    watch.phase = "batch 8"
    _use(False, 64)
    report = watch.report()
    assert [e[0] for e in watch.events] == ["build", "batch 8 warm-up", "batch 8"]
    assert "== build: 1 first uses" in report and "_decode_kernel x1" in report
    # the measured phase lists the variant: n lost its divisibility by 16 against the build's
    lines = report.splitlines()
    line = lines[lines.index(next(ln for ln in lines if ln.startswith("== batch 8:"))) + 2]
    assert "n: [['tt.divisibility', 16]] -> None" in line and "BLOCK" not in line


def test_a_kernel_first_seen_while_serving_says_so(monkeypatch):
    monkeypatch.setattr(jit.JITFunction, "_do_compile", lambda *a: "compiled")
    watch = compile_watch.CompileWatch()
    watch.phase = "batch 1"
    _use(True, 64)
    assert "the kernel's first variant" in watch.report()
