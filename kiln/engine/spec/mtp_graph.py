"""`MTPChainGraph`: the MTP pass of a steady decode round (catch-up + draft chain, all layers)
replayed from one CUDA graph per batch size.

Eagerly, a pass launches every MTP layer's kernels one by one from Python and costs several
milliseconds of host time at batch 1, more than the verify forward it follows. In steady decode
its shape is fixed: after a verify that accepted n_b drafts, request b has c_b = n_b + 1 newly
committed positions [F_b, T_b) whose entries every layer catches up (all frontiers equal F_b
before the pass), plus, for layers k >= 2, the draft row at sequence index T_b - 2 fed with
layer k - 1's draft token and hidden state. So each layer's batch is, per request, a block of
R = K + 2 rows: c_b catch-up rows, the draft row right after them, padding after that.

Static buffers hold, per request and row, what the host knows (catch-up tokens, positions,
sliding-window slots, the conv slots the hidden states are read from and kept in, the draft row
index); the graph does the rest on the device: the draft token and hidden state of layer k - 1
go into layer k's draft row by index, each layer's h^k of the catch-up rows is kept for the next
layer, and the K draft logits land in one static tensor. Padding rows read slot 0 and write to
slot 0 of every space (the scratch slots), and have extend length 0 in attention.

Applies when every request in the pass drafts K tokens from frontiers at F_b with 1 <= T_b - F_b
<= K + 1 and greedy drafts (sampled drafts need the host between layers); anything else runs
the eager pass (`MTPDrafter.run`). The equality of the two is tested on the CPU with a capturer
that re-runs the captured function (tests/engine/test_graph_buffers.py) and on the GPU.
"""

from __future__ import annotations

from typing import Optional

import torch

from kiln.engine.batch import ForwardBatch, ForwardMode
from kiln.engine.cuda_graph import CudaGraphCapturer, graph_batch_sizes
from kiln.engine.spec.mtp_drafter import page_slot


