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
    # Draft logits = the target's LM head x output_multiplier, then tanh soft-capped (z-lab's
    # compute_logits; 1.0 / None: the LM head's logits as they are).
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None
    # DFlash2 (kiln/models/dflash2.py), off at 0: the grouped dynamic conv around each sublayer
    # (kernel size, channels per group) and the candidate selector (rank, candidates per position).
    conv_kernel_size: int = 0
    conv_group_size: int = 16
    selector_rank: int = 0
    selector_top_k: int = 16
    vocab_size: Optional[int] = None  # the target's (the selector's codebooks are over it)

    @classmethod
    def from_dict(cls, d: dict, target: Any, where: str = "config.json: dspark_config") -> "BlockDrafterConfig":
        """Parse `d` against the target's config (any Kiln model config); ValueError naming `where`
        and what is wrong. z-lab's layout, with the drafter's own fields under `dflash_config`,
        reads the same."""
        d = {**d, **d.get("dflash_config", {})}
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
            output_multiplier=float(d.get("output_multiplier", 1.0)),
            final_logit_softcapping=float(d["final_logit_softcapping"]) if d.get("final_logit_softcapping") else None,
            conv_kernel_size=int(d.get("conv_kernel_size") or 0),
            conv_group_size=int(d.get("conv_group_size", 16)),
            selector_rank=int(d.get("selector_rank") or 0),
            selector_top_k=int(d.get("selector_top_k", 16)),
            vocab_size=None if _target_get(target, "vocab_size", None) is None else int(target.vocab_size),
        )
        bad_groups = cfg.conv_group_size < 1 or hidden % cfg.conv_group_size
        if cfg.conv_kernel_size < 0 or (cfg.conv_kernel_size and bad_groups):
            raise ValueError(f"{where}: conv_kernel_size must be >= 0 and hidden_size ({hidden}) a multiple of "
                             f"conv_group_size ({cfg.conv_group_size}).")
        if cfg.selector_rank < 0 or (cfg.selector_rank and (cfg.selector_top_k < 1 or cfg.vocab_size is None)):
            raise ValueError(f"{where}: selector_rank must be >= 0, and a selector needs selector_top_k >= 1 "
                             f"and the target's vocab_size.")
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
