"""`kiln init-model`: write a randomly initialised Inkling or MiniMax-M3 checkpoint (MODELS.md 7).

The output is a Hugging Face style directory Kiln serves like any other:

- `config.json`: the preset (`kiln.models.presets`) with every field, `model_type`, `torch_dtype`
  and the `<|im_end|>` id as `eos_token_id`;
- `model.safetensors` (or `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json` above
  2 GB) under the on-disk names of MODELS.md, produced by the model's `checkpoint_state_dict`;
- SmolLM2's tokenizer plus the tokens of MODELS.md 6 and a ChatML chat template
  (`tokenizer_config.json` `chat_template`), and `generation_config.json`.

Initialisation: `kiln.loader.init_dummy_weights` (N(0, 0.02), norm gains and scalar gains 1, router
bias buffers 0), then every on-disk tensor of 2 or more dims rescaled to std 1/sqrt(fan_in) (its
last dim: the input features of a matrix, the taps of a ShortConv filter) so that activations stay
O(1) through depth; the token embedding gets std 1. Deterministic for a given seed.
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional

from kiln.models.presets import (DEFAULT_DTYPE, DEFAULT_WITH_WEIGHTS, get_preset, param_counts,
                                 round_vocab, with_dspark)

# MODELS.md 6 (and 5: the image sentinel). `<|im_start|>` / `<|im_end|>` are already SmolLM2's.
# The reasoning and tool-call markers are added tokens that are *not* special, so that they stay in
# the text decoded with skip_special_tokens (the reasoning and tool parsers read them), like Qwen3's
# `<think>`; `<|image|>` is special (never shown in output).
TEXT_MARKERS = ("<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>")
IMAGE_TOKEN = "<|image|>"
ADDED_TOKENS = TEXT_MARKERS + (IMAGE_TOKEN,)

SHARD_BYTES = 2 * 1024**3  # shard the weights above 2 GB

# ChatML with reasoning and MiniMax XML tool calls (MODELS.md 6):
# - the system turn (if any) comes first; `tools` are appended to it as a JSON list with the call
#   format (a system turn holding only them is created when there is no system message);
# - every turn is `<|im_start|>{role}\n{content}<|im_end|>\n`; list contents render their text
#   parts and one `<|image|>` per image part;
# - an assistant turn is `<think>{reasoning_content}</think>` (when given) + content + its
#   `tool_calls` as one `<minimax:tool_call>` block with one `<invoke>` per call; string argument
#   values are written as is, others as JSON (arguments given as a JSON string, not an object, are
#   written verbatim inside `<invoke>`: parse them before rendering);
# - `add_generation_prompt` appends `<|im_start|>assistant\n`.
CHAT_TEMPLATE = r"""
{%- macro render_content(content) -%}
{%- if content is not defined or content is none -%}
{%- elif content is string -%}{{ content }}
{%- else -%}
{%- for part in content -%}
{%- if part is string -%}{{ part }}
{%- elif part.type == 'text' -%}{{ part.text }}
{%- elif part.type in ['image', 'image_url'] -%}{{ '<|image|>' }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- macro render_tool_calls(calls) -%}
{{ '<minimax:tool_call>' }}
{%- for call in calls -%}
{%- if call.function is defined -%}{%- set fn = call.function -%}{%- else -%}{%- set fn = call -%}{%- endif -%}
{{ '<invoke name="' + fn.name + '">' }}
{%- if fn.arguments is mapping -%}
{%- for key, value in fn.arguments.items() -%}
{{ '<parameter name="' + key + '">' }}
{%- if value is string -%}{{ value }}{%- else -%}{{ value | tojson }}{%- endif -%}
{{ '</parameter>' }}
{%- endfor -%}
{%- elif fn.arguments is string -%}{{ fn.arguments }}
{%- endif -%}
{{ '</invoke>' }}
{%- endfor -%}
{{ '</minimax:tool_call>' }}
{%- endmacro -%}
{%- if messages and messages[0].role == 'system' -%}
{%- set system = render_content(messages[0].content) -%}
{%- set has_system = true -%}
{%- set rest = messages[1:] -%}
{%- else -%}
{%- set system = '' -%}
{%- set has_system = false -%}
{%- set rest = messages -%}
{%- endif -%}
{%- if tools -%}
{{ '<|im_start|>system\n' }}
{%- if system -%}{{ system + '\n\n' }}{%- endif -%}
{{ '# Tools\n\nYou may call one or more of these tools (JSON schemas):\n' }}
{{- tools | tojson }}
{{- '\n\nTo call tools, reply with one <minimax:tool_call> block holding one <invoke> per call and one <parameter> per argument (values that are not strings written as JSON):\n' }}
{{- '<minimax:tool_call><invoke name="TOOL_NAME"><parameter name="ARGUMENT">VALUE</parameter></invoke></minimax:tool_call><|im_end|>\n' }}
{%- elif has_system -%}
{{ '<|im_start|>system\n' + system + '<|im_end|>\n' }}
{%- endif -%}
{%- for message in rest -%}
{%- if message.role == 'assistant' -%}
{{ '<|im_start|>assistant\n' }}
{%- if message.reasoning_content is defined and message.reasoning_content -%}
{{ '<think>' + message.reasoning_content + '</think>' }}
{%- endif -%}
{{ render_content(message.content) }}
{%- if message.tool_calls is defined and message.tool_calls -%}{{ render_tool_calls(message.tool_calls) }}{%- endif -%}
{{ '<|im_end|>\n' }}
{%- else -%}
{{ '<|im_start|>' + message.role + '\n' }}{{ render_content(message.content) }}{{ '<|im_end|>\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}
""".strip()


def build_tokenizer(base: Optional[str] = None):
    """SmolLM2's tokenizer (from the embedded model's cache, or the tokenizer directory `base`)
    with the MODELS.md 6 tokens and the chat template."""
    from transformers import AddedToken, AutoTokenizer

    from kiln.loader import resolve_model

    if base is None:
        try:
            base = resolve_model(None).model_dir
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{e} For kiln init-model, --tokenizer-path DIR (a directory with "
                                    "SmolLM2's tokenizer.json) works too.") from e
    tok = AutoTokenizer.from_pretrained(base, local_files_only=True)
    missing = [t for t in TEXT_MARKERS if t not in tok.get_vocab()]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in missing])
    if IMAGE_TOKEN not in tok.get_vocab():
        tok.add_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)], special_tokens=True)
    for t in ("<|im_start|>", "<|im_end|>") + ADDED_TOKENS:
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1, f"{t} must be one token, got {ids}"
    tok.chat_template = CHAT_TEMPLATE
    return tok


def init_model(arch: str, preset: str, out_dir: str, seed: int = 0, dtype: Optional[str] = None,
               with_weights: Optional[bool] = None, max_shard_bytes: int = SHARD_BYTES,
               tokenizer_path: Optional[str] = None, dspark: bool = False) -> dict:
    """Write a checkpoint directory for `PRESETS[arch][preset]`; return its config.json dict.

    `dtype`: weight dtype (default float32 for tiny/small, bfloat16 for bench). `with_weights`
    None: the preset's default (tiny/small yes; bench no: config + tokenizer only, serve it with
    `--load-format dummy`). `tokenizer_path`: the base tokenizer's directory (default: the
    embedded SmolLM2's; a machine without it, such as an offline GPU host, passes its files).
    `dspark` (MiniMax-M3): with the preset's DSpark drafter (`presets.with_dspark`), served with
    `--speculative-algorithm dspark`.
    """
    config = get_preset(arch, preset, dspark=dspark)  # (an Inkling with dspark: ValueError naming the fix)
    dtype = dtype or DEFAULT_DTYPE[preset]
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if with_weights is None:
        with_weights = DEFAULT_WITH_WEIGHTS[preset]
    os.makedirs(out_dir, exist_ok=True)
    if os.path.exists(os.path.join(out_dir, "config.json")):
        os.remove(os.path.join(out_dir, "config.json"))  # rewritten last, once everything else is

    tok = build_tokenizer(tokenizer_path)
    vocab = round_vocab(len(tok))
    if vocab != config["vocab_size"]:  # the preset assumes SmolLM2's vocab; follow the tokenizer
        config["vocab_size"] = vocab
        if dspark:  # its mask token is the vocabulary's last id
            config = with_dspark(config, preset)
    im_start, im_end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    config.update(torch_dtype=dtype, bos_token_id=im_start, eos_token_id=im_end)
    _validate(config)

    tok.save_pretrained(out_dir, save_jinja_files=False)  # chat_template inside tokenizer_config.json
    stale = os.path.join(out_dir, "chat_template.jinja")  # a re-run over an older output
    if os.path.exists(stale):
        os.remove(stale)
    _write_json(os.path.join(out_dir, "generation_config.json"),
                {"bos_token_id": im_start, "eos_token_id": im_end, "pad_token_id": im_end})
    _remove_weights(out_dir)
    if with_weights:
        save_weights(random_state_dict(config, seed, dtype), out_dir, max_shard_bytes)
    _write_json(os.path.join(out_dir, "config.json"), config)  # last: its presence marks a finished dir
    return config


def _validate(config: dict) -> None:
    from kiln.models.registry import parse_model_config

    parse_model_config(config)


def random_state_dict(config: dict, seed: int = 0, dtype: str = "float32"):
    """On-disk name -> tensor of a randomly initialised model of `config` (see the module doc)."""
    import torch

    from kiln.loader import init_dummy_weights
    from kiln.models.registry import get_model_class, parse_model_config

    cfg = parse_model_config(config)
    target = getattr(torch, dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(target)  # parameters in the written dtype (bench: half the memory)
    try:
        # Tiny RoPE tables: positions do not matter for the weights (they are buffers, not saved).
        model = get_model_class(config["model_type"])(cfg, max_positions=16)
    finally:
        torch.set_default_dtype(previous)
    for p in model.parameters():  # any parameter created with an explicit dtype; buffers stay fp32
        p.data = p.data.to(target)
    init_dummy_weights(model, seed)
    state = model.checkpoint_state_dict()
    del model
    with torch.no_grad():
        for name, t in state.items():
            if t.dim() < 2:
                continue  # norm and scalar gains (1), router bias buffers (0)
            std = 1.0 if name == "model.embed_tokens.weight" else 1.0 / math.sqrt(t.shape[-1])
            state[name] = (t.float() * (std / 0.02)).to(t.dtype)
    return state


def save_weights(state: dict, out_dir: str, max_shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write `state` as model.safetensors, or as numbered shards plus model.safetensors.index.json
    when it is larger than `max_shard_bytes`. Returns the file names written."""
    from safetensors.torch import save_file

    sizes = {n: t.numel() * t.element_size() for n, t in state.items()}
    total = sum(sizes.values())
    if total <= max_shard_bytes:
        save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        _readable(os.path.join(out_dir, "model.safetensors"))
        return ["model.safetensors"]
    shards: list[list[str]] = [[]]
    used = 0
    for name in state:  # checkpoint order keeps a layer's tensors together
        if shards[-1] and used + sizes[name] > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    files, weight_map = [], {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: state[n] for n in names}, os.path.join(out_dir, fname), metadata={"format": "pt"})
        _readable(os.path.join(out_dir, fname))
        weight_map.update((n, fname) for n in names)
        files.append(fname)
    _write_json(os.path.join(out_dir, "model.safetensors.index.json"),
                {"metadata": {"total_size": total}, "weight_map": weight_map})
    return files


def _readable(path: str) -> None:
    """safetensors creates files private to their owner; give them the umask's permissions like
    every other file of the checkpoint."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def _remove_weights(out_dir: str) -> None:
    """Drop weight files of an earlier run so the directory holds exactly one checkpoint."""
    for name in os.listdir(out_dir):
        if name.endswith(".safetensors") or name == "model.safetensors.index.json":
            os.remove(os.path.join(out_dir, name))


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def describe(config: dict) -> str:
    """One line: parameter counts of `config`."""
    from kiln.models.presets import format_count

    total, active = param_counts(config)
    return f"{format_count(total)} parameters, {format_count(active)} active per token"
