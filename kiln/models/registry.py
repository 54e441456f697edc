"""`model_type` (config.json) -> model class."""

from __future__ import annotations

from kiln.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
}


def get_model_class(model_type: str) -> type:
    try:
        return MODEL_REGISTRY[model_type]
    except KeyError:
        raise ValueError(f"model_type {model_type!r} is not supported; Kiln serves: "
                         f"{', '.join(sorted(MODEL_REGISTRY))}") from None
