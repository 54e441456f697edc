"""A steady decode step never waits for the GPU before the next step is queued (GPU).

Overlap scheduling hides the host's work (sampling launch, output processing, scheduling the next
step) behind the forward it has just queued; one hidden synchronisation in that path (a list index
on a CUDA tensor, an `.item()`) makes the host wait for the forward first, and the GPU then idles
for the whole host step. `HostSyncAudit` collects such waits with their call sites; the only
intended wait, the pinned read-back of the previous step's tokens, is an event wait it does not
report."""

from __future__ import annotations

import pytest
import torch

from kiln.engine.host_sync_audit import HostSyncAudit
from kiln.engine.io import GenerateReq
from kiln.engine.request import SamplingParams
from tests.engine.test_hybrid_engine import make_core, model_dir, prompts  # noqa: F401 (fixture)

pytestmark = pytest.mark.gpu


def test_audit_reports_a_sync_with_its_line():
    x = torch.ones(4, device="cuda")
    with HostSyncAudit() as audit:
        x.sum().item()
        x[[0, 2]]
    assert audit.count == 2, audit.report()
    assert any("x.sum().item()" in frame for site in audit.sites for frame in site), audit.report()
    with HostSyncAudit() as audit:
        x.sum()
    assert audit.count == 0, audit.report()


def test_steady_decode_steps_do_not_wait_for_the_gpu(arch_dir):
    core = make_core(arch_dir, device="cuda", page_size=4, cuda_graph_max_bs=16)
    core.scheduler.check_after_step = False  # the integrity check reads device tables on purpose
    assert core.scheduler.overlap and core.runner.graphs is not None
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=3, logprobs=2),
             dict(temperature=0.7, top_k=20, repetition_penalty=1.2, frequency_penalty=0.3),
             dict(temperature=1.0, min_p=0.1)]
    reqs = prompts(6, seed=4, lo=20, hi=60)
    for i, ids in enumerate(reqs):  # different lengths: some finish inside the audited steps
        params = SamplingParams(max_tokens=14 + 2 * i, ignore_eos=True, **kinds[i % len(kinds)])
        core.add_request(GenerateReq(rid=f"r{i}", input_ids=ids, params=params))
    started = set()
    while len(started) < len(reqs):  # prefill (extends may sync: eager paths, new shapes)
        started |= {o.rid for o in core.step() if o.new_token_ids}
    for _ in range(3):
        core.step()
    with HostSyncAudit(frames=6) as audit:
        for _ in range(12):
            core.step()
    assert audit.count == 0, audit.report()
    while core.has_work():
        core.step()


def _assert_steady_rounds_do_not_wait(tmp_path, kinds: list[dict], seed: int, **kw):
    """MTP rounds (K = 3) of Inkling on CUDA graphs for requests sampling with `kinds`: after the
    prefills and the first eager passes, ten steps are ten rounds of the whole batch on the device
    (`SpecDecoder._device_round`) in which the host waits for nothing but the samples' and the
    drafts' events. Returns the engine."""
    import json

    from tests.engine.test_speculative import SPEC_ARCHS, spec_core

    (tmp_path / "config.json").write_text(json.dumps(SPEC_ARCHS["inkling"]))
    core = spec_core(str(tmp_path), 3, device="cuda", page_size=4, cuda_graph_max_bs=16, **kw)
    core.scheduler.check_after_step = False
    spec = core.scheduler.spec
    assert spec.drafter.graph is not None
    rounds = []
    device_round = spec._device_round
    spec._device_round = lambda plan, *a: (rounds.append(len(plan)), device_round(plan, *a))[1]
    for i, ids in enumerate(prompts(len(kinds), seed=seed, lo=20, hi=60)):
        params = SamplingParams(max_tokens=200, ignore_eos=True, **kinds[i])
        core.add_request(GenerateReq(rid=f"r{i}", input_ids=ids, params=params))
    for _ in range(6):  # prefills, the first eager passes (they give sampled requests their q rows)
        core.step()
    before = len(rounds)
    with HostSyncAudit(frames=6) as audit:
        for _ in range(10):
            core.step()
    assert audit.count == 0, audit.report()
    assert len(rounds) - before == 10 and set(rounds[before:]) == {len(kinds)}, rounds
    while core.has_work():
        core.step()
    return core


@pytest.mark.parametrize("alpha", [0.01, 0.0])
def test_speculative_rounds_do_not_wait_for_the_gpu_between_verify_and_draft(tmp_path, alpha):
    # Point-mass verification: the verify's samples feed the chain graph on the device, whatever
    # the requests' processing (penalties included). alpha 0.01: partial acceptance; 0: every
    # draft accepted.
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=3, logprobs=2),
             dict(temperature=0.7, top_k=20, repetition_penalty=1.2, frequency_penalty=0.3)]
    _assert_steady_rounds_do_not_wait(tmp_path, kinds, seed=4, alpha=alpha)


@pytest.mark.parametrize("flag", ["speculative_use_rejection_sampling", "speculative_use_block_verification"])
def test_sampled_rounds_under_exact_verification_do_not_wait_for_the_gpu(tmp_path, flag):
    # Sampled requests whose drafts the chain graph draws (`kiln.engine.spec.draft_sampling`: no
    # penalty) verify on the device too (`verify_on_device`), as greedy rounds do.
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=3, logprobs=2),
             dict(temperature=1.0, min_p=0.05)]
    core = _assert_steady_rounds_do_not_wait(tmp_path, kinds, seed=5, alpha=0.01, **{flag: True})
    assert core.scheduler.spec.drafter.graph.sampling is not None


def test_routing_capture_does_not_wait_for_the_gpu(model_dir):
    # RL rollouts of MoE models (both hybrids) capture every token's routed experts. Their copy to
    # the host is asynchronous (`RoutingCapture`): a blocking one after each forward made every
    # decode step wait for the device. The ids returned equal those of the same run without overlap.
    reqs = prompts(5, seed=4, lo=20, hi=60)

    def run(overlap: bool, audit_steps: int = 0):
        core = make_core(model_dir, device="cuda", page_size=4, cuda_graph_max_bs=16, dtype="float32",
                         enable_return_routed_experts=True, disable_overlap_schedule=not overlap)
        core.scheduler.check_after_step = False
        for i, ids in enumerate(reqs):  # different lengths: some finish inside the audited steps
            params = SamplingParams(max_tokens=14 + 2 * i, ignore_eos=True, temperature=0.0)
            core.add_request(GenerateReq(rid=f"r{i}", input_ids=ids, params=params, return_routed_experts=True))
        routed, started, audit = {}, set(), None

        def collect(outs):
            for o in outs:
                started.add(o.rid)
                if o.finished:
                    routed[o.rid] = o.routed_experts

        while len(started) < len(reqs):
            collect(core.step())
        for _ in range(3):
            collect(core.step())
        if audit_steps:
            with HostSyncAudit(frames=6) as audit:
                for _ in range(audit_steps):
                    collect(core.step())
        while core.has_work():
            collect(core.step())
        return routed, audit

    routed, audit = run(overlap=True, audit_steps=12)
    assert audit.count == 0, audit.report()
    want, _ = run(overlap=False)
    assert routed.keys() == want.keys() == {f"r{i}" for i in range(len(reqs))}
    for rid, ids in want.items():
        got = routed[rid]
        assert got is not None and got.shape == ids.shape and (got >= 0).all() and (got == ids).all(), rid
