"""`kiln init-model` (MODELS.md 7): presets, checkpoints the engine loads and serves, the tokenizer's
MODELS.md 6 tokens and chat template, sharding, and `kiln serve` on a fresh tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
import torch
from safetensors.torch import load_file

from kiln.config import EngineConfig
from kiln.engine.core import EngineCore
from kiln.engine.io import GenerateReq
from kiln.engine.request import SamplingParams
from kiln.loader import load_tokenizer, resolve_model
from kiln.models.init_model import ADDED_TOKENS, init_model, random_state_dict
from kiln.models.presets import PRESETS, VOCAB_SIZE, get_preset, param_counts
from kiln.models.reference import packed_forward
from kiln.models.registry import get_model_class, parse_model_config
from tests.kiln_server import kiln_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module", params=sorted(PRESETS))
def tiny_dir(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp(f"{request.param}-tiny"))
    init_model(request.param, "tiny", d, seed=0)
    return d


def _read_weights(model_dir: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in resolve_model(model_dir).weight_files:
        out.update(load_file(f))
    return out


def test_files_and_config(tiny_dir):
    names = set(os.listdir(tiny_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    assert "chat_template.jinja" not in names  # the template lives in tokenizer_config.json
    with open(os.path.join(tiny_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = cfg["model_type"]
    assert {k: v for k, v in cfg.items() if k not in ("torch_dtype", "bos_token_id", "eos_token_id")} \
        == get_preset(arch, "tiny")
    assert cfg["torch_dtype"] == "float32" and cfg["vocab_size"] == VOCAB_SIZE
    assert cfg["max_position_embeddings"] == 4096
    if arch == "inkling":  # both layer kinds occur
        assert set(cfg["layer_types"]) == {"sliding_attention", "full_attention"}
    parse_model_config(cfg)


def test_engine_loads_the_weights_and_generates(tiny_dir):
    source = resolve_model(tiny_dir)
    assert source.load_format == "safetensors" and source.weight_files
    core = EngineCore(EngineConfig(model_path=tiny_dir, device="cpu", max_total_tokens=1024))
    model = core.runner.model
    saved = _read_weights(tiny_dir)
    loaded = model.checkpoint_state_dict()
    assert set(loaded) == set(saved)
    assert not any("selection_counter" in n for n in saved)  # runtime state, not a weight
    for name, t in saved.items():
        assert torch.equal(loaded[name], t), name

    tok = load_tokenizer(tiny_dir)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hello!"}], tokenize=False,
                                                add_generation_prompt=True), add_special_tokens=False)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    core.add_request(GenerateReq(rid="a", input_ids=prompt, params=params))
    out = []
    while core.has_work():
        for o in core.step():
            assert o.error is None, o.error
            out.extend(o.new_token_ids)
    assert len(out) == 5 and all(0 <= t < source.config["vocab_size"] for t in out)
    # Greedy = argmax of the reference forward; the scaled init keeps logits O(1), not flat.
    with torch.no_grad():
        ids = prompt + out[:-1]
        logits, _ = packed_forward(model, torch.tensor(ids), [len(ids)])
    assert logits[len(prompt) - 1:].argmax(-1).tolist() == out
    assert 0.2 < logits.std().item() < 5.0


def test_tokenizer_tokens_and_eos(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    with open(os.path.join(tiny_dir, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(tiny_dir, "generation_config.json")) as f:
        gen = json.load(f)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert cfg["eos_token_id"] == gen["eos_token_id"] == im_end
    assert len(tok) <= cfg["vocab_size"] == -(-len(tok) // 64) * 64
    for t in ("<|im_start|>", "<|im_end|>") + ADDED_TOKENS:
        ids = tok.encode(f"a{t}b", add_special_tokens=False)
        assert len(ids) == 3 and tok.convert_ids_to_tokens(ids[1]) == t, (t, ids)
        assert ids[1] < cfg["vocab_size"]
    # Reasoning / tool markers survive skip_special_tokens (the parsers read them); <|image|> not.
    text = "<think>x</think><minimax:tool_call>y</minimax:tool_call><|image|>"
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=True) == \
        "<think>x</think><minimax:tool_call>y</minimax:tool_call>"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18C, sunny"},
    {"role": "assistant", "content": "It is 18C and sunny.", "reasoning_content": "Done."},
    {"role": "user", "content": [{"type": "text", "text": "And here?"}, {"type": "image"}]},
]
RENDERED = (
    "<|im_start|>system\nYou are helpful.\n\n# Tools\n\nYou may call one or more of these tools (JSON schemas):\n"
    + json.dumps(TOOLS)
    + "\n\nTo call tools, reply with one <minimax:tool_call> block holding one <invoke> per call and one "
    "<parameter> per argument (values that are not strings written as JSON):\n"
    '<minimax:tool_call><invoke name="TOOL_NAME"><parameter name="ARGUMENT">VALUE</parameter></invoke>'
    "</minimax:tool_call><|im_end|>\n"
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    "<|im_start|>assistant\n<think>I should call the tool.</think>"
    '<minimax:tool_call><invoke name="get_weather"><parameter name="city">Paris</parameter>'
    '<parameter name="days">2</parameter></invoke></minimax:tool_call><|im_end|>\n'
    "<|im_start|>tool\n18C, sunny<|im_end|>\n"
    "<|im_start|>assistant\n<think>Done.</think>It is 18C and sunny.<|im_end|>\n"
    "<|im_start|>user\nAnd here?<|image|><|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_chat_template(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    with open(os.path.join(tiny_dir, "tokenizer_config.json")) as f:
        assert "chat_template" in json.load(f)
    assert tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False,
                                   add_generation_prompt=True) == RENDERED
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tok.apply_chat_template(plain, tokenize=False) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    assert tok.apply_chat_template(plain[:1], tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # Every marker is one token in the rendered prompt.
    ids = tok.encode(RENDERED, add_special_tokens=False)
    for t in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<minimax:tool_call>", "<|image|>"):
        assert tok.convert_tokens_to_ids(t) in ids


@pytest.mark.parametrize("arch", sorted(PRESETS))
def test_param_counts(arch):
    for preset, cfg in PRESETS[arch].items():
        with torch.device("meta"):
            model = get_model_class(arch)(parse_model_config(cfg), max_positions=16)
        total, active = param_counts(cfg)
        assert total == sum(p.numel() for p in model.parameters()), preset
        assert 0 < active < total
    if arch == "minimax_m3":  # the DSpark drafter: in the total, not in what a token reads
        for preset in PRESETS[arch]:
            cfg = get_preset(arch, preset, dspark=True)
            with torch.device("meta"):
                model = get_model_class(arch)(parse_model_config(cfg), max_positions=16)
            total, active = param_counts(cfg)
            assert total == sum(p.numel() for p in model.parameters()), preset
            assert total > param_counts(PRESETS[arch][preset])[0] and active == param_counts(PRESETS[arch][preset])[1]
    total, active = param_counts(PRESETS[arch]["bench"])
    assert 1e9 < total < 1e10 and active < total / 3
    assert 1e7 < param_counts(PRESETS[arch]["small"])[0] < 1e8
    bench = PRESETS[arch]["bench"]
    assert bench["head_dim"] == 128 and bench["max_position_embeddings"] == 131072
    if arch == "inkling":
        assert (bench["sliding_window"], bench["rel_extent"]) == (4096, 1024)
        assert bench["layer_types"].count("full_attention") == 4
    else:
        assert (bench["index_block_size"], bench["index_topk_blocks"], bench["index_head_dim"]) == (128, 16, 128)


def test_sharded_checkpoint_loads(tmp_path):
    one, sharded = str(tmp_path / "one"), str(tmp_path / "sharded")
    init_model("minimax_m3", "tiny", one, seed=3)
    init_model("minimax_m3", "tiny", sharded, seed=3, max_shard_bytes=8 * 2**20)
    files = sorted(n for n in os.listdir(sharded) if n.endswith(".safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        index = json.load(f)
    a, b = _read_weights(one), _read_weights(sharded)
    assert set(index["weight_map"]) == set(a) == set(b)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in a.values())
    assert all(torch.equal(a[n], b[n]) for n in a)
    core = EngineCore(EngineConfig(model_path=sharded, device="cpu", max_total_tokens=256))
    assert torch.equal(core.runner.model.checkpoint_state_dict()["lm_head.weight"], a["lm_head.weight"])


def test_seed_and_scale():
    cfg = get_preset("inkling", "tiny")
    a, b = random_state_dict(cfg, seed=1), random_state_dict(cfg, seed=2)
    assert torch.equal(a["lm_head.weight"], random_state_dict(cfg, seed=1)["lm_head.weight"])
    assert not torch.equal(a["lm_head.weight"], b["lm_head.weight"])
    std = lambda n: a[n].std().item()  # noqa: E731
    assert abs(std("model.embed_tokens.weight") - 1.0) < 0.02
    assert abs(std("model.layers.1.mlp.experts.0.down_proj.weight") - 32 ** -0.5) < 0.03  # fan_in 32
    assert abs(std("model.layers.0.self_attn.qkvr_proj.weight") - 64 ** -0.5) < 0.01
    assert torch.equal(a["model.norm.weight"], torch.ones(64))
    assert random_state_dict(cfg, dtype="bfloat16")["lm_head.weight"].dtype == torch.bfloat16


def test_bench_defaults_to_no_weights(tmp_path):
    out = str(tmp_path / "bench")
    cfg = init_model("inkling", "bench", out)
    assert cfg["torch_dtype"] == "bfloat16"
    assert not [n for n in os.listdir(out) if n.endswith(".safetensors")]
    assert resolve_model(out, "dummy").load_format == "dummy"
    with pytest.raises(FileNotFoundError, match="load-format dummy"):
        resolve_model(out)


def test_cli_init_model_then_serve(tmp_path):
    out = str(tmp_path / "inkling-tiny")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "kiln", "init-model", "--arch", "inkling", "--preset", "tiny",
                        "--out", out], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "6.80 M parameters" in r.stdout and os.path.isfile(os.path.join(out, "model.safetensors"))

    with kiln_server(["--model-path", out, "--device", "cpu", "--served-model-name", "tiny", "--log-level",
                      "warning", "--enable-return-routed-experts"], timeout=90, env=env) as (url, _):
        body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0.0}
        resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        data = resp.json()
        assert data["model"] == "tiny" and data["usage"]["completion_tokens"] >= 1
        assert isinstance(data["choices"][0]["text"], str)
        # /generate returns the routed experts of every forwarded prompt and output token
        gen = {"input_ids": list(range(10, 30)), "return_routed_experts": True,
               "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
        resp = httpx.post(url + "/generate", json=gen, timeout=60)
        assert resp.status_code == 200, resp.text
        routed = resp.json()["meta_info"]["routed_experts"]
        moe_layers = 6 - 1  # tiny Inkling: 6 layers, the first dense
        assert len(routed) == 20 + 3 - 1 and all(len(t) == moe_layers and len(t[0]) == 2 for t in routed)


def test_dspark_checkpoint_drafts_and_keeps_greedy_output(tmp_path):
    """`init-model --dspark`: MiniMax-M3 with its DSpark drafter (config and weights under
    `dspark.`), served with `--speculative-algorithm dspark`: its drafts are verified and greedy
    output equals the plain engine's."""
    out = str(tmp_path / "mm-dspark")
    cfg = init_model("minimax_m3", "tiny", out, seed=0, dspark=True)
    drafter = cfg["dspark_config"]
    assert drafter["mask_token_id"] == cfg["vocab_size"] - 1 and drafter["block_size"] == 8
    assert any(n.startswith("dspark.layers.1.") for n in _read_weights(out))
    prompt = list(range(40, 90))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for name, spec in (("plain", {}), ("dspark", {"speculative_algorithm": "dspark", "speculative_num_steps": 3})):
        core = EngineCore(EngineConfig(model_path=out, device="cpu", max_total_tokens=1024, **spec))
        core.add_request(GenerateReq(rid="a", input_ids=prompt, params=params))
        outputs[name] = []
        while core.has_work():
            for o in core.step():
                assert o.error is None, o.error
                outputs[name].extend(o.new_token_ids)
        if spec:
            assert core.runner.draft_model is core.runner.model.dspark
            assert core.stats().spec.verify_steps > 0
    assert len(outputs["plain"]) == 12 and outputs["dspark"] == outputs["plain"]


