"""The startup warm-up (`kiln/engine/warmup.py`): it runs where Triton kernels compile (CUDA) and
not on the CPU or with --skip-server-warmup; it serves its requests to completion and leaves
nothing behind: no work, no cached prefix, zeroed counters, and the same greedy and seeded
sampled outputs as a core that did not warm up (with and without MTP speculation)."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest
import torch

from kiln.config import EngineConfig
from kiln.engine.io import GenerateReq
from kiln.engine.request import SamplingParams
from kiln.engine.warmup import PHASES, wants_warm_up, warm_up
from tests.engine.test_hybrid_engine import INKLING, make_core, prompts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("inkling")
    (d / "config.json").write_text(json.dumps(INKLING))
    return str(d)


def test_warm_up_only_where_kernels_compile():
    runner = lambda dev, kernels: SimpleNamespace(device=torch.device(dev),  # noqa: E731
                                                 backend=SimpleNamespace(use_kernels=kernels))
    assert wants_warm_up(EngineConfig(), runner("cuda", True))
    assert not wants_warm_up(EngineConfig(skip_server_warmup=True), runner("cuda", True))
    assert not wants_warm_up(EngineConfig(), runner("cuda", False))  # --kernel-backend reference
    assert not wants_warm_up(EngineConfig(), runner("cpu", True))  # Triton's interpreter compiles nothing
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert EngineConfig.from_cli_args(parser.parse_args(["--skip-server-warmup"])).skip_server_warmup


def serve(core, reqs: list[tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    for i, (ids, params) in enumerate(reqs):
        core.add_request(GenerateReq(rid=f"u{i}", input_ids=ids, params=params))
    out: dict[str, list[int]] = {}
    while core.has_work():
        for o in core.step():
            assert o.error is None, o.error
            out.setdefault(o.rid, []).extend(o.new_token_ids)
    return out


@pytest.mark.parametrize("spec", [{}, dict(speculative_algorithm="mtp", speculative_num_steps=2)],
                         ids=["plain", "mtp"])
def test_warm_up_leaves_nothing_behind(model_dir, spec):
    warm, cold = make_core(model_dir, **spec), make_core(model_dir, **spec)  # on the CPU neither warms up
    assert warm.stats().prompt_tokens_total == 0
    served: dict[str, int] = {}
    step = warm.step

    def counted():
        outs = step()
        for o in outs:
            served[o.rid] = served.get(o.rid, 0) + len(o.new_token_ids)
        return outs

    warm.step = counted
    assert warm_up(warm) >= 0
    warm.step = step
    # every request of every phase served to its last token (the penalties', the filters', greedy)
    assert sorted(served.values()) == sorted(p.max_tokens for batch in PHASES for p in batch), served
    assert not warm.has_work()
    warm.check_integrity()
    stats = warm.stats()
    assert stats.kv_used_tokens == 0  # the warm-up's prefixes are flushed
    assert (stats.prompt_tokens_total, stats.generation_tokens_total, stats.cached_tokens_total) == (0, 0, 0)
    assert stats.spec is None or stats.spec.verify_steps == 0 and not any(stats.spec.steps_by_length)
    ps = prompts(3, seed=7)
    reqs = [(ps[0], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)),
            (ps[1], SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)),
            (ps[2], SamplingParams(max_tokens=10, temperature=1.0, repetition_penalty=1.2, seed=3, ignore_eos=True))]
    assert serve(warm, reqs) == serve(cold, reqs)
