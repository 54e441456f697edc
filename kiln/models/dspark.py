"""DSpark: MiniMax-M3's block drafter (MODELS.md 3.3), the DFlash design of MODELS.md 4.

Weights live in the target's checkpoint under `dspark.` (names as in z-lab's DFlash):

    dspark.fc.weight [H, len(target_layer_ids) * H]        context feature c_j = RMSNorm(fc(taps_j))
    dspark.hidden_norm.weight [H]
    dspark.layers.{i}.input_layernorm.weight / post_attention_layernorm.weight [H]
    dspark.layers.{i}.self_attn.{q,k,v,o}_proj.weight, self_attn.{q,k}_norm.weight [D]
    dspark.layers.{i}.mlp.{gate,up,down}_proj.weight
    dspark.norm.weight [H]

The drafter uses the target's token embedding and LM head. Serving it (its context-KV cache and the
verify loop) comes with speculative decoding; `draft_hidden` is the readable reference of one
block forward that the serving path and the trainer will be tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.dist.parallel import SINGLE
from kiln.layers.linear import ColumnParallelLinear, RowParallelLinear
from kiln.layers.norm import RMSNorm
from kiln.layers.rotary import RotaryEmbedding, apply_rotary
from kiln.models.llama import LlamaMLP
from kiln.models.minimax_m3_config import DSparkConfig

# The drafter is small: its layers take SINGLE and run replicated on every rank.


class DSparkAttention(nn.Module):
    """Queries from the block rows; keys/values from [context features ; block rows] with the same
    projections ("KV injection"); k_norm and q_norm per head, RoPE at absolute positions."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        d, h = cfg.head_dim, cfg.hidden_size
        self.q_proj = ColumnParallelLinear(h, cfg.num_attention_heads * d, pc=SINGLE)
        self.k_proj = ColumnParallelLinear(h, cfg.num_key_value_heads * d, pc=SINGLE)
        self.v_proj = ColumnParallelLinear(h, cfg.num_key_value_heads * d, pc=SINGLE)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, h, pc=SINGLE)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d

    def forward(self, x, ctx, x_pos, ctx_pos, rotary: RotaryEmbedding) -> torch.Tensor:
        """x [n, H] normed block rows; ctx [C, H] context features. Every block row sees every
        context feature (all precede the anchor) and every block row (bidirectional)."""
        n, d = x.shape[0], self.head_dim
        kv_in = torch.cat([ctx, x])
        q = self.q_norm(self.q_proj(x).view(n, self.num_heads, d))
        k = self.k_norm(self.k_proj(kv_in).view(-1, self.num_kv_heads, d))
        v = self.v_proj(kv_in).view(-1, self.num_kv_heads, d)
        pos = torch.cat([ctx_pos, x_pos])
        q = apply_rotary(q, rotary.cos[x_pos], rotary.sin[x_pos])
        k = apply_rotary(k, rotary.cos[pos], rotary.sin[pos])
        o = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(),
                                           v.transpose(0, 1).float(), enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(o.transpose(0, 1).reshape(n, -1).to(x.dtype))


class DSparkLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DSparkAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, SINGLE)

    def forward(self, h, ctx, h_pos, ctx_pos, rotary) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), ctx, h_pos, ctx_pos, rotary)
        return h + self.mlp(self.post_attention_layernorm(h))


class DSpark(nn.Module):
    """The drafter's own weights; the target's embedding and LM head are passed in by the caller."""

    def __init__(self, cfg: DSparkConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.fc = ColumnParallelLinear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, pc=SINGLE)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DSparkLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta)

    def context_features(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [C, len(target_layer_ids) * H] (the tapped target hidden states, concatenated in
        target_layer_ids order) -> c [C, H]."""
        return self.hidden_norm(self.fc(taps))

    def draft_hidden(self, block_embeds: torch.Tensor, anchor_pos: int, ctx: torch.Tensor,
                     ctx_pos: torch.Tensor) -> torch.Tensor:
        """One block: block_embeds [B, H] = target embedding of [anchor, MASK x (B-1)] at positions
        anchor_pos.. ; ctx [C, H] context features of the committed positions ctx_pos (< anchor_pos).
        Returns the final-normed hidden states [B, H]; rows 1..B-1 go through the target's LM head."""
        pos = torch.arange(anchor_pos, anchor_pos + block_embeds.shape[0], device=block_embeds.device)
        h = block_embeds
        for layer in self.layers:
            h = layer(h, ctx, pos, ctx_pos, self.rotary)
        return self.norm(h)
