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
from tests.engine.test_kernel_path import FEWER_LAYERS, INTERP_CONFIGS, INTERP_CONTEXT, greedy

pytest.importorskip("triton")


class RecomputeCapturer:
    """Replay = run the captured forward again and copy its result (a tensor, a tuple of them, or
    None) into the captured output."""

    def __init__(self):
        self.replays = 0

    def capture(self, fn):
        out = fn()

        def replay():
            self.replays += 1
            new = fn()
            for o, n in zip(out, new) if isinstance(out, tuple) else ((out, new),):
                if o is not None:
                    o.copy_(n)

        return replay, out

    def done(self, sizes):
        pass


def test_batch_size_ladder():
    assert graph_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert graph_batch_sizes(256)[-1] == 256 and graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(100)[-2:] == [96, 100]


@pytest.mark.parametrize("arch", ["llama", "inkling"])
def test_padded_replays_equal_eager(arch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(INTERP_CONFIGS[arch]))  # fewer layers: the interpreter
    reqs = prompts(5, seed=3, lo=8, hi=30)
    kw = dict(page_size=4, kernel_backend="triton", enable_return_routed_experts=arch == "inkling",
              context_length=INTERP_CONTEXT)
    want_out, want_rows = greedy(make_core(str(tmp_path), **kw), reqs, max_tokens=6)

    core = make_core(str(tmp_path), **kw)
    runner = core.runner
    runner.graphs = CudaGraphRunner(runner._forward_eager, 8, list(runner.window_tables), runner.device)
    capturer = RecomputeCapturer()
    runner.graphs.capture(capturer)
    assert sorted(runner.graphs.graphs) == [(1, 1), (1, 2), (1, 4), (1, 8)]
    got_out, got_rows = greedy(core, reqs, max_tokens=6)
    assert capturer.replays > 0  # decode steps went through the graph path (5 rows -> padded 8)
    assert got_out == want_out
    for rid in want_rows:
        torch.testing.assert_close(torch.stack(got_rows[rid]), torch.stack(want_rows[rid]), atol=1e-5, rtol=1e-5)
    core.check_integrity()


def test_verify_shape_ladder_is_capped():
    g = CudaGraphRunner(lambda b: None, 256, [], torch.device("cpu"), tokens_per_seq=(1, 4))
    assert g.sizes_of[1][-1] == 256 and g.sizes_of[4][-1] == 256  # 256 x 4 = MAX_VERIFY_TOKENS
    g = CudaGraphRunner(lambda b: None, 256, [], torch.device("cpu"), tokens_per_seq=(1, 16))
    assert g.sizes_of[16][-1] == 64 and g.input_ids.shape[0] == 1024


