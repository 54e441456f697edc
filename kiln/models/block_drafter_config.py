"""`BlockDrafterConfig`: the shape of a block drafter (MODELS.md 4, DFlash; 3.3, DSpark), parsed
from a DFlash drafter's own config.json or from a MiniMax-M3 checkpoint's `dspark_config`.

No torch here: the MiniMax-M3 config module imports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


def _target_get(target: Any, name: str, default: Any) -> Any:
    value = getattr(target, name, None)
    return default if value is None else value


@dataclass
class BlockDrafterConfig:
    """The drafter's shape. Sizes a config leaves out default to the target's; the hidden size
    must be the target's (the drafter runs on the target's token embedding and LM head).

    `target_layer_ids`: target layers whose *input* hidden state (the residual entering the
    layer; SGLang's capture convention) is tapped, concatenated in this order."""

    target_layer_ids: list[int]
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int = 16
    mask_token_id: Optional[int] = None

    @classmethod
    def from_dict(cls, d: dict, target: Any, where: str = "config.json: dspark_config") -> "BlockDrafterConfig":
        """Parse `d` against the target's config (any Kiln model config); ValueError naming `where`
        and what is wrong."""
        layers = int(_target_get(target, "num_hidden_layers", 0))
        if not d.get("target_layer_ids"):
            raise ValueError(f"{where}: needs target_layer_ids.")
        bad = [i for i in d["target_layer_ids"] if not 0 <= int(i) < layers]
        if bad:
            raise ValueError(f"{where}: target_layer_ids {bad} are not layers of the "
                             f"target ({layers} layers).")
        hidden = int(d.get("hidden_size", target.hidden_size))
        if hidden != target.hidden_size:
            raise ValueError(f"{where}: hidden_size ({hidden}) must equal the target's hidden_size "
                             f"({target.hidden_size}): the drafter uses the target's embedding and LM head.")
        heads = int(d.get("num_attention_heads", target.num_attention_heads))
        head_dim = int(d.get("head_dim") or _target_get(target, "head_dim", hidden // heads))
        cfg = cls(
            target_layer_ids=[int(i) for i in d["target_layer_ids"]],
            num_layers=int(d.get("num_layers", d.get("num_hidden_layers", 1))),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads", _target_get(target, "num_key_value_heads", heads))),
            head_dim=head_dim,
            intermediate_size=int(d.get("intermediate_size", target.intermediate_size)),
            rms_norm_eps=float(d.get("rms_norm_eps", _target_get(target, "rms_norm_eps", 1e-6))),
            # Inkling has no RoPE of its own: a drafter on it says its theta or takes 10000.
            rope_theta=float(d.get("rope_theta", _target_get(target, "rope_theta", 10000.0))),
            block_size=int(d.get("block_size", 16)),
            mask_token_id=None if d.get("mask_token_id") is None else int(d["mask_token_id"]),
        )
        if cfg.block_size < 2:
            raise ValueError(f"{where}: block_size must be >= 2 (the anchor plus at least one draft).")
        if cfg.num_attention_heads % cfg.num_key_value_heads or cfg.head_dim % 2:
            raise ValueError(f"{where}: num_attention_heads must be a multiple of "
                             f"num_key_value_heads and head_dim even (rotate-half RoPE).")
        vocab = _target_get(target, "vocab_size", None)
        if cfg.mask_token_id is not None and vocab is not None and not 0 <= cfg.mask_token_id < vocab:
            raise ValueError(f"{where}: mask_token_id {cfg.mask_token_id} is not a token of the "
                             f"target's vocabulary ({vocab}).")
        return cfg

    def to_dict(self) -> dict:
        return dict(vars(self))
