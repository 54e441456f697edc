"""Hybrid models (Inkling, MiniMax-M3) served by the engine equal the packed reference forward.

Every logit row the engine samples from must be within 1e-4 of the reference forward over the
same tokens, whatever the batching, chunking, prefix-cache hits and retraction; the integrity
check (every component's pages) runs after every scheduler step.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re

import pytest
import torch

from kiln.config import EngineConfig
from kiln.engine.core import EngineCore
from kiln.engine.io import GenerateReq
from kiln.engine.request import SamplingParams
from kiln.loader import init_dummy_weights
from kiln.models.reference import packed_forward

INKLING = dict(model_type="inkling", vocab_size=512, hidden_size=64, num_hidden_layers=6,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
               num_experts=8, num_experts_per_tok=2, num_shared_experts=2, moe_intermediate_size=32,
               first_k_dense_layers=1, shortconv_kernel_size=4, sliding_window=16, rel_dim=8,
               rel_extent=24, attn_scale_beta=0.5, attn_scale_floor=8, route_scale=1.25,
               num_mtp_layers=2, max_position_embeddings=512)
MINIMAX = dict(model_type="minimax_m3", vocab_size=512, hidden_size=64, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, index_head_dim=16,
               index_block_size=8, index_topk_blocks=4, intermediate_size=128, first_k_dense_layers=1,
               num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, routed_scaling_factor=2.0,
               rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
               max_position_embeddings=512)
ARCHS = {"inkling": INKLING, "minimax_m3": MINIMAX}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def model_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    (d / "config.json").write_text(json.dumps(ARCHS[request.param]))
    return str(d)


def make_core(model_dir: str, **kw) -> EngineCore:
    kw.setdefault("max_total_tokens", 4096)
    if "KILN_TEST_GEMV_MAX_ROWS" in os.environ:  # the decode GEMV's row limit for every engine built here (GPU)
        kw.setdefault("gemv_max_rows", int(os.environ["KILN_TEST_GEMV_MAX_ROWS"]))
    if os.environ.get("KILN_TEST_PDL_EARLY_TRIGGER") == "1":  # --pdl-early-trigger for every engine built here
        kw.setdefault("pdl_early_trigger", True)
    core = EngineCore(EngineConfig(model_path=model_dir, load_format="dummy", skip_tokenizer_init=True,
                                   **kw))
    model = core.runner.model
    init_dummy_weights(model, 0)
    with torch.no_grad():  # N(0, 1/fan_in): attention, selection and routing all matter
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(1.0 / (0.02 * math.sqrt(p.shape[-1])))
    core.scheduler.check_after_step = True
    return core


def prompts(n: int, seed: int = 0, lo: int = 40, hi: int = 90) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, 512, (k,), generator=g).tolist() for k in lens]


@contextlib.contextmanager
def sampled_logits(core: EngineCore):
    """Yields {rid: [logit row each token was sampled from]}, filled while the block runs."""
    rows: dict[str, list[torch.Tensor]] = {}
    sample = core.scheduler._sample

    def capture(logits, rs):
        for r, row in zip(rs, logits):
            rows.setdefault(r.rid, []).append(row.clone())
        return sample(logits, rs)

    core.scheduler._sample = capture
    try:
        yield rows
    finally:
        core.scheduler._sample = sample


def run(core: EngineCore, reqs: list[list[int]], max_tokens: int = 8, tag: str = "r"):
    """Run requests concurrently; returns {rid: (prompt, output ids, [logit rows sampled], cached)}."""
    with sampled_logits(core) as rows:
        out, cached = _run_greedy(core, reqs, max_tokens, tag)
    core.check_integrity()
    return {f"{tag}{i}": (ids, out[f"{tag}{i}"], rows[f"{tag}{i}"], cached[f"{tag}{i}"]) for i, ids in enumerate(reqs)}


def _run_greedy(core: EngineCore, reqs: list[list[int]], max_tokens: int, tag: str):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(reqs):
        core.add_request(GenerateReq(rid=f"{tag}{i}", input_ids=ids, params=params))
    out: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    while core.has_work():
        for o in core.step():
            assert o.error is None, o.error
            out.setdefault(o.rid, []).extend(o.new_token_ids)
            cached[o.rid] = o.cached_tokens
    return out, cached


def assert_reference(core: EngineCore, results) -> None:
    model = core.runner.model
    for rid, (prompt, output, rows, _) in results.items():
        ids = prompt + output[:-1]
        with torch.no_grad():
            ref, _ = packed_forward(model, torch.tensor(ids), [len(ids)])
        expect = ref[len(prompt) - 1:]
        got = torch.stack(rows)
        assert got.shape == expect.shape, rid
        err = (got - expect).abs().max().item()
        assert err <= 1e-4, f"{rid}: engine logits differ from the reference by {err:.2e}"


def test_prefill_then_64_decode_steps(model_dir):
    core = make_core(model_dir, page_size=4)
    assert_reference(core, run(core, prompts(1, lo=70, hi=71), max_tokens=64))


def test_chunked_prefill_not_page_aligned(model_dir):
    core = make_core(model_dir, page_size=4, chunked_prefill_size=7, max_prefill_tokens=11)
    assert_reference(core, run(core, prompts(3, seed=1)))


def test_mixed_prefill_and_decode_batches(model_dir):
    # A small budget makes later prompts prefill in chunks while earlier ones decode.
    core = make_core(model_dir, page_size=8, chunked_prefill_size=16, max_prefill_tokens=24)
    assert_reference(core, run(core, prompts(5, seed=2, lo=20, hi=100), max_tokens=12))


@pytest.mark.parametrize("shared", [3, 13, 30, 61])
def test_prefix_hits_inside_and_outside_windows(model_dir, shared):
    # Shared prefix lengths below the conv window, inside and beyond the sliding window W=16,
    # beyond R=24 and across MSA blocks; page size 4 puts boundaries inside and at page ends.
    core = make_core(model_dir, page_size=4)
    base = prompts(1, seed=3, lo=70, hi=71)[0]
    first = run(core, [base], tag="a")
    assert_reference(core, first)
    other = base[:shared] + prompts(1, seed=4, lo=20, hi=21)[0]
    second = run(core, [other, base], tag="b")
    assert_reference(core, second)
    assert second["b1"][3] > 0, "the repeated prompt must hit the prefix cache"


def test_retraction_then_recompute(model_dir):
    core = make_core(model_dir, page_size=4, max_total_tokens=160)
    res = run(core, prompts(6, seed=5, lo=20, hi=40), max_tokens=48)
    assert core.stats().num_retractions_total > 0
    assert_reference(core, res)


def test_sliding_window_pages_stay_bounded(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(INKLING))  # MiniMax-M3 has no sliding layers
    core = make_core(str(tmp_path), page_size=4)
    ps, w = 4, INKLING["sliding_window"]
    held = []
    step = core.scheduler.step

    def watch():
        out = step()
        for r in core.scheduler.running:
            held.append(sum(p is not None for p in r.win_pages["swa"]))
        return out

    core.scheduler.step = watch
    res = run(core, prompts(1, seed=6, lo=50, hi=51), max_tokens=100)
    assert_reference(core, res)
    assert max(held) <= w // ps + 2, f"a request held {max(held)} sliding-window pages"


def test_routing_capture_covers_prompt_and_output_and_replays(model_dir):
    core = make_core(model_dir, page_size=4, chunked_prefill_size=9, enable_return_routed_experts=True)
    prompt = prompts(1, seed=7, lo=30, hi=31)[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    core.add_request(GenerateReq(rid="x", input_ids=prompt, params=params, return_routed_experts=True))
    out, routed = [], None
    while core.has_work():
        for o in core.step():
            out += o.new_token_ids
            if o.finished:
                routed = o.routed_experts
    ids = prompt + out[:-1]
    num_moe = len({m.moe_index for m in core.runner.model.modules() if hasattr(m, "moe_index")})
    assert routed.shape == (len(ids), num_moe, 2) and routed.dtype.name == "int32"
    model = core.runner.model
    with torch.no_grad():
        ref_logits, ref_routed = packed_forward(model, torch.tensor(ids), [len(ids)])
        for i in range(num_moe):  # the engine recorded what the reference forward routes
            assert torch.equal(torch.from_numpy(routed[:, i]), ref_routed[i].int())
        replay = {i: torch.from_numpy(routed[:, i]).long() for i in range(num_moe)}
        same, _ = packed_forward(model, torch.tensor(ids), [len(ids)], replay=replay)
        other = {i: (r + 1) % 8 for i, r in replay.items()}
        changed, _ = packed_forward(model, torch.tensor(ids), [len(ids)], replay=other)
    assert torch.equal(same, ref_logits)
    assert (changed - ref_logits).abs().max() > 1e-3


def test_routing_capture_needs_the_flag(model_dir):
    core = make_core(model_dir)
    core.add_request(GenerateReq(rid="x", input_ids=[1, 2, 3], params=SamplingParams(max_tokens=2),
                                 return_routed_experts=True))
    (o,) = core.step()
    assert o.error and "--enable-return-routed-experts" in o.error


def test_offline_engine_returns_routed_experts(model_dir):
    from kiln.offline import Engine

    with Engine(model_path=model_dir, load_format="dummy", skip_tokenizer_init=True, max_total_tokens=1024,
                enable_return_routed_experts=True) as llm:
        (res,) = llm.generate([list(range(20, 45))], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                              return_routed_experts=True, use_tqdm=False)
    routed = res.outputs[0].routed_experts
    assert routed.shape[0] == 25 + 4 - 1 and (routed >= 0).all()


def test_window_eviction_leaves_tombstones_and_exact_hits(model_dir):
    # Window spaces sized for one small chunk: caching sequential requests forces the tree to
    # tombstone windowed pages while keeping the main pages (and paths) intact.
    core = make_core(model_dir, page_size=4, max_running_requests=1, chunked_prefill_size=8,
                     max_prefill_tokens=8)
    base = prompts(3, seed=8, lo=60, hi=70)
    res = run(core, base, tag="a")
    assert_reference(core, res)
    tree = core.cache.tree
    if core.cache.windows:
        holes = [p for n in tree._nodes() for w in n.win.values() for p in w if p is None]
        assert holes, "small window spaces should have forced tombstones"
    res = run(core, [base[2]], tag="b")  # the last request's tail state is still cached
    assert_reference(core, res)
    assert res["b0"][3] > 0
    # A prefix whose windowed state was tombstoned: the match falls back to an intact boundary.
    res = run(core, [base[0][:50] + prompts(1, seed=9, lo=10, hi=11)[0]], tag="c")
    assert_reference(core, res)


@pytest.mark.parametrize("arch_dir", ["inkling"], indirect=True)
def test_a_budget_the_windows_fill_names_the_flags_that_fix_it(arch_dir):
    """A hybrid's window spaces are sized first, for every running request's whole window: when
    they leave no main space, the error says so and how many requests would fit, and that many do."""
    kw = dict(model_path=arch_dir, load_format="dummy", skip_tokenizer_init=True, cpu_kv_cache_gb=0.2,
              max_running_requests=4096)
    with pytest.raises(ValueError, match=r"window spaces \(swa, conv\) take .* --max-running-requests 4096; "
                                         r"lower --max-running-requests \(about \d+ fit\)") as err:
        EngineCore(EngineConfig(**kw))
    fits = int(re.search(r"about (\d+) fit", str(err.value)).group(1))
    assert 0 < fits < 4096
    EngineCore(EngineConfig(**{**kw, "max_running_requests": fits}))  # builds
