"""Smoke test of the benchmark scripts: both run in-process on CPU on a tiny Llama with the
transformers comparison, and the roofline arithmetic matches the published Llama-3.1-8B figures."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import common  # noqa: E402
import decode_batch  # noqa: E402
import hf_baseline  # noqa: E402
import latency  # noqa: E402
import offline_throughput  # noqa: E402
import roofline  # noqa: E402

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
    "intermediate_size": 128, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}


@pytest.fixture
def tiny_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return str(tmp_path)


@pytest.fixture
def one_thread():
    # Tiny ops on a busy 2-core host: OpenMP spin-waits would dominate with more threads.
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_roofline_llama_8b_shape():
    cfg = os.path.join(REPO, "benchmarks", "configs", "llama-3.1-8b")
    rl = roofline.roofline(cfg, torch.bfloat16, [1000, 24])
    # All 8.03B parameters in bf16: the published ~16.06 GB.
    assert rl["weight_bytes_all_params"] == pytest.approx(16.06e9, rel=0.01)
    # A decode step reads everything but the (untied) embedding table: 8.03B - 0.525B params.
    assert rl["weight_bytes"] == pytest.approx(rl["weight_bytes_all_params"] - 2 * 128256 * 4096, rel=1e-9)
    assert rl["kv_bytes_per_token"] == 131072
    assert rl["kv_bytes"] == 131072 * 1024
    assert rl["bytes_per_step"] == rl["weight_bytes"] + rl["kv_bytes"]
    # Tied head (Qwen3-0.6B): the table is the lm_head, read once.
    q = roofline.param_counts(os.path.join(REPO, "benchmarks", "configs", "qwen3-0.6b"))
    assert q["tied"] and q["decode_read"] == q["total"]
    assert q["total"] == pytest.approx(596e6, rel=0.01)


def test_same_weights_as_transformers(tiny_dir, one_thread):
    torch.set_num_threads(1)
    from kiln.config import EngineConfig
    from kiln.engine.request import SamplingParams

    hf = hf_baseline.make_hf_model(tiny_dir, torch.float32, "cpu", seed=3)
    core = common.build_core(EngineConfig(model_path=tiny_dir, load_format="dummy", skip_tokenizer_init=True,
                                          device="cpu", dtype="float32", max_total_tokens=256), hf_model=hf)
    ids = list(range(7, 40))
    res = common.run_requests(core, [(ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))],
                              progress=False)
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                      pad_token_id=0)[0, len(ids):].tolist()
    assert res.requests[0].output_ids == ref


def test_offline_throughput_quick(tiny_dir, tmp_path, one_thread, capsys):
    out = tmp_path / "offline.json"
    result = offline_throughput.main(["--model-path", tiny_dir, "--quick", "--hf", "--device", "cpu",
                                      "--threads", "1", "--num-runs", "2", "--no-progress", "--profile-prefill",
                                      "--out", str(out)])
    rows = {r["engine"]: r for r in result["rows"]}
    assert set(rows) == {"kiln", "transformers", "kiln/transformers"}
    for name in ("kiln", "transformers"):
        r = rows[name]
        assert r["complete"] and r["requests"] == 8
        for key in ("input_tokens", "output_tokens", "wall_s", "output_tok_s", "total_tok_s"):
            assert _positive(r[key]), (name, key, r[key])
    # Both engines generate exactly the requested lengths of the same workload.
    assert rows["kiln"]["output_tokens"] == rows["transformers"]["output_tokens"]
    assert rows["kiln"]["runs"] == 2
    assert _positive(rows["kiln/transformers"]["output_tok_s"])
    captured = capsys.readouterr()
    text = captured.out
    assert "Offline throughput" in text and "kiln/transformers" in text
    assert "prefill step of" in text + captured.err and "step stats" in text + captured.err  # run 1's profile
    saved = json.loads(out.read_text())
    assert len(saved["rows"]) == 3 and saved["meta"]["benchmark"] == "offline_throughput"


def test_latency_quick(tiny_dir, tmp_path, one_thread, capsys):
    out = tmp_path / "latency.json"
    result = latency.main(["--model-path", tiny_dir, "--quick", "--hf", "--device", "cpu", "--threads", "1",
                           "--num-runs", "2", "--out", str(out)])
    rows = {r["engine"]: r for r in result["rows"]}
    assert set(rows) == {"kiln", "transformers", "kiln/transformers"}
    for name in ("kiln", "transformers"):
        r = rows[name]
        assert r["runs"] == 2 and r["input_len"] == 32 and r["output_len"] == 8
        for key in ("ttft_ms", "decode_tok_s", "ms_per_token", "nominal_roofline_tok_s", "frac_of_nominal"):
            assert _positive(r[key]), (name, key, r[key])
    meta = result["meta"]
    assert meta["roofline"]["bytes_per_step"] > meta["roofline"]["weight_bytes"] > 0
    text = capsys.readouterr().out
    assert "Batch-1 latency" in text and "roofline" in text
    assert json.loads(out.read_text())["meta"]["benchmark"] == "latency"


def test_decode_batch_quick(tiny_dir, tmp_path, one_thread, capsys):
    out = tmp_path / "decode.json"
    result = decode_batch.main(["--model-path", tiny_dir, "--quick", "--device", "cpu", "--threads", "1",
                                "--out", str(out)])
    rows = result["rows"]
    assert [r["batch"] for r in rows] == [2, 4]
    for r in rows:
        for key in ("prefill_s", "step_ms", "decode_tok_s", "total_tok_s", "roofline_tok_s", "frac_of_roofline"):
            assert _positive(r[key]), (r["batch"], key, r[key])
        assert r["gpu_idle_frac"] is None  # profiling is CUDA-only
        # 8 tokens: 7 decode steps after the first token, each one gap; the median is one of them
        assert 0 < r["round_p50_ms"] <= r["round_max_ms"], r
        assert "largest gap at decode step" in r["note"] and "of 7;" in r["note"], r["note"]
    # More sequences read more state per step, so the batch-4 roofline is higher but not 2x+.
    assert rows[0]["roofline_tok_s"] < rows[1]["roofline_tok_s"] < 2.01 * rows[0]["roofline_tok_s"]
    assert "Decode at fixed batch" in capsys.readouterr().out
    assert json.loads(out.read_text())["meta"]["benchmark"] == "decode_batch"


def test_gc_timer_counts_collections_inside_only():
    import gc

    with common.GcTimer() as t:
        gc.collect()
        gc.collect(0)
    gc.collect()  # after the window: not counted
    assert t.collections == [1, 0, 1] and t.seconds > 0
    assert t.note().startswith("gc 2 (1/0/1) ")
    assert common.GcTimer().note() == ""


def test_decode_batch_refreezes_after_its_warmup(tiny_dir, one_thread, monkeypatch):
    """--refreeze-after-warmup freezes the heap once more per batch size, after that size's warm-up."""
    import gc

    freezes = []
    real = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: (freezes.append(1), real())[1])
    args = ["--model-path", tiny_dir, "--quick", "--device", "cpu", "--threads", "1", "--warmup", "on"]
    decode_batch.main(args)
    base = len(freezes)
    decode_batch.main(args + ["--refreeze-after-warmup"])
    assert len(freezes) - base == base + 2  # the core's build, then after each of the two warm-ups


