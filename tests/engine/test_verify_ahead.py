"""The next round's verify queued before this round's samples are read back
(`kiln.engine.spec.verify_ahead`), on the CPU: Triton's interpreter for the kernels and a capturer
that re-runs the captured forward for the CUDA graphs (tests/engine/test_graph_buffers.py), with
the feature forced on (on CUDA it is on by default, `--speculative-verify-ahead all`). The `gpu`
variants run the same on real CUDA graphs.

What must hold: the verify built on the device from the counts, samples and drafts of the round
before it is the forward the host would have built. So greedy output equals plain greedy decoding,
every emitted token's logits equal the packed reference forward over the committed tokens, every
MTP draft from committed inputs equals the teacher-forced reference, and the integrity check
passes after every step; also for prompt lookup, whose verify is queued before the commit.
Requests that stop, are aborted, arrive or are paused while a verify is queued:
tests/engine/test_verify_ahead_events.py."""

from __future__ import annotations

import json

import pytest

from kiln.engine.request import ReqStatus, SamplingParams
from tests.engine.test_graph_buffers import RecomputeCapturer
from tests.engine.test_hybrid_engine import assert_reference, prompts
from tests.engine.test_kernel_path import FEWER_LAYERS, INTERP_CONTEXT
from tests.engine.test_speculative import (SPEC_ARCHS, assert_mtp_reference, plain_core, run_plain, run_spec,
                                           spec_core)

pytest.importorskip("triton")


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def device_kw(device: str) -> dict:
    return dict(page_size=4, context_length=INTERP_CONTEXT,
                **(dict(device="cuda", dtype="float32") if device == "cuda" else {}))


def graph_core(model_dir: str, k: int, alpha: float, device: str, max_bs: int = 4):
    """An MTP engine on graphs (verify, decode and chain; on the CPU stood in for by
    `RecomputeCapturer`) with verifies queued ahead."""
    if device == "cuda":
        core = spec_core(model_dir, k, alpha=alpha, cuda_graph_max_bs=max_bs, speculative_verify_ahead="all",
                         **device_kw(device))
        assert core.scheduler.spec.ahead.after_device_rounds
        return core
    return stand_in_graphs(spec_core(model_dir, k, alpha=alpha, kernel_backend="triton", cuda_graph_max_bs=max_bs,
                                     **device_kw(device)), max_bs)


def stand_in_graphs(core, max_bs: int):
    """On the CPU: the verify's and the drafter pass's graphs captured by `RecomputeCapturer`, and
    verifies queued ahead, MTP's and block drafters' rounds included (on CUDA by default)."""
    runner, spec = core.runner, core.scheduler.spec
    runner.graphs = runner._new_graphs()
    runner.graphs.capture(RecomputeCapturer())
    spec.drafter.use_graphs(max_bs, RecomputeCapturer())
    spec.ahead.enabled = spec.ahead.after_device_rounds = True
    return core


def record_taken(core) -> list[tuple[int, int, bool]]:
    """(requests still running, requests, whether the last one is) of every queued verify taken
    (by a step, or dropped: all of its requests finished at the commit before, or a pause)."""
    ahead, taken = core.scheduler.spec.ahead, []
    take = ahead.take

    def recorded():
        q = take()
        if q is not None:
            running = [r.status is ReqStatus.RUNNING for r in q.reqs]
            taken.append((sum(running), len(running), running[-1]))
        return q

    ahead.take = recorded
    return taken


@pytest.mark.parametrize("mode,overlap,tp,want", [
    ("prompt-lookup", True, 1, (True, False)), ("all", True, 1, (True, True)), ("off", True, 1, (False, False)),
    ("all", False, 1, (False, False)), ("all", True, 2, (False, False))])
def test_verify_ahead_modes(mode, overlap, tp, want):
    """--speculative-verify-ahead: (prompt lookup's rounds queue ahead, MTP's and block drafters'
    rounds do); never without overlap scheduling or with tensor parallelism."""
    from types import SimpleNamespace

    from kiln.engine.spec.verify_ahead import VerifyAhead

    runner = SimpleNamespace(routing=None, pc=SimpleNamespace(tp_size=tp))
    a = VerifyAhead(runner, mode, overlap, counts=None)
    assert (a.enabled, a.after_device_rounds) == want
    with pytest.raises(AssertionError):
        VerifyAhead(runner, "sometimes", overlap, counts=None)


def test_a_bad_verify_ahead_mode_names_the_flag():
    from kiln.config import EngineConfig

    with pytest.raises(ValueError, match="--speculative-verify-ahead takes all, prompt-lookup, off"):
        EngineConfig(speculative_verify_ahead="sometimes")


