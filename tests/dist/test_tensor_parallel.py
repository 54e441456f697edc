"""Tensor parallelism: `tp_size=2` (two processes over gloo on the CPU) computes the same logits
and the same greedy tokens as one process, for the Llama family and both hybrid models.

Each rank builds its own EngineCore from the same checkpoint (sharded at load) and is given the
same requests, as `kiln serve --tp 2` and torchrun benchmarks do.
"""

from __future__ import annotations

import json
import socket

import pytest
import torch
import multiprocessing as mp

from kiln.config import EngineConfig
from kiln.dist.init import init_tensor_parallel, shutdown
from kiln.engine.core import EngineCore
from tests.engine.test_hybrid_engine import _run_greedy
from tests.engine.test_kernel_path import greedy

pytestmark = pytest.mark.slow


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in (5, 23, 40, 9)]


def generate(core: EngineCore, prompts: list[list[int]], max_tokens: int = 6):
    """Greedy outputs and the stacked logit rows they were sampled from, per request (outputs
    only, and no rows, with speculative decoding: its verify samples rows of its own)."""
    core.scheduler.check_after_step = True
    if core.scheduler.spec is not None:
        out, _ = _run_greedy(core, prompts, max_tokens, "r")
        core.check_integrity()
        return out, {}
    out, rows = greedy(core, prompts, max_tokens=max_tokens)
    return out, {k: torch.stack(v) for k, v in rows.items()}


def _config(model_dir: str, tp: int, **extra) -> EngineConfig:
    return EngineConfig(model_path=model_dir, device="cpu", dtype="float32", tp_size=tp, max_total_tokens=2048,
                        page_size=4, chunked_prefill_size=16, skip_tokenizer_init=True, **extra)


def _spec_counts(core: EngineCore):
    """(proposed per position, accepted, every pass's drafts) of speculative decoding (the
    drafts recorded by `_record_drafts`), or None without it."""
    spec = core.stats().spec
    return None if spec is None else (list(spec.proposed), spec.accepted_tokens, core.recorded_drafts)


def _record_drafts(core: EngineCore) -> EngineCore:
    """Keep every drafter pass's drafts, per request, in `core.recorded_drafts`."""
    drafter, core.recorded_drafts = core.scheduler.spec.drafter, []
    run = drafter.run

    def recorded(reqs, num_drafts):
        run(reqs, num_drafts)
        core.recorded_drafts.append({r.rid: list(r.spec.drafts) for r in reqs})

    drafter.run = recorded
    return core


def _rank(rank: int, model_dir: str, port: int, vocab: int, results, extra=None, hook=None) -> None:
    torch.set_num_threads(1)
    import gc

    pc = init_tensor_parallel(rank, 2, f"tcp://127.0.0.1:{port}", "cpu")
    try:
        core = EngineCore(_config(model_dir, 2, **(extra or {})), pc=pc)
        if core.scheduler.spec is not None:
            _record_drafts(core)
        if hook is not None:
            hook(core, rank)
        out, rows = generate(core, _prompts(vocab))
        # Plain arrays: a tensor would travel as shared memory that dies with this process.
        results.put((rank, (out, {k: v.numpy() for k, v in rows.items()}, _spec_counts(core))))
        # Free the model before leaving the group: tearing gloo down under live tensors can
        # abort the process at exit ("terminate called without an active exception").
        del core
        gc.collect()
    finally:
        shutdown(pc)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_tp2(model_dir: str, vocab: int, extra=None, hook=None):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, model_dir, port, vocab, results, extra, hook)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got


def _llama_dir(tmp) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(tmp)
    return str(tmp)


def _preset_dir(tmp, arch: str) -> str:
    from kiln.models.init_model import init_model

    init_model(arch, "tiny", str(tmp))
    return str(tmp)


@pytest.mark.parametrize("arch", ["llama", "inkling", "minimax_m3"])
def test_tp2_equals_tp1(arch, tmp_path):
    model_dir = _llama_dir(tmp_path) if arch == "llama" else _preset_dir(tmp_path, arch)
    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    torch.set_num_threads(1)
    want_out, want_rows = generate(EngineCore(_config(model_dir, 1)), _prompts(vocab))
    got = run_tp2(model_dir, vocab)
    for rank in (0, 1):
        out, rows, _ = got[rank]
        assert out == want_out, f"rank {rank} greedy tokens differ from tp 1"
        for rid, r in want_rows.items():
            torch.testing.assert_close(torch.from_numpy(rows[rid]), r, atol=1e-4, rtol=1e-4)


