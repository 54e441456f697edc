"""The Llama family (llama, qwen2, qwen3, mistral): one definition from Kiln's layers.

Differences between members are config switches: attention bias (qwen2), per-head qk-norm
(qwen3), sliding window (mistral), tied head. Matches Hugging Face transformers exactly in fp32.
A config with `num_mtp_layers > 0` adds MTP layers (`kiln.models.mtp`, MODELS.md 2.4) whose block
is a Llama decoder layer with a sliding window, for `--speculative-algorithm mtp`; the main
forward never runs them, so the model's logits do not change.
"""

from __future__ import annotations

from typing import Iterable, Optional

import dataclasses

import torch
from torch import nn

from kiln.dist.parallel import SINGLE, ParallelContext
from kiln.engine.batch import ForwardBatch
from kiln.engine.cache.components import ComponentKind, StateSpec
from kiln.layers.attention import Attention
from kiln.layers.decode_gemv import (decode_linear, decode_linear_conv, decode_linear_norm, decode_logits,
                                     decode_prenorm, decode_qkv_rope, decode_swiglu, hooked, qkv_rope_args)
from kiln.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kiln.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kiln.layers.norm import RMSNorm
from kiln.layers.rotary import RotaryEmbedding
from kiln.models.config import ModelConfig
from kiln.models.mtp import MTPHost, MTPLayer, mtp_index, shift_mtp


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, pc: ParallelContext):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], pc=pc)
        self.down_proj = RowParallelLinear(intermediate, hidden, pc=pc)

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None,
                out_conv: nn.Module | None = None) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)), then `out_conv` (a ShortConv on the output: Inkling's dense
        layers) when given; `batch` only picks the kernels' paths (see `kiln.layers.activation`,
        `kiln.layers.decode_gemv`: at decode the conv can run in down's GEMV epilogue)."""
        return self.down(decode_swiglu(self.gate_up_proj, x, batch), batch, out_conv)

    def down(self, act: torch.Tensor, batch: ForwardBatch | None = None,
             out_conv: nn.Module | None = None) -> torch.Tensor:
        """The MLP from silu(gate) * up on: down_proj, then `out_conv` as in `forward`."""
        if out_conv is not None:
            return decode_linear_conv(self.down_proj, out_conv, act, batch)
        return decode_linear(self.down_proj, act, batch)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, pc: ParallelContext):
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=cfg.attention_bias, pc=pc)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, pc=pc)
        self.qk_norm = cfg.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(layer_id, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d,
                              sliding_window=cfg.sliding_window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch,
                rope: Optional[tuple] = None) -> torch.Tensor:
        """o_proj(attention(qkv_proj(x))); `rope`: `decode_rope`'s arguments when the caller has them
        (else looked up here)."""
        return decode_linear(self.o_proj, self.attention(positions, x, batch, rope), batch)

    def decode_rope(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> Optional[tuple]:
        """The `rope=` arguments when this decode step's qkv GEMV rotates q and k and writes the
        cache itself (`qkv_rope_args`; not with Qwen3's qk-norm, which comes before RoPE), else None."""
        return None if self.qk_norm else qkv_rope_args(self.attn, self.rotary, positions, x, self.qkv_proj, batch)

    def attention(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch, rope: Optional[tuple] = None,
                  qkv: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The attention's output before o_proj. qkv: qkv_proj(x) when the caller ran it (with
        `rope`: the rotated q of a GEMV that wrote k and v into the cache, `decode_rope`)."""
        if qkv is None:
            rope = rope if rope is not None else self.decode_rope(positions, x, batch)
            if rope is not None:
                return self.attn.attend_stored(decode_qkv_rope(self.qkv_proj, x, rope, batch), batch)
            qkv = decode_linear(self.qkv_proj, x, batch)
        elif rope is not None:
            return self.attn.attend_stored(qkv, batch)
        q, k, v = self.qkv_proj.split(qkv)
        t, d = qkv.shape[0], self.attn.head_dim
        q = q.reshape(t, -1, d)
        k = k.reshape(t, -1, d)
        if self.qk_norm:
            q, k = self.q_norm(q, batch), self.k_norm(k, batch)
        return self.attn(q, k, v, batch, rope=(self.rotary, positions))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, pc: ParallelContext):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_id, rotary, pc)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, pc)

    def forward(self, positions, h: torch.Tensor, batch: ForwardBatch, residual: torch.Tensor | None = None,
                normed: torch.Tensor | None = None, next_norm: nn.Module | None = None) -> tuple:
        """Pre-norm block with the residual stream carried apart (vLLM's layout): the layer's input
        is h + residual (h alone for the first layer), its output f + residual as returned. The
        adds happen inside the norms, fused with them on the kernel path; the reference path
        computes exactly `h = h + attn(norm(h)); h = h + mlp(norm(h))`.

        On the decode GEMV path each norm runs inside a GEMV: in the prologue of the one that
        reads it at hidden sizes up to --fold-norms-max-hidden (`decode_prenorm`), else in the
        epilogue of the one before it (`decode_linear_norm`: o_proj's for the post-attention norm,
        down_proj's for `next_norm`); qkv_proj's GEMV may also run RoPE and the cache write
        (`LlamaAttention.decode_rope`).

        normed: norm(h), computed by the layer before in its epilogue (h is then the whole stream,
        residual None). next_norm: the norm that reads this layer's output (the next layer's input
        norm, the model's final norm). With next_norm it returns (h, residual, normed), normed being
        next_norm(h) when down_proj's epilogue computed it (h the whole stream, residual None), else
        None; without, (h, residual) as every decoder layer does."""
        attn, mlp = self.self_attn, self.mlp
        rope = attn.decode_rope(positions, h, batch)
        if normed is not None:
            qkv, residual, x = None, h, normed
        else:
            qkv, residual, x = decode_prenorm(self.input_layernorm, attn, attn.qkv_proj, h, residual, batch,
                                              rope=rope)
        fused = None
        if hooked(attn):  # its call runs whole (and `decode_prenorm` did not fold: qkv is None)
            a = attn(positions, x, batch, rope=rope)
        else:
            o = attn.attention(positions, x, batch, rope, qkv)
            fused = decode_linear_norm(attn.o_proj, o, batch, residual, self.post_attention_layernorm)
            a = None if fused is not None else decode_linear(attn.o_proj, o, batch)
        if fused is not None:
            (x, residual), act = fused, None
        else:
            act, residual, x = decode_prenorm(self.post_attention_layernorm, mlp, mlp.gate_up_proj, a, residual,
                                              batch, glu=True)
        if act is None and hooked(mlp):  # its call runs whole
            f = mlp(x, batch)
        else:
            act = act if act is not None else decode_swiglu(mlp.gate_up_proj, x, batch)
            fused = None if next_norm is None else decode_linear_norm(mlp.down_proj, act, batch, residual, next_norm)
            if fused is not None:
                return fused[1], None, fused[0]
            f = mlp.down(act, batch)
        return (f, residual) if next_norm is None else (f, residual, None)


class LlamaMTPBlock(LlamaDecoderLayer):
    """The block of a Llama MTP layer: a decoder layer called as `block(u, batch)`, with RoPE at
    the rows' sequence indices (`batch.positions`)."""

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(batch.positions, h, batch)


def llama_mtp_layer(cfg: ModelConfig, k: int, rotary: RotaryEmbedding, pc: ParallelContext) -> MTPLayer:
    """MTP layer k: a sliding-window (`mtp_sliding_window`) Llama decoder layer with a dense SwiGLU
    of `mtp_intermediate_size`, attention layer id L + k - 1 (after the main layers)."""
    block_cfg = dataclasses.replace(cfg, sliding_window=cfg.mtp_sliding_window,
                                    intermediate_size=cfg.mtp_intermediate_size or cfg.intermediate_size)
    block = LlamaMTPBlock(block_cfg, cfg.num_hidden_layers + k - 1, rotary, pc)
    return MTPLayer(cfg.hidden_size, cfg.rms_norm_eps, k, block)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, pc: ParallelContext, max_positions: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, pc)
        # One table shared by every layer (a buffer, so it follows .to(device)).
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, rotary, pc) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h, residual, normed = self.embed_tokens(batch.input_ids), None, None
        for i, layer in enumerate(self.layers):
            batch.capture(i, h, residual)
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            h, residual, normed = layer(batch.positions, h, batch, residual, normed, next_norm)
        return normed if normed is not None else self.norm(h, batch, residual)[0]


class LlamaForCausalLM(MTPHost, nn.Module):
    """Causal LM over a `ForwardBatch`: `forward` returns final hidden states [T, H];
    `compute_logits` projects the rows the batch asks for. MTP layers (if the config has them)
    live in `self.mtp[k - 1]` for checkpoint prefix `mtp.{k}.`."""

    # checkpoint name fragment -> (our parameter fragment, shard id)
    stacked_params = [
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
    ]

    def __init__(self, cfg: ModelConfig, pc: ParallelContext = SINGLE, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        self.pc = pc
        self.model = LlamaModel(cfg, pc, max_positions or cfg.max_position_embeddings)
        rotary = self.model.layers[0].self_attn.rotary  # the MTP blocks share the RoPE table
        self.mtp = nn.ModuleList(llama_mtp_layer(cfg, k, rotary, pc) for k in range(1, cfg.num_mtp_layers + 1))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, pc)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def state_specs(self, num_mtp: int = 0) -> list[StateSpec]:
        """Per-token state this model needs the engine to keep: K and V for every layer, and with
        `num_mtp` > 0 the first num_mtp MTP layers' (`MTPHost.with_mtp_state_specs`)."""
        a = self.model.layers[0].self_attn.attn
        specs = [StateSpec(ComponentKind.FULL_KV, list(range(self.config.num_hidden_layers)),
                           (a.num_kv_heads, a.head_dim))]
        return self.with_mtp_state_specs(specs, num_mtp)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return decode_logits(self.lm_head, hidden, batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> set[str]:
        """Copy checkpoint tensors into the (sharded, stacked) parameters; returns loaded names.
        `strict=False` accepts a subset (weight updates)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            k = mtp_index(name)
            if k is not None:
                if not 1 <= k <= len(self.mtp):
                    raise KeyError(f"checkpoint tensor {name!r}: the config has {len(self.mtp)} MTP layers")
                name = shift_mtp(name, -1)
            for ckpt, ours, shard in self.stacked_params:
                if ckpt in name:
                    target = name.replace(ckpt, ours)
                    p = params[target]
                    p.weight_loader(p, tensor.to(p.dtype), shard)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
                p = params[name]
                loader = getattr(p, "weight_loader", None)
                if loader is not None:
                    loader(p, tensor.to(p.dtype))
                else:
                    p.data.copy_(tensor.to(p.dtype))
                loaded.add(name)
        missing = set(dict(self.named_parameters()).keys()) - loaded
        if self.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing and strict:
            raise ValueError(f"checkpoint is missing parameters: {sorted(missing)[:8]}")
        return loaded
