"""`model_type` (config.json) -> (model class, config class).

The runner parses config.json with the config class's `from_dict` and builds the model class with
it (`cls(cfg, pc, max_positions=...)`). Model classes of new architectures also accept a generic
`ModelConfig` (they re-parse its `raw` dict), so a caller that always uses `ModelConfig` works too.
"""

from __future__ import annotations

from kiln.models.config import ModelConfig
from kiln.models.inkling import InklingForCausalLM
from kiln.models.inkling_config import InklingConfig
from kiln.models.llama import LlamaForCausalLM
from kiln.models.minimax_m3 import MiniMaxM3ForCausalLM
from kiln.models.minimax_m3_config import MiniMaxM3Config

MODEL_REGISTRY: dict[str, tuple[type, type]] = {
    "llama": (LlamaForCausalLM, ModelConfig),
    "qwen2": (LlamaForCausalLM, ModelConfig),
    "qwen3": (LlamaForCausalLM, ModelConfig),
    "mistral": (LlamaForCausalLM, ModelConfig),
    "inkling": (InklingForCausalLM, InklingConfig),
    "minimax_m3": (MiniMaxM3ForCausalLM, MiniMaxM3Config),
}


def _entry(model_type: str) -> tuple[type, type]:
    try:
        return MODEL_REGISTRY[model_type]
    except KeyError:
        raise ValueError(f"model_type {model_type!r} is not supported; Kiln serves: "
                         f"{', '.join(sorted(MODEL_REGISTRY))}") from None


def get_model_class(model_type: str) -> type:
    return _entry(model_type)[0]


def get_config_class(model_type: str) -> type:
    return _entry(model_type)[1]


def parse_model_config(d: dict):
    """config.json dict -> the config object its model class expects."""
    return get_config_class(d.get("model_type")).from_dict(d)
