"""MiniMax-M3 (MODELS.md 3): MSA attention in every layer, a dense SwiGLU in the first
`first_k_dense_layers` layers and a sigmoid-routed MoE with one shared expert after, and the
optional DSpark drafter's weights (`dspark.*`, loaded, not run by `forward`).

Layer l (on disk `model.layers.{l}.`):

    h = h + MSAAttention(RMSNorm_in(h))                 self_attn.*, input_layernorm
    h = h + MLP(RMSNorm_post(h))                        post_attention_layernorm, mlp.*

`forward(batch)` returns the final-normed hidden states; `compute_logits` projects the rows the
batch asks for. The engine keeps two per-token components for every layer: K/V (FULL_KV) and the
indexer key kI (INDEX_K); see `kiln.layers.msa` for the backend method that fills them.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn

from kiln.dist.parallel import SINGLE, ParallelContext
from kiln.engine.batch import ForwardBatch
from kiln.engine.cache.components import ComponentKind, StateSpec
from kiln.layers.decode_gemv import decode_logits, decode_prenorm
from kiln.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kiln.layers.moe import Experts, MiniMaxMoE, SharedExperts, moe_param_for
from kiln.layers.msa import MSAAttention
from kiln.layers.norm import RMSNorm
from kiln.layers.rotary import RotaryEmbedding
from kiln.loader.weights import copy_into_param
from kiln.models.dspark import DSpark
from kiln.models.llama import LlamaMLP
from kiln.models.minimax_m3_config import MiniMaxM3Config

logger = logging.getLogger(__name__)

# On-disk fragment -> (our stacked parameter fragment, shard id), for q/k/v and dense gate/up.
_STACKED = [
    (".self_attn.q_proj.", ".self_attn.qkv_proj.", "q"),
    (".self_attn.k_proj.", ".self_attn.qkv_proj.", "k"),
    (".self_attn.v_proj.", ".self_attn.qkv_proj.", "v"),
    (".self_attn.indexer.q_proj.", ".self_attn.indexer.qk_proj.", 0),
    (".self_attn.indexer.k_proj.", ".self_attn.indexer.qk_proj.", 1),
    (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0),
    (".mlp.up_proj.", ".mlp.gate_up_proj.", 1),
]


class MiniMaxM3DecoderLayer(nn.Module):
    def __init__(self, cfg: MiniMaxM3Config, layer_id: int, moe_index: int | None, rotary: RotaryEmbedding,
                 index_rotary: RotaryEmbedding, pc: ParallelContext):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MSAAttention(cfg, layer_id, rotary, index_rotary, pc)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = moe_index is not None
        if self.is_moe:
            self.mlp = MiniMaxMoE(cfg, moe_index, pc)
        else:
            self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, pc)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, batch: ForwardBatch,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Input h + residual (h alone when residual is None), output f + residual as returned
        (the residual stream carried apart, see `LlamaDecoderLayer.forward`). With --fold-norms-max-hidden at
        decode the input norm runs in the qkv GEMV's prologue (which also projects the indexer when
        its weight is stacked after qkv_proj's, `MSAAttention.qkv_index_weight`, else writes the
        normed rows for it) and the post-attention norm in the router's or a dense MLP's gate_up's
        (`decode_prenorm`)."""
        # with the indexer's weight stacked after qkv_proj's, one GEMV projects both (and the
        # normed rows are not needed again)
        w = self.self_attn.qkv_index_weight(batch, h)
        qkv, residual, x = decode_prenorm(self.input_layernorm, self.self_attn, self.self_attn.qkv_proj, h, residual,
                                          batch, keep_normed=w is None, weight=w)
        a = self.self_attn(positions, x, batch) if qkv is None else self.self_attn.attend(positions, qkv, x, batch)
        if self.is_moe:  # folded: the gate's GEMV normalises, and keeps the rows for the experts
            z, residual, m = decode_prenorm(self.post_attention_layernorm, self.mlp, self.mlp.gate, a, residual,
                                            batch, keep_normed=True, router=True)
            return self.mlp(m, batch, router_logits=z), residual
        act, residual, m = decode_prenorm(self.post_attention_layernorm, self.mlp, self.mlp.gate_up_proj, a, residual,
                                          batch, glu=True)
        return (self.mlp(m, batch) if act is None else self.mlp.down(act, batch)), residual


class MiniMaxM3Model(nn.Module):
    def __init__(self, cfg: MiniMaxM3Config, pc: ParallelContext, max_positions: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, pc)
        # One RoPE table per head size, shared by every layer (buffers follow .to(device)).
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta)
        index_rotary = (rotary if cfg.index_head_dim == cfg.head_dim
                        else RotaryEmbedding(cfg.index_head_dim, max_positions, cfg.rope_theta))
        layers = []
        for i in range(cfg.num_hidden_layers):
            moe_index = i - cfg.first_k_dense_layers if i >= cfg.first_k_dense_layers else None
            layers.append(MiniMaxM3DecoderLayer(cfg, i, moe_index, rotary, index_rotary, pc))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h, residual = self.embed_tokens(batch.input_ids), None
        for i, layer in enumerate(self.layers):
            batch.capture(i, h, residual)
            h, residual = layer(batch.positions, h, batch, residual)
        return self.norm(h, batch, residual)[0]


