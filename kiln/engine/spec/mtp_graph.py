"""`MTPChainGraph`: the MTP pass of a steady decode round (catch-up + draft chain, all layers)
replayed from one CUDA graph per batch size.

Eagerly, a pass launches every MTP layer's kernels one by one from Python and costs several
milliseconds of host time at batch 1, more than the verify forward it follows. In steady decode
its shape is fixed: after a verify that accepted n_b drafts, request b has c_b = n_b + 1 newly
committed positions [F_b, F_b + c_b) whose entries every layer catches up (all frontiers equal
F_b before the pass), plus, for layers k >= 2, the draft row at sequence index F_b + c_b - 2 fed
with layer k - 1's draft token and hidden state. So each layer's batch is, per request, a block
of R = K + 2 rows: c_b catch-up rows, the draft row right after them, padding after that.

The graph's inputs are per *request*, not per row: the catch-up count c_b, the first stored
position F_b, the committed tokens t_{F_b} .. (K + 1 of room), the conv slots of positions
F_b - 1 .. F_b + K and the sliding-window slots of F_b .. F_b + 2K - 1 (every position a round
of any acceptance can touch), and the request's row. The graph derives every row's token,
position and slots from them on the device (`_rows`). So the catch-up counts and tokens can come
straight from the verify's samples on the device (`run_after_verify`): the pass is queued right
behind the verify without the host reading anything, which is what lets a speculative round run
without a host synchronisation between verify and draft. `run` fills the same inputs from the
host (passes after a mixed or non-uniform step).

Inside the graph the draft token and hidden state of layer k - 1 go into layer k's draft row by
index, each layer's h^k of the catch-up rows is kept for the next layer, and the K draft logits
land in one static tensor. Around each layer's projection and block those steps (with the
embedding, the input norms and the draft head's final norm) take one launch before and one after
(`kiln.ops.mtp_layer_io`, on the kernel path `kiln.kernels.mtp_layer_io`). Under exact
verification of sampled requests (`sampling`, the `--speculative-use-*` flags) each layer also
draws its sampled requests' drafts from q in the graph (`kiln.engine.spec.draft_sampling`), and
the drafts and q rows land in static tensors too. Padding rows (and padding requests, c = 0)
read slot 0 and write to slot 0 of every space (the scratch slots), and have extend length 0 in
attention.

Applies when every request in the pass is ready to decode, its frontiers are at F_b with
1 <= c_b <= K + 1 and its drafts are greedy or drawn from constants alone
(`draft_sampling.eligible`: a penalty counts the earlier drafts, which needs the host between
layers); anything else runs the eager pass (`MTPDrafter.run`), except a late catch-up of up to
`MTPDrafter.max_lag` + K + 1 entries (adaptive plain steps left it), which `catch_up` brings
within K + 1 first: in one replay of the late catch-up graph (the same pass with C = max_lag
catch-up rows per request, no draft rows and no draft heads), or, past that graph's batch sizes,
in replays of this one, K + 1 entries each. A replay reads the layers' weights once whether it
has 4 rows per request or 16, so one replay of the late graph replaces four or five. When the
pass drafts nothing (the lag bound reached during plain steps), the replays take every entry and
no pass follows.

A request that wants fewer than K drafts (at the end of the context) still gets K and uses the
first ones: the draft rows past its pages map to the scratch slot (`_slots_or_scratch`), and a
draft row only ever feeds later draft rows.
The equality of the two is tested on the CPU with a capturer that re-runs the captured function
(tests/engine/test_graph_buffers.py) and on the GPU.
"""

from __future__ import annotations

from typing import Optional

import torch

from kiln.engine.batch import ForwardBatch, ForwardMode, int64_to_device
from kiln.engine.cuda_graph import CudaGraphCapturer, graph_batch_sizes
from kiln.engine.sampler import greedy_ids
from kiln.engine.spec.draft_sampling import DraftSampling
from kiln.ops import mtp_layer_io, mtp_rows


