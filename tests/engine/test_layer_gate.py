"""HiCache's layer-wise overlap: the forward waits for a buffer's copies right before the layer
that uses it (`LayerGate`), and the host -> device copy reads runs of consecutive host pages.

On the CPU there are no streams, so the events are stand-ins that record when the compute stream
"waits" for them; the order they are waited in must follow the layers, and every buffer must be
waited for before the forward returns. The real CUDA path is covered by the gpu-marked HiCache
test (greedy outputs equal, host copies equal the device)."""

from __future__ import annotations

import json

import pytest

from kiln.engine.cache.host_pool import _by_host_page, page_runs
from kiln.engine.cache.layer_gate import LayerGate
from kiln.engine.io import GenerateReq
from kiln.engine.request import SamplingParams
from tests.engine.test_hicache import ARCHS
from tests.engine.test_hybrid_engine import make_core


def test_page_runs_coalesce_consecutive_pages():
    assert page_runs([], 4) == []
    assert page_runs([3, 4, 5], 4) == [(12, 12)]
    assert page_runs([3, 5, 6, 2], 4) == [(12, 4), (20, 8), (8, 4)]  # order kept: it is the copy order
    assert sum(n for _, n in page_runs([7, 1, 2, 9], 16)) == 4 * 16
    # Pages freed in any order come back as runs once the (host, device) pairs are sorted.
    host, dev = _by_host_page([6, 5, 4], [11, 30, 2])
    assert (host, dev) == ([4, 5, 6], [2, 30, 11]) and page_runs(host, 4) == [(16, 12)]


def test_gate_waits_once_per_recorded_buffer():
    import torch

    waited = []
    gate = LayerGate(wait_event=waited.append)
    a, b, c = torch.zeros(2), torch.zeros(2), torch.zeros(2)
    gate.record(a, "a1")
    gate.record(a, "a2")  # a later copy on the same buffer replaces the earlier event
    gate.record(b, "b")
    gate.wait(c)
    assert waited == []
    gate.wait(a, c)
    gate.wait(a)
    assert waited == ["a2"]
    gate.wait_all()
    assert waited == ["a2", "b"] and len(gate) == 0


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_eager_forward_waits_layer_by_layer(arch, tmp_path):
    """Every pool buffer gets an event before a prefill; the forward must wait for each buffer it
    uses, in layer order, and none may be left pending after it."""
    (tmp_path / "config.json").write_text(json.dumps(ARCHS[arch]))
    core = make_core(str(tmp_path), page_size=4, max_total_tokens=128)
    runner = core.runner
    order = []
    gate = runner.load_gate
    gate._wait_event = order.append
    buffers = [t for pool in (runner.full_kv, runner.index_k, runner.swa_kv, runner.conv) if pool is not None
               for t in pool.tensors()]
    for i, t in enumerate(buffers):
        gate.record(t, i)
    wait_all = gate.wait_all
    gate.wait_all = lambda: (order.append("all"), wait_all())
    core.add_request(GenerateReq(rid="r", input_ids=list(range(1, 20)),
                                 params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    core.step()
    assert len(gate) == 0
    assert sorted(i for i in order if i != "all") == list(range(len(buffers)))
    # The layers asked for their buffers before the forward's final wait_all, in layer order: the
    # K/V buffers of the full-attention layers (one pool, allocated in layer order) and the
    # indexer keys.
    layered = order[:order.index("all")]
    n_layers = len(runner.full_kv.k)  # tensors() = every layer's K, then every layer's V
    full = [i for i in layered if i < 2 * n_layers]
    assert full == [j for i in range(n_layers) for j in (i, n_layers + i)]
    if runner.index_k is not None:
        n = 2 * n_layers
        assert [i for i in layered if n <= i < n + len(runner.index_k.tensors())] == \
            list(range(n, n + len(runner.index_k.tensors())))