@pytest.fixture
def interp_dir(request, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**SPEC_ARCHS[request.param],
                                                      **FEWER_LAYERS.get(request.param, {})}))
    return str(tmp_path)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interp_dir,alpha", [("llama", 0.01), ("inkling", 0.0)], indirect=["interp_dir"])
def test_queued_verifies_equal_plain_greedy(interp_dir, alpha, device):
    # alpha 0.01: partial acceptance (counts of 1 .. K + 1 move the verify on by different
    # amounts per request); 0: every draft accepted (the largest move, K + 1, whose last row
    # needs a page beyond the chain pass's). Inkling at 0.01 runs in the next test.
    reqs = prompts(3, seed=4, lo=10, hi=30)
    core = graph_core(interp_dir, 3, alpha, device)
    taken = record_taken(core)
    res, drafts, _ = run_spec(core, reqs, max_tokens=13)
    assert {rid: r[1] for rid, r in res.items()} == run_plain(plain_core(interp_dir, alpha=alpha, **device_kw(device)),
                                                              reqs, max_tokens=13)
    if device == "cpu":  # (fp32 on the GPU: the graphs' tests hold their logits to looser bounds)
        assert_reference(core, res)
        assert assert_mtp_reference(core, res, drafts) > 0
    # (a request may still finish at the commit before: accepting drafts up to max_tokens)
    assert len(taken) >= 2 and any(alive == n for alive, n, _ in taken), taken
    assert core.stats().spec.verifies_queued_ahead == len(taken) and core.scheduler.spec.ahead.queued is None
    counts = core.stats().spec
    if alpha:
        assert 0 < counts.accepted_tokens < 3 * counts.verify_steps, "expected partial acceptance"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interp_dir", ["llama"], indirect=True)
def test_prompt_lookup_rounds_queue_their_verifies_before_the_commit(interp_dir, device):
    """Prompt lookup drafts on the host from committed tokens: its next verify is queued between
    the read-back and the commit, with the drafts the lookup will give once this round's tokens are
    committed (`NgramDrafter.drafts_ahead`). Prompts that echo the model's own output (matches,
    acceptances and rejections) and random ones (misses, fallback guesses), one stopping on a stop
    token: greedy output equals plain decoding and every emitted token's logits the reference
    forward; the integrity check runs after every step."""
    from tests.engine.test_ngram import copy_core, echo_prompts, ngram_core

    kw = device_kw(device)
    ps = echo_prompts(interp_dir, 2, seed=31, max_tokens=14, **kw)
    core = ngram_core(interp_dir, 3, cuda_graph_max_bs=4, **kw,
                      **(dict(kernel_backend="triton") if device == "cpu" else {}))
    spec = core.scheduler.spec
    if device == "cpu":
        core.runner.graphs = core.runner._new_graphs()
        core.runner.graphs.capture(RecomputeCapturer())
        spec.drafter.uniform = True  # as with graphs: every ready request drafts K when one matches
        spec.ahead.enabled = True
    taken, used = record_taken(core), []
    # the queued drafts equal the pass's after the commit unless a request of the batch finished
    # there (only then may the others' fallback guesses differ)
    mismatched, take = [], spec.ahead.take

    def compared():
        q = take()
        if q is not None and all(r.status is ReqStatus.RUNNING for r in q.reqs):
            mismatched.extend(r.rid for r, d in zip(q.reqs, q.drafts) if r.spec.drafts != d)
        return q

    spec.ahead.take = compared
    run_queued = spec.run_queued
    spec.run_queued = lambda: (lambda ran: (used.append(ran), ran)[1])(run_queued())
    want = run_plain(copy_core(interp_dir, **kw), ps, max_tokens=14)
    stop = want["r1"][6]  # an echoed prompt stops inside an accepted run
    want["r1"] = want["r1"][:want["r1"].index(stop) + 1]
    params = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, stop_token_ids=[stop] if i == 1 else None)
              for i in range(len(ps))]
    res, _, last = run_spec(core, ps, params=params)
    assert {rid: r[1] for rid, r in res.items()} == want and last["r1"].finish_reason == "stop"
    if device == "cpu":
        assert_reference(core, res)
    counts = core.stats().spec
    assert 0 < counts.accepted_tokens < sum(counts.proposed), "want both acceptances and rejections"
    assert counts.verifies_queued_ahead == len(taken) and spec.ahead.queued is None
    assert any(alive == n == len(ps) for alive, n, _ in taken), taken
    # most were taken by a step (the others: every request finished at the commit before)
    assert sum(used) >= len(taken) / 2, (sum(used), taken)
    assert not mismatched, mismatched
