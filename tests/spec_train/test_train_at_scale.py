"""`kiln train-draft` at scale: prompts the target writes itself (Magpie), a clock-bound training
run whose learning rate still decays to its floor, the checkpoint rebuilt from exported MTP
tensors, and (on CUDA) the whole run on the GPU."""

from __future__ import annotations

import json
import os
import types

import pytest
import torch

from kiln.spec_train import TrainDraftConfig
from kiln.spec_train.cli import train_draft
from kiln.spec_train.data import SYNTH_MIN_CHARS, load_or_generate, synthesize_prompts, user_turn_prefix
from tests.spec_train.test_train_draft import TARGET, _acceptance, _write_target


def _kw(target, **extra):
    kw = dict(target=target, method="mtp", prompts=os.path.join(target, "prompts.jsonl"), num_prompts=40,
              max_new_tokens=40, temperature=0.0, num_mtp_layers=2, mtp_sliding_window=16, mtp_init="random",
              batch_tokens=256, lr=3e-3, warmup_steps=2, eval_every=0, val_fraction=0.1, progress=False)
    kw.update(extra)
    return kw


def test_time_limit_stops_training_and_ends_at_the_low_rate(tmp_path):
    target = _write_target(str(tmp_path / "target"))
    out = str(tmp_path / "out")
    final = train_draft(TrainDraftConfig(out=out, num_steps=100_000, time_limit_s=3.0, **_kw(target)))
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][1:]
    assert 2 < len(rows) < 100_000 and "val_loss" in rows[-1] and set(final) == {"val_loss", "val_loss_k", "val_acc_k"}
    lrs = [r["lr"] for r in rows[2:]]  # after the warmup
    assert all(a >= b for a, b in zip(lrs, lrs[1:])), "the decay must not rise"
    assert lrs[-1] < 0.12 * 3e-3, "a clock-bound run must end near the floor (10% of the peak)"
    with pytest.raises(ValueError, match="--time-limit-s"):
        TrainDraftConfig(out=out, time_limit_s=-1, **_kw(target))


def test_keep_best_exports_the_weights_of_the_lowest_validation_loss(tmp_path):
    """A learning rate that wrecks the drafter at once: with --keep-best the export is the step-0
    drafter (the lowest validation loss), the same tensors an untrained run writes."""
    from safetensors import safe_open

    target = _write_target(str(tmp_path / "target"))
    kw = _kw(target, lr=50.0, warmup_steps=1, eval_every=1)
    best = train_draft(TrainDraftConfig(out=str(tmp_path / "best"), num_steps=4, keep_best=True, **kw))
    rows = [json.loads(line) for line in open(os.path.join(str(tmp_path / "best"), "metrics.jsonl"))]
    assert best["val_step"] == 0 and best["val_loss"] == min(r["val_loss"] for r in rows)
    assert rows[-1]["val_loss"] > best["val_loss"] + 1.0  # the last step's drafter is worse
    train_draft(TrainDraftConfig(out=str(tmp_path / "untrained"), num_steps=0, **kw))
    with safe_open(os.path.join(str(tmp_path / "best"), "model.safetensors"), "pt") as a, \
            safe_open(os.path.join(str(tmp_path / "untrained"), "model.safetensors"), "pt") as b:
        names = [k for k in a.keys() if k.startswith("mtp.")]
        assert names and all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in names)


def test_user_turn_prefix_is_the_template_up_to_the_message(smollm2_source):
    from kiln.loader import load_tokenizer

    tok = load_tokenizer(smollm2_source.model_dir)
    llm = types.SimpleNamespace(tokenizer=tok)
    prefix = user_turn_prefix(llm)
    text = tok.decode(prefix)
    assert text.endswith("<|im_start|>user\n") and text.startswith("<|im_start|>system\n")
    full = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False),
                      add_special_tokens=False)
    assert full[:len(prefix)] == prefix
    with pytest.raises(ValueError, match="needs a target with a tokenizer"):
        user_turn_prefix(types.SimpleNamespace(tokenizer=None))