def test_tp2_token_map_drafts_as_tp1(tmp_path):
    """MTP drafts over a token map with the LM head split over the vocabulary: every rank
    assembles the hot rows of both slices (the map spans both), so each rank drafts, accepts and
    emits what one process does, and the output is plain greedy."""
    model_dir = _preset_dir(tmp_path / "model", "inkling")
    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    g = torch.Generator().manual_seed(1)
    path = tmp_path / "map.json"
    path.write_text(json.dumps(torch.randperm(vocab, generator=g)[:vocab // 2].tolist()))
    spec = dict(speculative_algorithm="mtp", speculative_num_steps=2, speculative_token_map=str(path))
    torch.set_num_threads(1)
    plain_out, _ = generate(EngineCore(_config(model_dir, 1)), _prompts(vocab))
    one = _record_drafts(EngineCore(_config(model_dir, 1, **spec)))
    want_out, _ = generate(one, _prompts(vocab))
    assert want_out == plain_out
    want_counts = _spec_counts(one)
    assert sum(want_counts[0]) > 0, want_counts
    # the drafts come from both ranks' vocabulary slices (a rank with only its own would draft
    # from half the map)
    per_rank = (vocab + 1) // 2
    drafted = {d for step in want_counts[2] for ds in step.values() for d in ds}
    assert min(drafted) < per_rank <= max(drafted), sorted(drafted)
    got = run_tp2(model_dir, vocab, spec)
    for rank in (0, 1):
        out, _, counts = got[rank]
        assert out == want_out and counts == want_counts, (rank, counts, want_counts)


def _choose_apart(core: EngineCore, rank: int) -> None:
    """Give each rank's adaptive controller a different step clock, and rank 1 a choice of its own
    that disagrees with rank 0's every step (K where rank 0 would pick 0 and back): only the
    broadcast keeps the ranks' forwards the same shape."""
    spec = core.scheduler.spec
    ctl, t = spec.adaptive, [0.0]
    per_draft = 0.02 if rank == 0 else 0.6

    def clock():
        t[0] += 1.0 + per_draft * spec.step_k
        return t[0]

    ctl.clock, ctl.probe_every = clock, 1
    if rank == 1:
        own = ctl.choose
        ctl.choose = lambda n: spec.num_steps if own(n) == 0 else 0


def test_tp2_adaptive_lengths_follow_rank_0(tmp_path):
    """--speculative-adaptive with --tp-size 2: each step's draft length is rank 0's choice on both
    ranks (their own clocks disagree), lengths change mid-request down to plain rows and back, and
    greedy output equals one process's plain decoding."""
    model_dir = _preset_dir(tmp_path, "inkling")
    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    torch.set_num_threads(1)
    plain_out, _ = generate(EngineCore(_config(model_dir, 1)), _prompts(vocab))
    spec = dict(speculative_algorithm="ngram", speculative_num_steps=2, speculative_adaptive=True)
    got = run_tp2(model_dir, vocab, spec, hook=_choose_apart)
    lengths = []
    for rank in (0, 1):
        out, _, counts = got[rank]
        assert out == plain_out, f"rank {rank} greedy tokens differ from plain decoding"
        lengths.append([len(ds) for step in counts[2] for ds in step.values()])
    assert lengths[0] == lengths[1] and {0, 2} <= set(lengths[0]), lengths


def test_serve_tp2_equals_tp1(tmp_path):
    """`kiln serve --tp 2`: two engine processes, rank 0 broadcasting the requests; the greedy
    completion (token ids) equals the one-process server's."""
    import httpx

    from tests.kiln_server import kiln_server

    model_dir = _preset_dir(tmp_path, "inkling")
    body = {"model": "m", "prompt": [5, 17, 99, 3, 250, 8, 41], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    outs = []
    for tp in ("1", "2"):
        args = ["--model-path", model_dir, "--device", "cpu", "--dtype", "float32", "--tp", tp,
                "--max-total-tokens", "1024", "--served-model-name", "m"]
        with kiln_server(args, env={"OMP_NUM_THREADS": "1"}) as (url, _):
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            outs.append(r.json()["choices"][0]["text"])
    assert outs[0] == outs[1]
