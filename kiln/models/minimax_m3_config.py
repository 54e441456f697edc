"""`MiniMaxM3Config`: the config.json of a MiniMax-M3 checkpoint (MODELS.md 3), with its defaults,
and `DSparkConfig` for the optional block drafter shipped beside it (MODELS.md 3.3 and 4)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from kiln.models.block_drafter_config import BlockDrafterConfig

# The DSpark drafter is the generic block drafter read from `dspark_config` (MODELS.md 3.3).
DSparkConfig = BlockDrafterConfig

MODEL_TYPE = "minimax_m3"

_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size")


@dataclass
class MiniMaxM3Config:
    """Every MODELS.md 3 field; `raw` keeps the whole dict for fields read elsewhere."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    model_type: str = MODEL_TYPE
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    index_head_dim: int = 128
    index_block_size: int = 128
    index_topk_blocks: int = 16
    first_k_dense_layers: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 1
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131072
    eos_token_id: Union[int, list[int], None] = None
    torch_dtype: Optional[str] = None
    dspark_config: Optional[DSparkConfig] = None
    vision_config: Optional[dict] = None  # parsed by the vision tower when it lands
    raw: dict = field(default_factory=dict, repr=False)

    # Names the engine and loader read on every config (the Llama-family ModelConfig has them too).
    rope_scaling: Optional[dict] = None
    sliding_window: Optional[int] = None

    @classmethod
    def from_dict(cls, d: dict) -> "MiniMaxM3Config":
        """Parse a config.json dict; raise ValueError naming what is wrong or missing."""
        if d.get("model_type") != MODEL_TYPE:
            raise ValueError(f"MiniMaxM3Config expects model_type {MODEL_TYPE!r}, got {d.get('model_type')!r}.")
        missing = [k for k in _REQUIRED if d.get(k) is None]
        if missing:
            raise ValueError(f"config.json (model_type {MODEL_TYPE!r}) is missing {missing}.")
        heads = int(d["num_attention_heads"])
        kv_heads = int(d.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"config.json: num_attention_heads ({heads}) must be a multiple of "
                             f"num_key_value_heads ({kv_heads}).")
        if d.get("rope_scaling"):
            raise ValueError("config.json: rope_scaling is not part of MiniMax-M3 (MODELS.md 3).")
        cfg = cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
            intermediate_size=int(d["intermediate_size"]),
            num_experts=int(d["num_experts"]),
            num_experts_per_tok=int(d["num_experts_per_tok"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            index_head_dim=int(d.get("index_head_dim", 128)),
            index_block_size=int(d.get("index_block_size", 128)),
            index_topk_blocks=int(d.get("index_topk_blocks", 16)),
            first_k_dense_layers=int(d.get("first_k_dense_layers", 1)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            num_shared_experts=int(d.get("num_shared_experts", 1)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings") or 131072),
            eos_token_id=d.get("eos_token_id"),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            vision_config=d.get("vision_config"),
            raw=dict(d),
        )
        _check(cfg)
        if d.get("dspark_config") is not None:
            cfg.dspark_config = DSparkConfig.from_dict(d["dspark_config"], cfg)
        return cfg

    @classmethod
    def coerce(cls, cfg) -> "MiniMaxM3Config":
        """A MiniMaxM3Config from itself or a generic config that kept the raw dict (the runner
        may parse config.json with `ModelConfig.from_dict` first)."""
        return cfg if isinstance(cfg, cls) else cls.from_dict(cfg.raw)

    def to_dict(self) -> dict[str, Any]:
        """config.json fields (for `kiln init-model`); the inverse of `from_dict`."""
        out = {k: getattr(self, k) for k in (
            "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "index_head_dim",
            "index_block_size", "index_topk_blocks", "intermediate_size", "first_k_dense_layers",
            "num_experts", "num_experts_per_tok", "moe_intermediate_size", "routed_scaling_factor",
            "num_shared_experts", "tie_word_embeddings", "max_position_embeddings")}
        if self.eos_token_id is not None:
            out["eos_token_id"] = self.eos_token_id
        if self.dspark_config is not None:
            out["dspark_config"] = dict(vars(self.dspark_config))
        if self.vision_config is not None:
            out["vision_config"] = self.vision_config
        return out


def _check(cfg: MiniMaxM3Config) -> None:
    if cfg.num_shared_experts < 1:
        raise ValueError(f"config.json: MiniMax-M3 has a shared expert (num_shared_experts "
                         f"{cfg.num_shared_experts}; its width is num_shared_experts * moe_intermediate_size).")
    if not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
        raise ValueError(f"config.json: num_experts_per_tok ({cfg.num_experts_per_tok}) must be in "
                         f"1..num_experts ({cfg.num_experts}).")
    if cfg.index_topk_blocks < 1 or cfg.index_block_size < 1:
        raise ValueError("config.json: index_topk_blocks and index_block_size must be >= 1.")
    for name in ("head_dim", "index_head_dim"):
        if getattr(cfg, name) % 2:
            raise ValueError(f"config.json: {name} must be even (rotate-half RoPE).")
