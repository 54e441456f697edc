"""`PagedBlockPass`: a block drafter's pass (DFlash, DSpark) on the engine's kernel path, replayed
from one CUDA graph per batch size.

The reference path (`BlockDraftRunner._draft_padded`) gathers every request's context K/V from
the pool into a [requests, longest context] tensor per layer and runs padded SDPA: its shapes
change with the context, so it runs eagerly, and at batch 1 the host spent ~3.4 ms per pass
launching its small PyTorch ops (H200, Inkling `bench`, a 1-layer drafter; docs/speculative.md).

Here the block's own K/V go into the drafter's page space (`DRAFT_KV`) at the block's positions
anchor .. anchor + B - 1, right after the context K/V of the committed positions < anchor. Then
every block row attends to keys 0 .. anchor + B - 1 of its request, all of them (the block is
bidirectional): the decode attention of one query row per block row with seq_len = anchor + B,
which `kiln.kernels.block_attention` computes with a block's rows in one program, reading the
request's K/V once per block (not once per row). Nothing depends on the context length but the
kernel's loop bounds, so the pass is captured once per batch size, its inputs per *request*
(anchor token, anchor position, request row) in static buffers, every row's token, position and
slot derived on the device.

Why writing the block rows into the pool is safe: positions >= anchor = `num_computed` are past
the committed prefix. The next target forward stores the context K/V of every row it computes
(`block_drafter.store_context`, inside the forward) before any block reads them, and a later block reads the
context below its own anchor, which is again the committed length, and its own rows, which it
writes first. The request's pages must cover anchor + B
positions (`pages_needed`), so the writes land in its own pages; padding requests write the
scratch slot 0 and read the padding row 0 of the page table.

The drafts stay on the device (`DraftsInFlight`): the next verify gathers them there, and the
host reads them back only to verify, after that forward is queued. A sampled request under exact
verification takes this pass too, its drafts drawn from the pass's logits on the host
(`BlockDraftRunner._draft_paged`); a request whose block would reach past the context or lacks the
pages for it takes the reference path, and so does every request with DFlash2's candidate
selector. In a steady round on the device (`SpecDecoder._device_round`) the anchors come from the
verify's acceptance counts on the device instead of the host (`run_after_verify`).

Under exact verification (the owner's `sampling`, a `DraftSampling`) the sampled requests' K
drafts are drawn from the pass's logits, and their q rows kept, by launches right after the pass's
replay (`DraftSampling.draw_block`: all K positions in one launch per kernel, ~13 launches; their
inputs, each request's draw keys taken from its stream after the verify's, are set while the pass
runs). Rows that do not draw (greedy requests, padding) take the argmax. The draws were a graph of
their own from 9eabcaa, and inside the pass's graph from c95c8ce, when they were ~30 launches
and a batch-1 round waited on the host for them; but from c95c8ce on, the graph replays after
them (the next verify's, mostly) ran without programmatic dependent launch's overlap, ~0.3 us
more per kernel, though they kept their programmatic edges (why is not known). Eager again:
sampled DFlash K = 3 rounds 5.58 -> 5.42 ms at batch 8, 2.69 -> 2.71 at batch 1, on an H100
(docs/benchmarks.md, forty-third pass). The capture runs them once per batch size, so that their
Triton kernels compile there and not in the first sampled round.
"""

from __future__ import annotations

from typing import Optional

import torch

from kiln.engine.batch import int64_to_device
from kiln.engine.cuda_graph import CudaGraphCapturer, graph_batch_sizes
from kiln.engine.request import Req
from kiln.engine.sampler import greedy_ids


class LayerRoute:
    """Stands in for a `ForwardBatch` where the drafter's layers only ask which path to take:
    `kiln.kernels.kernel_path` and the GEMV route read `batch.backend`."""

    def __init__(self, backend):
        self.backend = backend


