"""`ModelConfig`: the Llama-family fields of a config.json, with Hugging Face's defaults filled in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

# Model types whose config.json `ModelConfig.from_dict` accepts. Other architectures' modules add
# their model_type here when they register, then read their own extra fields from `raw`.
SUPPORTED_MODEL_TYPES: set[str] = {"llama", "qwen2", "qwen3", "mistral", "inkling", "minimax_m3"}

# transformers' per-architecture defaults for fields a config.json may leave out.
_MAX_POSITIONS_DEFAULT = {"llama": 2048, "qwen2": 32768, "qwen3": 32768, "mistral": 131072}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "intermediate_size")


@dataclass
class ModelConfig:
    """The shape and numerics of a Llama-family model, parsed from config.json by `from_dict`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # has "rope_type" (e.g. "llama3", "linear"); None = plain
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: Optional[int] = None
    eos_token_id: Union[int, list[int], None] = None
    torch_dtype: Optional[str] = None  # the checkpoint's dtype, for information only
    hidden_act: str = "silu"
    mlp_bias: bool = False
    # MTP layers for speculative decoding (MODELS.md 2.4 on a Llama decoder layer; docs/models.md):
    # `mtp.{k}.` on disk, each block a sliding-window layer of `mtp_sliding_window` keys with a
    # dense SwiGLU of `mtp_intermediate_size` (default: intermediate_size).
    num_mtp_layers: int = 0
    mtp_sliding_window: int = 1024
    mtp_intermediate_size: Optional[int] = None
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def qk_norm(self) -> bool:
        """Whether attention applies RMSNorm to q and k per head (Qwen3)."""
        return self.model_type == "qwen3"

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Parse a config.json dict; raise ValueError naming what is wrong or missing."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"Unsupported model_type {model_type!r} in config.json; Kiln supports "
                f"{sorted(SUPPORTED_MODEL_TYPES)}.")
        missing = [k for k in _REQUIRED if d.get(k) is None]
        if missing:
            raise ValueError(f"config.json (model_type {model_type!r}) is missing {missing}.")
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        kv_heads = d.get("num_key_value_heads") or heads
        head_dim = d.get("head_dim") or hidden // heads
        if heads % kv_heads:
            raise ValueError(f"config.json: num_attention_heads ({heads}) must be a multiple of "
                             f"num_key_value_heads ({kv_heads}).")
        hidden_act = d.get("hidden_act", d.get("hidden_activation", "silu"))
        if hidden_act != "silu":
            raise ValueError(f"config.json: hidden_act {hidden_act!r} is not supported (only 'silu').")
        rope_theta, rope_scaling = _rope(d)
        num_mtp = int(d.get("num_mtp_layers") or 0)
        mtp_window = int(d.get("mtp_sliding_window") or 1024)
        if num_mtp < 0 or mtp_window < 1:
            raise ValueError(f"config.json: num_mtp_layers ({num_mtp}) must be >= 0 and "
                             f"mtp_sliding_window ({mtp_window}) >= 1.")
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
            intermediate_size=int(d["intermediate_size"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings")
                                        or _MAX_POSITIONS_DEFAULT.get(model_type, 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and its config.json usually does not say so.
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            sliding_window=_sliding_window(model_type, d),
            eos_token_id=d.get("eos_token_id"),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            hidden_act=hidden_act,
            mlp_bias=bool(d.get("mlp_bias", False)),
            num_mtp_layers=num_mtp,
            mtp_sliding_window=mtp_window,
            mtp_intermediate_size=int(d["mtp_intermediate_size"]) if d.get("mtp_intermediate_size") else None,
            raw=dict(d),
        )


def _rope(d: dict) -> tuple[float, Optional[dict]]:
    """rope_theta and rope_scaling from either the transformers 4 or 5 config layout."""
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    theta = d.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling") if isinstance(d.get("rope_scaling"), dict) else None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        # Old configs say "type"; the rotary layer reads "rope_type".
        scaling.setdefault("rope_type", scaling.get("type", "default"))
        if scaling["rope_type"] == "default":
            scaling = None
    return float(theta), scaling


def _sliding_window(model_type: str, d: dict) -> Optional[int]:
    window: Any = d.get("sliding_window")
    if model_type == "mistral":
        return int(window) if window else None
    if model_type in ("qwen2", "qwen3") and d.get("use_sliding_window"):
        # Qwen applies the window only to some layers (max_window_layers); not implemented.
        raise ValueError("config.json: use_sliding_window=true is not supported for "
                         f"{model_type}; set it to false (released Qwen checkpoints do).")
    return None
