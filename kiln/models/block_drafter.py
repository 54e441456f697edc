"""`BlockDrafter`: the block drafter of MODELS.md 4 (DFlash), shared by the standalone DFlash
drafter (`kiln.models.dflash`) and MiniMax-M3's DSpark (`kiln.models.dspark`, weights under
`dspark.` in the target's checkpoint). Names as in z-lab's DFlash:

    fc.weight [H, len(target_layer_ids) * H]        context feature c_j = RMSNorm(fc(taps_j))
    hidden_norm.weight [H]
    layers.{i}.input_layernorm.weight / post_attention_layernorm.weight [H]
    layers.{i}.self_attn.{q,k,v,o}_proj.weight, self_attn.{q,k}_norm.weight [D]
    layers.{i}.mlp.{gate,up,down}_proj.weight
    norm.weight [H]
    DFlash2 (when configured, kiln/models/dflash2.py): layers.{i}.{attention,mlp}_conv.base_kernel /
    .kernel_projection.weight, candidate_selector.{predecessor,successor}_codebook[.weight] (z-lab
    stores them bare), candidate_selector.hidden_projection.weight

The drafter runs on the target's token embedding and LM head (passed in by the caller). Three
forwards of the same math:
- `draft_hidden`: one block against raw context features, readable; the reference the engine
  path and the trainer are tested against;
- `context_kv` + `forward_blocks`: what the engine's reference path runs. Every layer projects
  the *same* context feature c_j into its keys and values ("KV injection"), so a layer's context
  K/V at position j depends on c_j alone: the engine computes it once per committed position and
  keeps it (`kiln.engine.spec.block_drafter`), then runs many blocks batched against the kept
  K/V, gathered and padded;
- `forward_paged`: the kernel path. The block rows' K/V go into the paged cache right after
  their context's, so each row's attention is a decode attention over keys 0 .. anchor + B - 1
  of its request (`kiln.engine.spec.block_pass`): no gather, shapes that do not depend on the
  context length, and so one CUDA graph per batch size.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from kiln.dist.parallel import SINGLE
from kiln.kernels import kernel_path
from kiln.layers.linear import ColumnParallelLinear, RowParallelLinear
from kiln.layers.norm import RMSNorm
from kiln.layers.rotary import RotaryEmbedding, apply_rotary
from kiln.loader.weights import copy_into_param
from kiln.models.block_drafter_config import BlockDrafterConfig
from kiln.models.dflash2 import CandidateSelector, GroupedDynamicConv
from kiln.models.llama import LlamaMLP

# The drafter is small: its layers take SINGLE and run replicated on every rank.

# The drafter runs on the target's embedding and LM head; copies of them in its checkpoint are not read.
TARGET_OWNED = ("embed_tokens.weight", "lm_head.weight")


class BlockDrafterAttention(nn.Module):
    """Queries from the block rows; keys/values from [context features ; block rows] with the same
    projections ("KV injection"); k_norm and q_norm per head, RoPE at absolute positions."""

    def __init__(self, cfg: BlockDrafterConfig):
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
        """Reference: x [n, H] normed block rows; ctx [C, H] context features. Every block row
        sees every context feature (all precede the anchor) and every block row (bidirectional)."""
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

    def kv(self, x: torch.Tensor, pos: torch.Tensor, rotary: RotaryEmbedding, batch=None
           ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated at `pos`) and values [n, Hkv, D] of rows x [n, H]: context
        features or normed block rows, the same projections for both. `batch` only picks the
        kernels' path (`kiln.kernels.kernel_path`)."""
        n, d = x.shape[0], self.head_dim
        k = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, d), batch)
        v = self.v_proj(x).view(n, self.num_kv_heads, d)
        if kernel_path(batch, k):  # the RoPE kernel with no query heads rotates k alone
            return rotary(pos, k[:, :0], k, batch)[1], v
        return apply_rotary(k, rotary.cos[pos], rotary.sin[pos]), v

    def forward_paged(self, x: torch.Tensor, pos: torch.Tensor, rotary: RotaryEmbedding, batch,
                      store: Callable, attend: Callable) -> torch.Tensor:
        """The engine's kernel path of `forward_blocks`, with the context K/V left in the paged
        cache: x [N, H] normed block rows at positions pos [N]; `store(k, v)` writes the block
        rows' keys and values into the cache beside their context's, then `attend(q)` [N, Hq, D]
        attends every row over its block's context and the whole block (bidirectional: every
        key below anchor + B). Same math as `forward_blocks`."""
        n, d = x.shape[0], self.head_dim
        q = self.q_norm(self.q_proj(x).view(n, self.num_heads, d), batch)
        k = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, d), batch)
        q, k = rotary(pos, q, k, batch)
        store(k, self.v_proj(x).view(n, self.num_kv_heads, d))
        return self.o_proj(attend(q).reshape(n, -1))

    def forward_blocks(self, x: torch.Tensor, pos: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                       ctx_mask: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        """R blocks of B rows at once: x [R * B, H] normed block rows at positions pos [R * B];
        ctx_k / ctx_v [R, C, Hkv, D] each block's context keys (rotated) and values, padded to C;
        ctx_mask [R, C] which of them exist. Same math as `forward`."""
        R, C = ctx_k.shape[:2]
        B, d = x.shape[0] // R, self.head_dim
        q = self.q_norm(self.q_proj(x).view(R * B, self.num_heads, d))
        q = apply_rotary(q, rotary.cos[pos], rotary.sin[pos]).view(R, B, self.num_heads, d)
        kb, vb = self.kv(x, pos, rotary)
        k = torch.cat([ctx_k.to(kb.dtype), kb.view(R, B, self.num_kv_heads, d)], dim=1)
        v = torch.cat([ctx_v.to(vb.dtype), vb.view(R, B, self.num_kv_heads, d)], dim=1)
        visible = torch.cat([ctx_mask, ctx_mask.new_ones(R, B)], dim=1)[:, None, None, :]  # [R, 1, 1, C + B]
        o = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(),
                                           v.transpose(1, 2).float(), attn_mask=visible,
                                           enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(o.transpose(1, 2).reshape(R * B, -1).to(x.dtype))


class BlockDrafterLayer(nn.Module):
    def __init__(self, cfg: BlockDrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = BlockDrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, SINGLE)
        self.attention_conv = self.mlp_conv = None
        if cfg.conv_kernel_size:  # DFlash2
            self.attention_conv = GroupedDynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    @staticmethod
    def around(conv: GroupedDynamicConv | None, sublayer, x: torch.Tensor, rows: int) -> torch.Tensor:
        """sublayer(x), inside DFlash2's conv when there is one; x [n, H] holds blocks of `rows`
        rows back to back (the conv runs along each block's rows)."""
        if conv is None:
            return sublayer(x)
        y, dyn = conv.prepare(x.view(-1, rows, x.shape[-1]))
        out = sublayer(y.reshape(x.shape))
        return conv.finish(out.view(-1, rows, out.shape[-1]), dyn).reshape(out.shape)

    def forward(self, h, ctx, h_pos, ctx_pos, rotary) -> torch.Tensor:
        """Reference, one block: h [B, H]."""
        n = h.shape[0]
        attn = lambda x: self.self_attn(x, ctx, h_pos, ctx_pos, rotary)  # noqa: E731
        h = h + self.around(self.attention_conv, attn, self.input_layernorm(h), n)
        return h + self.around(self.mlp_conv, self.mlp, self.post_attention_layernorm(h), n)


class BlockDrafter(nn.Module):
    """The drafter's own weights; the target's embedding and LM head are passed in by the caller.
    `max_positions` is the target's context length: blocks reach block_size - 1 positions past it."""

    def __init__(self, cfg: BlockDrafterConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.fc = ColumnParallelLinear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, pc=SINGLE)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(BlockDrafterLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions + cfg.block_size, cfg.rope_theta)
        self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, cfg.selector_rank,
                                                    cfg.selector_top_k) if cfg.selector_rank else None

    def process_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft logits from the target's LM head output: x output_multiplier, then
        tanh soft-capped when the config says so (z-lab's `compute_logits`)."""
        cfg = self.config
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        if cfg.final_logit_softcapping:
            logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
        return logits

    def context_features(self, taps: torch.Tensor, batch=None) -> torch.Tensor:
        """taps [C, len(target_layer_ids) * H] (the tapped target hidden states, concatenated in
        target_layer_ids order) -> c [C, H]. `batch` only picks the kernels' path."""
        return self.hidden_norm(self.fc(taps), batch)

    def draft_hidden(self, block_embeds: torch.Tensor, anchor_pos: int, ctx: torch.Tensor,
                     ctx_pos: torch.Tensor) -> torch.Tensor:
        """Reference, one block: block_embeds [B, H] = target embedding of [anchor, MASK x (B-1)]
        at positions anchor_pos.. ; ctx [C, H] context features of the committed positions ctx_pos
        (< anchor_pos). Returns the final-normed hidden states [B, H]; rows 1..B-1 go through the
        target's LM head."""
        pos = torch.arange(anchor_pos, anchor_pos + block_embeds.shape[0], device=block_embeds.device)
        h = block_embeds
        for layer in self.layers:
            h = layer(h, ctx, pos, ctx_pos, self.rotary)
        return self.norm(h)

    def context_kv(self, ctx: torch.Tensor, pos: torch.Tensor, batch=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys (rotated) and values [C, Hkv, D] of context features ctx [C, H] at
        positions pos [C]: what the engine keeps per committed position."""
        return [layer.self_attn.kv(ctx, pos, self.rotary, batch) for layer in self.layers]

    def forward_blocks(self, block_embeds: torch.Tensor, anchor_pos: torch.Tensor,
                       ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], ctx_mask: torch.Tensor) -> torch.Tensor:
        """R blocks at once: block_embeds [R, B, H], anchor_pos [R], ctx_kv per layer (K, V)
        [R, C, Hkv, D] padded, ctx_mask [R, C]. Returns final-normed hidden states [R, B, H];
        equals `draft_hidden` of each block on its own."""
        R, B, H = block_embeds.shape
        pos = (anchor_pos[:, None] + torch.arange(B, device=block_embeds.device)).reshape(-1)
        h = block_embeds.reshape(R * B, H)
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            attn = lambda x: layer.self_attn.forward_blocks(x, pos, ck, cv, ctx_mask, self.rotary)  # noqa: E731
            h = h + layer.around(layer.attention_conv, attn, layer.input_layernorm(h), B)
            h = h + layer.around(layer.mlp_conv, layer.mlp, layer.post_attention_layernorm(h), B)
        return self.norm(h).view(R, B, H)

    def forward_paged(self, block_embeds: torch.Tensor, pos: torch.Tensor, batch,
                      caches: list[tuple[Callable, Callable]]) -> torch.Tensor:
        """The engine's kernel path of `forward_blocks`: block_embeds [N, H] (blocks of
        block_size rows back to back) at positions pos [N]; per layer, `caches[i]` = (store,
        attend) as `BlockDrafterAttention.forward_paged` takes them. Returns final-normed hidden
        states [N, H]; `batch` picks the kernels (`kiln.kernels.kernel_path`)."""
        B = self.config.block_size
        h = block_embeds
        for layer, (store, attend) in zip(self.layers, caches):
            attn = lambda x: layer.self_attn.forward_paged(x, pos, self.rotary, batch, store, attend)  # noqa: E731
            h = h + layer.around(layer.attention_conv, attn, layer.input_layernorm(h, batch), B)
            mlp = lambda x: layer.mlp(x, batch)  # noqa: E731
            h = h + layer.around(layer.mlp_conv, mlp, layer.post_attention_layernorm(h, batch), B)
        return self.norm(h, batch)

    # --- checkpoints (the standalone DFlash layout; MiniMax-M3 maps `dspark.` names itself) ----

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> set[str]:
        """Copy tensors named as on disk (gate/up separate) into the parameters; KeyError on an
        unknown name, ValueError on missing ones when `strict`."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name in TARGET_OWNED:  # some DFlash checkpoints carry a copy of the target's
                continue
            if name.endswith("_codebook"):  # z-lab stores the selector's embeddings bare
                name = name + ".weight"
            target, shard = name, None
            for part, shard_id in ((".mlp.gate_proj.", 0), (".mlp.up_proj.", 1)):
                if part in name:
                    target, shard = name.replace(part, ".mlp.gate_up_proj."), shard_id
            if target not in params:
                raise KeyError(f"drafter checkpoint tensor {name!r} has no parameter in the block drafter")
            try:
                copy_into_param(params[target], tensor, shard)
            except RuntimeError as e:  # a shape mismatch: say which tensor, and against what
                raise ValueError(f"drafter checkpoint tensor {name!r} {tuple(tensor.shape)} does not fit parameter "
                                 f"{target!r} {tuple(params[target].shape)} (the drafter's config, or the target's "
                                 f"vocab_size for the selector's codebooks, disagrees with the weights): {e}") from e
            loaded.add(target)
        missing = set(params) - loaded
        if missing and strict:
            raise ValueError(f"drafter checkpoint is missing tensors: {sorted(missing)[:8]}")
        return loaded

    @torch.no_grad()
    def checkpoint_state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Every tensor under its on-disk name (gate/up unstacked); `load_weights` restores it."""
        out: dict[str, torch.Tensor] = {}
        for name, t in self.state_dict().items():
            if name.endswith(".gate_up_proj.weight"):
                gate, up = t.chunk(2, dim=0)
                out[prefix + name.replace(".gate_up_proj.", ".gate_proj.")] = gate
                out[prefix + name.replace(".gate_up_proj.", ".up_proj.")] = up
            else:
                out[prefix + name] = t
        return {k: v.detach().contiguous().clone() for k, v in out.items()}

    def block_ids(self, anchors: list[int]) -> list[int]:
        """Input ids of blocks [anchor, MASK x (B-1)], flattened."""
        mask = self.mask_token_id
        return [t for a in anchors for t in [a] + [mask] * (self.config.block_size - 1)]

    @property
    def mask_token_id(self) -> Optional[int]:
        return self.config.mask_token_id
