"""The engine's kernel path (`kernel_backend="triton"`: Triton attention, ShortConv and MSA kernels
fed with device-side lengths) generates what the reference path generates.

On the CPU the kernels run under Triton's interpreter (tests/conftest.py), which makes this the
CI check that `PagedBackend` hands the kernels the right addressing; on a GPU the same test runs
compiled kernels (and CUDA graphs, see test_cuda_graph.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.engine.test_hybrid_engine import ARCHS, make_core, prompts, run

LLAMA = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
             rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
CONFIGS = {**ARCHS, "llama": LLAMA}

pytest.importorskip("triton")


def greedy(core, reqs, max_tokens=5):
    """Greedy outputs {rid: ids} and {rid: [logit rows sampled]} of requests run together."""
    res = run(core, reqs, max_tokens=max_tokens)
    return {rid: r[1] for rid, r in res.items()}, {rid: r[2] for rid, r in res.items()}


def test_kernel_path_equals_reference(arch_dir):
    # Prompts longer than the tiny sliding window (16) and MSA's selection start (32 tokens),
    # chunked (chunk 24 < prompt) so that extends have a cached prefix.
    # The interpreter runs MSA's kernels slowly: MiniMax-M3 gets two short-ish prompts.
    reqs = prompts(2, seed=1, lo=34, hi=44) if "minimax" in arch_dir else prompts(3, seed=1, lo=30, hi=60)
    kw = dict(page_size=4, chunked_prefill_size=24, max_prefill_tokens=64)
    want_out, want_rows = greedy(make_core(arch_dir, kernel_backend="reference", **kw), reqs, max_tokens=4)
    core = make_core(arch_dir, kernel_backend="triton", **kw)
    assert core.runner.use_kernels
    got_out, got_rows = greedy(core, reqs, max_tokens=4)
    assert got_out == want_out
    for rid in want_rows:
        torch.testing.assert_close(torch.stack(got_rows[rid]), torch.stack(want_rows[rid]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch_dir", ["llama", "inkling", "minimax_m3"], indirect=True)
def test_decode_gemv_path_equals_reference(arch_dir, monkeypatch):
    """Decode steps of at most --gemv-max-rows rows project through Kiln's GEMV and generate what
    the reference path generates; 0 keeps every projection on cuBLAS. The GEMV is counted, so a
    path that silently falls back fails."""
    from kiln.kernels import gemv as gemv_module

    calls = {"n": 0}
    real = gemv_module.gemv

    def counted(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(gemv_module, "gemv", counted)
    llama = os.path.basename(arch_dir).startswith("llama")
    # hybrids: prompts past the tiny sliding window and MSA's selection start, as above
    reqs = prompts(3, seed=2, lo=20, hi=30) if llama else prompts(2, seed=2, lo=34, hi=40)
    kw = dict(page_size=4, chunked_prefill_size=24, max_prefill_tokens=64)
    want_out, want_rows = greedy(make_core(arch_dir, kernel_backend="reference", **kw), reqs, max_tokens=4)
    for rows in ((4, 0) if llama else (4,)):
        calls["n"] = 0
        got_out, got_rows = greedy(make_core(arch_dir, kernel_backend="triton", gemv_max_rows=rows, **kw), reqs,
                                   max_tokens=4)
        assert got_out == want_out
        for rid in want_rows:
            torch.testing.assert_close(torch.stack(got_rows[rid]), torch.stack(want_rows[rid]), atol=1e-4, rtol=1e-4)
        if llama:  # 3 decode steps of 3 rows, 2 layers x 4 projections each (prefill chunks are longer)
            assert calls["n"] == (3 * 2 * 4 if rows else 0), (rows, calls["n"])
        else:  # attention projections (and MSA's indexer) of every layer, dense MLPs
            assert calls["n"] > 0