class MTPChainGraph:
    """Per batch size, one graph of the whole MTP pass of `drafter` (an `MTPDrafter`)."""

    def __init__(self, drafter, max_bs: int):
        self.drafter = drafter
        self.K = drafter.num_layers
        self.R = self.K + 2  # rows per request per layer: up to K + 1 catch-up rows and the draft row
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        dev = drafter.runner.device
        n, rows = self.max_bs, self.max_bs * self.R
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=dev)  # noqa: E731
        self.ids = z(rows)  # catch-up tokens (draft rows filled on the device)
        self.hid_locs = z(rows)  # conv slot of h^{k-1} at p - 1 (catch-up rows)
        self.keep_locs = z(rows)  # conv slot that keeps h^k at p (catch-up rows; others: scratch 0)
        self.pos = z(self.K, rows)  # per layer: sequence index of each row
        self.swa_locs = z(self.K, rows)  # per layer: sliding-window slot of each row
        self.ext = z(self.K, n)  # per layer: rows per request (0 for padding requests)
        self.draft_out = z(self.K, n)  # per layer: the row whose output is the draft's hidden state
        self.draft_in = z(n)  # the draft row of layers k >= 2
        self.req_slots = z(n)
        self.token_slots = z(rows)  # the request row of every row (padding: 0)
        self.zeros = z(n)
        self.starts = torch.arange(n, dtype=torch.int64, device=dev) * self.R
        self.graphs: dict[int, tuple] = {}
        self._ptrs: Optional[tuple] = None

    # ---- capture -----------------------------------------------------------------------------
    def _pool_ptrs(self) -> tuple:
        d = self.drafter
        return (d.site(0).data_ptr(), d.runner.swa_kv.layer(d.layers[0].block.self_attn.attn.layer_id)[0].data_ptr())

    @torch.inference_mode()
    def capture(self, capturer=None) -> None:
        """Capture every batch size, largest first (one memory pool)."""
        capturer = capturer or CudaGraphCapturer(self.drafter.runner.device)
        self.graphs = {}
        for bs in reversed(self.sizes):
            replay, logits = capturer.capture(lambda bs=bs: self._chain(bs))
            self.graphs[bs] = (replay, logits)
        capturer.done(self.sizes)
        self._ptrs = self._pool_ptrs()

    def _chain(self, bs: int) -> torch.Tensor:
        """The pass on the static buffers of the first `bs` requests -> logits [K, bs, V] (fp32)."""
        d, R = self.drafter, self.R
        rows = bs * R
        prev_tok = prev_h = None
        out_logits = []
        for k, layer in enumerate(d.layers, start=1):
            ids, h_prev = self.ids[:rows], d.site(k - 1)[self.hid_locs[:rows]]
            if k > 1:  # layer k - 1's draft token and hidden state feed layer k's draft row
                ids = ids.index_copy(0, self.draft_in[:bs], prev_tok)
                h_prev = h_prev.index_copy(0, self.draft_in[:bs], prev_h.to(h_prev.dtype))
            batch = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=ids, positions=self.pos[k - 1, :rows],
                                 prefix_lens=[0] * bs, extend_lens=[R] * bs, logits_indices=ids[:0],
                                 req_slots=self.req_slots[:bs], out_cache_loc=None,
                                 win_out_locs={"swa": self.swa_locs[k - 1, :rows]}, backend=d.runner.backend)
            batch.prefix_lens_t, batch.seq_lens_t = self.zeros[:bs], self.ext[k - 1, :bs]
            batch.extend_lens_t, batch.extend_starts_t, batch.max_extend_len = self.ext[k - 1, :bs], self.starts[:bs], R
            batch.extras["token_slots"] = self.token_slots[:rows]
            emb = d.model.model.embed_tokens(ids)
            out = layer(emb, h_prev.to(emb.dtype), batch)
            if k < self.K:  # h^k of the catch-up rows, for layer k + 1 (other rows: scratch slot 0)
                d.site(k)[self.keep_locs[:rows]] = out.to(d.site(k).dtype)
            prev_h = out.index_select(0, self.draft_out[k - 1, :bs])
            logits = d.model.lm_head.compute_logits(layer.final_norm(prev_h)).float()
            prev_tok = logits.argmax(dim=-1)
            out_logits.append(logits)
        return torch.stack(out_logits)

    # ---- one pass ----------------------------------------------------------------------------
    def can_run(self, reqs, num_drafts: dict[str, int]) -> bool:
        if not self.graphs or not reqs or len(reqs) > self.max_bs:
            return False
        K = self.K
        for r in reqs:
            f = r.spec.frontier
            T = r.seq_len
            if (num_drafts.get(r.rid, 0) != K or r.num_computed != T - 1 or any(x != f[0] for x in f)
                    or not 1 <= T - f[0] <= K + 1):
                return False
        return True

    def run(self, reqs) -> torch.Tensor:
        """Fill the buffers for `reqs` (`can_run` said yes), replay, advance the frontiers to T and
        return the draft logits [K, len(reqs), V] (a view of a static tensor: read it before the
        next replay)."""
        d, K, R, ps = self.drafter, self.K, self.R, self.drafter.page_size
        if self._ptrs != self._pool_ptrs():  # the pools were reallocated (RL release / resume)
            self.capture()
        n = len(reqs)
        bs = next(s for s in self.sizes if s >= n)
        ids, hid, keep = [0] * (bs * R), [0] * (bs * R), [0] * (bs * R)
        pos, swa = [[0] * (bs * R) for _ in range(K)], [[0] * (bs * R) for _ in range(K)]
        ext, dout = [[0] * bs for _ in range(K)], [[0] * bs for _ in range(K)]
        # Padding requests point their draft rows into their own (all-padding) block: an index
        # shared with a live request's row would race in the index_copy.
        din, slots, tok_slots = [b * R + R - 1 for b in range(bs)], [0] * bs, [0] * (bs * R)
        for k in range(K):
            dout[k] = [b * R for b in range(bs)]
        for b, r in enumerate(reqs):
            F, T = r.spec.frontier[0], r.seq_len
            c, base = T - F, b * R
            conv, swa_view = r.win_pages["conv"], r.win_pages["swa"]
            ids[base:base + c] = r.token_ids(F, T)
            for i, p in enumerate(range(F, T)):
                hid[base + i] = page_slot(conv, p - 1, ps)
                keep[base + i] = page_slot(conv, p, ps)
            slots[b], din[b] = r.slot, base + c
            tok_slots[base:base + R] = [r.slot] * R
            for k in range(1, K + 1):
                for i, p in enumerate(range(F, T)):
                    pos[k - 1][base + i] = p - k
                    swa[k - 1][base + i] = page_slot(swa_view, p, ps)
                if k >= 2:  # the draft row at index T - 2, stored at T - 2 + k
                    pos[k - 1][base + c] = T - 2
                    swa[k - 1][base + c] = page_slot(swa_view, T - 2 + k, ps)
                ext[k - 1][b] = c + (k >= 2)
                dout[k - 1][b] = base + c - (k == 1)
        host = torch.tensor(ids + hid + keep + din + slots + sum(pos, []) + sum(swa, []) + sum(ext, [])
                            + sum(dout, []) + tok_slots, dtype=torch.int64)
        if host.device.type != d.runner.device.type:
            host = host.pin_memory() if d.runner.device.type == "cuda" else host
        flat = host.to(d.runner.device, non_blocking=True)
        m = bs * R
        parts = flat.split([m, m, m, bs, bs, K * m, K * m, K * bs, K * bs, m])
        for dst, src in ((self.ids[:m], parts[0]), (self.hid_locs[:m], parts[1]), (self.keep_locs[:m], parts[2]),
                         (self.draft_in[:bs], parts[3]), (self.req_slots[:bs], parts[4]),
                         (self.pos[:, :m], parts[5].view(K, m)), (self.swa_locs[:, :m], parts[6].view(K, m)),
                         (self.ext[:, :bs], parts[7].view(K, bs)), (self.draft_out[:, :bs], parts[8].view(K, bs)),
                         (self.token_slots[:m], parts[9])):
            dst.copy_(src)
        replay, logits = self.graphs[bs]
        replay()
        for r in reqs:
            r.spec.frontier = [r.seq_len] * K
        return logits[:, :n]

