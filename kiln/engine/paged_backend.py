"""`PagedBackend`: the engine's state backend for every model, hybrid or not.

It executes each op that reads or writes cached state, against the pools the runner built from
the model's `state_specs()`:
- `attention`: full-attention layers use the main page space (FULL_KV), sliding-window layers the
  "swa" window space (SWA_KV) when the model declares one; on the kernel path `rope_attention`
  also rotates q and k, in the same launch as the cache write;
- `short_conv`: the last K-1 inputs of each sequence come from the "conv" window space (CONV),
  this forward's inputs are written there;
- `msa_attention`: K/V in FULL_KV and the indexer keys in INDEX_K, both in the main page space;
- `conv_qk_norm_attention` (kernel path; decode steps and short extends such as a speculative
  verify): Inkling's k/v ShortConvs over the "conv" space fused with the q/k norms and the K/V
  cache write (`kiln.kernels.conv_qk_norm`), then attention.
The math is the reference ops in `kiln.ops`; only the addressing lives here. Before a layer
touches its buffers it waits for HiCache copies still running on them (`LayerGate`). With
`use_kernels` (CUDA), the same calls go to the Triton kernels in `kiln.kernels`, which read the
batch's lengths from device tensors (`ForwardBatch.set_device_metadata`) so that a decode step
has no host synchronisation and can be replayed from a CUDA graph.

Speculative decoding's MTP layers (MODELS.md 2.4) attend with a `key_gap` (query i sees key j iff
j == i or i - j >= gap) and keep their cache at `position + cache_offset`; their batches carry
explicit query positions (`batch.extras["positions_cpu"]`, and `batch.positions` on the device:
catch-up rows and a draft row further ahead). Both attention kernels know all three: the decode
kernel (one query per row) runs a decode round's short MTP batches, the extend kernel the long
catch-up after a prefill.
"""

from __future__ import annotations

from typing import Optional

import torch

from kiln.engine.batch import ForwardBatch, ForwardMode
from kiln.engine.cache.layer_gate import LayerGate
from kiln.ops import attention as attn_ops
from kiln.ops import msa as msa_ops
from kiln.ops import shortconv as conv_ops

# Extends of at most this many tokens per sequence run the decode kernel, one query per token
# (speculative verify, and the MTP layers' pass of a decode round: up to K + 2 rows).
SHORT_EXTEND = 10
SPLIT_COUNTERS = 65536


