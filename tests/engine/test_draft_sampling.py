"""Sampled drafts drawn on the device (`kiln.engine.spec.draft_sampling`): inside the MTP chain
graph and after a block drafter's paged pass, the draws and q rows equal the host path's for
seeded requests, and rounds of sampled requests under exact verification run on the device
(verify -> draft without the host) with the tokens of the host path."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from kiln.engine.request import SamplingParams, SamplingRow
from kiln.engine.sampler import Sampler, filtered_probs
from kiln.engine.spec.draft_sampling import DraftSampling, eligible
from kiln.engine.spec.sampled_verify import draw_drafts, row_view
from tests.engine.test_graph_buffers import RecomputeCapturer
from tests.engine.test_hybrid_engine import prompts
from tests.engine.test_kernel_path import FEWER_LAYERS, INTERP_CONTEXT
from tests.kernels.devices import INTERPRETER_ONLY

SAMPLED = [SamplingParams(temperature=0.8, top_k=20, seed=5),
           SamplingParams(temperature=1.0, top_p=0.9, min_p=0.02, seed=6),
           SamplingParams(temperature=0.0), SamplingParams(temperature=0.6, top_k=1, seed=8),
           SamplingParams(temperature=1.3, top_k=7, top_p=0.8, seed=2 ** 63 + 11)]


def _req(params: SamplingParams, output=()) -> SimpleNamespace:
    return SimpleNamespace(params=params, prompt_ids=[1, 2], output_ids=list(output), eos_token_ids=(),
                           generator=None, sampling_row=SamplingRow.of(params, ()), num_output=len(output))


def test_graph_draws_equal_the_eager_draws():
    # Each of K layers: the eager pass draws with `draw_drafts` (views of the request, one draw
    # of its stream each); the graph's `draw` from the keys `fill` took. Same tokens, same q
    # rows, bit for bit, and the streams end at the same draw.
    K, V = 3, 96
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(len(SAMPLED), V, generator=g) * 3 for _ in range(K)]
    logits[1][:, 40:] = float("-inf")  # a token map: q is 0 off it
    eager = [_req(p) for p in SAMPLED]
    graph = [_req(p) for p in SAMPLED]
    sampler = Sampler(seed=0)
    cs = DraftSampling(8, K, "cpu", seed=0)
    cs.fill(graph, 8)
    for k in range(K):
        argmax = logits[k].argmax(dim=-1)
        tokens, q = cs.draw(k, torch.cat([logits[k], logits[k][:3]]), torch.cat([argmax, argmax[:3]]))
        sampled = [i for i, p in enumerate(SAMPLED) if not p.greedy]
        drawn, q_eager = draw_drafts(sampler, logits[k][sampled], [row_view(eager[i], [], "cpu") for i in sampled])
        want = argmax.clone()
        want[sampled] = torch.tensor(drawn)
        assert torch.equal(tokens[:len(SAMPLED)], want), k
        assert torch.equal(q[sampled], q_eager), k
        # the q rows of greedy requests are nobody's (their rounds verify with one-hot rows)
        assert torch.equal(tokens[len(SAMPLED):], argmax[:3])  # padding rows take the argmax
    assert [r.generator.draws if r.generator else None for r in graph] == \
        [r.generator.draws if r.generator else None for r in eager]
    assert graph[0].generator.draws == K


def _kernel_draws(monkeypatch) -> None:
    """`DraftSampling` on the CPU with the Triton kernels (the interpreter) instead of the
    references: the filter, the race and the noise the GPU takes."""
    import kiln.engine.spec.draft_sampling as ds
    from kiln.kernels import sampling
    from kiln.kernels.seeded_noise import noise

    monkeypatch.setattr(ds, "filter_fn", lambda device: sampling.filtered_probs)
    monkeypatch.setattr(ds, "_race", lambda q, e: sampling.sample_from_probs(q.contiguous(), e.contiguous()))
    monkeypatch.setattr(ds.seeded_noise, "exponentials", lambda keys, width: noise(keys, width, exponential=True))


@pytest.mark.parametrize("bs", [1, 8])
@pytest.mark.parametrize("device", ["cpu", pytest.param("triton", marks=INTERPRETER_ONLY),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_block_draws_equal_one_draw_per_position(device, bs, monkeypatch):
    # A block drafter's graph draws its K positions in one filter and one race (`draw_block`):
    # the tokens and q rows of K `draw` calls from the same keys, padding rows on the argmax. At
    # one request the per-row inputs once reached the kernels as a stride-0 view, so positions
    # 1.. read the padding rows' constants (top-p 0: the argmax): the kernels' path at bs 1.
    if device == "triton":
        _kernel_draws(monkeypatch)
        device = "cpu"
    K, V = 3, 96
    reqs = [_req(p) for p in SAMPLED[:bs]] if bs > 1 else [_req(SamplingParams(temperature=1.2, seed=3))]
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(bs, K, V, generator=g) * 3).to(device)
    logits[:, 1, 40:] = float("-inf")  # a token map at one position: q is 0 off it
    argmax = logits.argmax(-1)
    cs = DraftSampling(bs, K, device, seed=0)
    cs.fill(reqs, bs)
    tokens, q = cs.draw_block(logits, argmax)
    drawing = cs.draws.bool()
    for k in range(K):
        t, qk = cs.draw(k, logits[:, k], argmax[:, k])  # strided views, as K calls would take them
        assert torch.equal(tokens[:, k], t), k
        if device == "cpu":
            assert torch.equal(q[drawing, k], qk[drawing]), k
        else:  # one launch over bs * K rows against K over bs: the same kept sets, sums in another order
            assert torch.equal(q[drawing, k] > 0, qk[drawing] > 0), k
            torch.testing.assert_close(q[drawing, k], qk[drawing], rtol=1e-5, atol=1e-9)
        # against the filter of each row alone, with its own request's constants
        for b in torch.nonzero(drawing).flatten().tolist():
            row = reqs[b].sampling_row
            one = filtered_probs(logits[b, k][None].cpu(), torch.tensor([row.temperature]), torch.tensor([row.top_k]),
                                 torch.tensor([row.top_p]), torch.tensor([row.min_p]))
            torch.testing.assert_close(q[b, k].cpu(), one[0], rtol=1e-5, atol=1e-7)
    if bs > len(SAMPLED):
        assert torch.equal(tokens[len(SAMPLED):], argmax[len(SAMPLED):])  # padding rows
    if bs > 2:
        assert torch.equal(tokens[2], argmax[2])  # the greedy request


def test_unseeded_requests_draw_fresh_keys_every_pass():
    cs = DraftSampling(2, 2, "cpu", seed=3)
    r = _req(SamplingParams(temperature=1.0))
    cs.fill([r], 2)
    first = cs.keys[0].clone()
    cs.fill([r], 2)
    assert r.generator is None and not torch.equal(first, cs.keys[0])
    assert len({tuple(x) for x in torch.cat([first, cs.keys[0]]).tolist()}) == 4  # four distinct draws
    cs.fill(None, 2)  # a catch-up replay: every row takes the argmax
    assert cs.draws.tolist() == [0, 0]


def test_eligible_needs_a_processing_of_constants():
    assert eligible(_req(SamplingParams(temperature=0.9, top_p=0.5, top_k=4, min_p=0.1)))
    assert eligible(_req(SamplingParams(temperature=0.0, repetition_penalty=1.3)))  # greedy: argmax
    for bad in (dict(repetition_penalty=1.1), dict(frequency_penalty=0.2), dict(presence_penalty=0.2)):
        assert not eligible(_req(SamplingParams(temperature=0.9, **bad))), bad
    mt = SamplingParams(temperature=0.9, min_tokens=3, stop_token_ids=[7])
    assert not eligible(_req(mt, output=[1, 2])) and eligible(_req(mt, output=[1, 2, 3]))
    own = _req(SamplingParams(temperature=0.9))
    own.generator = torch.Generator()
    assert not eligible(own)


@pytest.mark.parametrize("method", ["tokenwise", "block"])
def test_verify_on_device_equals_verify_rounds(method):
    # Rounds of k = 3 drafts: what the device round verifies with (drafts and q on the device, the
    # counts not read back) equals the host path's `verify_rounds` on the same seeded streams; a
    # greedy round given one-hot q rows emits what point masses do (the argmax run, then the argmax).
    from kiln.engine.sampler import SamplingBatch
    from kiln.engine.seeded_noise import SeededStream
    from kiln.engine.spec.sampled_verify import RowView, verify_on_device, verify_rounds

    gen = torch.Generator().manual_seed(1)
    B, k, V = 4, 3, 32
    logits = torch.randn(B * (k + 1), V, generator=gen) * 2
    q = torch.softmax(torch.randn(B, k, V, generator=gen) * 2, -1)
    drafts = torch.randint(0, V, (B, k), generator=gen)
    params = [SamplingParams(temperature=0.9, seed=s) for s in range(B - 1)] + [SamplingParams(temperature=0.0)]
    am = logits.view(B, k + 1, V).argmax(-1)
    drafts[3, :2] = am[3, :2]  # the greedy round: two drafts right, the third a guess
    q[3] = torch.zeros(k, V).scatter_(1, drafts[3].unsqueeze(1), 1.0)
    drafts[0] = logits.view(B, k + 1, V)[0, :k].argmax(-1)  # a round likely to accept
    views = [RowView(p, [], drafts[b, :i].tolist(), (), None) for b, p in enumerate(params) for i in range(k + 1)]
    streams = lambda: [SeededStream(s) for s in range(B - 1)] + [None]  # noqa: E731
    batch = SamplingBatch.from_reqs(views, "cpu")
    out, n = verify_on_device(Sampler(), logits, batch, drafts, q, streams(), method)
    ref, n_ref = verify_rounds(Sampler(), logits, batch, drafts.tolist(), q.reshape(B * k, V), streams(), method)
    assert n.tolist() == n_ref and torch.equal(out.token_ids, ref.token_ids)
    assert n[3] == 2 and out.token_ids[12:16].tolist() == am[3, :3].tolist() + [0]


@pytest.mark.parametrize("method", ["tokenwise"])  # block: the same path but for the verify's math (above)
def test_sampled_rounds_on_the_device_equal_the_host_path(method, tmp_path):
    # Inkling MTP K = 3 under exact verification, graphs on (replayed by recomputation on the
    # CPU) against the same engine without graphs (every round on the host, eager passes).
    # Seeded sampled requests, a greedy one, one whose repetition penalty keeps its rounds on the
    # host while it runs, and one under min_tokens: the same tokens, and sampled rounds ran on
    # the device.
    from tests.engine.test_spec_sampled import FLAGS
    from tests.engine.test_speculative import SPEC_INKLING, run_spec, spec_core

    (tmp_path / "config.json").write_text(json.dumps({**SPEC_INKLING, **FEWER_LAYERS["inkling"]}))
    ps = prompts(4, seed=31, lo=8, hi=16)
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=11, temperature=1.0, top_p=0.9, min_p=0.02, seed=6, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=3, temperature=0.7, repetition_penalty=1.2, seed=7, ignore_eos=True)]
    kw = dict(alpha=0.01, page_size=4, kernel_backend="triton", cuda_graph_max_bs=4, context_length=INTERP_CONTEXT,
              **FLAGS[method])
    host = spec_core(str(tmp_path), 3, **kw)
    want, _, _ = run_spec(host, ps, params=params)

    core = spec_core(str(tmp_path), 3, **kw)
    runner, drafter, spec = core.runner, core.scheduler.spec.drafter, core.scheduler.spec
    runner.graphs = runner._new_graphs()
    runner.graphs.capture(RecomputeCapturer())
    chain = RecomputeCapturer()
    drafter.use_graphs(4, chain)
    assert drafter.graph.sampling is not None
    sampled_rounds = []
    device_round = spec._device_round
    spec._device_round = lambda plan, *a: (sampled_rounds.append(sum(not r.params.greedy for r, _, _ in plan)),
                                           device_round(plan, *a))[1]
    got, _, _ = run_spec(core, ps, params=params)
    assert {rid: r[1] for rid, r in got.items()} == {rid: r[1] for rid, r in want.items()}
    assert chain.replays > 0 and sum(sampled_rounds) > 0, sampled_rounds
    counts = core.stats().spec
    assert 0 < counts.accepted_tokens < sum(counts.proposed)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sampled_block_rounds_on_the_device_equal_the_host_path(device, tmp_path_factory):
    # DFlash on Llama, K = 3, rejection sampling: the paged block pass on graphs (recomputed on the
    # CPU) that draw the sampled requests' drafts themselves (`PagedBlockPass._block(draw=True)`),
    # against the same engine without graphs (host path, drafts drawn position by position).
    from tests.engine.test_block_drafter import make_target, spec_core
    from tests.engine.test_block_rounds_on_device import block_graph_core
    from tests.engine.test_speculative import run_spec

    target = make_target("llama", tmp_path_factory)
    ps = prompts(2, seed=33, lo=8, hi=14)
    params = [SamplingParams(max_tokens=9, temperature=1.5, min_p=0.01, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)]
    kw = dict(page_size=4, chunked_prefill_size=16, max_prefill_tokens=64, speculative_use_rejection_sampling=True)
    host = dict(kernel_backend="triton") if device == "cpu" else dict(device="cuda", dtype="float32",
                                                                       disable_cuda_graph=True)
    want, _, _ = run_spec(spec_core(target, 3, **host, **kw), ps, params=params)
    core = block_graph_core(target, 3, device, 2, **kw)
    spec, drawn = core.scheduler.spec, []
    paged = spec.drafter.paged
    assert paged.draws, "the pass's graphs do not draw"
    run_after_verify = paged.run_after_verify
    paged.run_after_verify = lambda reqs, *a, sampled=False: (
        drawn.append(len(reqs)) if sampled else None, run_after_verify(reqs, *a, sampled=sampled))[1]
    got, _, _ = run_spec(core, ps, params=params)
    assert {rid: r[1] for rid, r in got.items()} == {rid: r[1] for rid, r in want.items()}
    assert drawn, "no sampled drafts were drawn on the device"
    assert core.stats().spec.accepted[2] > 0, "no third draft accepted: later positions' draws untested"


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["tokenwise", "block"])
def test_sampled_rounds_with_graphs_on_cuda(method, tmp_path):
    # On the GPU with real CUDA graphs: sampled requests' rounds run on the device (the chain
    # graph draws their drafts), a run repeats token for token, and it gives the tokens of the
    # same engine without graphs (the host path and eager passes), fp32.
    from tests.engine.test_spec_sampled import FLAGS
    from tests.engine.test_speculative import SPEC_INKLING, run_spec, spec_core

    (tmp_path / "config.json").write_text(json.dumps(SPEC_INKLING))
    ps = prompts(4, seed=32, lo=10, hi=40)
    params = [SamplingParams(max_tokens=24, temperature=0.8, top_k=20, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=22, temperature=1.0, top_p=0.9, min_p=0.02, seed=6, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=21, temperature=1.0, seed=9, ignore_eos=True)]
    kw = dict(alpha=0.01, page_size=4, dtype="float32", device="cuda", **FLAGS[method])

    def run(**more):
        core = spec_core(str(tmp_path), 3, **kw, **more)
        spec, sampled_rounds = core.scheduler.spec, []
        device_round = spec._device_round
        spec._device_round = lambda plan, *a: (sampled_rounds.append(sum(not r.params.greedy for r, _, _ in plan)),
                                               device_round(plan, *a))[1]
        res, _, _ = run_spec(core, ps, params=params)
        return {rid: r[1] for rid, r in res.items()}, sum(sampled_rounds), core

    got, on_device, core = run(cuda_graph_max_bs=8)
    assert core.scheduler.spec.drafter.graph.sampling is not None and on_device > 0
    again, _, _ = run(cuda_graph_max_bs=8)
    host, host_on_device, _ = run(disable_cuda_graph=True)
    assert host_on_device == 0
    assert got == again
    assert got == host