def test_decode_batch_flags_a_batch_that_did_not_fit_the_pool(tiny_dir, one_thread, capsys):
    """Four requests of 32 + 8 tokens in a pool of 100 run in waves (or are retracted): the row keeps
    its end-to-end throughput and says so, with no per-step numbers (a wave's tail would pass for a
    step of the whole batch: a roofline fraction above 1 on an H100, forty-eighth pass)."""
    rows = decode_batch.main(["--model-path", tiny_dir, "--quick", "--device", "cpu", "--threads", "1",
                              "--batch-sizes", "2,4", "--max-total-tokens", "100"])["rows"]
    fits, over = rows
    assert _positive(fits["step_ms"]) and "did not fit" not in fits["note"], fits
    assert over["note"].startswith("did not fit the KV pool (96 tokens)"), over["note"]  # (whole pages)
    assert all(over[k] is None for k in ("step_ms", "decode_tok_s", "round_p50_ms")), over
    assert "frac_of_roofline" not in over and _positive(over["total_tok_s"]), over
    assert "did not fit the KV pool" in capsys.readouterr().out


def test_decode_batch_samples_with_seeds(tiny_dir, one_thread, monkeypatch, capsys):
    """`--temperature`: every request samples (top-p / top-k passed on) with its own seed."""
    made = []
    real = decode_batch.GenerateReq
    monkeypatch.setattr(decode_batch, "GenerateReq", lambda **kw: (made.append(kw["params"]), real(**kw))[1])
    decode_batch.main(["--model-path", tiny_dir, "--device", "cpu", "--threads", "1", "--batch-sizes", "2",
                       "--input-len", "8", "--output-len", "4", "--temperature", "0.7", "--top-p", "0.9",
                       "--top-k", "5", "--seed", "3"])
    assert [(p.temperature, p.top_p, p.top_k, p.seed) for p in made] == [(0.7, 0.9, 5, 3), (0.7, 0.9, 5, 4)]
    assert "temperature 0.7" in capsys.readouterr().out


