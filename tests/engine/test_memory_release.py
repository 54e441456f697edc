"""GPU: the colocated engine's memory release on CUDA, where it really gives memory back.

`release_memory_occupation(["kv_cache", "weights"])` must free the state pools and the weights
(parameters to pinned host memory), and `resume_memory_occupation` must bring back an engine whose CUDA graphs,
kernels and caches see the new allocations: the same greedy tokens as before, and a weight update
made after the cycle reaching every kernel exactly as in an engine that never released. The CPU
tests (`tests/rl/test_colocate_release.py`) cannot see either: there the weights never move.
"""

from __future__ import annotations

import pytest
import torch

from kiln.rl.sync import checkpoint_views
from tests.engine.test_hybrid_engine import make_core, prompts
from tests.engine.test_kernel_path import greedy

pytestmark = pytest.mark.gpu

TAGS = ["kv_cache", "weights"]


def _perturbed(core) -> list[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor plus seeded noise (10% of its spread), on the CPU."""
    g = torch.Generator().manual_seed(11)
    out = []
    for name, t in checkpoint_views(core.runner.model):
        c = t.detach().float().cpu()
        if c.is_floating_point() and c.numel() > 1:
            c = c + 0.1 * c.std() * torch.randn(c.shape, generator=g)
        out.append((name, c.to(t.dtype)))
    return out


def test_release_frees_the_gpu_and_resume_serves_the_same_and_new_weights(arch_dir):
    reqs = prompts(4, seed=3, lo=20, hi=60)
    kw = dict(page_size=4, chunked_prefill_size=32, dtype="float32", device="cuda", cuda_graph_max_bs=8)
    core = make_core(arch_dir, **kw)
    assert core.runner.graphs is not None and core.runner.graphs.graphs
    before, rows_before = greedy(core, reqs, max_tokens=10)

    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    weight_bytes = sum(p.numel() * p.element_size() for p in core.runner.model.parameters())
    info = core.release_memory_occupation(TAGS)
    freed = allocated - torch.cuda.memory_allocated()
    assert info["kv_cache_bytes"] > 0 and info["weights_on_cpu"]
    assert all(p.device.type == "cpu" for p in core.runner.model.parameters())
    # Nothing else kept the GPU copies alive (a cache of a weight, a graph's pool).
    assert freed >= weight_bytes + info["kv_cache_bytes"], (freed, weight_bytes, info)

    # The recapture runs each graph's forward once, inside its capture: no eager warm-ups.
    forwards = []
    eager = core.runner._forward_eager
    core.runner._forward_eager = lambda batch: forwards.append(batch.batch_size) or eager(batch)
    core.resume_memory_occupation(TAGS)
    del core.runner._forward_eager
    assert not core.runner.kv_released and not core.runner.weights_released
    assert core.runner.graphs is not None and core.runner.graphs.graphs  # captured again
    assert len(forwards) == len(core.runner.graphs.graphs), forwards
    from kiln.layers.stacked_weights import stacked_weight
    for m in core.runner.model.modules():  # MiniMax-M3: qkv and indexer weights stacked again
        if hasattr(m, "qkv_index_weight"):
            assert stacked_weight(m.qkv_proj, m.indexer.qk_proj) is not None
    after, rows_after = greedy(core, reqs, max_tokens=10)
    assert after == before
    for rid in before:
        torch.testing.assert_close(torch.stack(rows_after[rid]), torch.stack(rows_before[rid]), atol=1e-5, rtol=1e-5)

    # The trainer's sync after the cycle: the same update in an engine that never released.
    new = _perturbed(core)
    core.update_weights_from_tensor(new)
    updated, rows_updated = greedy(core, reqs, max_tokens=10)
    fresh = make_core(arch_dir, **kw)
    fresh.update_weights_from_tensor(new)
    want, rows_want = greedy(fresh, reqs, max_tokens=10)
    assert updated == want
    assert updated != before  # the update changed what the engine computes
    for rid in want:
        torch.testing.assert_close(torch.stack(rows_updated[rid]), torch.stack(rows_want[rid]), atol=1e-5, rtol=1e-5)


def test_pinned_weights_keep_ties_and_reuse_their_host_memory():
    from kiln.engine.pinned_weights import PinnedWeights

    emb = torch.nn.Embedding(10, 4).cuda()
    head = torch.nn.Linear(4, 10, bias=False).cuda()
    head.weight = emb.weight  # tied: one Parameter in two modules
    norm = torch.nn.BatchNorm1d(4).cuda()  # buffers too
    mods = [torch.nn.ModuleList([emb, head]), norm]
    want = {k: v.clone() for k, v in {"w": emb.weight, "mean": norm.running_mean}.items()}
    store = PinnedWeights()
    moved = store.offload(mods)
    assert moved == (40 + 4 + 4 + 4 + 4) * 4 + 8  # the tied weight once; the int64 step counter
    assert emb.weight.device.type == "cpu" and emb.weight.is_pinned() and head.weight is emb.weight
    assert norm.running_mean.device.type == "cpu"
    first = emb.weight.data_ptr()
    store.restore(mods, torch.device("cuda"))
    assert emb.weight.is_cuda and head.weight is emb.weight and norm.running_mean.is_cuda
    assert torch.equal(emb.weight, want["w"]) and torch.equal(norm.running_mean, want["mean"])
    with torch.no_grad():
        emb.weight.add_(1)  # a sync while on the device reaches the next offload
    store.offload(mods)
    assert emb.weight.data_ptr() == first  # the same pinned tensor, not a new allocation
    assert torch.equal(emb.weight, want["w"].cpu() + 1)


def test_model_to_model_sync_waits_for_the_weights_and_reaches_the_graphs(arch_dir):
    """`update_weights_from_model` (sync_full's colocated path): refused while the weights are
    released; after the resume, the same tokens as the checkpoint-name path in another engine."""
    reqs = prompts(4, seed=5, lo=20, hi=60)
    kw = dict(page_size=4, chunked_prefill_size=32, dtype="float32", device="cuda", cuda_graph_max_bs=8)
    core, source = make_core(arch_dir, **kw), make_core(arch_dir, **kw)
    before, _ = greedy(core, reqs, max_tokens=10)
    source.update_weights_from_tensor(_perturbed(source))  # the "trainer" model: new weights
    want, rows_want = greedy(source, reqs, max_tokens=10)
    assert want != before

    core.release_memory_occupation(TAGS)
    with pytest.raises(RuntimeError, match="resume_memory_occupation"):
        core.update_weights_from_model(source.runner.model)
    core.resume_memory_occupation(TAGS)
    nbytes = core.update_weights_from_model(source.runner.model)
    assert nbytes >= sum(p.numel() * p.element_size() for p in core.runner.model.parameters())  # + buffers
    got, rows_got = greedy(core, reqs, max_tokens=10)
    assert got == want
    for rid in want:
        torch.testing.assert_close(torch.stack(rows_got[rid]), torch.stack(rows_want[rid]), atol=1e-5, rtol=1e-5)