class _FakeEngine:
    """What synthesize_prompts needs of an engine: a tokenizer with a chat template, and generate."""

    def __init__(self, outputs):
        self.tokenizer = types.SimpleNamespace(
            chat_template="x", apply_chat_template=lambda msgs, tokenize: f"<s>U: {msgs[0]['content']}</s>",
            encode=lambda text, add_special_tokens: [ord(c) for c in text])
        self.outputs, self.calls = outputs, []

    def generate(self, prompts, params, use_tqdm):
        self.calls.append((prompts, params))
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(text=t, finish_reason=r) for t, r in self.outputs])]


def test_synthesize_prompts_keeps_finished_distinct_requests():
    long = "Explain how tides work, please."
    fake = _FakeEngine([(f"  {long} ", "stop"), (long, "stop"), ("Cut off in the midd", "length"),
                        ("Hi", "stop"), ("What is a prime number?", "stop")])
    cfg = TrainDraftConfig(target="t", method="mtp", out="o", seed=7)
    assert synthesize_prompts(cfg, 5, fake) == [long, "What is a prime number?"]
    (prompts, params), = fake.calls
    assert prompts == [[ord(c) for c in "<s>U: "]]  # the template up to the user's message
    assert (params.n, params.temperature, params.seed) == (5, 1.0, 7) and len("Hi") < SYNTH_MIN_CHARS


def test_synthetic_prompts_join_the_data_and_its_cache_key(tmp_path, monkeypatch):
    import contextlib

    import kiln.offline
    from kiln.spec_train import data

    target = _write_target(str(tmp_path / "target"))
    seen, engines = [], []

    @contextlib.contextmanager
    def one_engine(**kw):
        engines.append(kw)
        yield "llm"

    monkeypatch.setattr(kiln.offline, "Engine", one_engine)
    monkeypatch.setattr(data, "synthesize_prompts", lambda cfg, n, llm: ["made up one", "made up two"][:n])

    def fake_continue(llm, cfg, prompts):
        assert llm == "llm"  # the engine that wrote them continues them
        seen.append(list(prompts))
        return [data.Sample([1, 2], [3, 4]) for _ in prompts]

    monkeypatch.setattr(data, "continue_prompts", fake_continue)
    monkeypatch.setattr(data, "generate", lambda cfg, prompts: fake_continue("llm", cfg, prompts))
    cfg = TrainDraftConfig(out=str(tmp_path / "o"), synthetic_prompts=2, **_kw(target, num_prompts=3))
    d = str(tmp_path / "o" / "data")
    assert len(load_or_generate(cfg, d)) == 5 and len(engines) == 1
    turns = [[{"role": "user", "content": t}] for t in ("made up one", "made up two")]
    assert seen[0][3:] == turns
    assert [json.loads(line)["prompt"] for line in open(os.path.join(d, "synthetic_prompts.jsonl"))] == \
        ["made up one", "made up two"]
    assert len(load_or_generate(cfg, d)) == 5 and len(seen) == 1  # cached
    plain = TrainDraftConfig(out=str(tmp_path / "o"), **_kw(target, num_prompts=3))
    load_or_generate(plain, d)
    assert len(seen) == 2 and len(seen[1]) == 3  # without them: another key, generated again
    assert "synthetic_prompts" not in data._meta(plain, [])  # caches from before the option still match
    with pytest.raises(ValueError, match="--synthetic-prompts must be >= 0"):
        TrainDraftConfig(out="o", synthetic_prompts=-1, **_kw(target))
    with pytest.raises(ValueError, match="apply to --method mtp only"):
        TrainDraftConfig(out="o", **{**_kw(target), "method": "dflash"}, keep_best=True)


