"""Verifies queued ahead (`kiln.engine.spec.verify_ahead`) while requests stop, are aborted, arrive
and are paused, on the CPU (tests/engine/test_verify_ahead.py has the setup; a file of its own so
that the slow interpreter tests spread over the suite's workers)."""

from __future__ import annotations

import pytest

from kiln.engine.io import GenerateReq
from kiln.engine.request import SamplingParams
from tests.engine.test_speculative import plain_core, run_plain
from tests.engine.test_verify_ahead import DEVICES, device_kw, graph_core, interp_dir, prompts, record_taken  # noqa: F401

pytest.importorskip("triton")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interp_dir", ["inkling"], indirect=True)
def test_queued_verifies_with_stops_aborts_arrivals_and_pauses(interp_dir, device):
    """While their rows are in a queued verify: the batch's last request stops on a stop token and
    its first one is aborted (the others verify over their own rows on the host path); a request
    arrives (no verify is queued while it waits for admission); generation is paused with
    retraction and in place (the queued verify is dropped). The others' output equals plain
    decoding; the integrity check runs after every step."""
    ps = prompts(4, seed=21, lo=10, hi=24)
    free = run_plain(plain_core(interp_dir, alpha=0.01, **device_kw(device)), ps, max_tokens=16)
    stop = free["r2"][4]  # r2 stops at the device round that queues the next verify
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                             stop_token_ids=[stop] if i == 2 else None) for i in range(len(ps))]
    core = graph_core(interp_dir, 3, 0.01, device)
    taken = record_taken(core)
    ahead = core.scheduler.spec.ahead
    for i in range(3):
        core.add_request(GenerateReq(rid=f"r{i}", input_ids=ps[i], params=params[i]))
    out, reasons, queued_while_waiting, paused = {}, {}, [], []
    while core.has_work():
        queued = ahead.queued is not None
        if queued and "r0" not in reasons and len(out.get("r0", [])) >= 9:
            core.abort("r0")  # its rows are in the queued verify
        if (queued or device == "cuda") and "r3" not in out and "r2" in reasons:
            core.add_request(GenerateReq(rid="r3", input_ids=ps[3], params=params[3]))
            out["r3"] = []
        for mode, at in (("retract", 3), ("in_place", 8)):
            if queued and mode not in paused and len(out.get("r3", [])) >= at:
                core.pause_generation(mode)
                assert ahead.queued is None
                core.continue_generation()
                paused.append(mode)
        queued_while_waiting.append(bool(core.scheduler.waiting))
        for o in core.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finished:
                reasons[o.rid] = o.finish_reason
        if queued_while_waiting[-1]:
            queued_while_waiting[-1] = ahead.queued is not None
    core.check_integrity()
    assert out["r2"] == free["r2"][:free["r2"].index(stop) + 1]
    assert out["r0"] == free["r0"][:len(out["r0"])]
    assert out["r1"] == free["r1"] and out["r3"] == free["r3"]
    assert core.scheduler.flush_cache() and core.cache.allocator.num_free == core.cache.allocator.capacity
    if device == "cuda":  # fp32 kernels on the GPU: the acceptances, so where the events land, may differ
        assert taken, "no verify was queued ahead"
        return
    assert reasons == {"r0": "abort", "r1": "length", "r2": "stop", "r3": "length"}, reasons
    assert paused == ["retract", "in_place"] and core.stats().num_retractions_total > 0
    # queued verifies were taken with every request still running, and with the last one (the
    # stop) or the first one (the abort) left out; none was queued while a request waited
    assert any(alive == n > 1 for alive, n, _ in taken), taken
    assert any(0 < alive < n and not last for alive, n, last in taken), taken
    assert any(0 < alive < n and last for alive, n, last in taken), taken
    assert not any(queued_while_waiting)