class MTPChainGraph:
    """Per batch size, one graph of the whole MTP pass of `drafter` (an `MTPDrafter`).

    `catch_up_rows` C makes it the late catch-up graph instead: up to C catch-up rows per request
    and nothing drafted (no draft rows, no draft heads; `catch_up` replays it). `sample_seed`
    (not None): sampled requests' drafts are drawn in the graph (`DraftSampling`, its stream for
    unseeded requests seeded with it), and a pass returns (logits, drafts [K, n], q [K, n, V])."""

    def __init__(self, drafter, max_bs: int, catch_up_rows: Optional[int] = None, sample_seed: Optional[int] = None):
        self.drafter = drafter
        self.K = drafter.num_layers
        self.drafts = catch_up_rows is None
        self.C = self.K + 1 if self.drafts else catch_up_rows  # catch-up rows per request
        self.R = self.C + 1 if self.drafts else self.C  # rows per request per layer (+ the draft row)
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        dev = drafter.runner.device
        n, K = self.max_bs, self.K
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=dev)  # noqa: E731
        # Per request (padding requests: all 0)
        self.count = z(n)  # c_b: catch-up rows (committed positions F_b .. F_b + c_b - 1)
        self.first = z(n)  # F_b
        self.tokens = z(n, self.R)  # t_{F_b + i} for i < c_b (the draft row's column stays 0)
        self.conv_slots = z(n, self.C + 1)  # conv slot of positions F_b - 1 .. F_b + C - 1
        # draft rows reach position F_b + 2K - 1; the late graph's rows F_b + C - 1
        self.swa_width = max(2 * K, self.R) if self.drafts else self.C
        self.swa_slots = z(n, self.swa_width)  # sliding-window slot of positions F_b .. F_b + swa_width - 1
        self.req_slots = z(n)
        self.zeros = z(n)
        self.starts = torch.arange(n, dtype=torch.int64, device=dev) * self.R
        self.graphs: dict[int, tuple] = {}
        self._ptrs: Optional[tuple] = None
        self.late: Optional[MTPChainGraph] = None  # the late catch-up graph (`MTPDrafter.use_graphs`)
        self.sampling = DraftSampling(n, K, dev, sample_seed) if self.drafts and sample_seed is not None else None
        self.chain_rows, self.layer_io = mtp_rows.chain_rows, mtp_layer_io
        if drafter.runner.backend.use_kernels:  # imported only here: the CPU build of torch ships without Triton
            from kiln.kernels import mtp_layer_io as layer_io_kernels
            from kiln.kernels.mtp_rows import chain_rows
            self.chain_rows, self.layer_io = chain_rows, layer_io_kernels
        # Each layer's inputs and outputs in one launch each side (`layer_io`), which gathers from the
        # whole embedding: one rank's. Under tensor parallelism the vocabulary-parallel embedding's
        # module runs, and the steps around each layer are PyTorch's.
        embed = drafter.model.model.embed_tokens
        self.fused_io = getattr(getattr(embed, "pc", None), "tp_size", 1) == 1

    # ---- capture -----------------------------------------------------------------------------
    def _addresses(self) -> tuple:
        """Addresses the graphs were captured with: the state pools', and the weights' (RL's
        release + resume of the weights alone moves them while the pools stay)."""
        d = self.drafter
        return (d.site(0).data_ptr(), d.runner.swa_kv.layer(d.layers[0].block.self_attn.attn.layer_id)[0].data_ptr(),
                d.model.lm_head.weight.data_ptr(), next(d.layers[0].parameters()).data_ptr())

    @torch.inference_mode()
    def capture(self, capturer=None) -> None:
        """Capture every batch size, largest first (one memory pool); a recapture (after a
        memory release) without warm-ups, as `CudaGraphRunner` does."""
        capturer = capturer or CudaGraphCapturer(self.drafter.runner.device, warmups=0 if self.graphs else 2)
        self.graphs = {}
        for bs in reversed(self.sizes):
            replay, logits = capturer.capture(lambda bs=bs: self._chain(bs))
            self.graphs[bs] = (replay, logits)
        capturer.done(self.sizes)
        self._ptrs = self._addresses()

    def _rows(self, bs: int) -> dict[str, torch.Tensor]:
        """Every row's inputs from the per-request tables of the first `bs` requests
        (`kiln.ops.mtp_rows.chain_rows`: flattened [bs * R] per row, [K, ...] per layer), in one
        launch on the kernel path."""
        return self.chain_rows(self.count[:bs], self.first[:bs], self.tokens[:bs], self.conv_slots[:bs],
                               self.swa_slots[:bs], self.req_slots[:bs], self.K, self.R, self.drafts)

    def _chain(self, bs: int):
        """The pass on the static buffers of the first `bs` requests -> logits [K, bs, N] (fp32)
        over the draft vocabulary (`DraftVocab`: N = V without a token map); with `sampling`,
        (logits, drafts [K, bs], q [K, bs, V]); None for the late catch-up graph."""
        d, R = self.drafter, self.R
        rows = self._rows(bs)
        prev_tok = prev_h = None
        out_logits, out_tokens, out_q = [], [], []
        for k, layer in enumerate(d.layers, start=1):
            draft = k > 1 and self.drafts  # layer k - 1's draft token and hidden state feed layer k's draft row
            if self.fused_io:
                assert layer.enorm.eps == layer.hnorm.eps, (layer.enorm.eps, layer.hnorm.eps)
                x, ids = self.layer_io.layer_inputs(
                    d.model.model.embed_tokens.weight, rows["ids"], d.site(k - 1), rows["hid"], layer.enorm.weight,
                    layer.hnorm.weight, layer.enorm.eps,
                    **(dict(draft_row=rows["draft_row"], prev_tok=prev_tok, prev_h=prev_h) if draft else {}))
            else:
                ids, h_prev = rows["ids"], d.site(k - 1)[rows["hid"]]
                if draft:
                    # a `where` and an in-place copy into the fresh gather: an out-of-place index_copy
                    # would clone first, a memcpy node in the graph
                    ids = torch.where(rows["draft_row"], prev_tok.to(ids.dtype)[:, None], ids.view(bs, R)).view(-1)
                    h_prev.index_copy_(0, rows["draft_in"], prev_h.to(h_prev.dtype))
            ext = rows["ext"][k - 1]
            batch = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=ids, positions=rows["pos"][k - 1],
                                 prefix_lens=[0] * bs, extend_lens=[R] * bs, logits_indices=ids[:0],
                                 req_slots=self.req_slots[:bs], out_cache_loc=None,
                                 win_out_locs={"swa": rows["swa"][k - 1]}, backend=d.runner.backend, in_graph=True)
            batch.prefix_lens_t, batch.seq_lens_t = self.zeros[:bs], ext
            batch.extend_lens_t, batch.extend_starts_t, batch.max_extend_len = ext, self.starts[:bs], R
            batch.extras["token_slots"] = rows["token_slots"]
            # h^k of the catch-up rows goes to the site layer k + 1 reads (other rows: scratch slot 0)
            site = d.site(k) if k < self.K else None
            if self.fused_io:
                _, prev_h, normed = self.layer_io.layer_outputs(
                    *layer.project(x, batch), site, rows["keep"], rows["draft_out"][k - 1] if self.drafts else None,
                    layer.final_norm.weight, layer.final_norm.eps)
            else:
                emb = d.model.model.embed_tokens(ids)
                out = layer(emb, h_prev.to(emb.dtype), batch)
                if site is not None:
                    site[rows["keep"]] = out.to(site.dtype)
                if self.drafts:
                    prev_h = out.index_select(0, rows["draft_out"][k - 1])
                    normed = layer.final_norm(prev_h, batch)
            if not self.drafts:
                continue
            logits = d.vocab.logits(normed, batch)  # over the draft vocabulary
            prev_tok = d.vocab.tokens(greedy_ids(logits))
            out_logits.append(logits)
            if self.sampling is not None:
                prev_tok, q = self.sampling.draw(k - 1, d.vocab.full(logits), prev_tok)
                out_tokens.append(prev_tok)
                out_q.append(q)
        if not self.drafts:
            return None
        if self.sampling is not None:
            return torch.stack(out_logits), torch.stack(out_tokens), torch.stack(out_q)
        return torch.stack(out_logits)

    # ---- one pass ----------------------------------------------------------------------------
    def can_run(self, reqs, num_drafts: dict[str, int], behind: Optional[int] = None) -> bool:
        """Whether one pass on the graph serves `reqs`: every request decodes, its frontiers are
        equal and 1 .. `behind` (default K + 1: what one pass catches up) committed tokens back."""
        if not self.graphs or not reqs or len(reqs) > self.max_bs:
            return False
        behind = self.K + 1 if behind is None else behind
        for r in reqs:
            f = r.spec.frontier
            T = r.seq_len
            if (r.rid not in num_drafts or r.num_computed != T - 1 or any(x != f[0] for x in f)
                    or not 1 <= T - f[0] <= behind):
                return False
        return True

    def catch_up(self, reqs, leave: int) -> int:
        """A late catch-up (`MTPDrafter.max_lag`: passes that drafted nothing left it) on graphs
        instead of one eager pass, which launches every layer's kernels from Python (several
        milliseconds of host time): while a request's frontiers are more than `leave` (K + 1: what
        the pass that drafts next takes) committed tokens back, replay a pass with all
        but its last `leave` entries as catch-up rows, at most C per replay (requests already
        within reach are padding, c = 0), and move its frontiers on. `leave` = 0 when no pass
        follows (nobody drafts).
        The late catch-up graph (`self.late`, C = max_lag) does it in one replay; past its batch
        sizes this graph does, K + 1 entries a replay, as a steady round's pass whose drafts go
        unused like a rejected round's (their K/V sits past the caught-up entries, hidden by the
        key gap until a later pass overwrites it). `can_run` must hold for `behind` = any lag.
        Returns how many replays ran; `run` then serves the last `leave`."""
        K, passes = self.K, 0
        assert 0 <= leave <= K + 1, leave
        g = self.late if self.late is not None and len(reqs) <= self.late.max_bs else self
        while True:
            first = [r.spec.frontier[0] for r in reqs]
            counts = [min(max(r.seq_len - F - leave, 0), g.C) for r, F in zip(reqs, first)]
            if not any(counts):
                return passes
            host = g._tables(reqs, first)
            host["count"] = counts
            host["tokens"] = []
            for r, F, n in zip(reqs, first, counts):
                host["tokens"] += r.token_ids(F, F + n) + [0] * (g.C - n)
            g._pass(len(reqs), host)  # drafts nothing anyone reads: every row takes the argmax
            for r, F, n in zip(reqs, first, counts):
                if n:
                    r.spec.frontier = [F + n] * K
            passes += 1

    def _tables(self, reqs, first: list[int]) -> dict[str, list[int]]:
        """The host's per-request inputs (request b's first stored position `first[b]`): slots of
        every position a round can touch, the scratch slot 0 where the request has no page (only
        draft rows it does not use land there)."""
        K, ps = self.K, self.drafter.page_size
        conv, swa, slots = [], [], []
        for r, F in zip(reqs, first):
            conv += _slots_or_scratch(r.win_pages["conv"], F - 1, F + self.C, ps)
            swa += _slots_or_scratch(r.win_pages["swa"], F, F + self.swa_width, ps)
            slots.append(r.slot)
        return {"first": first, "conv": conv, "swa": swa, "slots": slots}

    def _pass(self, n: int, host: dict[str, list[int]], count=None, tokens=None, reqs=None):
        """Copy the host tables (one transfer) and the counts / tokens (from `host` when None)
        into the static inputs of the smallest captured size >= n (the rest are padding
        requests), and with `sampling` the sampling inputs of `reqs` (None: every row argmax),
        replay, and return the draft logits [K, n, N] (with `sampling`: (logits, drafts, q)),
        views of static tensors: read them before the next replay; None for the late catch-up
        graph."""
        if self._ptrs != self._addresses():  # pools or weights were reallocated (RL release / resume)
            self.capture()
        C = self.C
        bs = next(s for s in self.sizes if s >= n)
        t = int64_to_device(host, self.drafter.runner.device)
        # one multi-tensor copy (see CudaGraphRunner.replay); the tokens' rows are strided
        torch._foreach_copy_([self.first[:n], self.conv_slots[:n], self.swa_slots[:n], self.req_slots[:n], self.count[:n]],
                             [t["first"], t["conv"].view(n, C + 1), t["swa"].view(n, self.swa_width), t["slots"],
                              t["count"] if count is None else count])
        self.tokens[:n, :C].copy_(t["tokens"].view(n, C) if tokens is None else tokens)
        if bs > n:
            torch._foreach_zero_([self.count[n:bs], self.req_slots[n:bs]])
        if self.sampling is not None:
            self.sampling.fill(reqs, bs)
        replay, out = self.graphs[bs]
        # a replay cannot wait between layers: HiCache copies of pages the pass writes (backups of
        # pages evicted to grow this round's) must land first, as before the verify's replay
        self.drafter.runner.load_gate.wait_all()
        replay()
        if isinstance(out, tuple):
            return tuple(o[:, :n] for o in out)
        return out[:, :n] if out is not None else None

    def run(self, reqs):
        """Fill the inputs for `reqs` (`can_run` said yes) from the host, replay, advance the
        frontiers to T and return the draft logits [K, len(reqs), N] (with `sampling`: (logits,
        drafts, q); views of static tensors: read them before the next replay)."""
        K = self.K
        first = [r.spec.frontier[0] for r in reqs]
        host = self._tables(reqs, first)
        host["count"] = [r.seq_len - F for r, F in zip(reqs, first)]
        host["tokens"] = []
        for r, F in zip(reqs, first):
            ids = r.token_ids(F, r.seq_len)
            host["tokens"] += ids + [0] * (self.C - len(ids))
        out = self._pass(len(reqs), host, reqs=reqs)
        for r in reqs:
            r.spec.frontier = [r.seq_len] * K
        return out

    def run_after_verify(self, reqs, tokens: torch.Tensor, count: torch.Tensor):
        """The pass right after a verify that is still on the device: request b (seq_len L_b, L_b - 1
        computed, frontiers at L_b, pages up to L_b + 2K or more) committed `count[b]` tokens
        `tokens[b, :count[b]]` ([n, K + 1] and [n] on the device). Nothing is read on the host;
        the caller advances the frontiers once it knows the counts. Returns what `run` returns."""
        return self._pass(len(reqs), self._tables(reqs, [r.seq_len for r in reqs]), count=count, tokens=tokens,
                          reqs=reqs)


def _slots_or_scratch(view: list, start: int, end: int, page_size: int) -> list[int]:
    """The token slots of positions [start, end) in a page view (`page_slot`), and the scratch
    slot 0 for a position before 0, past the request's pages or on a trimmed page: one range per
    page (the host builds these for every request of every round)."""
    out: list[int] = []
    pos = start
    while pos < end:
        if pos < 0:
            out.append(0)
            pos += 1
            continue
        i, off = divmod(pos, page_size)
        n = min(page_size - off, end - pos)
        if i >= len(view) or view[i] is None:
            out.extend([0] * n)
        else:
            base = view[i] * page_size + off
            out.extend(range(base, base + n))
        pos += n
    return out
