"""The CUDA-graph runner's bookkeeping, on the CPU: static input buffers, padding to the captured
batch sizes (padding rows must write only to the scratch slot 0 of every space), the logits and
routed-expert views a replay returns. A capturer that re-runs the forward on the static buffers
stands in for `torch.cuda.CUDAGraph` (what a real graph replays is the same computation on the
same buffers); the kernels run under Triton's interpreter. tests/engine/test_cuda_graph.py is
the GPU version with real graphs."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.engine.cuda_graph import CudaGraphRunner, graph_batch_sizes
from tests.engine.test_hybrid_engine import make_core, prompts
from tests.engine.test_kernel_path import CONFIGS, greedy

pytest.importorskip("triton")


class RecomputeCapturer:
    """Replay = run the captured forward again and copy its result into the captured output."""

    def __init__(self):
        self.replays = 0

    def capture(self, fn):
        out = fn()

        def replay():
            self.replays += 1
            out.copy_(fn())

        return replay, out

    def done(self, sizes):
        pass


def test_batch_size_ladder():
    assert graph_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert graph_batch_sizes(256)[-1] == 256 and graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(100)[-2:] == [96, 100]


@pytest.mark.parametrize("arch", ["llama", "inkling"])
def test_padded_replays_equal_eager(arch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[arch]))
    reqs = prompts(5, seed=3, lo=8, hi=30)
    kw = dict(page_size=4, kernel_backend="triton", enable_return_routed_experts=arch == "inkling")
    want_out, want_rows = greedy(make_core(str(tmp_path), **kw), reqs, max_tokens=6)

    core = make_core(str(tmp_path), **kw)
    runner = core.runner
    runner.graphs = CudaGraphRunner(runner._forward_eager, 8, list(runner.window_tables), runner.device)
    capturer = RecomputeCapturer()
    runner.graphs.capture(capturer)
    assert sorted(runner.graphs.graphs) == [1, 2, 4, 8]
    got_out, got_rows = greedy(core, reqs, max_tokens=6)
    assert capturer.replays > 0  # decode steps went through the graph path (5 rows -> padded 8)
    assert got_out == want_out
    for rid in want_rows:
        torch.testing.assert_close(torch.stack(got_rows[rid]), torch.stack(want_rows[rid]), atol=1e-5, rtol=1e-5)
    core.check_integrity()