def test_dspark_on_inkling_names_the_fix(tmp_path, capsys):
    from kiln.cli import main

    with pytest.raises(SystemExit, match="belongs to MiniMax-M3 .*kiln train-draft --method dflash"):
        main(["init-model", "--arch", "inkling", "--preset", "tiny", "--dspark", "--out", str(tmp_path / "x")])
    assert not os.path.exists(tmp_path / "x")


def test_inkling_loader_ignores_runtime_buffers(tmp_path):
    """A checkpoint tensor named like a gate's selection counter (runtime state, not a weight) is
    refused like any unknown tensor, never copied into the counter."""
    from kiln.models.inkling import InklingForCausalLM
    from kiln.models.inkling_config import InklingConfig
    from kiln.models.presets import get_preset

    model = InklingForCausalLM(InklingConfig.from_dict(get_preset("inkling", "tiny")))
    name = next(n for n, _ in model.named_buffers() if n.endswith("selection_counter"))
    with pytest.raises(KeyError, match="selection_counter"):
        model.load_weights([(name, torch.ones(1, dtype=torch.int32))], strict=False)
    assert int(dict(model.named_buffers())[name]) == 0


def test_tokenizer_from_a_directory_and_the_error_without_one(tmp_path, monkeypatch):
    """An offline host without the embedded model passes SmolLM2's tokenizer files; without
    either, the error names both fixes."""
    import kiln.loader as loader

    tok_dir = str(tmp_path / "tok")
    load_tokenizer(resolve_model(None).model_dir).save_pretrained(tok_dir)
    want = init_model("inkling", "tiny", str(tmp_path / "a"), with_weights=False)

    def missing(path=None, *a, **k):
        raise FileNotFoundError("The embedded default model is missing. Install it with `pip install ...`.")

    monkeypatch.setattr(loader, "resolve_model", missing)
    with pytest.raises(FileNotFoundError, match="--tokenizer-path"):
        init_model("inkling", "tiny", str(tmp_path / "b"), with_weights=False)
    got = init_model("inkling", "tiny", str(tmp_path / "c"), with_weights=False, tokenizer_path=tok_dir)
    assert got == want
    with open(os.path.join(tmp_path / "a", "tokenizer.json")) as a, open(os.path.join(tmp_path / "c", "tokenizer.json")) as c:
        assert json.load(a) == json.load(c)
