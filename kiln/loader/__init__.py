"""Model sources, weights and tokenizers: everything between a `--model-path` and a model."""

from kiln.loader.source import (
    ModelSource,
    cache_dir,
    convert_gguf,
    default_model_path,
    resolve_model,
)
from kiln.loader.tokenizer import eos_token_ids, has_tokenizer_files, load_tokenizer
from kiln.loader.weights import cast_parameters, init_dummy_weights, iter_weights

__all__ = [
    "ModelSource",
    "cache_dir",
    "cast_parameters",
    "convert_gguf",
    "default_model_path",
    "eos_token_ids",
    "has_tokenizer_files",
    "init_dummy_weights",
    "iter_weights",
    "load_tokenizer",
    "resolve_model",
]
