"""Loading the tokenizer and collecting the token ids that end a generation."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from kiln.loader.source import TOKENIZER_FILES

# Any one of these is enough for AutoTokenizer to build a tokenizer.
_LOADABLE = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tokenizer_config.json")


def load_tokenizer(model_dir: str, tokenizer_path: Optional[str] = None,
                   chat_template_file: Optional[str] = None):
    """Load a transformers tokenizer from `tokenizer_path` (a directory or .gguf file) or `model_dir`.

    `chat_template_file`, when given, replaces the tokenizer's chat template.
    """
    from transformers import AutoTokenizer

    where = os.path.abspath(os.path.expanduser(tokenizer_path or model_dir))
    if where.endswith(".gguf") and os.path.isfile(where):
        tok = AutoTokenizer.from_pretrained(os.path.dirname(where), gguf_file=os.path.basename(where))
    else:
        if not os.path.isdir(where):
            raise FileNotFoundError(f"Tokenizer path {where!r} does not exist; pass a directory "
                                    "holding tokenizer.json / tokenizer_config.json to --tokenizer-path.")
        if not any(os.path.isfile(os.path.join(where, n)) for n in _LOADABLE):
            raise FileNotFoundError(
                f"No tokenizer files in {where} (looked for {', '.join(_LOADABLE)}). Pass "
                "--tokenizer-path DIR with the model's tokenizer, or --skip-tokenizer-init to "
                "send and receive token ids only.")
        # local_files_only: a local directory must never trigger a Hub lookup.
        tok = AutoTokenizer.from_pretrained(where, local_files_only=True)
    if chat_template_file:
        path = os.path.expanduser(chat_template_file)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"Chat template file {chat_template_file!r} does not exist; "
                                    "pass a Jinja template file to --chat-template.")
        with open(path) as f:
            tok.chat_template = f.read()
    return tok


def has_tokenizer_files(model_dir: str) -> bool:
    """Whether `model_dir` holds any tokenizer file."""
    return any(os.path.isfile(os.path.join(model_dir, n)) for n in TOKENIZER_FILES)


def eos_token_ids(model_dir: str, config: Any, tokenizer: Any = None) -> list[int]:
    """Token ids that end a generation, in first-seen order.

    The union of config.json's `eos_token_id` (int or list; `config` is the dict or any object
    with an `eos_token_id` attribute), generation_config.json's, and the tokenizer's eos id.
    Instruct models often list their end-of-turn token only in one of these places.
    """
    ids: list[int] = []

    def add(value: Any) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0 and v not in ids:
                ids.append(v)

    add(config.get("eos_token_id") if isinstance(config, dict) else getattr(config, "eos_token_id", None))
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        try:
            with open(gen_path) as f:
                add(json.load(f).get("eos_token_id"))
        except (OSError, json.JSONDecodeError):
            pass  # a broken optional file must not stop serving
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    return ids