class PagedBackend:
    def __init__(self, full_kv, tables: dict[str, torch.Tensor], swa_kv=None, index_k=None,
                 conv=None, use_kernels: bool = False, gate: Optional[LayerGate] = None,
                 gemv_max_rows: int = 0, moe_gemv_max_tokens: int = 1, gemv_prefetch_bytes: int = 0,
                 fused_router_gate: bool = False,
                 fold_norms_max_hidden: int = 0, early_kv_max_bs: int = 0, prologue_max_bs: int = 0,
                 qkv_rope: bool = False, msa_prologue: bool = False, msa_prologue_scores: bool = True,
                 norm_epilogue: bool = False):
        self.use_kernels = use_kernels
        self.gemv_max_rows = gemv_max_rows  # kiln.layers.decode_gemv (on the kernel path only)
        self.moe_gemv_max_tokens = moe_gemv_max_tokens  # kiln.layers.moe: the expert GEMVs up to this many tokens
        self.gemv_prefetch_bytes = gemv_prefetch_bytes  # its L2 prefetch (kiln.kernels.prefetch)
        self.fused_router_gate = fused_router_gate  # kiln.layers.moe: routers' logits + gate in one launch
        self.fold_norms_max_hidden = fold_norms_max_hidden  # kiln.layers.decode_gemv: pre-norms in GEMVs
        self.early_kv_max_bs = early_kv_max_bs  # decode steps this small read older keys before the PDL wait
        self.prologue_max_bs = prologue_max_bs  # decode steps this small: Inkling's prologue inside the attention
        self.qkv_rope = qkv_rope  # a decode qkv GEMV may rotate and write the cache (decode_rope_args)
        self.norm_epilogue = norm_epilogue  # kiln.layers.decode_gemv: pre-norms in the last GEMV before them
        self.msa_prologue = msa_prologue and use_kernels  # MiniMax-M3's norms, RoPEs and cache write in one launch
        self.msa_prologue_scores = msa_prologue_scores  # ... and at decode MSA's block scores in it too
        self.gate = gate if gate is not None else LayerGate()  # HiCache copies still running on a layer's buffers
        if use_kernels:  # imported only here: the CPU build of torch ships without Triton
            from kiln.kernels import attention as attn_kernels
            from kiln.kernels import conv_qk_norm as prologue_kernels
            from kiln.kernels import msa as msa_kernels
            from kiln.kernels.msa_prologue import DecodeScores as k_msa_prologue_scores
            from kiln.kernels.msa_prologue import msa_prologue as k_msa_prologue
            from kiln.kernels import shortconv as conv_kernels
            from kiln.kernels.kv_store import store_kv
            from kiln.kernels.rotary import rope_store

            self.k_rope_store = rope_store
            self.k_attn, self.k_msa, self.k_conv = attn_kernels, msa_kernels, conv_kernels
            self.k_prologue = prologue_kernels
            self.k_msa_prologue = k_msa_prologue
            self.k_msa_prologue_scores = k_msa_prologue_scores
        # The cache write of every attention layer: one launch for K and V (and MSA's indexer
        # keys) on the kernel path, per-tensor index_put otherwise.
        self.store_kv = store_kv if use_kernels else attn_ops.store_kv
        self.full_kv = full_kv  # KVPool or None
        self.swa_kv = swa_kv  # KVPool or None
        self.index_k = index_k  # TokenStatePool or None
        self.conv = conv  # TokenStatePool keyed by conv site id, or None
        self.tables = tables  # page space name -> [rows, max_context] token slots
        # The decode kernel merges its splits in place with these counters (zeroed, left zeroed by
        # every call; one stream runs the layers in order). Rows x KV heads beyond them take the
        # merge kernel: 64K covers 8K query rows of 8 KV heads.
        self.split_counters = (torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=next(iter(tables.values())).device)
                               if use_kernels and tables else None)

    # ---- addressing ----------------------------------------------------------------------
    @staticmethod
    def _loc(batch: ForwardBatch, space: str) -> torch.Tensor:
        return batch.out_cache_loc if space == "main" else batch.win_out_locs[space]

    @staticmethod
    def _plan(batch: ForwardBatch, device):
        """Split once per forward: single-token sequences run as one batched decode call, longer
        extends one by one."""
        plan = batch.extras.get("paged_plan")
        if plan is None:
            slots = batch.extras.get("req_slots_cpu") or batch.req_slots.tolist()
            dec, ext = [], []
            for slot, prefix, n, start in zip(slots, batch.prefix_lens, batch.extend_lens, batch.extend_starts):
                (dec if n == 1 else ext).append((slot, prefix, n, start))
            as_t = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
            dec_t = (as_t([d[3] for d in dec]), as_t([d[0] for d in dec]), as_t([d[1] + 1 for d in dec])) if dec else None
            plan = batch.extras["paged_plan"] = (dec_t, ext)
        return plan

    @staticmethod
    def _token_slots(batch: ForwardBatch, num_tokens: int) -> torch.Tensor:
        """[T] the request row of every token: `extras["token_slots"]` when the batch brings it
        (graph batches fill it once per replay, not once per layer; the MTP chain graph's rows
        include padding), else each sequence's row repeated over its extend (no host sync: the
        output size is the token count), kept in the batch for its other layers. Not kept in a
        graph batch: its warm-up's tensor would be read by the capture instead of recomputed."""
        slots = batch.extras.get("token_slots")
        if slots is not None:
            return slots
        slots = torch.repeat_interleave(batch.req_slots, batch.extend_lens_t, output_size=num_tokens)
        if not batch.in_graph:
            batch.extras["token_slots"] = slots
        return slots

    # ---- attention -----------------------------------------------------------------------
    def _kv(self, layer) -> tuple[torch.Tensor, torch.Tensor, str]:
        """The layer's K/V caches (once HiCache copies on them are done) and their page space."""
        swa = self.swa_kv is not None and layer.layer_id in self.swa_kv.layer_index
        pool, space = (self.swa_kv, "swa") if swa else (self.full_kv, "main")
        k_cache, v_cache = pool.layer(layer.layer_id)
        self.gate.wait(k_cache, v_cache)
        return k_cache, v_cache, space

    def attention(self, layer, q, k, v, batch: ForwardBatch, rel: Optional[torch.Tensor] = None) -> torch.Tensor:
        k_cache, v_cache, space = self._kv(layer)
        self.store_kv(k, v, k_cache, v_cache, self._loc(batch, space))
        return self._attend(layer, q, k_cache, v_cache, space, batch, rel)

    def rope_attention(self, layer, rotary, positions: torch.Tensor, q, k, v, batch: ForwardBatch) -> torch.Tensor:
        """`attention` of q and k rotated by `rotary` at `positions` (kernel path only): RoPE and
        the cache write run as one launch (`kiln.kernels.rotary.rope_store`), bit-identical to
        `rotary` followed by `attention`."""
        assert self.use_kernels
        k_cache, v_cache, space = self._kv(layer)
        q = self.k_rope_store(positions, q, k, v, rotary.cos, rotary.sin, k_cache, v_cache, self._loc(batch, space))
        return self._attend(layer, q, k_cache, v_cache, space, batch, None)

    def decode_rope_args(self, layer, rotary, positions: torch.Tensor, batch: ForwardBatch) -> Optional[tuple]:
        """The RoPE and cache-write arguments (`kiln.kernels.rotary.rope_store`'s after q, k, v:
        cos, sin, positions, cache rows, k_cache, v_cache) for a kernel that computes this decode
        step's q, k, v and can rotate and store them itself (the qkv GEMV's epilogue,
        `kiln.layers.decode_gemv.decode_qkv_rope`); then `attend_stored` attends. None where the
        step must take `rope_attention` (not a decode step on the kernel path, or --disable-fused-qkv-rope)."""
        if not (self.qkv_rope and self.use_kernels and batch.mode == ForwardMode.DECODE):
            return None
        k_cache, v_cache, space = self._kv(layer)  # HiCache copies into them are done before the write
        return rotary.cos, rotary.sin, positions, self._loc(batch, space), k_cache, v_cache

    def attend_stored(self, layer, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Attention of q [T, Hq, D] (rotated) over the caches, this step's K/V already written
        there (`decode_rope_args`)."""
        k_cache, v_cache, space = self._kv(layer)
        return self._attend(layer, q, k_cache, v_cache, space, batch, None)

    def _attend(self, layer, q, k_cache, v_cache, space: str, batch: ForwardBatch,
                rel: Optional[torch.Tensor], prologue=None) -> torch.Tensor:
        """Attention of this forward's queries over the caches (this forward's K/V already in, or,
        at a decode step, made by the attention kernel from `prologue`)."""
        assert prologue is None or (self.use_kernels and batch.mode == ForwardMode.DECODE), "prologue: decode kernel only"
        table = self.tables[space]
        win = layer.sliding_window
        gap, offset = getattr(layer, "key_gap", 0), getattr(layer, "cache_offset", 0)
        positions = batch.extras.get("positions_cpu")
        mtp = gap > 1 or offset or positions is not None
        decode_rows = batch.mode == ForwardMode.DECODE or batch.max_extend_len <= SHORT_EXTEND
        if not (self.use_kernels and decode_rows and not mtp):
            # only the decode kernel (decode steps, verifies) computes Inkling's bias from its
            # projection's input
            rel = attn_ops.materialized(rel)
        if mtp:  # an MTP layer (explicit query positions)
            if self.use_kernels and batch.max_extend_len <= SHORT_EXTEND:  # a decode round's pass
                return self.k_attn.decode_attention(q, k_cache, v_cache, table, self._token_slots(batch, q.shape[0]),
                                                    batch.positions, layer.scale, win, rel, key_gap=gap,
                                                    key_offset=offset, split_counters=self.split_counters,
                                                    len_offset=1)
            if self.use_kernels:
                return self.k_attn.extend_attention(
                    q, k_cache, v_cache, table, batch.req_slots, batch.prefix_lens_t, batch.extend_lens_t,
                    batch.extend_starts_t, layer.scale, win, rel, max_extend_len=batch.max_extend_len,
                    positions=batch.positions, key_gap=gap, key_offset=offset)
            slots = batch.extras.get("req_slots_cpu") or batch.req_slots.tolist()
            return attn_ops.paged_attention(q, k_cache, v_cache, table, slots, batch.prefix_lens, batch.extend_lens,
                                            layer.scale, win, rel, key_gap=gap, positions=positions,
                                            key_offset=offset)
        if self.use_kernels:
            if batch.mode == ForwardMode.DECODE:
                # A decode step's lengths and page table come from the host (the scheduler, a
                # graph's input copies) and its older keys from earlier steps: `early_kv` may
                # read them before the wait (measured faster at batch 1, slower at 8 and 64).
                return self.k_attn.decode_attention(q, k_cache, v_cache, table, batch.req_slots, batch.seq_lens_t,
                                                    layer.scale, win, rel, split_counters=self.split_counters,
                                                    early_kv=q.shape[0] <= self.early_kv_max_bs, prologue=prologue)
            if batch.max_extend_len <= SHORT_EXTEND:
                # A few new tokens per sequence over a long cache (speculative verify): the
                # extend kernel would run one program per (sequence, head) along the whole
                # context; as one decode query per token it is split along the keys instead.
                return self.k_attn.decode_attention(q, k_cache, v_cache, table, self._token_slots(batch, q.shape[0]),
                                                    batch.positions, layer.scale, win, rel,
                                                    split_counters=self.split_counters, len_offset=1)
            return self.k_attn.extend_attention(q, k_cache, v_cache, table, batch.req_slots, batch.prefix_lens_t,
                                                batch.extend_lens_t, batch.extend_starts_t, layer.scale, win, rel,
                                                max_extend_len=batch.max_extend_len)
        dec, ext = self._plan(batch, q.device)
        if not ext:
            return attn_ops.paged_decode_attention(q, k_cache, v_cache, table, dec[1], dec[2], layer.scale, win, rel)
        out = torch.empty_like(q)
        if dec is not None:
            rows = dec[0]
            out[rows] = attn_ops.paged_decode_attention(q[rows], k_cache, v_cache, table, dec[1], dec[2],
                                                        layer.scale, win, None if rel is None else rel[rows])
        for slot, prefix, n, start in ext:
            sl = slice(start, start + n)
            out[sl] = attn_ops.paged_attention(q[sl], k_cache, v_cache, table, [slot], [prefix], [n],
                                               layer.scale, win, None if rel is None else rel[sl])
        return out

    # ---- ShortConv -----------------------------------------------------------------------
    def short_conv(self, conv, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        decode = self.decode_conv_args(conv, batch)
        if decode is not None:
            return self.k_conv.short_conv_decode(x, *decode)
        buf = self.conv.layer(conv.conv_id)  # [slots, C]
        self.gate.wait(buf)
        k = conv.weight.shape[1]
        if self.use_kernels:
            return self.k_conv.short_conv_extend(x, conv.weight, buf, self.tables["conv"], batch.req_slots,
                                                 batch.prefix_lens_t, batch.extend_lens_t, batch.extend_starts_t,
                                                 batch.win_out_locs["conv"])
        prev = self._conv_history(buf, batch, k, x.device)
        buf[batch.win_out_locs["conv"]] = x.to(buf.dtype)
        return conv_ops.short_conv(x, conv.weight, batch.extend_lens, prev)

    def decode_conv_args(self, conv, batch: ForwardBatch) -> Optional[tuple]:
        """The arguments of `kiln.kernels.shortconv.short_conv_decode` after x for `conv` in this
        decode step (once HiCache copies on its buffer are done), for that kernel or one that runs
        it in its epilogue (`kiln.kernels.gemv`'s `conv`); None where it does not serve (no
        kernels, or not a decode step)."""
        if not (self.use_kernels and batch.mode == ForwardMode.DECODE):
            return None
        buf = self.conv.layer(conv.conv_id)
        self.gate.wait(buf)
        return (conv.weight, buf, self.tables["conv"], batch.req_slots, batch.seq_lens_t, batch.win_out_locs["conv"])

    def chunk_conv_args(self, conv, batch: ForwardBatch) -> Optional[tuple]:
        """For a forward of short chunks (at most SHORT_EXTEND tokens per sequence: a speculative
        verify) on the kernel path, `conv`'s state as the GEMV's chunk epilogue takes it
        (`kiln.kernels.gemv.gemv(conv=..., conv_chunk=True)`): (weight, buffer, table, each token's
        request row, each token's position, each token's state slot). None otherwise (decode steps
        have `decode_conv_args`)."""
        if not (self.use_kernels and batch.mode == ForwardMode.EXTEND and batch.max_extend_len <= SHORT_EXTEND):
            return None
        buf = self.conv.layer(conv.conv_id)
        self.gate.wait(buf)
        rows = self._token_slots(batch, batch.positions.shape[0])
        return (conv.weight, buf, self.tables["conv"], rows, batch.positions, batch.win_out_locs["conv"])

    def fuses_conv_qk_norm(self, batch: ForwardBatch) -> bool:
        """Whether `conv_qk_norm_attention` serves this batch: the kernel path, and a decode step or chunks
        of at most SHORT_EXTEND tokens (a speculative verify; longer prefill chunks keep the
        separate kernels, whose programs cover several rows)."""
        return self.use_kernels and (batch.mode == ForwardMode.DECODE or batch.max_extend_len <= SHORT_EXTEND)

    def conv_qk_norm_attention(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                               q_scale: Optional[torch.Tensor], rel) -> torch.Tensor:
        """Inkling's attention prologue in one launch (when `fuses_conv_qk_norm`,
        `kiln.kernels.conv_qk_norm.conv_qk_norm_store`), then `layer.attn` over the caches:
        layer.k_conv / v_conv on k and v with their conv-space history and state writes (as
        `short_conv`), layer.q_norm / k_norm per head, q times `q_scale` [T] (lam), and the new
        k and v written into the layer's K/V cache (as `attention` writes them). q [T, Hq*D],
        k / v [T, Hkv*D] -> [T, Hq*D]."""
        assert self.fuses_conv_qk_norm(batch)
        k_buf, v_buf = self.conv.layer(layer.k_conv.conv_id), self.conv.layer(layer.v_conv.conv_id)
        self.gate.wait(k_buf, v_buf)
        k_cache, v_cache, space = self._kv(layer.attn)
        if batch.mode == ForwardMode.DECODE and 0 < q.shape[0] <= self.prologue_max_bs:
            # one launch: the attention kernel makes the new token's K/V itself (--attention-prologue-max-bs)
            prologue = self.k_prologue.AttentionPrologue(
                k, v, layer.q_norm.weight, layer.k_norm.weight, layer.q_norm.eps, layer.k_norm.eps,
                layer.k_conv.weight, layer.v_conv.weight, k_buf, v_buf, self.tables["conv"], batch.positions,
                batch.win_out_locs["conv"], q_scale)
            o = self._attend(layer.attn, q.view(q.shape[0], -1, layer.attn.head_dim), k_cache, v_cache, space, batch,
                             rel, prologue)
            return o.reshape(q.shape[0], -1)
        rows = batch.req_slots if batch.mode == ForwardMode.DECODE else self._token_slots(batch, q.shape[0])
        q = self.k_prologue.conv_qk_norm_store(
            q, k, v, layer.q_norm.weight, layer.k_norm.weight, layer.q_norm.eps, layer.k_norm.eps,
            layer.k_conv.weight, layer.v_conv.weight, k_buf, v_buf, self.tables["conv"], rows,
            batch.positions, batch.win_out_locs["conv"], layer.attn.head_dim, q_scale,
            k_cache, v_cache, self._loc(batch, space))
        o = self._attend(layer.attn, q, k_cache, v_cache, space, batch, rel)
        return o.reshape(q.shape[0], -1)

    def _conv_history(self, buf: torch.Tensor, batch: ForwardBatch, k: int, device) -> torch.Tensor:
        """[B, K-1, C]: each sequence's K-1 inputs before its first new token (zeros before the
        sequence start)."""
        idx = batch.extras.get("conv_hist_idx")
        if idx is None:
            prefix = torch.tensor(batch.prefix_lens, device=device)
            pos = prefix[:, None] - (k - 1) + torch.arange(k - 1, device=device)  # [B, K-1]
            valid = pos >= 0
            slots = self.tables["conv"][batch.req_slots[:, None], pos.clamp(min=0)]
            idx = batch.extras["conv_hist_idx"] = (slots, valid)
        slots, valid = idx
        return buf[slots] * valid[..., None].to(buf.dtype)

    # ---- MSA -----------------------------------------------------------------------------
    def msa_attention(self, layer, q, k, v, qI, kI, batch: ForwardBatch) -> torch.Tensor:
        k_cache, v_cache, ki_cache = self._msa_caches(layer)
        self.store_kv(k, v, k_cache, v_cache, batch.out_cache_loc, kI, ki_cache)
        return self._msa(layer, q, qI, k_cache, v_cache, ki_cache, batch)

    def fuses_msa_prologue(self, batch: ForwardBatch) -> bool:
        """Whether `msa_prologue_attention` serves this batch: the kernel path with
        --disable-msa-prologue off (every mode: the prologue is per token)."""
        return self.msa_prologue

    def msa_prologue_attention(self, layer, positions, q, k, v, qI, kI, batch: ForwardBatch) -> torch.Tensor:
        """`msa_attention` from the raw projections: the q/k norms, both RoPEs and the cache write
        of k', v and kI' in one launch (`kiln.kernels.msa_prologue`), then MSA. At decode the same
        launch scores the blocks (their keys are older than this step; unless
        --disable-msa-prologue-scores), and the sparse attention selects from the scores: two
        launches for the whole attention."""
        k_cache, v_cache, ki_cache = self._msa_caches(layer)
        table = self.tables["main"]
        scored = batch.mode == ForwardMode.DECODE and self.msa_prologue_scores  # the scores in the same launch
        scores = (self.k_msa_prologue_scores(table, batch.req_slots, layer.block_size, layer.topk_blocks)
                  if scored else None)
        q, qI, s = self.k_msa_prologue(positions, q, k, v, qI, kI, layer.q_norm.weight, layer.k_norm.weight,
                                       layer.q_norm.eps, layer.k_norm.eps, layer.rotary.cos, layer.rotary.sin,
                                       layer.index_rotary.cos, layer.index_rotary.sin, k_cache, v_cache, ki_cache,
                                       batch.out_cache_loc, scores=scores)
        if not scored:
            return self._msa(layer, q, qI, k_cache, v_cache, ki_cache, batch)
        return self.k_msa.msa_sparse_attention(q, k_cache, v_cache, table, batch.req_slots, positions, None,
                                               layer.block_size, layer.scale, split_counters=self.split_counters,
                                               scores=s, topk_blocks=layer.topk_blocks)

    def _msa_caches(self, layer):
        """The layer's K, V and indexer-key caches, once HiCache copies into them are done."""
        k_cache, v_cache = self.full_kv.layer(layer.layer_id)
        ki_cache = self.index_k.layer(layer.layer_id)
        self.gate.wait(k_cache, v_cache, ki_cache)
        return k_cache, v_cache, ki_cache

    def _msa(self, layer, q, qI, k_cache, v_cache, ki_cache, batch: ForwardBatch) -> torch.Tensor:
        """MSA of this forward's queries over the caches (this forward's K, V and kI already in)."""
        if self.use_kernels:
            if batch.mode == ForwardMode.DECODE:
                return self.k_msa.msa_decode(q, qI, k_cache, v_cache, ki_cache, self.tables["main"], batch.req_slots,
                                             batch.seq_lens_t, layer.block_size, layer.topk_blocks, layer.scale,
                                             q_pos=batch.positions, split_counters=self.split_counters)
            # A tight bound on the blocks any sequence spans keeps the score grid small; a graph's
            # batch has no host lengths (they are placeholders), so its grid spans the context.
            max_len = None if batch.in_graph else max(p + e for p, e in zip(batch.prefix_lens, batch.extend_lens))
            return self.k_msa.msa_extend(q, qI, k_cache, v_cache, ki_cache, self.tables["main"], batch.req_slots,
                                         batch.prefix_lens_t, batch.extend_lens_t, batch.extend_starts_t,
                                         layer.block_size, layer.topk_blocks, layer.scale, max_len=max_len,
                                         split_counters=self.split_counters, q_pos=batch.positions,
                                         row_slots=self._token_slots(batch, q.shape[0]))
        slots = batch.extras.get("req_slots_cpu") or batch.req_slots.tolist()
        return msa_ops.paged_msa_attention(q, qI, k_cache, v_cache, ki_cache, self.tables["main"], slots,
                                           batch.prefix_lens, batch.extend_lens, layer.block_size,
                                           layer.topk_blocks, layer.scale)