def test_decode_batch_times_full_ngram_rounds_on_random_weights(tiny_dir, one_thread, monkeypatch):
    """`--ngram-always-draft`: every decode round verifies K drafts even though random weights
    rarely repeat their prompt (guesses from `NgramIndex.fallback`), so `round_ms` is the time of
    a full round."""
    from kiln.engine.spec.ngram_drafter import NgramIndex

    guesses = []
    fallback = NgramIndex.fallback
    monkeypatch.setattr(NgramIndex, "fallback", lambda self, k: (guesses.append(k), fallback(self, k))[1])
    args = ["--model-path", tiny_dir, "--device", "cpu", "--threads", "1", "--batch-sizes", "2", "--input-len", "24",
            "--output-len", "9", "--speculative-algorithm", "ngram", "--speculative-num-steps", "3"]
    with pytest.raises(SystemExit, match="needs --speculative-algorithm ngram"):
        decode_batch.main(args[:-4] + ["--ngram-always-draft"])
    row = decode_batch.main(args + ["--ngram-always-draft"])["rows"][0]
    # 8 decoded tokens per request: a round every step, each emitting 1 to 4 of them
    assert row["accept_len"] is not None and 1.0 <= row["accept_len"] <= 4.0 and _positive(row["round_ms"])
    assert guesses and set(guesses) == {3}
    # the round's own bound: a verify of K + 1 rows per request and no drafter, so on this dense
    # model the bytes of a plain step
    assert row["bytes_per_round"] == row["bytes_per_step"] and _positive(row["round_bound_ms"])
    assert row["frac_of_round_bound"] == pytest.approx(row["round_bound_ms"] / row["round_ms"])


def test_gpu_idle_fraction_union():
    """The idle fraction counts overlapping GPU intervals once; per-kernel totals add up."""
    class Ev:
        def __init__(self, s, e, name="k"):
            self.device_type = "DeviceType.CUDA"
            self.name = name
            self.time_range = type("R", (), {"start": s, "end": e, "elapsed_us": lambda self: e - s})()

    prof = type("P", (), {"events": lambda self: [Ev(0, 10, "a"), Ev(5, 20), Ev(30, 40)]})()
    assert decode_batch.gpu_idle_fraction(prof) == pytest.approx(1 - 30 / 40)
    idle, busy, by_name = decode_batch.gpu_activity(prof)
    assert busy == 30 and by_name == {"a": (10, 1), "k": (25, 2)}


def test_roofline_per_gpu_splits_the_bytes_over_tensor_parallel_ranks():
    import roofline

    rl = {"weight_bytes": 8.0, "active_weight_bytes": 6.0, "kv_bytes": 2.0, "bytes_per_step": 10.0, "kv": {}}
    assert roofline.per_gpu(rl, 1) is rl
    two = roofline.per_gpu(rl, 2)
    assert (two["bytes_per_step"], two["weight_bytes"], two["kv_bytes"], two["tp_size"]) == (5.0, 4.0, 1.0, 2)
    assert rl["bytes_per_step"] == 10.0  # the model's numbers stay as they were


def test_host_phases_times_and_restores(tiny_dir, one_thread, capsys):
    """`--host-phases` reports the step's phases, and the engine's methods are unwrapped after."""
    from host_phases import HostPhases

    class Part:
        def __init__(self, **fns):
            self.__dict__.update(fns)

    sched = Part(_schedule=lambda: None, _forward=lambda plan: None, _commit=lambda s: None, spec=None)
    runner = Part(forward=lambda b: None, graphs=None)
    core = Part(scheduler=sched, runner=runner)
    core.step = lambda: (sched._schedule(), sched._forward([]), runner.forward(None))
    own, step = dict(vars(sched)), core.step
    with HostPhases(core) as phases:
        for _ in range(3):
            core.step()
    report = phases.report(3)
    assert "scheduler._schedule" in report and "runner.forward" in report and "scheduler._commit" not in report
    assert phases.calls["runner.forward"] == 3
    assert vars(sched) == own and core.step is step  # unwrapped: the originals are back
    decode_batch.main(["--model-path", tiny_dir, "--quick", "--device", "cpu", "--threads", "1",
                       "--batch-sizes", "2", "--output-len", "12", "--host-phases", "--profile-steps", "4"])
    out = capsys.readouterr()
    assert "host phases over 4 steps" in out.out + out.err and "core.step (whole step)" in out.out + out.err


