"""Inkling (MODELS.md 2): ShortConv at four sites per layer, attention with a query-conditioned
relative-logit bias instead of positional embeddings (log-length scaling on full layers), a sink
MoE whose shared experts share the routed experts' weight budget, and chained MTP layers.

ShortConv sites are numbered `conv_id = 4 * layer + {0: k_conv, 1: v_conv, 2: o_conv, 3: out_conv}`
so the engine keeps one state per site. Every op that touches cached state (attention, ShortConv)
goes through `batch.backend`, so the same module runs in the engine and in the trainer.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from kiln.dist.parallel import SINGLE, ParallelContext
from kiln.engine.batch import ForwardBatch
from kiln.engine.cache.components import ComponentKind, StateSpec
from kiln.kernels import kernel_path
from kiln.layers.attention import Attention
from kiln.layers.decode_gemv import decode_linear, decode_linear_conv, decode_logits, decode_prenorm
from kiln.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kiln.layers.linear import ColumnParallelLinear, RowParallelLinear
from kiln.layers.moe import SinkMoE
from kiln.layers.norm import RMSNorm
from kiln.layers.shortconv import ShortConv
from kiln.models.inkling_config import InklingConfig
from kiln.models.llama import LlamaMLP
from kiln.models.mtp import MTPHost, MTPLayer, replicated_linear
from kiln.ops.attention import RelProjection


ATTN_SCALE = "attn_scale"  # ForwardBatch.extras key: this forward's lam [T], shared by its full layers


def attn_scale(positions: torch.Tensor, beta: float, floor_scale: float) -> torch.Tensor:
    """lam_i = 1 + beta * ln(floor((i + 1) / floor_scale) + 1) per absolute position i (fp32).

    The floor is taken in exact integer arithmetic when floor_scale is integral, so the step
    lands on the same token on every device and in every mode."""
    pos = positions.long() + 1
    if float(floor_scale).is_integer():
        n = torch.div(pos, int(floor_scale), rounding_mode="floor").float()
    else:
        n = torch.floor(pos.double() / floor_scale).float()
    return 1.0 + beta * torch.log1p(n)


def forward_attn_scale(batch: ForwardBatch, beta: float, floor_scale: float) -> torch.Tensor:
    """`attn_scale` of the batch's positions: on the engine's kernel path in one launch
    (`kiln.kernels.attn_scale`, bit for bit), else the six PyTorch ops above."""
    if kernel_path(batch, batch.positions):
        from kiln.kernels import attn_scale as kernels  # needs Triton: imported only on the kernel path

        if kernels.supported(floor_scale) and batch.positions.is_contiguous():
            return kernels.attn_scale(batch.positions, beta, floor_scale)
    return attn_scale(batch.positions, beta, floor_scale)


class QKVRParallelLinear(ColumnParallelLinear):
    """q [Hq*D], k [Hkv*D], v [Hkv*D], r [Hq*d_r] stacked along the output dim, stored on disk as
    one matrix (`qkvr_proj.weight`); heads are split across ranks (KV heads replicated when there
    are fewer KV heads than ranks)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, rel_dim: int,
                 pc: ParallelContext = SINGLE):
        tp = pc.tp_size
        assert num_heads % tp == 0, f"{num_heads} heads not divisible by tp_size {tp}"
        self.head_dim, self.rel_dim = head_dim, rel_dim
        self.num_heads = num_heads // tp
        if num_kv_heads >= tp:
            assert num_kv_heads % tp == 0
            self.num_kv_heads, self.kv_rank = num_kv_heads // tp, pc.tp_rank
        else:
            assert tp % num_kv_heads == 0
            self.num_kv_heads, self.kv_rank = 1, pc.tp_rank // (tp // num_kv_heads)
        self.sizes = [self.num_heads * head_dim, self.num_kv_heads * head_dim,
                      self.num_kv_heads * head_dim, self.num_heads * rel_dim]
        self.disk_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim,
                           num_heads * rel_dim]
        super().__init__(hidden, sum(self.sizes) * tp, False, pc)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        parts = loaded.split(self.disk_sizes, dim=0)
        ranks = [self.pc.tp_rank, self.kv_rank, self.kv_rank, self.pc.tp_rank]
        offset = 0
        for part, n, rank in zip(parts, self.sizes, ranks):
            param.data.narrow(0, offset, n).copy_(part.narrow(0, rank * n, n))
            offset += n

    def split(self, qkvr: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return qkvr.split(self.sizes, dim=-1)


class InklingAttention(nn.Module):
    def __init__(self, cfg: InklingConfig, layer_id: int, sliding: bool, use_conv: bool,
                 pc: ParallelContext):
        super().__init__()
        d, h, kk = cfg.head_dim, cfg.hidden_size, cfg.shortconv_kernel_size
        self.qkvr_proj = QKVRParallelLinear(h, d, cfg.num_attention_heads, cfg.num_key_value_heads,
                                            cfg.rel_dim, pc)
        nh, nkv = self.qkvr_proj.num_heads, self.qkvr_proj.num_kv_heads
        self.use_conv = use_conv
        if use_conv:
            kv_ch = nkv * d
            self.k_conv = ShortConv(4 * layer_id, kv_ch, kk, row_start=self.qkvr_proj.kv_rank * kv_ch)
            self.v_conv = ShortConv(4 * layer_id + 1, kv_ch, kk, row_start=self.qkvr_proj.kv_rank * kv_ch)
            self.o_conv = ShortConv(4 * layer_id + 2, h, kk)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.rel_proj = replicated_linear(cfg.rel_dim, cfg.rel_extent)  # P_l [R, d_r], frozen in RL
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, h, pc=pc)
        # Full layers scale q and rel by lam_i; sliding layers have lam = 1.
        self.full = not sliding
        self.beta, self.floor_scale = cfg.attn_scale_beta, cfg.attn_scale_floor
        self.attn = Attention(layer_id, nh, nkv, d, sliding_window=cfg.sliding_window if sliding else None,
                              rel_extent=cfg.rel_extent)

    def _fused_prologue(self, qkvr: torch.Tensor, batch: ForwardBatch) -> bool:
        """A decode step or a short extend (a speculative verify) on the engine's kernel path runs
        the k/v convs, the q/k norms, q's lam scale and the K/V cache write as one launch
        (`PagedBackend.conv_qk_norm_attention`)."""
        return (self.use_conv and kernel_path(batch, qkvr) and hasattr(batch.backend, "fuses_conv_qk_norm")
                and batch.backend.fuses_conv_qk_norm(batch))

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.attend(decode_linear(self.qkvr_proj, x, batch), batch)

    def attend(self, qkvr: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The attention from its qkvr projection on (what `forward` does after its first GEMV)."""
        t, d = qkvr.shape[0], self.attn.head_dim
        nh, nkv = self.attn.num_heads, self.attn.num_kv_heads
        q, k, v, r = self.qkvr_proj.split(qkvr)
        lam = None
        if self.full:  # [T] fp32, computed once per forward by InklingModel (MTP layers: here)
            lam = batch.extras.get(ATTN_SCALE)
            if lam is None:
                lam = forward_attn_scale(batch, self.beta, self.floor_scale)
        # [T, Hq, R] = rel_proj(r) (* lam), computed where the attention backend finds it cheapest
        rel = RelProjection(r.reshape(t, nh, self.qkvr_proj.rel_dim), self.rel_proj.weight, lam)
        if self._fused_prologue(qkvr, batch):
            o = batch.backend.conv_qk_norm_attention(self, q, k, v, batch, lam, rel)
        else:
            if self.use_conv:  # on the raw projections, before the per-head norm
                k, v = self.k_conv(k, batch), self.v_conv(v, batch)
            q = self.q_norm(q.reshape(t, nh, d), batch)
            k = self.k_norm(k.reshape(t, nkv, d), batch)
            if lam is not None:
                q = (q.float() * lam[:, None, None]).to(q.dtype)
            o = self.attn(q.reshape(t, nh * d), k.reshape(t, nkv * d), v, batch, rel=rel)
        if self.use_conv:  # at decode or a short verify through the GEMV, o_conv runs in o_proj's epilogue
            return decode_linear_conv(self.o_proj, self.o_conv, o, batch)
        return decode_linear(self.o_proj, o, batch)


class InklingDecoderLayer(nn.Module):
    """MODELS.md 2.2. `moe_index` None: dense SwiGLU; `use_conv` False: the MTP block (no ShortConv)."""

    def __init__(self, cfg: InklingConfig, layer_id: int, sliding: bool, moe_index: Optional[int],
                 use_conv: bool, pc: ParallelContext):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = InklingAttention(cfg, layer_id, sliding, use_conv, pc)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.is_moe = moe_index is not None
        self.mlp = SinkMoE(cfg, moe_index, pc) if self.is_moe else LlamaMLP(h, cfg.intermediate_size, pc)
        self.use_conv = use_conv
        if use_conv:  # lives under `mlp.` on disk (mlp.out_conv.weight)
            self.mlp.out_conv = ShortConv(4 * layer_id + 3, h, cfg.shortconv_kernel_size)

    def forward(self, h: torch.Tensor, batch: ForwardBatch,
                residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Input h + residual (h alone when residual is None), output f + residual as returned:
        the residual stream is carried apart and added inside the next norm (see
        `LlamaDecoderLayer.forward`); the reference path is exactly `h = h + attn(norm(h));
        h = h + out_conv(mlp(norm(h)))`. With --fold-norms-max-hidden at decode each norm runs in the prologue
        of the GEMV that reads it first (`decode_prenorm`: qkvr; the router, or a dense MLP's
        gate_up), and the layer runs the rest of the sublayer (`attend`, the MoE from its logits,
        `down`)."""
        qkvr, residual, x = decode_prenorm(self.input_layernorm, self.self_attn, self.self_attn.qkvr_proj, h,
                                           residual, batch)
        a = self.self_attn(x, batch) if qkvr is None else self.self_attn.attend(qkvr, batch)
        # out_conv goes in with the MLP: at decode or a short verify it runs in the epilogue of the
        # down projection (dense layer) or of the experts' last kernel
        out_conv = self.mlp.out_conv if self.use_conv else None
        if self.is_moe:  # folded: the router GEMV normalises, and keeps the rows for the experts
            z, residual, m = decode_prenorm(self.post_attention_layernorm, self.mlp, self.mlp.router, a, residual,
                                            batch, keep_normed=True, router=True)
            return self.mlp(m, batch, out_conv=out_conv, router_logits=z), residual
        act, residual, m = decode_prenorm(self.post_attention_layernorm, self.mlp, self.mlp.gate_up_proj, a, residual,
                                          batch, glu=True)
        return (self.mlp(m, batch, out_conv=out_conv) if act is None else self.mlp.down(act, batch, out_conv)), residual


def inkling_mtp_layer(cfg: InklingConfig, k: int, pc: ParallelContext) -> MTPLayer:
    """MTP layer k (MODELS.md 2.4) around a sliding-window Inkling decoder block without ShortConv
    and with a dense SwiGLU. Its attention layer id comes after the main model's (L + k - 1)."""
    block = InklingDecoderLayer(cfg, cfg.num_hidden_layers + k - 1, sliding=True, moe_index=None,
                                use_conv=False, pc=pc)
    return MTPLayer(cfg.hidden_size, cfg.rms_norm_eps, k, block)


class InklingModel(nn.Module):
    def __init__(self, cfg: InklingConfig, pc: ParallelContext):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, pc)
        self.layers = nn.ModuleList(
            InklingDecoderLayer(cfg, l, cfg.is_sliding(l),
                                l - cfg.first_k_dense_layers if cfg.is_moe(l) else None, True, pc)
            for l in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.beta, self.floor_scale = cfg.attn_scale_beta, cfg.attn_scale_floor
        self.has_full = any(not cfg.is_sliding(l) for l in range(cfg.num_hidden_layers))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h, residual = self.embed_tokens(batch.input_ids), None
        # lam depends on the positions only: one computation (one launch on the kernel path, six
        # small ones elsewhere) serves every full layer of this forward. Dropped at the end, so no
        # later forward sees a stale one.
        if self.has_full:
            batch.extras[ATTN_SCALE] = forward_attn_scale(batch, self.beta, self.floor_scale)
        try:
            for i, layer in enumerate(self.layers):
                batch.capture(i, h, residual)
                h, residual = layer(h, batch, residual)
        finally:
            batch.extras.pop(ATTN_SCALE, None)
        return self.norm(h, batch, residual)[0]


class InklingForCausalLM(MTPHost, nn.Module):
    """Causal LM over a `ForwardBatch`: `forward` returns final hidden states [T, H] (after
    model.norm); `compute_logits` projects the rows the batch asks for.

    MTP layers live in `self.mtp[k - 1]` for checkpoint prefix `mtp.{k}.` (k = 1..num_mtp_layers).
    """

    # Parameters the RL trainer must keep frozen (MODELS.md 2.2); router biases are buffers.
    frozen_in_training = (".self_attn.rel_proj.",)

    def __init__(self, cfg, pc: ParallelContext = SINGLE, max_positions: Optional[int] = None):
        super().__init__()
        cfg = InklingConfig.coerce(cfg)
        self.config = cfg
        self.pc = pc
        self.max_positions = max_positions or cfg.max_position_embeddings  # no table depends on it
        self.model = InklingModel(cfg, pc)
        self.mtp = nn.ModuleList(inkling_mtp_layer(cfg, k, pc) for k in range(1, cfg.num_mtp_layers + 1))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, pc)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_conv_sites(self) -> int:
        return 4 * self.config.num_hidden_layers

    def state_specs(self, num_mtp: int = 0) -> list[StateSpec]:
        """FULL_KV for full layers, SWA_KV (window W) for sliding layers, and CONV (window K-1) per
        distinct channel size, keyed by conv_id: Hkv*D for k/v convs, H for o/out convs; with
        `num_mtp` = n > 0, the first n MTP layers' state as well (`MTPHost.with_mtp_state_specs`:
        their attention joins SWA_KV, their hidden states get window-1 CONV sites)."""
        cfg = self.config
        a = self.model.layers[0].self_attn.attn
        kv = (a.num_kv_heads, a.head_dim)
        full = [l for l in range(cfg.num_hidden_layers) if not cfg.is_sliding(l)]
        swa = [l for l in range(cfg.num_hidden_layers) if cfg.is_sliding(l)]
        specs = []
        if full:
            specs.append(StateSpec(ComponentKind.FULL_KV, full, kv))
        if swa:
            specs.append(StateSpec(ComponentKind.SWA_KV, swa, kv, window=cfg.sliding_window))
        by_channels: dict[int, list[int]] = {}
        for layer in self.model.layers:
            for conv in (layer.self_attn.k_conv, layer.self_attn.v_conv, layer.self_attn.o_conv,
                         layer.mlp.out_conv):
                by_channels.setdefault(conv.channels, []).append(conv.conv_id)
        for c, ids in by_channels.items():
            specs.append(StateSpec(ComponentKind.CONV, sorted(ids), (c,),
                                   window=cfg.shortconv_kernel_size - 1))
        return self.with_mtp_state_specs(specs, num_mtp)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return decode_logits(self.lm_head, hidden, batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> set[str]:
        """Copy checkpoint tensors (MODELS.md names) into the stacked/sharded parameters;
        `strict=False` accepts a subset (weight updates)."""
        from kiln.models.inkling_weights import load_inkling_weights

        return load_inkling_weights(self, weights, strict)

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """This model's weights under their on-disk names (for `kiln init-model` and exports)."""
        from kiln.models.inkling_weights import inkling_checkpoint_state_dict

        return inkling_checkpoint_state_dict(self)