class MiniMaxM3ForCausalLM(nn.Module):
    """Causal LM over a `ForwardBatch` (engine or trainer), with the DSpark drafter's weights in
    `self.dspark` when the config has `dspark_config`."""

    # Parameters the RL trainer keeps frozen (MODELS.md 3.1: the indexer; its selection is
    # recomputed in training, and no gradient reaches it anyway). Router biases are buffers.
    frozen_in_training = (".self_attn.indexer.",)

    def __init__(self, cfg, pc: ParallelContext = SINGLE, max_positions: int | None = None):
        super().__init__()
        cfg = MiniMaxM3Config.coerce(cfg)
        self.config = cfg
        self.pc = pc
        max_positions = max_positions or cfg.max_position_embeddings
        self.model = MiniMaxM3Model(cfg, pc, max_positions)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, pc)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.dspark = DSpark(cfg.dspark_config, max_positions) if cfg.dspark_config is not None else None
        if cfg.vision_config is not None:
            logger.warning("MiniMax-M3: vision_config is not supported yet; serving text only")

    def stack_decode_weights(self) -> None:
        """Engine only (after loading, and after weights come back to the device): each layer's qkv
        and indexer weights back to back, for one decode GEMV (`MSAAttention.stack_decode_weights`)."""
        for layer in self.model.layers:
            layer.self_attn.stack_decode_weights()

    def state_specs(self) -> list[StateSpec]:
        """Per-token state of every layer: K and V (FULL_KV) and the indexer key kI (INDEX_K)."""
        a = self.model.layers[0].self_attn
        layers = list(range(self.config.num_hidden_layers))
        return [StateSpec(ComponentKind.FULL_KV, layers, (a.num_kv_heads, a.head_dim)),
                StateSpec(ComponentKind.INDEX_K, layers, (a.num_kv_heads, a.index_head_dim))]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return decode_logits(self.lm_head, hidden, batch)

    # --- checkpoints -------------------------------------------------------------------------

    def _loadable(self) -> dict[str, torch.Tensor]:
        """Parameters and persistent buffers (the gates' correction bias), by our names."""
        out = dict(self.named_parameters(remove_duplicate=False))
        persistent = self.state_dict(keep_vars=True).keys()
        out.update((name, buf) for name, buf in self.named_buffers() if name in persistent)
        return out

    def _target(self, name: str, ours: dict) -> tuple[str, object]:
        """Our tensor name and weight_loader shard id for an on-disk tensor name."""
        if name in ours:
            return name, None
        mapped = moe_param_for(name)
        if mapped is not None and mapped[0] in ours:
            return mapped
        for disk, stacked, shard in _STACKED:
            if disk in name and name.replace(disk, stacked) in ours:
                return name.replace(disk, stacked), shard
        raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> set[str]:
        """Copy checkpoint tensors (on-disk names) into our (sharded, stacked) tensors; returns the
        names of ours that were filled. Raises on unknown tensors, and on missing ones when
        `strict` (weight updates pass strict=False to send a subset)."""
        ours = self._loadable()
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name.startswith("vision.") and self.config.vision_config is not None:
                continue  # the vision tower is not built yet (text-only serving)
            if name.startswith("dspark.") and self.dspark is None:
                continue  # drafter weights without dspark_config: nothing would run them
            target, shard = self._target(name, ours)
            copy_into_param(ours[target], tensor, shard)
            loaded.add(target)
        missing = set(self.state_dict().keys()) - loaded
        if self.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing and strict:
            raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]}")
        return loaded

    @torch.no_grad()
    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor under its on-disk name (q/k/v, gate/up and experts unstacked), ready for
        safetensors; `load_weights(...items())` restores this model exactly. Single rank only."""
        assert self.pc.tp_size == 1, "checkpoint_state_dict writes whole tensors: run it with tp_size 1"
        out: dict[str, torch.Tensor] = {}
        done: set[str] = set()
        for mname, mod in self.named_modules():
            if isinstance(mod, (Experts, SharedExperts)):
                prefix = mname.rsplit(".", 1)[0] + "."
                out.update(mod.checkpoint_items(prefix))
                done |= {f"{mname}.w13", f"{mname}.w2"}
        for name, t in self.state_dict().items():
            if name in done or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            if name.endswith(".qkv_proj.weight"):
                mod = self.get_submodule(name[: -len(".weight")])
                for part, w in zip("qkv", mod.split(t.t())):
                    out[name.replace(".qkv_proj.", f".{part}_proj.")] = w.t()
            elif name.endswith(".indexer.qk_proj.weight"):
                q, k = t.chunk(2, dim=0)
                out[name.replace(".qk_proj.", ".q_proj.")] = q
                out[name.replace(".qk_proj.", ".k_proj.")] = k
            elif name.endswith(".gate_up_proj.weight"):
                gate, up = t.chunk(2, dim=0)
                out[name.replace(".gate_up_proj.", ".gate_proj.")] = gate
                out[name.replace(".gate_up_proj.", ".up_proj.")] = up
            else:
                out[name] = t
        return {k: v.detach().contiguous().clone() for k, v in out.items()}
