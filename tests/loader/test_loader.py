"""Model sources, weights, tokenizers and ModelConfig parsing (CPU)."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from safetensors.torch import save_file

import kiln.loader.source as source_mod
from kiln.loader import (
    convert_gguf,
    default_model_path,
    eos_token_ids,
    init_dummy_weights,
    iter_weights,
    load_tokenizer,
    resolve_model,
)
from kiln.models.config import SUPPORTED_MODEL_TYPES, ModelConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_CONFIGS = os.path.join(REPO, "benchmarks", "configs")

TINY_CONFIG = {"model_type": "llama", "vocab_size": 32, "hidden_size": 8, "num_hidden_layers": 1,
               "num_attention_heads": 2, "intermediate_size": 16}


def write_config(path, cfg=None):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg or TINY_CONFIG, f)


# ---- the embedded default model --------------------------------------------------------------
# Converted into the normal cache (~/.cache/kiln or $KILN_CACHE_DIR), not tmp, so the ~20 s
# conversion happens once per machine rather than once per test run.


@pytest.mark.slow
def test_default_model_converts_once_and_is_reused():
    src = resolve_model(None)
    assert src.name == "SmolLM2-135M-Instruct"
    assert src.load_format == "safetensors"
    assert src.weight_files and all(os.path.isfile(f) for f in src.weight_files)
    assert "quantization_config" not in src.config
    cfg = ModelConfig.from_dict(src.config)
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers) == ("llama", 576, 30)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
    assert cfg.head_dim == 64 and cfg.tie_word_embeddings

    start = time.time()
    again = resolve_model(None)
    assert time.time() - start < 2.0, "the second resolve must reuse the cache"
    assert again.model_dir == src.model_dir
    # The cache is keyed on the file, so the explicit path and the default agree.
    assert resolve_model(default_model_path()).model_dir == src.model_dir

    dummy = resolve_model(None, "dummy")
    assert dummy.load_format == "dummy" and dummy.weight_files == []

    names = {}
    for name, tensor in iter_weights(src):
        names[name] = tuple(tensor.shape)
    assert names["model.embed_tokens.weight"] == (49152, 576)
    assert names["model.layers.0.self_attn.k_proj.weight"] == (192, 576)
    assert names["model.norm.weight"] == (576,)

    tok = load_tokenizer(src.model_dir)
    assert tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok.encode("Hello world")).endswith("Hello world")
    assert 2 in eos_token_ids(src.model_dir, src.config, tok)  # <|im_end|>


# ---- GGUF cache mechanics (fake conversion) --------------------------------------------------


def test_gguf_cache_is_atomic_and_keyed_on_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "Tiny-1B.Q8_0.gguf"
    gguf.write_bytes(b"GGUF fake")
    calls = []

    def failing(path, out_dir):
        write_config(out_dir)
        raise RuntimeError("interrupted")

    def working(path, out_dir):
        calls.append(path)
        write_config(out_dir)
        save_file({"w": torch.zeros(2)}, os.path.join(out_dir, "model.safetensors"))

    monkeypatch.setattr(source_mod, "_convert_into", failing)
    with pytest.raises(RuntimeError):
        convert_gguf(str(gguf))
    gguf_root = tmp_path / "cache" / "gguf"
    assert [p.name for p in gguf_root.iterdir() if not p.name.endswith(".lock")] == []

    monkeypatch.setattr(source_mod, "_convert_into", working)
    src = resolve_model(str(gguf))
    assert src.name == "Tiny-1B" and src.load_format == "safetensors"
    assert src.model_dir.startswith(str(gguf_root / "Tiny-1B.Q8_0-"))
    assert resolve_model(str(gguf)).model_dir == src.model_dir and len(calls) == 1

    os.utime(gguf, (1, 1))  # a changed file gets a new cache entry
    assert resolve_model(str(gguf)).model_dir != src.model_dir and len(calls) == 2


# ---- HF directories --------------------------------------------------------------------------


def test_sharded_safetensors_round_trip(tmp_path):
    write_config(tmp_path)
    shards = {
        "model-00001-of-00002.safetensors": {"a.weight": torch.randn(3, 4), "b.bias": torch.arange(5.0)},
        "model-00002-of-00002.safetensors": {"c.weight": torch.randn(2, 2, dtype=torch.float64)},
    }
    weight_map = {}
    for fname, tensors in shards.items():
        save_file(tensors, str(tmp_path / fname))
        weight_map.update({k: fname for k in tensors})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    # A stray file the index does not list must not be read.
    save_file({"stray": torch.zeros(1)}, str(tmp_path / "consolidated.safetensors"))

    src = resolve_model(str(tmp_path))
    assert [os.path.basename(f) for f in src.weight_files] == sorted(shards)
    assert src.name == os.path.basename(tmp_path) and src.load_format == "safetensors"
    got = dict(iter_weights(src))
    expected = {k: v for tensors in shards.values() for k, v in tensors.items()}
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v)


def test_single_and_unindexed_safetensors(tmp_path):
    write_config(tmp_path)
    save_file({"x": torch.ones(2)}, str(tmp_path / "weights-b.safetensors"))
    save_file({"y": torch.ones(2)}, str(tmp_path / "weights-a.safetensors"))
    assert [os.path.basename(f) for f in resolve_model(str(tmp_path)).weight_files] == [
        "weights-a.safetensors", "weights-b.safetensors"]
    save_file({"z": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    assert [os.path.basename(f) for f in resolve_model(str(tmp_path)).weight_files] == [
        "model.safetensors"]


def test_missing_path_message():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model("/nonexistent/kiln-model")


def test_missing_weights_message_suggests_dummy(tmp_path):
    write_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="--load-format dummy"):
        resolve_model(str(tmp_path))
    src = resolve_model(str(tmp_path), "dummy")
    assert src.weight_files == [] and src.load_format == "dummy"


def test_missing_config_message(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))


def test_missing_shard_message(tmp_path):
    write_config(tmp_path)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="missing"):
        resolve_model(str(tmp_path))


def test_bad_load_format():
    with pytest.raises(ValueError, match="load_format"):
        resolve_model(os.path.join(BENCH_CONFIGS, "qwen3-0.6b"), "pickle")


# ---- ModelConfig -----------------------------------------------------------------------------


def test_bench_configs_parse():
    src = resolve_model(os.path.join(BENCH_CONFIGS, "qwen3-0.6b"), "dummy")
    assert src.name == "qwen3-0.6b" and src.weight_files == []
    q = ModelConfig.from_dict(src.config)
    assert (q.model_type, q.hidden_size, q.num_hidden_layers) == ("qwen3", 1024, 28)
    assert (q.num_attention_heads, q.num_key_value_heads, q.head_dim) == (16, 8, 128)
    assert (q.intermediate_size, q.vocab_size, q.rope_theta) == (3072, 151936, 1e6)
    assert q.tie_word_embeddings and q.rms_norm_eps == 1e-6 and q.max_position_embeddings == 40960
    assert q.qk_norm and not q.attention_bias and q.rope_scaling is None and q.sliding_window is None

    src = resolve_model(os.path.join(BENCH_CONFIGS, "llama-3.1-8b"), "dummy")
    ll = ModelConfig.from_dict(src.config)
    assert (ll.model_type, ll.hidden_size, ll.num_hidden_layers) == ("llama", 4096, 32)
    assert (ll.num_attention_heads, ll.num_key_value_heads, ll.head_dim) == (32, 8, 128)
    assert (ll.intermediate_size, ll.vocab_size, ll.rope_theta) == (14336, 128256, 500000.0)
    assert ll.rope_scaling == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    assert not ll.tie_word_embeddings and ll.rms_norm_eps == 1e-5
    assert ll.max_position_embeddings == 131072 and ll.torch_dtype == "bfloat16"


def test_config_defaults_and_rope_parameters():
    d = dict(TINY_CONFIG, model_type="qwen2",
             rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5})
    c = ModelConfig.from_dict(d)
    assert c.attention_bias  # qwen2 default
    assert c.num_key_value_heads == 2 and c.head_dim == 4
    assert c.rope_theta == 5e5 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert c.raw == d

    c = ModelConfig.from_dict(dict(TINY_CONFIG, rope_parameters={"rope_type": "default",
                                                                 "rope_theta": 1e5}))
    assert c.rope_theta == 1e5 and c.rope_scaling is None and not c.attention_bias
    assert ModelConfig.from_dict(dict(TINY_CONFIG, rope_scaling={"type": "linear", "factor": 4.0})
                                 ).rope_scaling == {"type": "linear", "factor": 4.0, "rope_type": "linear"}
    m = ModelConfig.from_dict(dict(TINY_CONFIG, model_type="mistral", sliding_window=4096))
    assert m.sliding_window == 4096


def test_unknown_model_type_lists_supported():
    with pytest.raises(ValueError) as e:
        ModelConfig.from_dict(dict(TINY_CONFIG, model_type="gpt2"))
    msg = str(e.value)
    assert "gpt2" in msg and all(t in msg for t in SUPPORTED_MODEL_TYPES)


def test_missing_config_field_is_named():
    d = dict(TINY_CONFIG)
    del d["hidden_size"]
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_dict(d)


# ---- dummy weights ---------------------------------------------------------------------------


class Tiny(torch.nn.Module):
    def __init__(self, extra: bool = False):
        super().__init__()
        if extra:  # registered first, to check values do not depend on parameter order
            self.extra = torch.nn.Linear(3, 3)
        self.embed_tokens = torch.nn.Embedding(50, 16)
        self.proj = torch.nn.Linear(16, 32)
        self.input_layernorm = torch.nn.Module()
        self.input_layernorm.weight = torch.nn.Parameter(torch.zeros(16))
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.zeros(16))
        self.global_scale = torch.nn.Parameter(torch.zeros(()))
        self.register_buffer("expert_bias", torch.full((4,), 7.0))


def test_dummy_init_is_deterministic():
    a, b, c, d = Tiny(), Tiny(), Tiny(), Tiny(extra=True)
    init_dummy_weights(a, seed=0)
    init_dummy_weights(b, seed=0)
    init_dummy_weights(c, seed=1)
    init_dummy_weights(d, seed=0)
    pa, pb, pc, pd = (dict(m.named_parameters()) for m in (a, b, c, d))
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
        assert torch.equal(pa[name], pd[name]), name
    assert not torch.equal(pa["proj.weight"], pc["proj.weight"])
    assert not torch.equal(pa["proj.weight"], pa["embed_tokens.weight"][:32])
    for name in ("input_layernorm.weight", "norm.weight", "global_scale"):
        assert torch.all(pa[name] == 1.0), name
    assert abs(pa["embed_tokens.weight"].std().item() - 0.02) < 0.004
    assert torch.all(a.expert_bias == 7.0)  # buffers untouched


def test_dummy_init_casts_to_param_dtype():
    a, b = Tiny(), Tiny().to(torch.bfloat16)
    init_dummy_weights(a, seed=3)
    init_dummy_weights(b, seed=3)
    assert b.proj.weight.dtype == torch.bfloat16
    assert torch.equal(a.proj.weight.to(torch.bfloat16), b.proj.weight)


# ---- tokenizer -------------------------------------------------------------------------------


def test_missing_tokenizer_names_the_flags(tmp_path):
    write_config(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        load_tokenizer(str(tmp_path))
    assert "--tokenizer-path" in str(e.value) and "--skip-tokenizer-init" in str(e.value)


def test_eos_token_ids_union(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))

    class Tok:
        eos_token_id = 11

    assert eos_token_ids(str(tmp_path), {"eos_token_id": 9}, Tok()) == [9, 7, 11]
    assert eos_token_ids(str(tmp_path), {"eos_token_id": [1, 2]}, None) == [1, 2, 7, 9]
    (tmp_path / "generation_config.json").unlink()
    assert eos_token_ids(str(tmp_path), {}, None) == []