class PagedBlockPass:
    """The block pass of a `BlockDraftRunner` on the kernel path: eager, or from CUDA graphs after
    `capture`."""

    def __init__(self, owner, max_bs: int):
        self.owner = owner  # the BlockDraftRunner: its drafter, pool, page table and draft head
        runner = owner.runner
        self.route = LayerRoute(runner.backend)
        self.block_size = owner.block_size
        self.K = owner.num_steps
        self.context_length = runner.context_length
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        z = lambda n: torch.zeros(n, dtype=torch.int64, device=runner.device)  # noqa: E731
        # Per request (padding requests: all 0)
        self.anchor_ids, self.anchor_pos, self.req_slots, self.live = (z(self.max_bs) for _ in range(4))
        self.offsets = torch.arange(self.block_size, dtype=torch.int64, device=runner.device)
        self.graphs: dict[int, tuple] = {}
        self._ptrs: Optional[tuple] = None

    # ---- the pass on the static buffers -----------------------------------------------------------
    def _buffers(self) -> tuple[torch.Tensor, ...]:
        return self.anchor_ids, self.anchor_pos, self.req_slots, self.live

    def _block(self, bs: int, inputs: Optional[tuple[torch.Tensor, ...]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks of the first `bs` requests of the static buffers (or of `inputs`, tensors
        like them) -> (drafts [bs, K] token ids, their logits [bs, K, N] over the draft
        vocabulary, processed as `BlockDrafter.process_logits` does)."""
        o = self.owner
        drafter, pool, table = o.drafter, o.pool, o.table
        B, K = self.block_size, self.K
        anchor_ids, anchor_pos, req_slots, live = (t[:bs, None] for t in (inputs or self._buffers()))
        pos = anchor_pos + self.offsets  # [bs, B]
        # contiguous: the kernels index these with stride 1 (at bs 1 a reshaped expand would
        # stay a stride-0 view)
        rows = req_slots.expand(bs, B).contiguous()
        # A live request's pages cover its block (`can_run`); padding writes the scratch slot 0
        # and reads the page table's padding row 0.
        slots = torch.where(live > 0, table[rows, pos], 0).view(-1)
        seq_lens = (anchor_pos + B).expand(bs, B).contiguous().view(-1)
        ids = torch.where(self.offsets == 0, anchor_ids, drafter.config.mask_token_id)
        rows, pos = rows.view(-1), pos.view(-1)
        emb = o.target.model.embed_tokens(ids.reshape(-1))
        scale = drafter.config.head_dim ** -0.5
        from kiln.kernels.block_attention import block_attention
        from kiln.kernels.kv_store import store_kv

        def layer_cache(i: int):
            k_cache, v_cache = pool.layer(i)
            return (lambda k, v: store_kv(k, v, k_cache, v_cache, slots),
                    lambda q: block_attention(q, k_cache, v_cache, table, rows, seq_lens, scale, B))

        h = drafter.forward_paged(emb.to(drafter.fc.weight.dtype), pos, self.route,
                                  [layer_cache(i) for i in range(len(drafter.layers))])
        h = h.view(bs, B, -1)[:, 1:K + 1].reshape(bs * K, -1)
        logits = drafter.process_logits(o.vocab.logits(h.to(emb.dtype))).view(bs, K, -1)
        return o.vocab.tokens(greedy_ids(logits)), logits

    def _draws(self, tokens: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A pass's drafts with the sampled rows' drawn from q (the owner's `DraftSampling`, filled
        for these rows) [bs, K], and q [bs, K, V]. Positions do not depend on each other's drafts:
        each draws from its own logits, with its own key, all K in one launch per kernel
        (`DraftSampling.draw_block`)."""
        o = self.owner
        return o.sampling.draw_block(o.vocab.full(logits), tokens)

    # ---- capture ------------------------------------------------------------------------------
    def _addresses(self) -> tuple:
        """What the graphs read by address: the pool, the page table and the weights (RL's release
        + resume of the weights alone moves them)."""
        o = self.owner
        return (o.pool.layer(0)[0].data_ptr(), o.table.data_ptr(), o.target.lm_head.weight.data_ptr(),
                o.drafter.fc.weight.data_ptr())

    @torch.inference_mode()
    def capture(self, capturer=None) -> None:
        """Capture every batch size, largest first (one memory pool); a recapture (after a memory
        release) without warm-ups, as `CudaGraphRunner` does. Under exact verification (`draws`)
        the eager draws run once per batch size too, on padding rows, to compile their kernels."""
        first = not self.graphs
        capturer = capturer or CudaGraphCapturer(self.owner.runner.device, warmups=0 if self.graphs else 2)
        self.graphs = {}
        for buf in self._buffers():
            buf.zero_()  # warm-up and capture run on padding requests (scratch slot 0)
        for bs in reversed(self.sizes):
            self.graphs[bs] = capturer.capture(lambda bs=bs: self._block(bs))
        capturer.done(self.sizes)
        if self.draws and first:  # on a replay's logits (a capture leaves its outputs unwritten)
            self.owner.sampling.fill(None, self.max_bs)  # padding rows: argmax
            for bs, (replay, out) in self.graphs.items():
                replay()
                self._draws(*out)
        self._ptrs = self._addresses()

    @property
    def draws(self) -> bool:
        """Whether sampled drafts are drawn after the pass (the owner holds a `DraftSampling`)."""
        return self.owner.sampling is not None

    # ---- one pass -----------------------------------------------------------------------------
    def can_run(self, reqs: list[Req]) -> bool:
        """Whether `reqs` can draft here: every one ready to decode, with pages for its whole block
        inside the context (the pool and page-table writes), and nothing that needs the host
        between positions (sampled drafts, DFlash2's selector: the caller checks those)."""
        B, ps = self.block_size, self.owner.runner.page_size
        for r in reqs:
            a = r.num_computed
            if a != r.seq_len - 1 or a + B > self.context_length or a + B > len(r.pages) * ps:
                return False
        return bool(reqs)

    @torch.inference_mode()
    def run(self, reqs: list[Req]) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft for `reqs` (`can_run` said yes): (drafts [n, K], logits [n, K, N]). From a graph
        when one is captured for a batch size >= n (views of static tensors: read them before the
        next pass), else eagerly."""
        n = len(reqs)
        if self.graphs and self._ptrs != self._addresses():  # pools or weights were reallocated
            self.capture()
        t = int64_to_device({"ids": [r.token_ids(r.seq_len - 1, r.seq_len)[0] for r in reqs],
                             "pos": [r.num_computed for r in reqs], "slots": [r.slot for r in reqs],
                             "live": [1] * n}, self.anchor_ids.device)
        inputs = (t["ids"], t["pos"], t["slots"], t["live"])
        bs = next((s for s in self.sizes if s >= n), None) if self.graphs else None
        if bs is None and n > self.max_bs:  # eager, wider than the static buffers: its own inputs
            return self._block(n, inputs)
        self._load(n, bs or n, inputs)
        return self._block(n) if bs is None else self._replay(n, bs)

    @torch.inference_mode()
    def run_after_verify(self, reqs: list[Req], samples: torch.Tensor, count: torch.Tensor,
                         sampled: bool = False) -> tuple:
        """`run` right after a verify still on the device, from a graph: request b (seq_len L_b,
        pages covering L_b + K + B positions) committed the first `count[b]` of `samples[b]`
        ([n, K + 1] and [n] on the device), so its anchor is position L_b - 1 + count[b] with the
        token samples[b, count[b] - 1]. Nothing is read on the host. Returns (drafts, logits), or
        with `sampled` (under exact verification: `draws`) (drafts with the sampled requests'
        drawn [n, K], logits, q [n, K, V]), each request's K draws taken from its stream."""
        n = len(reqs)
        assert self.graphs and n <= self.max_bs, (n, self.max_bs)
        ps = self.owner.runner.page_size  # a block at any count writes up to L_b + K + B - 2
        reach = [r.seq_len + self.K + self.block_size - 1 for r in reqs]
        assert all(len(r.pages) * ps >= n for r, n in zip(reqs, reach)), "past a request's pages"
        if self._ptrs != self._addresses():
            self.capture()
        t = int64_to_device({"pos": [r.seq_len - 1 for r in reqs], "slots": [r.slot for r in reqs],
                             "live": [1] * n}, self.anchor_ids.device)
        anchor = samples.gather(1, (count - 1)[:, None])[:, 0].long()
        bs = next(s for s in self.sizes if s >= n)
        self._load(n, bs, (anchor, t["pos"] + count, t["slots"], t["live"]))
        assert self.draws or not sampled, "sampled drafts need the owner's sampling (exact verification)"
        tokens, logits = self._replay(n, bs)
        if not sampled:
            return tokens, logits
        self.owner.sampling.fill(reqs, bs)  # after the pass's launch: the host works while it runs
        drafts, q = self._draws(*self.graphs[bs][1])  # eager: the module docstring says why
        return drafts[:n], logits, q[:n]

    def _load(self, n: int, width: int, inputs: tuple[torch.Tensor, ...]) -> None:
        """The first n requests' inputs into the static buffers in one multi-tensor copy (see
        CudaGraphRunner.replay), padding requests up to `width`."""
        bufs = self._buffers()
        torch._foreach_copy_([b[:n] for b in bufs], list(inputs))
        if width > n:
            torch._foreach_zero_([b[n:width] for b in bufs])

    def _replay(self, n: int, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        replay, (tokens, logits) = self.graphs[bs]
        self.owner.runner.load_gate.wait_all()  # HiCache copies land first (`MTPChainGraph._pass`)
        replay()
        return tokens[:n], logits[:n]
