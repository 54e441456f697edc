"""`InklingConfig`: every config.json field of an Inkling checkpoint (MODELS.md 2), with its defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

MODEL_TYPE = "inkling"
SLIDING, FULL = "sliding_attention", "full_attention"

_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size")


def default_layer_types(num_layers: int) -> list[str]:
    """5 sliding-window layers then 1 full-attention layer, repeated."""
    return [FULL if i % 6 == 5 else SLIDING for i in range(num_layers)]


@dataclass
class InklingConfig:
    vocab_size: int
    hidden_size: int  # H
    num_hidden_layers: int  # L
    num_attention_heads: int  # Hq
    num_key_value_heads: int  # Hkv
    head_dim: int  # D
    intermediate_size: int  # dense MLP (and MTP blocks)
    num_experts: int  # E
    num_experts_per_tok: int  # k
    moe_intermediate_size: int
    layer_types: list[str]
    sliding_window: Optional[int]  # W (keys i-W < j <= i)
    model_type: str = MODEL_TYPE
    first_k_dense_layers: int = 1
    num_shared_experts: int = 2  # S
    route_scale: float = 1.0
    shortconv_kernel_size: int = 4  # K
    rel_dim: int = 32  # d_r
    rel_extent: int = 1024  # R
    attn_scale_beta: float = 0.1
    attn_scale_floor: float = 8192.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    num_mtp_layers: int = 8
    vision_config: Optional[dict] = None
    max_position_embeddings: int = 2048  # no positional table; only the engine's default context
    eos_token_id: Union[int, list[int], None] = None
    torch_dtype: Optional[str] = None
    raw: dict = field(default_factory=dict, repr=False)

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_layers

    @classmethod
    def from_dict(cls, d: dict) -> "InklingConfig":
        """Parse a config.json dict; raise ValueError naming what is wrong or missing."""
        if d.get("model_type") != MODEL_TYPE:
            raise ValueError(f"not an Inkling config.json (model_type {d.get('model_type')!r})")
        missing = [k for k in _REQUIRED if d.get(k) is None]
        if missing:
            raise ValueError(f"config.json (model_type 'inkling') is missing {missing}.")
        layers, heads, hidden = int(d["num_hidden_layers"]), int(d["num_attention_heads"]), int(d["hidden_size"])
        kv_heads = int(d.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"config.json: num_attention_heads ({heads}) must be a multiple of "
                             f"num_key_value_heads ({kv_heads}).")
        layer_types = list(d.get("layer_types") or default_layer_types(layers))
        if len(layer_types) != layers or set(layer_types) - {SLIDING, FULL}:
            raise ValueError(f"config.json: layer_types must list {layers} entries of {SLIDING!r} or "
                             f"{FULL!r}, got {layer_types}.")
        window = d.get("sliding_window")
        if SLIDING in layer_types and not window:
            raise ValueError("config.json: sliding_window is required when a layer is sliding_attention.")
        if int(d["num_experts_per_tok"]) > int(d["num_experts"]):
            raise ValueError("config.json: num_experts_per_tok exceeds num_experts.")
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(d.get("head_dim") or hidden // heads),
            intermediate_size=int(d["intermediate_size"]),
            num_experts=int(d["num_experts"]),
            num_experts_per_tok=int(d["num_experts_per_tok"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            layer_types=layer_types,
            sliding_window=int(window) if window else None,
            first_k_dense_layers=int(d.get("first_k_dense_layers", 1)),
            num_shared_experts=int(d.get("num_shared_experts", 2)),
            route_scale=float(d.get("route_scale", 1.0)),
            shortconv_kernel_size=int(d.get("shortconv_kernel_size", 4)),
            rel_dim=int(d.get("rel_dim", 32)),
            rel_extent=int(d.get("rel_extent", 1024)),
            attn_scale_beta=float(d.get("attn_scale_beta", 0.1)),
            attn_scale_floor=float(d.get("attn_scale_floor", 8192)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            num_mtp_layers=int(d.get("num_mtp_layers", 8)),
            vision_config=d.get("vision_config"),
            max_position_embeddings=int(d.get("max_position_embeddings") or 2048),
            eos_token_id=d.get("eos_token_id"),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            raw=dict(d),
        )

    @classmethod
    def coerce(cls, cfg) -> "InklingConfig":
        """An InklingConfig from either itself or a generic config that kept the raw dict
        (the runner may parse config.json with `ModelConfig.from_dict` first)."""
        return cfg if isinstance(cfg, cls) else cls.from_dict(cfg.raw)
