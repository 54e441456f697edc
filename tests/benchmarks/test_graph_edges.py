"""benchmarks/graph_edges.py's summary of a captured graph's topology, on a synthetic graph (the
driver calls that read a real one need a GPU: the tool runs on the device only)."""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import graph_edges  # noqa: E402


def test_summary_counts_kernel_edges_by_type_and_names_the_default_ones():
    # a -> b (programmatic), b -> copy (default), copy -> c (default, not kernel to kernel),
    # c -> d (default), a -> d (programmatic): d joins two predecessors
    types = ["kernel", "kernel", "memcpy", "kernel", "kernel"]
    names = ["a", "b", "memcpy", "c", "d"]
    edges = [(0, 1, 1, 1), (1, 2, 0, 0), (2, 3, 0, 0), (3, 4, 0, 0), (0, 4, 1, 1)]
    s = graph_edges.summarize(types, names, edges)
    assert s["nodes"] == {"kernel": 4, "memcpy": 1}
    assert s["kernel_edges"] == {"programmatic/port1": 2, "default/port0": 1}
    assert s["first_default"] == ["c -> d"]
    assert s["default_successors"] == {"d": 1}
    assert s["joins"] == 1 and s["roots"] == 1


def test_summary_of_an_all_programmatic_chain_has_no_default_edges():
    n = 5
    s = graph_edges.summarize(["kernel"] * n, [f"k{i}" for i in range(n)],
                              [(i, i + 1, 1, 1) for i in range(n - 1)])
    assert s["kernel_edges"] == {"programmatic/port1": n - 1}
    assert s["first_default"] == [] and s["joins"] == 0 and s["roots"] == 1


def test_kept_graphs_patches_the_capture_and_restores_it(tmp_path):
    import torch

    from kiln.engine import cuda_graph

    graph_cls, capture = torch.cuda.CUDAGraph, cuda_graph.CudaGraphCapturer.capture
    with graph_edges.kept_graphs([]) as records:
        assert torch.cuda.CUDAGraph is not graph_cls and issubclass(torch.cuda.CUDAGraph, graph_cls)
        assert cuda_graph.CudaGraphCapturer.capture is not capture
        assert records == []
    assert torch.cuda.CUDAGraph is graph_cls and cuda_graph.CudaGraphCapturer.capture is capture


def test_main_runs_decode_batch_and_writes_the_graphs_it_kept(tmp_path, capsys):
    # On the CPU nothing is captured: the run checks the wiring (arguments after "--" reach
    # decode_batch.py, the JSON is written), not the driver calls
    import json

    out = tmp_path / "edges.json"
    records = graph_edges.main(["--json", str(out), "--", "--model-path", "preset:inkling/tiny", "--quick",
                                "--device", "cpu", "--threads", "1", "--batch-sizes", "2"])
    assert records == [] and json.loads(out.read_text()) == []
    assert "Decode at fixed batch" in capsys.readouterr().out
