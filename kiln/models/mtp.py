"""MTP layers (multi-token prediction, MODELS.md 2.4), shared by every model that has them.

Layer k at sequence index i reads the token t_{i+k} and the previous layer's state h^{k-1}_i
(h^0 = the main model's final hidden state, after model.norm) and predicts t_{i+k+1}:

    u = [enorm(Emb(t_{i+k})) ; hnorm(h^{k-1}_i)] @ eh_proj^T       (embedding first)
    h^k_i = block(u)     a sliding-window decoder layer of the host model with a dense SwiGLU
    logits^k_i = lm_head(final_norm(h^k_i))

Query i of layer k sees key j iff j == i or j <= i + 1 - k (and the window): the block's attention
gets `key_gap = k - 1`. The engine stores entry i at position i + k (`cache_offset = k`), the last
token it depends on. What differs between models is only the block (Inkling's decoder layer
without ShortConv; a Llama decoder layer with RoPE at position i); `MTPLayer` wraps either.

`MTPHost` is what a model with MTP layers adds for the engine's drafter
(`kiln.engine.spec.mtp_drafter`): the state specs of the MTP sites and their ids.
`forward_mtp_reference` runs the chain teacher-forced on packed sequences (tests, and the
`kiln train-draft` trainer, which backpropagates through `mtp_hidden_chain`).
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from kiln.engine.batch import ForwardBatch
from kiln.engine.cache.components import ComponentKind, StateSpec
from kiln.layers.norm import RMSNorm
from kiln.models.reference import packed_batch

_MTP_NAME = re.compile(r"^mtp\.(\d+)\.")


def shift_mtp(name: str, delta: int) -> str:
    """`mtp.{k}.` on disk (k = 1..N) <-> `mtp.{k-1}.` in the ModuleList: delta -1 reads, +1 writes."""
    return _MTP_NAME.sub(lambda m: f"mtp.{int(m.group(1)) + delta}.", name)


def mtp_index(name: str) -> int | None:
    """The k of an on-disk `mtp.{k}.` name, else None."""
    m = _MTP_NAME.match(name)
    return int(m.group(1)) if m else None


def replicated_linear(in_features: int, out_features: int) -> nn.Linear:
    """A bias-free linear every tensor-parallel rank holds whole (small matrices)."""
    lin = nn.Linear(in_features, out_features, bias=False)
    lin.weight.requires_grad_(False)  # engine convention: the trainer enables what it trains
    return lin


class MTPLayer(nn.Module):
    """MTP layer k around a host model's decoder `block` (a module called as `block(u, batch)`,
    returning (f, residual) like every decoder layer: h^k = residual + f; whose attention is `block.self_attn.attn`, built sliding-window with a dense MLP).
    Not run by the host model's `forward`: the engine's drafter and the trainer run the chain."""

    def __init__(self, hidden: int, eps: float, k: int, block: nn.Module):
        super().__init__()
        self.k = k
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = replicated_linear(2 * hidden, hidden)
        self.block = block
        attn = block.self_attn.attn
        assert attn.sliding_window is not None, "MTP blocks are sliding-window layers (MODELS.md 2.4)"
        attn.key_gap = k - 1
        attn.cache_offset = k
        self.final_norm = RMSNorm(hidden, eps)

    def forward(self, tok_emb: torch.Tensor, h_prev: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """tok_emb = Emb(t_{i+k}), h_prev = h^{k-1}_i, both [T, H] -> h^k_i [T, H] (before
        final_norm); `batch.positions` are the rows' sequence indices i."""
        f, residual = self.project(torch.cat([self.enorm(tok_emb, batch), self.hnorm(h_prev, batch)], dim=-1), batch)
        return residual + f

    def project(self, x: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The joined normed inputs x [T, 2H] -> (f, residual) of the block, h^k = residual + f:
        the part of `forward` between its input norms and its residual add (the engine's chain
        graph runs those two in one launch each: `kiln.kernels.mtp_layer_io`)."""
        return self.block(self.eh_proj(x), batch)


class MTPHost:
    """Mixin for a causal LM with `self.mtp` (a ModuleList of `MTPLayer`), `self.model.embed_tokens`
    and `self.lm_head`: the per-token state its MTP chain needs in the engine.

    With speculative decoding over the first n MTP layers, their attention joins the SWA_KV space
    (entries stored at position + k), and n window-1 CONV sites `mtp_hidden_site(k)`, k = 0..n-1,
    hold the hidden state h^k each position feeds layer k + 1 at the next position (h^0 = the main
    model's final hidden state). Both are per-token state in window spaces, so rollback,
    retraction and the prefix cache handle them like every other component."""

    @property
    def num_conv_sites(self) -> int:
        """ShortConv sites of the main model; the MTP hidden sites are numbered after them."""
        return 0

    def mtp_hidden_site(self, k: int) -> int:
        """CONV site id holding h^k per position (k = 0: the main model's final hidden state)."""
        return self.num_conv_sites + k

    def with_mtp_state_specs(self, specs: list[StateSpec], num_mtp: int) -> list[StateSpec]:
        """`specs` (the main model's) plus what the first `num_mtp` MTP layers need. The engine
        keeps one sliding-window space, so MTP layers join an existing SWA_KV spec, which must
        then have their head shape and window."""
        if num_mtp > len(self.mtp):
            raise ValueError(f"{num_mtp} MTP layers asked for; the checkpoint has {len(self.mtp)}")
        if num_mtp <= 0:
            return specs
        attn = [self.mtp[k].block.self_attn.attn for k in range(num_mtp)]
        shape, window = (attn[0].num_kv_heads, attn[0].head_dim), attn[0].sliding_window
        ids = [a.layer_id for a in attn]
        out, merged = [], False
        for s in specs:
            if s.kind == ComponentKind.SWA_KV:
                if (s.shape, s.window) != (shape, window):
                    raise ValueError(f"MTP layers (heads {shape}, window {window}) cannot share the sliding-"
                                     f"window space of the main layers (heads {s.shape}, window {s.window})")
                s = dataclasses.replace(s, layer_ids=list(s.layer_ids) + ids)
                merged = True
            out.append(s)
        if not merged:
            out.append(StateSpec(ComponentKind.SWA_KV, ids, shape, window=window))
        hidden = self.model.embed_tokens.weight.shape[1]
        out.append(StateSpec(ComponentKind.CONV, [self.mtp_hidden_site(k) for k in range(num_mtp)],
                             (hidden,), window=1))
        return out

    def forward_mtp_reference(self, input_ids: torch.Tensor, seq_lens: list[int],
                              hidden: torch.Tensor) -> list[torch.Tensor]:
        """Teacher-forced MTP logits on packed sequences (`forward_mtp_reference` below)."""
        return forward_mtp_reference(self, input_ids, seq_lens, hidden)


def mtp_rows(seq_lens: list[int], k: int) -> list[int]:
    """Rows of layer k per sequence: indices i with a token t_{i+k}, i.e. n - k."""
    return [max(n - k, 0) for n in seq_lens]


def mtp_hidden_chain(model, input_ids: torch.Tensor, seq_lens: list[int], hidden: torch.Tensor,
                     num_layers: int | None = None) -> list[torch.Tensor]:
    """input_ids [T] and the main model's final hidden states [T, H] of packed sequences ->
    h^k [sum_b max(n_b - k, 0), H] for k = 1..num_layers (default: all), rows i = 0 .. n_b - 1 - k
    of each sequence in order. Rows keep their index i as position, so RoPE, the relative bias
    and the window see the same distances as in serving. Runs under the caller's grad mode."""
    layers = list(model.mtp)[:num_layers]
    starts = [sum(seq_lens[:b]) for b in range(len(seq_lens))]
    dev = input_ids.device
    h_prev, prev_lens = hidden, list(seq_lens)
    out = []
    for k, layer in enumerate(layers, start=1):
        lens = mtp_rows(seq_lens, k)
        if not sum(lens):  # sequences too short for this layer (and every later one)
            out.append(hidden.new_zeros(0, hidden.shape[1]))
            h_prev, prev_lens = out[-1], lens
            continue
        # Rows i < n - k of the previous layer (which has n - k + 1 rows per sequence) ...
        prev_starts = [sum(prev_lens[:b]) for b in range(len(prev_lens))]
        keep = torch.cat([torch.arange(s, s + n, device=dev) for s, n in zip(prev_starts, lens)])
        # ... and the tokens t_{i+k} at those rows.
        toks = torch.cat([input_ids[s + k:s + k + n] for s, n in zip(starts, lens)])
        # The trainer's few MTP layers may keep padded scores for the backward (one batched
        # attention per layer on a GPU instead of one per sequence).
        h_k = layer(model.model.embed_tokens(toks), h_prev[keep], packed_batch(toks, lens, pad_under_grad=True))
        out.append(h_k)
        h_prev, prev_lens = h_k, lens
    return out


def forward_mtp_reference(model, input_ids: torch.Tensor, seq_lens: list[int],
                          hidden: torch.Tensor) -> list[torch.Tensor]:
    """One fp32 logits tensor per MTP layer k = 1..N: [sum_b max(n_b - k, 0), V], the rows
    i = 0 .. n_b - 1 - k of each sequence in order; row i predicts t_{i+k+1} (the last row of
    each sequence has no target inside the sequence)."""
    return [model.lm_head.compute_logits(layer.final_norm(h)).float()
            for layer, h in zip(model.mtp, mtp_hidden_chain(model, input_ids, seq_lens, hidden))]
