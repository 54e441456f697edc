"""Programmatic dependent launch (`kiln.kernels.launch`): when kernels take it, and that it changes
no result. PDL only moves a kernel's launch earlier (every kernel waits for its predecessor before
touching memory), so the GPU engine's output with it must equal its output without it, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.config import EngineConfig  # noqa: E402
from kiln.kernels import launch  # noqa: E402


@pytest.fixture
def restore_pdl():
    launch.set_pdl(True)  # an engine built earlier on this worker may have left the trigger on
    yield
    launch.set_pdl(True)


def test_pdl_off_where_it_cannot_apply(restore_pdl, monkeypatch):
    assert launch.pdl_launch(torch.device("cpu")) == dict(PDL=False, launch_pdl=False)
    # As on a GPU: not interpreting, the device's capability decides, set_pdl(False) overrides it.
    queried = []
    monkeypatch.setattr(launch, "_INTERPRETING", False)
    monkeypatch.setattr(launch, "_sm90_or_later", lambda index: queried.append(index) or index == 0)
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert launch.pdl_supported(cuda0) and launch.pdl_launch(cuda0) == dict(PDL=True, launch_pdl=True)
    assert not launch.pdl_supported(cuda1)  # an older GPU
    launch.set_pdl(False)
    queried.clear()
    assert not launch.pdl_supported(cuda0) and launch.pdl_launch(cuda0) == dict(PDL=False, launch_pdl=False)
    assert queried == []  # disabled: no device query at all
    launch.set_pdl(True)
    assert launch.pdl_supported(cuda0)
    launch.set_pdl(True, early_trigger=True)  # PDL 2: wait, then let the successor launch
    assert launch.pdl_launch(cuda0) == dict(PDL=2, launch_pdl=True)
    assert launch.pdl_launch(cuda1) == dict(PDL=False, launch_pdl=False)


def test_early_trigger_context_restores(restore_pdl, monkeypatch):
    monkeypatch.setattr(launch, "_INTERPRETING", False)
    monkeypatch.setattr(launch, "_sm90_or_later", lambda index: True)
    cuda0 = torch.device("cuda", 0)
    with launch.early_trigger(True):
        assert launch.pdl_launch(cuda0)["PDL"] == 2
        with launch.early_trigger(False):
            assert launch.pdl_launch(cuda0)["PDL"] == 1
        assert launch.pdl_launch(cuda0)["PDL"] == 2
    assert launch.pdl_launch(cuda0)["PDL"] == 1
    launch.set_pdl(True, early_trigger=True)
    with launch.early_trigger(False):
        assert launch.pdl_launch(cuda0)["PDL"] == 1
    assert launch.pdl_launch(cuda0)["PDL"] == 2


def test_graphs_of_few_rows_capture_the_early_trigger(restore_pdl, monkeypatch):
    """The engine captures graphs of at most --pdl-early-trigger-max-tokens rows with PDL 2, the
    others with PDL 1; with speculative decoding only the decode graphs (one token per sequence:
    adaptive plain steps), not the verify graphs; --pdl-early-trigger: all."""
    from types import SimpleNamespace

    from kiln.engine.cuda_graph import CudaGraphRunner
    from kiln.engine.runner import ModelRunner

    monkeypatch.setattr(launch, "_INTERPRETING", False)
    monkeypatch.setattr(launch, "_sm90_or_later", lambda index: True)

    class RecordingCapturer:  # what a kernel launched during each capture would be given
        def __init__(self):
            self.pdl = []

        def capture(self, fn):
            self.pdl.append(launch.pdl_launch(torch.device("cuda", 0))["PDL"])
            return (lambda: None), None

        def done(self, sizes):
            pass

    for everywhere, max_tokens, spec in ((False, 8, 0), (False, 0, 0), (True, 0, 0), (False, 8, 3), (True, 8, 3)):
        runner = SimpleNamespace(config=EngineConfig(pdl_early_trigger=everywhere,
                                                     pdl_early_trigger_max_tokens=max_tokens), spec_steps=spec)
        context = lambda bs, q: ModelRunner._graph_capture_context(runner, bs, q)  # noqa: E731
        g = CudaGraphRunner(lambda b: None, 16, [], torch.device("cpu"), tokens_per_seq=(1, 4),
                            capture_context=context)
        capturer = RecordingCapturer()
        g.capture(capturer)
        shapes = [(bs, q) for q in sorted(g.tokens_per_seq, key=lambda q: -q * g.sizes_of[q][-1])
                  for bs in reversed(g.sizes_of[q])]
        rows = [bs * q for bs, q in shapes]
        assert rows == [64, 32, 16, 8, 4, 16, 8, 4, 2, 1]  # verify graphs of 4 rows per sequence first
        assert capturer.pdl == [2 if everywhere or (bs * q <= max_tokens and (q == 1 or not spec)) else 1
                                for bs, q in shapes]
        assert spec == 0 or everywhere or max_tokens == 0 or capturer.pdl[-4:] == [2, 2, 2, 2]  # decode graphs, bs <= 8
        assert launch.pdl_launch(torch.device("cuda", 0))["PDL"] == 1  # restored after every capture
    with pytest.raises(ValueError, match="pdl-early-trigger-max-tokens"):
        EngineConfig(pdl_early_trigger_max_tokens=-1)


def test_disable_pdl_flag():
    cfg = EngineConfig.from_cli_args(_parse(["--model-path", "m", "--disable-pdl"]))
    assert cfg.disable_pdl
    assert not EngineConfig.from_cli_args(_parse(["--model-path", "m"])).disable_pdl
    assert EngineConfig.from_cli_args(_parse(["--model-path", "m", "--pdl-early-trigger"])).pdl_early_trigger
    assert not EngineConfig.from_cli_args(_parse(["--model-path", "m"])).pdl_early_trigger
    assert EngineConfig.from_cli_args(_parse(["--model-path", "m"])).pdl_early_trigger_max_tokens == 8
    assert EngineConfig.from_cli_args(
        _parse(["--model-path", "m", "--pdl-early-trigger-max-tokens", "0"])).pdl_early_trigger_max_tokens == 0


def _parse(argv):
    import argparse

    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    return p.parse_args(argv)


@pytest.mark.gpu
def test_engine_output_identical_with_and_without_pdl(arch_dir, restore_pdl):
    # Decode replays from CUDA graphs captured with (then without, then with early-triggered) PDL
    # edges; prefill runs eagerly.
    # Before sm_90 both engines launch plainly: the flag must then change nothing either.
    from tests.engine.test_hybrid_engine import make_core, prompts
    from tests.engine.test_kernel_path import greedy

    hopper = torch.cuda.get_device_capability() >= (9, 0) and torch.version.hip is None
    reqs = prompts(5, seed=3, lo=20, hi=60)
    # The GEMV's row limit pinned: unset, it follows PDL (1 with it, 0 without: `gemv_max_rows`),
    # and with it the kernels of the LM heads and routers of 2-16 rows (the GEMV's or cuBLAS's),
    # whose sums round differently; what is compared here is PDL's own effect.
    kw = dict(page_size=4, chunked_prefill_size=32, dtype="bfloat16", device="cuda", cuda_graph_max_bs=16,
              gemv_max_rows=1)
    with_pdl = make_core(arch_dir, pdl_early_trigger_max_tokens=0, **kw)  # no graph triggers early
    assert launch.pdl_supported(torch.device("cuda")) == hopper
    out_a, rows_a = greedy(with_pdl, reqs, max_tokens=12)
    small = make_core(arch_dir, **kw)  # the default: graphs of <= 8 rows trigger early, the 16 does not
    out_d, rows_d = greedy(small, reqs, max_tokens=12)
    without = make_core(arch_dir, disable_pdl=True, **kw)
    assert not launch.pdl_supported(torch.device("cuda"))
    out_b, rows_b = greedy(without, reqs, max_tokens=12)
    triggered = make_core(arch_dir, pdl_early_trigger=True, **kw)  # every kernel triggers its successor early
    assert launch.pdl_launch(torch.device("cuda"))["PDL"] == (2 if hopper else 0)
    out_c, rows_c = greedy(triggered, reqs, max_tokens=12)
    assert out_a == out_b == out_c == out_d
    for rid in rows_a:
        assert torch.equal(torch.stack(rows_a[rid]), torch.stack(rows_d[rid])), rid
        assert torch.equal(torch.stack(rows_a[rid]), torch.stack(rows_b[rid])), rid
        assert torch.equal(torch.stack(rows_a[rid]), torch.stack(rows_c[rid])), rid