@pytest.mark.parametrize("chunk_bytes", [15 * 2**20, 5000])
def test_checkpoint_rebuilt_from_exported_mtp_tensors_is_the_trained_one(tmp_path, monkeypatch, chunk_bytes):
    """benchmarks/spec_train_gpu.py's round trip: export (files under the size cap; at 5000 bytes
    the larger tensors go in row blocks) + assemble."""
    from safetensors import safe_open

    import benchmarks.spec_train_gpu as stg
    from kiln.loader import resolve_model
    from kiln.spec_train.mtp import write_checkpoint

    monkeypatch.setattr(stg, "CHUNK_BYTES", chunk_bytes)

    target = _write_target(str(tmp_path / "target"))
    out = str(tmp_path / "out")
    train_draft(TrainDraftConfig(out=out, num_steps=2, **_kw(target)))
    export = str(tmp_path / "export")
    os.makedirs(export)
    parts = stg.export_mtp(out, export)
    stg.pack_results(out, export, {"k": 1})
    assert all(os.path.getsize(p) <= chunk_bytes + 4096 for p in parts)  # + the safetensors header
    mtp = stg.load_export(export)
    rebuilt = str(tmp_path / "rebuilt")
    write_checkpoint(resolve_model(target), mtp, json.load(open(os.path.join(out, "config.json"))), rebuilt)
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as a, \
            safe_open(os.path.join(rebuilt, "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys()) and any(k.startswith("mtp.") for k in a.keys())
        for k in a.keys():
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k
    with pytest.raises(ValueError, match="mtp"):
        write_checkpoint(resolve_model(target), {"model.x": torch.zeros(1)}, {}, str(tmp_path / "bad"))


@pytest.mark.gpu
def test_train_mtp_on_cuda_then_serve(tmp_path):
    """The whole train-draft run on the GPU: the hidden states stay there, the loss falls, and the
    checkpoint serves greedy output identical to the target's (fp32 engine)."""
    # Head dim 16: the smallest the Triton attention kernels take (the CPU tests' target has 12).
    target = _write_target(str(tmp_path / "target"), {**TARGET, "head_dim": 16})
    out = str(tmp_path / "out")
    kw = _kw(target, device="cuda", eval_every=40, cache_hidden=False, engine={"dtype": "float32"})
    final = train_draft(TrainDraftConfig(out=out, num_steps=80, **kw))
    start, *rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert len(rows) == 80 and start["val_loss"] > final["val_loss"] + 0.5, (start, final)
    assert not os.path.exists(os.path.join(out, "data", "hidden.pt"))
    ps = [json.loads(line)["prompt_ids"] for line in open(os.path.join(target, "prompts.jsonl"))][40:]
    plain, _ = _acceptance(target, ps, spec=False, device="cuda", dtype="float32")
    trained, tau = _acceptance(out, ps, device="cuda", dtype="float32")
    assert trained == plain and tau > 1.2, tau


def test_gpu_run_starts_a_data_chunk_only_if_it_can_end_within_the_share(monkeypatch):
    """benchmarks/spec_train_gpu.py's data stage on a fake clock: after the first chunk, a chunk
    starts only if one as long as the last ends within the share (chunks of 10, 30, 50 s against
    100 s: the fourth would start at 90 s and is not run)."""
    import contextlib
    import dataclasses
    import types

    import benchmarks.spec_train_gpu as stg
    from kiln.spec_train import data

    now, durations, calls = [0.0], iter([10.0, 30.0, 50.0, 50.0, 50.0]), []

    def continue_prompts(llm, cfg, part):
        calls.append(list(part))
        now[0] += next(durations)
        return [types.SimpleNamespace(output_ids=[1, 2], prompt_ids=[3]) for _ in part]

    monkeypatch.setattr(stg.time, "time", lambda: now[0])
    monkeypatch.setattr(data, "open_target", lambda cfg: contextlib.nullcontext(None))
    monkeypatch.setattr(data, "synthesize_prompts", lambda cfg, n, llm: [f"q{cfg.seed + i}" for i in range(n)])
    monkeypatch.setattr(data, "base_prompts", lambda cfg: [])
    monkeypatch.setattr(data, "as_user_turns", lambda ps: list(ps))
    monkeypatch.setattr(data, "continue_prompts", continue_prompts)
    cfg = dataclasses.make_dataclass("Cfg", [("seed", int, 0)])()  # synthesis replaces its seed
    summary = {}
    used, synth, samples = stg.generate_data(cfg, 10, 1.0, 100.0, 2, summary)
    assert len(calls) == 3 and used == [p for c in calls for p in c] and len(samples) == 6
    assert summary["prompts_used"] == 6 and summary["prompts_available"] == 10