def test_count_experts_reports_the_union_a_verify_reads(one_thread, capsys):
    """`--count-experts` counts each MoE forward's distinct routed experts: top-k for one row, and
    for a speculative verify of K + 1 rows a union between top-k and min(E, (K + 1) x top-k)."""
    import re

    from expert_spread import ExpertSpread

    with pytest.raises(SystemExit, match="--disable-cuda-graph"):
        decode_batch.main(["--model-path", "preset:inkling/tiny", "--device", "cpu", "--batch-sizes", "1",
                           "--count-experts"])
    decode_batch.main(["--model-path", "preset:inkling/tiny", "--device", "cpu", "--threads", "1",
                       "--batch-sizes", "1", "--input-len", "80", "--output-len", "10", "--count-experts",
                       "--disable-cuda-graph", "--speculative-algorithm", "mtp", "--speculative-num-steps", "2"])
    text = capsys.readouterr()
    text = text.out + text.err
    rows = {int(r): float(m) for r, m in re.findall(r"forwards of (\d+) rows: ([\d.]+) distinct", text)}
    assert 80 not in rows and 3 in rows  # prefill chunks are left out; the verifies have K + 1 = 3 rows
    assert 2 <= rows[3] <= 6  # tiny Inkling: top 2 of 8 experts
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="no MoE routers"):
        ExpertSpread(model)


@pytest.mark.parametrize("drafter", ["mtp", "dflash"])
def test_round_host_cost_runs_steady_rounds_on_the_device_path(drafter, one_thread, capsys):
    # the CPU harness of the eighteenth pass: its rounds must be the device path's (it asserts
    # 20 of them before timing) and it reports the host phases and the op counts; a block
    # drafter's with the next verify queued ahead (the thirty-first session's rounds)
    pytest.importorskip("triton")
    import round_host_cost

    extra = ["--ops"] if drafter == "mtp" else ["--verify-ahead"]
    round_host_cost.main(["--drafter", drafter, "--steps", "5", *extra])
    out = capsys.readouterr().out
    assert f"steady {drafter} K = 3 rounds on the device_round path" in out and "spec._device_round" in out
    assert ("aten ops per round" in out) if drafter == "mtp" else ("ahead.queue" in out and "block pass graph" in out)


def test_host_profile_and_cache_fill_quick(one_thread, capsys):
    """benchmarks/host_profile.py and cache_fill.py on the CPU at tiny sizes: they run and report."""
    import cache_fill
    import host_profile

    r = host_profile.main(["--prompts", "8", "--new-tokens", "3", "--max-running-requests", "4", "--rows", "3"])
    assert r["wall_s"] > r["forward_s"] > 0 and r["host_us_per_request_step"] > 0
    assert "per request and step" in capsys.readouterr().out
    r = cache_fill.main(["--device", "cpu", "--chunks", "2", "--prompts", "3", "--new-tokens", "2",
                         "--max-running-requests", "3"])
    assert [row["tokens"] for row in r["rows"]] == [6, 6]


def test_detokenize_quick(capsys):
    """benchmarks/detokenize.py at a tiny size: every sequence's text equals the decode of its ids."""
    import detokenize

    for flags in (["--stop"], ["--no-stream"]):
        r = detokenize.main(["--batch", "4", "--tokens", "30", "--repeats", "1"] + flags)
        assert r["us_per_token"] > 0 and r["stream"] == (flags == ["--stop"])
        assert "text equals the decode of the ids: True" in capsys.readouterr().out


def test_ngram_siblings_replay_counts_forwards():
    """benchmarks/ngram_siblings.py's replay: a sample that a finished sibling already wrote is
    drafted from it in full rounds; a sibling in step is never ahead of it; from its own text
    alone, one token per forward when nothing repeats."""
    from ngram_siblings import replay

    prompt, out = [1, 2, 3], list(range(10, 27))  # 17 tokens, none repeating the prompt
    assert replay(prompt, out, [], k=4, lo=1, hi=12) == 17
    assert replay(prompt, out, [out], k=4, lo=1, hi=12) == 17
    # after the prefill's first token, rounds of 4 accepted drafts + 1: 16 tokens in 4 forwards
    assert replay(prompt, out, [out], k=4, lo=1, hi=12, finished=True) == 1 + 4


def test_sampling_noise_quick(capsys):
    """benchmarks/sampling_noise.py at a tiny size: both ways time the sampler's noise call."""
    import sampling_noise

    rows = sampling_noise.main(["--batch-sizes", "2", "--vocab", "64", "--repeats", "1", "--threads", "1"])
    assert rows[2]["generators_ms"] > 0 and rows[2]["streams_ms"] > 0
    assert "a generator per row" in capsys.readouterr().out


def test_grammar_cost_reports_every_stage():
    pytest.importorskip("xgrammar")
    import grammar_cost

    out = grammar_cost.main(["--batch-sizes", "1,4", "--steps", "3", "--threads", "1"])
    assert out["tokenizer_table_s"] > 0 and out["first_compile_ms"] > out["cached_compile_ms"] >= 0
    assert set(out["mask_ms"]) == {1, 4} and all(ms > 0 for ms in out["mask_ms"].values())