@pytest.mark.parametrize("arch,alpha", [("llama", 0.01), ("inkling", 0.01), ("inkling", 0.0)])
def test_speculative_rounds_replay_equal_plain_greedy(arch, alpha, tmp_path):
    # MTP rounds (k = 3) on graphs: the verify forward (4 tokens per request) replays from the
    # uniform-extend graphs (3 requests padded to 4), decode steps from the decode graphs, and
    # steady-decode MTP passes from the chain graphs (`MTPChainGraph`). alpha 0.01: partial
    # acceptance (asserted), so rejected drafts are rolled back; alpha 0: every draft accepted
    # (the longest catch-up, K + 1 rows). The drafts the chain graph makes
    # must equal the teacher-forced MTP reference, and the output plain greedy decoding.
    from tests.engine.test_speculative import (SPEC_ARCHS, assert_mtp_reference, plain_core, run_plain,
                                               run_spec, spec_core)

    # fewer layers and a short context for the interpreter (test_kernel_path.FEWER_LAYERS)
    (tmp_path / "config.json").write_text(json.dumps({**SPEC_ARCHS[arch], **FEWER_LAYERS.get(arch, {})}))
    reqs = prompts(3, seed=4, lo=10, hi=30)
    core = spec_core(str(tmp_path), 3, alpha=alpha, page_size=4, kernel_backend="triton", cuda_graph_max_bs=4,
                     context_length=INTERP_CONTEXT)
    runner, drafter = core.runner, core.scheduler.spec.drafter
    runner.graphs = runner._new_graphs()
    runner.graphs.capture(RecomputeCapturer())
    assert {q for q, _ in runner.graphs.graphs} == {1, 4}
    chain = RecomputeCapturer()
    drafter.use_graphs(4, chain)
    # as on CUDA with --speculative-verify-ahead prompt-lookup: only prompt lookup's rounds queue
    # their next verify ahead, so these rounds' next verifies are built on the host
    core.scheduler.spec.ahead.enabled = True
    shapes = []
    replay = runner.graphs.replay
    runner.graphs.replay = lambda batch: (shapes.append(runner.graphs.shape_of(batch)), replay(batch))[1]
    gathered = []  # verify inputs whose drafts were still on the device (DraftsInFlight)
    draft_ids = core.scheduler.spec.draft_ids
    core.scheduler.spec.draft_ids = lambda r, k: (lambda out: (gathered.append(out[1] is not None), out)[1])(
        draft_ids(r, k))
    in_flight = []  # draft counts of the requests whose drafts came from a chain graph
    set_in_flight = drafter._set_in_flight
    drafter._set_in_flight = lambda r, row, k: (in_flight.append(k), set_in_flight(r, row, k))[1]
    on_device = []  # rounds whose MTP pass was fed from the verify's samples on the device
    spec = core.scheduler.spec
    device_round = spec._device_round
    in_round, shrunk_in_round = [False], []

    def counted_round(plan, *a):
        on_device.append(len(plan))
        in_round[0] = True
        try:
            return device_round(plan, *a)
        finally:
            in_round[0] = False

    spec._device_round = counted_round
    # a steady round holds the pages the next one grows to (`hold`): it frees none to retake it
    shrink = core.scheduler.cache.shrink
    core.scheduler.cache.shrink = lambda r, n: (shrunk_in_round.append(in_round[0]), shrink(r, n))[1]
    res, drafts, _ = run_spec(core, reqs, max_tokens=9)
    assert not any(shrunk_in_round), "a round on the device freed pages the next round takes again"
    assert 4 in shapes, "no verify forward replayed"
    assert chain.replays > 0, "no MTP pass replayed"
    assert any(gathered), "no verify read its drafts on the device"
    assert on_device, "no round ran verify -> draft on the device"
    # every round drafts K, up to the last one (max_tokens stops the commit, not the draft)
    assert set(in_flight) == {3}, in_flight
    want = run_plain(plain_core(str(tmp_path), alpha=alpha, page_size=4), reqs, max_tokens=9)
    assert {rid: r[1] for rid, r in res.items()} == want
    counts = core.stats().spec
    assert counts.verifies_queued_ahead == 0, "an MTP round queued its next verify under 'prompt-lookup'"
    if alpha:
        assert 0 < counts.accepted_tokens < 3 * counts.verify_steps, "expected partial acceptance"
    else:
        assert counts.accepted_tokens == 3 * counts.verify_steps
    assert assert_mtp_reference(core, res, drafts) > 0


def test_adaptive_rounds_replay_a_graph_per_length(tmp_path):
    # --speculative-adaptive (K = 4) on graphs: a verify graph per candidate length (1, 2 and 4
    # drafts, and decode for 0), the length changing every few steps (a fake clock,
    # tests/engine/test_adaptive_spec.py): rounds of every length replay from their graph, MTP
    # passes from the chain graph (which drafts K and hands over the first k), rounds at K from
    # the device. Output equals plain greedy decoding, drafts the teacher-forced reference.
    from tests.engine.test_adaptive_spec import charge_by_length
    from tests.engine.test_speculative import (SPEC_ARCHS, assert_mtp_reference, plain_core, run_plain,
                                               run_spec, spec_core)

    (tmp_path / "config.json").write_text(json.dumps({**SPEC_ARCHS["inkling"], **FEWER_LAYERS["inkling"]}))
    reqs = prompts(2, seed=8, lo=10, hi=30)
    core = spec_core(str(tmp_path), 4, alpha=0.01, page_size=4, kernel_backend="triton", cuda_graph_max_bs=2,
                     context_length=INTERP_CONTEXT, speculative_adaptive=True)
    runner, drafter = core.runner, core.scheduler.spec.drafter
    runner.graphs = runner._new_graphs()
    runner.graphs.capture(RecomputeCapturer())
    assert {q for q, _ in runner.graphs.graphs} == {1, 2, 3, 5}
    chain = RecomputeCapturer()
    drafter.use_graphs(2, chain)
    chosen = charge_by_length(core, 0.02)
    shapes = []
    replay = runner.graphs.replay
    runner.graphs.replay = lambda batch: (shapes.append(runner.graphs.shape_of(batch)), replay(batch))[1]
    res, drafts, _ = run_spec(core, reqs, max_tokens=24)
    assert {0, 4} < set(chosen), chosen  # plain rows, K and a length between
    assert {k + 1 for k in chosen} <= set(shapes), (chosen, shapes)  # every length replayed its graph
    assert chain.replays > 0
    want = run_plain(plain_core(str(tmp_path), alpha=0.01, page_size=4), reqs, max_tokens=24)
    assert {rid: r[1] for rid, r in res.items()} == want
    assert assert_mtp_reference(core, res, drafts) > 0
