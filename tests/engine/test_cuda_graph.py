"""GPU: decode replayed from CUDA graphs equals eager decode, and the GPU engine's greedy output
equals the CPU reference path, for the Llama family and both hybrid presets (fp32 on the GPU so
that the comparison is tight)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_kernel_path import greedy
from tests.engine.test_hybrid_engine import make_core, prompts

pytestmark = pytest.mark.gpu


def test_graphs_equal_eager_and_cpu(arch_dir):
    # 5 requests: batch sizes 5 -> padded to the captured 8, then fewer as requests finish.
    reqs = prompts(5, seed=2, lo=20, hi=70)
    kw = dict(page_size=4, chunked_prefill_size=32, dtype="float32")
    cpu_out, cpu_rows = greedy(make_core(arch_dir, device="cpu", **kw), reqs, max_tokens=12)
    eager = make_core(arch_dir, device="cuda", disable_cuda_graph=True, **kw)
    assert eager.runner.use_kernels and eager.runner.graphs is None
    eager_out, eager_rows = greedy(eager, reqs, max_tokens=12)
    graphed = make_core(arch_dir, device="cuda", cuda_graph_max_bs=16, **kw)
    assert graphed.runner.graphs is not None and graphed.runner.graphs.graphs
    graph_out, graph_rows = greedy(graphed, reqs, max_tokens=12)
    assert graph_out == eager_out == cpu_out
    for rid in cpu_rows:
        want = torch.stack(cpu_rows[rid])
        torch.testing.assert_close(torch.stack(eager_rows[rid]).cpu(), want, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(torch.stack(graph_rows[rid]).cpu(), torch.stack(eager_rows[rid]).cpu(),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "inkling"])
def test_speculative_rounds_with_graphs_equal_plain(arch, tmp_path):
    # MTP rounds (k = 3) on the GPU: verify forwards replay from the uniform-extend graphs and
    # steady MTP passes from the chain graphs (the MTP layers run the extend kernel with key_gap).
    # Greedy output equals plain greedy decoding (graphs and all), with partial acceptance (copy
    # drafter, small alpha).
    import json

    from tests.engine.test_speculative import SPEC_ARCHS, plain_core, run_plain, run_spec, spec_core

    (tmp_path / "config.json").write_text(json.dumps(SPEC_ARCHS[arch]))
    reqs = prompts(5, seed=5, lo=10, hi=40)
    kw = dict(page_size=4, dtype="float32", device="cuda", cuda_graph_max_bs=8)
    core = spec_core(str(tmp_path), 3, alpha=0.01, **kw)
    assert {q for q, _ in core.runner.graphs.graphs} == {1, 4}
    chain = core.scheduler.spec.drafter.graph  # steady MTP passes replay from the chain graphs
    assert chain is not None and sorted(chain.graphs) == [1, 2, 4, 8]
    passes, fed = [], []  # chain-graph passes filled by the host / fed by their verify on the device
    run, run_after_verify = chain.run, chain.run_after_verify
    chain.run = lambda reqs: (passes.append(len(reqs)), run(reqs))[1]
    chain.run_after_verify = lambda reqs, *a: (fed.append(len(reqs)), run_after_verify(reqs, *a))[1]
    res, _, _ = run_spec(core, reqs, max_tokens=16)
    want = run_plain(plain_core(str(tmp_path), alpha=0.01, **kw), reqs, max_tokens=16)
    assert {rid: r[1] for rid, r in res.items()} == want
    counts = core.stats().spec
    assert 0 < counts.accepted_tokens < 3 * counts.verify_steps
    assert fed, "no MTP pass was fed by its verify on the device"


def adaptive_mtp_on_cuda(arch: str, tmp_path, seed: int):
    """An MTP engine (K = 4, the copy drafter) with --speculative-adaptive and graphs on the GPU,
    three prompts, and plain greedy decoding of them (a function of max_tokens)."""
    import json

    from tests.engine.test_speculative import SPEC_ARCHS, plain_core, run_plain, spec_core

    (tmp_path / "config.json").write_text(json.dumps(SPEC_ARCHS[arch]))
    reqs = prompts(3, seed=seed, lo=10, hi=40)
    kw = dict(page_size=4, dtype="float32", device="cuda", cuda_graph_max_bs=8)
    core = spec_core(str(tmp_path), 4, alpha=0.01, speculative_adaptive=True, **kw)
    return core, reqs, lambda n: run_plain(plain_core(str(tmp_path), alpha=0.01, **kw), reqs, max_tokens=n)


@pytest.mark.parametrize("arch", ["llama", "inkling"])
def test_adaptive_rounds_with_graphs_equal_plain(arch, tmp_path):
    # --speculative-adaptive with MTP (K = 4) on the GPU: a verify graph per candidate length
    # (rounds of 1, 2 and 4 drafts, plus decode), the length changing every few steps (a fake
    # clock, tests/engine/test_adaptive_spec.py), rounds of each length replayed from their graph.
    # Greedy output equals plain greedy decoding.
    from tests.engine.test_adaptive_spec import charge_by_length
    from tests.engine.test_speculative import run_spec

    core, reqs, plain = adaptive_mtp_on_cuda(arch, tmp_path, seed=6)
    assert {q for q, _ in core.runner.graphs.graphs} == {1, 2, 3, 5}
    chosen = charge_by_length(core, 0.02)
    replays = []
    replay = core.runner.graphs.replay
    core.runner.graphs.replay = lambda batch: (replays.append(batch.num_tokens // batch.batch_size), replay(batch))[1]
    res, _, _ = run_spec(core, reqs, max_tokens=64)
    assert {rid: r[1] for rid, r in res.items()} == plain(64)
    assert {0, 4} < set(chosen), chosen  # plain rows, K and a length between
    assert {k + 1 for k in chosen} <= set(replays), (chosen, replays)  # tokens per request replayed


@pytest.mark.parametrize("arch", ["llama", "inkling"])
def test_late_mtp_catch_up_with_graphs_equals_plain(arch, tmp_path):
    # --speculative-adaptive with MTP on the GPU, lengths scripted: stretches of plain steps skip
    # the MTP layers (the catch-up lags up to CATCH_UP_LAG tokens) and run under overlap scheduling,
    # the late catch-up replays the late catch-up graph once (`MTPChainGraph.catch_up`),
    # then rounds of K replay it again. Greedy output equals plain greedy decoding.
    from tests.engine.test_adaptive_plain_steps import script_lengths
    from tests.engine.test_speculative import run_spec

    core, reqs, plain = adaptive_mtp_on_cuda(arch, tmp_path, seed=7)
    passes = script_lengths(core, ([4] * 8 + [0] * 30) * 10)
    spec = core.scheduler.spec
    assert spec.overlap_plain_steps  # plain steps between plain steps leave their tokens on the device
    overlapped, step = [], spec._overlapped_plain_step
    spec._overlapped_plain_step = lambda plan, *a: (overlapped.append(len(plan)), step(plan, *a))[1]
    chain = spec.drafter.graph
    runs, run, after_verify = [], chain.run, chain.run_after_verify
    chain.run = lambda *a, **k: (runs.append(1), run(*a, **k))[1]
    chain.run_after_verify = lambda *a, **k: (runs.append(2), after_verify(*a, **k))[1]
    res, _, _ = run_spec(core, reqs, max_tokens=96)
    assert {rid: r[1] for rid, r in res.items()} == plain(96)
    # stretches of skipped passes (no eager layer, no chain replay), late catch-ups after them
    # (lag > K + 1), and rounds on the chain graph again after those. A 30-step stretch reaches
    # the lag bound, whose catch-up is a replay of the late graph alone (nobody drafts), so the
    # stretch goes on past CATCH_UP_LAG passes. (How many stretches the 96 tokens reach depends on
    # the drafts accepted: on an H100 llama reached one such stretch, inkling two.)
    from kiln.engine.spec.mtp_drafter import CATCH_UP_LAG

    late = [i for i in range(1, len(passes)) if passes[i - 1][1] == 0 and passes[i][1]]
    stretches = [len(s) for s in "".join("0" if n == 0 else "|" for _, n in passes).split("|") if s]
    assert max(stretches) > CATCH_UP_LAG and any(passes[i][0] > 5 for i in late), passes
    assert runs.count(2) >= 5, runs  # rounds fed from the verify on the device (chain graph) in K stretches
    # lag 16 at K = 4: one replay of the late graph at the bound, one before the pass that drafts next
    assert spec.drafter.late_passes >= 2 and spec.drafter.graph.late is not None, spec.drafter.late_passes
    # plain steps between plain steps overlap: all of a stretch's but its ends (llama 31 of 31)
    assert len(overlapped) >= sum(stretches) - 2 * len(stretches), (overlapped, stretches)


@pytest.mark.parametrize("arch", ["llama", "inkling"])
def test_ngram_rounds_with_graphs_equal_plain(arch, tmp_path):
    # Prompt lookup (k = 3) on the GPU: with graphs the drafter keeps a batch's rounds uniform
    # (`NgramDrafter.uniform`), so verifies replay from the uniform-extend graph. Greedy output
    # equals plain greedy decoding, with acceptances (echoed prompts) and rejections.
    import json

    from tests.engine.test_ngram import echo_prompts, ngram_core, copy_core
    from tests.engine.test_speculative import SPEC_ARCHS, run_plain, run_spec

    (tmp_path / "config.json").write_text(json.dumps(SPEC_ARCHS[arch]))
    kw = dict(page_size=4, dtype="float32", device="cuda", cuda_graph_max_bs=8)
    reqs = echo_prompts(str(tmp_path), 2, seed=9, max_tokens=16, **kw)
    core = ngram_core(str(tmp_path), 3, **kw)
    assert core.scheduler.spec.drafter.uniform and {q for q, _ in core.runner.graphs.graphs} == {1, 4}
    replays = []
    replay = core.runner.graphs.replay
    core.runner.graphs.replay = lambda batch: (replays.append(batch.num_tokens), replay(batch))[1]
    res, _, _ = run_spec(core, reqs, max_tokens=16)
    assert {rid: r[1] for rid, r in res.items()} == run_plain(copy_core(str(tmp_path), **kw), reqs, max_tokens=16)
    counts = core.stats().spec
    assert 0 < counts.accepted_tokens < 3 * counts.verify_steps
    assert any(n % 4 == 0 and n > 4 for n in replays), replays  # verifies of several requests on a graph


@pytest.mark.parametrize("arch", ["llama", "inkling"])
def test_adaptive_ngram_plain_steps_overlap_with_graphs(arch, tmp_path):
    # --speculative-adaptive with prompt lookup (K = 3) on the GPU, lengths scripted: plain steps
    # between plain steps run under overlap scheduling (their shadow drafts scored a step later),
    # rounds of K replay their verify graph. Greedy output equals plain greedy decoding.
    import json

    from tests.engine.test_ngram import echo_prompts, ngram_core, copy_core
    from tests.engine.test_speculative import SPEC_ARCHS, run_plain, run_spec

    (tmp_path / "config.json").write_text(json.dumps(SPEC_ARCHS[arch]))
    kw = dict(page_size=4, dtype="float32", device="cuda", cuda_graph_max_bs=8)
    reqs = echo_prompts(str(tmp_path), 2, seed=10, max_tokens=32, **kw)
    core = ngram_core(str(tmp_path), 3, speculative_adaptive=True, **kw)
    spec = core.scheduler.spec
    assert spec.overlap_plain_steps
    calls = iter(([3] * 3 + [0] * 12) * 20)
    spec.adaptive.choose = lambda n: next(calls, 0)
    overlapped, step = [], spec._overlapped_plain_step
    spec._overlapped_plain_step = lambda plan, *a: (overlapped.append(len(plan)), step(plan, *a))[1]
    res, _, _ = run_spec(core, reqs, max_tokens=32)
    assert {rid: r[1] for rid, r in res.items()} == run_plain(copy_core(str(tmp_path), **kw), reqs, max_tokens=32)
    assert len(overlapped) > 10 and core.stats().spec.accepted_tokens > 0, overlapped


@pytest.mark.parametrize("name", ["llama", "minimax_m3"])  # DFlash, DSpark
def test_block_drafter_pass_replays_from_graphs(name, tmp_path_factory):
    # Block drafter rounds (k = 3) on the GPU: the block pass replays from its CUDA graphs
    # (`PagedBlockPass`), its drafts gathered by the next verify on the device. Greedy output
    # equals plain greedy decoding and every draft's logits the fresh reference block forward
    # (fp32): the block rows' K/V went to the right slots and the padded graphs touched nothing else.
    from tests.engine.test_block_drafter import assert_block_reference, make_target, outputs, plain_core, spec_core
    from tests.engine.test_block_pass import count_paged_passes
    from tests.engine.test_speculative import run_plain, run_spec

    target = make_target(name, tmp_path_factory)
    reqs = prompts(5, seed=7, lo=10, hi=40)
    kw = dict(page_size=4, dtype="float32", device="cuda", cuda_graph_max_bs=8)
    core = spec_core(target, 3, **kw)
    drafter = core.scheduler.spec.drafter
    assert sorted(drafter.paged.graphs) == [1, 2, 4, 8]
    calls = count_paged_passes(core)
    res, drafts, _ = run_spec(core, reqs, max_tokens=16)
    assert outputs(res) == run_plain(plain_core(target, **kw), reqs, max_tokens=16)
    assert 5 in calls, calls  # 5 requests replay the graph of 8
    assert assert_block_reference(core, res, drafts) > 0


@pytest.mark.parametrize("flags", [{}, dict(gemv_max_rows=4, moe_gemv_max_tokens=4)], ids=["default", "g4m4"])
@pytest.mark.parametrize("num_reqs,k", [(1, 3), (2, 1)])
def test_speculative_verify_of_few_rows_equals_plain(num_reqs, k, flags, tmp_path, monkeypatch):
    # A verify of at most 4 rows (K = 3 at batch 1; K = 1 at batch 2). By default its o_proj runs on
    # the GEMV with o_conv in the epilogue over the verify's chunks, and its MoE layers on the
    # grouped path with out_conv in the sum's epilogue (`conv_chunk`); with --gemv-max-rows 4 and
    # --moe-gemv-max-tokens 4 every dense projection takes the GEMV's 4-row loop (folded norms) and
    # the MoE the expert GEMVs (out_conv then separate). Greedy output equals plain greedy decoding.
    import json

    from kiln.kernels import gemv as gemv_module
    from kiln.kernels import moe as km
    from tests.engine.test_speculative import SPEC_ARCHS, plain_core, run_plain, run_spec, spec_core

    (tmp_path / "config.json").write_text(json.dumps(SPEC_ARCHS["inkling"]))
    rows = num_reqs * (k + 1)
    chunk_gemv, chunk_moe, expert_gemv = [], [], []
    real_gemv, real_fused, real_experts = gemv_module.gemv, km.fused_experts, km.experts_gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda x, w, **kw: (
        kw.get("conv_chunk") and chunk_gemv.append(x.shape[0]), real_gemv(x, w, **kw))[1])
    monkeypatch.setattr(km, "fused_experts", lambda x, *a, **kw: (
        kw.get("conv_chunk") and chunk_moe.append(x.shape[0]), real_fused(x, *a, **kw))[1])
    monkeypatch.setattr(km, "experts_gemv", lambda x, *a: (expert_gemv.append(x.shape[0]), real_experts(x, *a))[1])
    reqs = prompts(num_reqs, seed=7, lo=10, hi=40)
    kw = dict(page_size=4, dtype="float32", device="cuda", cuda_graph_max_bs=8)
    core = spec_core(str(tmp_path), k, alpha=0.01, **flags, **kw)
    res, _, _ = run_spec(core, reqs, max_tokens=16)
    want = run_plain(plain_core(str(tmp_path), alpha=0.01, **kw), reqs, max_tokens=16)
    assert {rid: r[1] for rid, r in res.items()} == want
    assert rows in chunk_gemv  # o_proj + o_conv of the verify (captured in its graph)
    if flags:
        assert rows in expert_gemv and rows not in chunk_moe
    else:
        assert rows in chunk_moe and rows not in expert_gemv


def test_a_collection_during_capture_cannot_destroy_an_old_graph():
    # A CUDA graph left in a reference cycle (an earlier engine) is destroyed by the cyclic
    # collector, which a capturing stream forbids: the capturer keeps the collector off while it
    # captures. Here the cycle becomes garbage inside the capture (still in the young generation:
    # the collector was off since it was made) and every allocation after asks for a collection.
    import gc

    from kiln.engine.cuda_graph import CudaGraphCapturer

    class Holder:
        pass

    x = torch.ones(64, device="cuda")
    capturer = CudaGraphCapturer(torch.device("cuda"), warmups=0)
    before, keep = gc.get_threshold(), []
    gc.disable()
    try:
        old = Holder()
        old.self, old.graph = old, torch.cuda.CUDAGraph()
        with torch.cuda.graph(old.graph):
            old.y = x * 2
        keep.append(old)
        del old

        def forward():
            keep.clear()  # the cycle is garbage now
            gc.set_threshold(1)
            _ = [[i] for i in range(100)]  # container allocations: a young collection each, if on
            return x + 1

        gc.enable()
        replay, out = capturer.capture(forward)
    finally:
        gc.set_threshold(*before)
        gc.enable()
    x.fill_(2.0)
    replay()
    torch.cuda.synchronize()
    assert out.eq(3.0).all()
