"""`MTPDrafter`: a model's chained MTP layers (MODELS.md 2.4; Inkling, or a Llama-family checkpoint
with `num_mtp_layers`, see `kiln.models.mtp`) as a drafter inside the engine.

Coordinates. MTP layer k's entry for sequence index j depends on the tokens up to t_{j+k} (its
input token) and nothing later, so the engine *stores* it at position p = j + k: in the "swa"
page space for its attention K/V (the layer's `cache_offset` is k), and its output hidden state
h^k_j in the "conv" space (site `mtp_hidden_site(k)`, window 1), where layer k+1 reads it one
position later. h^0_j, the main model's final hidden state, is stored at position j (site 0).
Every stored entry is then a function of the tokens up to its position, like any other per-token
state: rollback is bookkeeping, and prefix-cache pages are valid for the MTP layers too.

Per request, `frontier[k-1]` = F_k: layer k's entries at stored positions < F_k are complete
(computed from committed tokens). An entry at p needs t_p committed (p < T = seq_len), h^{k-1} at
p - 1 complete (p <= F_{k-1}, with F_0 = the main model's computed tokens) and a page (p < S).
After every main forward one *pass* runs, layer by layer, batched over requests:
  - catch-up rows: stored positions [F_k, F_k') with F_k' = min(F_{k-1}' + 1, T, S), teacher
    forced (token t_p, hidden h^{k-1} at p - 1 read from the conv space);
  - for a request that is ready to decode (main computed T - 1 tokens), the draft at anchor
    n = T - 2: layer 1's draft is its catch-up row at p = T - 1 (complete: t_{T-1} is committed);
    layer k >= 2 adds one row at index n (stored n + k) fed the previous layer's draft token and
    draft hidden state. The draft row's K/V lands at a position no committed query can see before
    the catch-up overwrites it (the key_gap hides it), so rejected drafts need no cleanup.
This is the wavefront of MODELS.md 2.4 (layer k lags layer k-1 by one index) fused with the next
round's draft chain, as one extend batch per layer.
A pass that drafts nothing (`--speculative-adaptive` chose plain decode rows) may skip the layers
and leave the catch-up to a later pass, until a request's MTP state lags its committed tokens by
`CATCH_UP_LAG`: a catch-up row costs about the same as a draft row, so in a long stretch of plain
steps the K layers would otherwise run every step for drafts nobody asked for. The runner keeps
that many more tokens of window history (swa, conv) for it, so the late rows still find theirs.
With the pass on CUDA graphs the late catch-up replays a graph of the same pass with `max_lag`
catch-up rows per request and no drafts (`MTPChainGraph.catch_up`) before the pass that drafts,
or instead of the pass when the lag bound is reached and nobody drafts: eagerly one cost ~8 ms of
host time on an H100, most of what made adaptive MTP's plain steps 1.55x plain decode's at batch 1
there (docs/speculative.md).
Drafts are the argmax of each layer's logits (over `--speculative-token-map`'s tokens when one is
given: `DraftVocab`), except for sampled requests when exact verification
is on (`sample_drafts`): those draw d_k from q_k = the sampler's processing of the logits (d_1..d_{k-1}
counted as output) and keep q in `DraftState.q` for the verify (`sampled_verify`). The chain
graph draws them too when their processing reads no output (`draft_sampling`); then a round of
sampled requests runs on the device like a greedy one (`device_round_samples`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from kiln.engine.batch import ForwardBatch, ForwardMode, int64_to_device
from kiln.engine.cache.pools import position_slots
from kiln.engine.request import Req
from kiln.engine.sampler import greedy_ids
from kiln.engine.spec import draft_sampling
from kiln.engine.spec.draft_vocab import DraftVocab
from kiln.engine.spec.drafter import DraftsInFlight, DraftState
from kiln.engine.spec.sampled_verify import draw_drafts, row_view

# Committed tokens a request's MTP state may lag behind when passes draft nothing (the module
# docstring): the catch-up of a stretch of plain steps runs as one pass of up to this many rows
# per request, for ~1/16 of the per-step cost
CATCH_UP_LAG = 16


def resolve_mtp_steps(config, model) -> int:
    """The draft length for `--speculative-algorithm mtp`, with a clear error when the model or the
    flags cannot serve it."""
    layers = getattr(model, "mtp", None)
    if layers is None or len(layers) == 0:
        raise ValueError(f"--speculative-algorithm mtp needs a model with MTP layers (num_mtp_layers > 0 "
                         f"in config.json: Inkling, or a Llama-family checkpoint from `kiln train-draft "
                         f"--method mtp`); {type(model).__name__} has none")
    k = config.speculative_num_steps if config.speculative_num_steps is not None else len(layers)
    if not 1 <= k <= len(layers):
        raise ValueError(f"--speculative-num-steps must be in [1, {len(layers)}] (the checkpoint's MTP "
                         f"layers); got {k}")
    return k


@dataclass
class MTPState(DraftState):
    """A request's MTP state: completeness frontiers, plus the drafts for its next verify."""

    frontier: list[int] = field(default_factory=list)  # F_k for k = 1..K, stored coordinates

    @classmethod
    def fresh(cls, num_layers: int, num_computed: int) -> "MTPState":
        """After admission with `num_computed` tokens from the prefix cache: every cached page holds
        complete entries; stored positions < k hold no entry of layer k at all."""
        return cls(frontier=[max(k, num_computed) for k in range(1, num_layers + 1)])

    @property
    def complete(self) -> int:
        """Tokens whose MTP state is complete in every layer (caps prefix caching)."""
        return min(self.frontier)


@dataclass
class _Rows:
    """One request's rows in one layer's batch."""

    req: Req
    catch_up: range  # stored positions
    draft: bool  # one more row at the anchor (layer k >= 2), or layer 1's last row is the draft


class MTPDrafter:
    """Runs the MTP pass (catch-up + draft chain) for a batch of requests."""

    def __init__(self, runner, num_layers: int, token_map: Optional[list[int]] = None, max_lag: int = 0):
        """`max_lag`: how far a pass that drafts nothing may leave the catch-up behind (0: never;
        the runner's window spaces must keep that much more history: `runner.mtp_catch_up_lag`)."""
        self.runner = runner
        self.max_lag = max_lag
        self.model = runner.model
        self.layers = list(self.model.mtp[:num_layers])
        self.num_layers = num_layers
        # The draft head: the LM head over `token_map` only (`--speculative-token-map`), else all of it
        self.vocab = DraftVocab(self.model.lm_head, token_map)
        self.page_size = runner.page_size
        self.keep_logits = False  # tests: keep each draft's logits on the request (MTPState.draft_logits)
        # Exact verification of sampled requests: their drafts are drawn from q (SpecDecoder sets it)
        self.sample_drafts = False
        self._h0_hidden, self._h0_rows, self._h0_locs = None, [], []  # queued by on_commit
        self.graph = None  # MTPChainGraph: steady decode passes replayed from CUDA graphs (`use_graphs`)
        self.late_passes = 0  # graph passes of late catch-ups (`MTPChainGraph.catch_up`) so far
        self.flight = None  # the last pass's drafts when the graph made them (still on the device)
        self._flight_logits = None  # their logits, when keep_logits
        self._flight_q = None  # their q rows [K, n, V], when the graph drew sampled drafts

    def use_graphs(self, max_bs: int, capturer=None) -> None:
        """Capture the pass of steady decode rounds (`kiln.engine.spec.mtp_graph`) up to `max_bs`,
        and with `max_lag` the late catch-up's pass of up to `max_lag` rows per request."""
        from kiln.engine.spec.mtp_graph import MTPChainGraph

        # under exact verification the graph draws sampled requests' drafts too (draft_sampling)
        seed = self.runner.config.seed if self.sample_drafts else None
        self.graph = MTPChainGraph(self, max_bs, sample_seed=seed)
        self.graph.capture(capturer)
        if self.max_lag:
            self.graph.late = MTPChainGraph(self, max_bs, catch_up_rows=self.max_lag)
            self.graph.late.capture(capturer)

    # ---- the drafter contract (kiln.engine.spec.drafter) ----------------------------------
    @property
    def num_steps(self) -> int:
        return self.num_layers

    def new_state(self, r: Req) -> MTPState:
        return MTPState.fresh(self.num_layers, r.num_computed)

    def pages_needed(self, seq_len: int, k: int) -> int:
        """The committed positions (catch-up) and the draft rows' stored positions up to T - 2 + k."""
        return max(seq_len, seq_len - 1 + k)

    def min_pages_needed(self, seq_len: int, k: int) -> int:
        """No other pass: the chain stores every draft row."""
        return self.pages_needed(seq_len, k)

    def on_forward(self, batch) -> None:
        """Nothing before verification: h^0 is stored for committed rows only (`on_commit`)."""

    def on_weights_changed(self) -> None:
        """The draft head's copy of the hot LM-head rows follows the new weights."""
        self.vocab.refresh()

    def on_commit(self, r: Req, first_pos: int, rows: slice, batch) -> None:
        """Queue h^0 of the committed rows; `run` stores every request's in one copy."""
        n = rows.stop - rows.start
        if n:
            self._h0_hidden = batch.extras["hidden"]
            self._h0_rows += range(rows.start, rows.stop)
            self._h0_locs += position_slots(r.win_pages["conv"], first_pos, first_pos + n, self.page_size)

    def _store_queued_h0(self, dev) -> None:
        if self._h0_rows:
            rows, n = self._h0_rows, len(self._h0_rows)
            if rows == list(range(n)):  # a decode step's rows, in order (padding after): a view, no gather
                src = self._h0_hidden[:n]
                t = int64_to_device({"locs": self._h0_locs}, dev)
            else:
                t = int64_to_device({"rows": rows, "locs": self._h0_locs}, dev)
                src = self._h0_hidden[t["rows"]]
            self.site(0)[t["locs"]] = src.to(self.site(0).dtype)
        self._h0_hidden, self._h0_rows, self._h0_locs = None, [], []

    def site(self, k: int) -> torch.Tensor:
        """[conv slots, H] buffer of h^k per stored position."""
        return self.runner.conv.layer(self.model.mtp_hidden_site(k))

    @torch.inference_mode()
    def run(self, reqs: list[Req], num_drafts: dict[str, int]) -> None:
        """One pass: advance every request's frontiers as far as committed tokens, computed hidden
        states and pages allow, and draft `num_drafts[rid]` tokens (0: none) into `req.spec.drafts`.
        Pages must cover stored positions up to T - 2 + num_drafts (the caller grows them).

        Argmax drafts stay on the device through the chain (layer k reads layer k - 1's draft
        token by index) and are read back once at the end, so the layers' launches queue without
        waiting for each other; drafts drawn from q (sampled requests under exact verification)
        need the host between layers (their penalties count the earlier drafts)."""
        dev = self.runner.device
        self._store_queued_h0(dev)
        self.flight = None
        if self._may_wait(reqs, num_drafts):
            _clear_drafts(reqs)
            return
        sampled = self.sample_drafts and any(not r.params.greedy for r in reqs)
        # the graph's pass, after replays that bring a late catch-up within its K + 1 rows; when
        # nobody drafts, the catch-up replays take every entry and the pass is skipped (its drafts
        # would go unread)
        if self.graph is not None and (not sampled or self._graph_draws(reqs)) and self.graph.can_run(
                reqs, num_drafts, behind=self.graph.K + 1 + self.max_lag):
            if self.max_lag:
                drafting = any(num_drafts[r.rid] for r in reqs)
                self.late_passes += self.graph.catch_up(reqs, leave=self.graph.K + 1 if drafting else 0)
                if not drafting:
                    _clear_drafts(reqs)
                    return
            self._start_flight(self.graph.run(reqs))
            for i, r in enumerate(reqs):
                self._set_in_flight(r, i, num_drafts[r.rid])
            return
        draft_hidden: dict[str, torch.Tensor] = {}  # rid -> previous layer's draft-row output [H]
        draft_token: dict[str, torch.Tensor] = {}  # rid -> previous layer's draft token (0-d, device)
        chain: dict[str, list[torch.Tensor]] = {}  # rid -> draft tokens so far (0-d, device)
        _clear_drafts(reqs)
        q_rows: dict[str, list[torch.Tensor]] = {}
        prev_frontier = {r.rid: r.num_computed for r in reqs}
        for k, layer in enumerate(self.layers, start=1):
            items: list[_Rows] = []
            for r in reqs:
                st = r.spec
                T, S = r.seq_len, len(r.pages) * self.page_size
                f = st.frontier[k - 1]
                new_f = max(f, min(prev_frontier[r.rid] + 1, T, S))
                st.frontier[k - 1] = new_f
                prev_frontier[r.rid] = new_f
                wants = num_drafts.get(r.rid, 0) >= k
                items.append(_Rows(r, range(f, new_f), wants and k >= 2))
            items = [it for it in items if len(it.catch_up) or it.draft]
            if not items:
                continue
            out, rows_of, keep, batch = self._forward_layer(k, layer, items, draft_hidden, draft_token, dev)
            if k < self.num_layers and keep is not None:  # h^k of catch-up rows for layer k + 1
                rows, locs = keep
                self.site(k)[locs] = out[rows].to(self.site(k).dtype)
            for it in items:
                r, (lo, n) = it.req, rows_of[it.req.rid]
                if num_drafts.get(r.rid, 0) >= k:
                    # layer 1: the last catch-up row sits at the anchor (stored T - 1)
                    row = lo + n - 1
                    assert k >= 2 or (len(it.catch_up) and it.catch_up[-1] == r.seq_len - 1), \
                        f"{r.rid}: layer 1 did not reach the anchor"
                    draft_hidden[r.rid] = out[row]
            drafting = [it.req for it in items if num_drafts.get(it.req.rid, 0) >= k]
            if drafting:
                h = torch.stack([draft_hidden[r.rid] for r in drafting])
                sub = self.vocab.logits(layer.final_norm(h, batch), batch)  # over the draft vocabulary, as in the graph
                tokens = self.vocab.tokens(greedy_ids(sub))
                sampled = [i for i, r in enumerate(drafting) if self.sample_drafts and not r.params.greedy]
                # over the whole vocabulary, -inf off a token map (q is 0 there): only where read
                logits = self.vocab.full(sub) if sampled or self.keep_logits else None
                if sampled:  # d_k ~ q_k, processed like the target's rows (d_1..d_{k-1} as output)
                    views = [row_view(drafting[i], [int(t) for t in chain.get(drafting[i].rid, [])], dev)
                             for i in sampled]
                    drawn, q = draw_drafts(self.runner.sampler, logits[sampled], views)
                    tokens = tokens.index_copy(0, torch.tensor(sampled, device=dev),
                                               torch.tensor(drawn, dtype=tokens.dtype, device=dev))
                    for j, i in enumerate(sampled):
                        q_rows.setdefault(drafting[i].rid, []).append(q[j])
                for i, r in enumerate(drafting):
                    draft_token[r.rid] = tokens[i]
                    chain.setdefault(r.rid, []).append(tokens[i])
                    if self.keep_logits:
                        r.spec.draft_logits.append(logits[i])
        if chain:  # the one read-back of the pass
            rids = list(chain)
            flat = torch.cat([torch.stack(chain[rid]) for rid in rids]).tolist()
            at = 0
            for r in reqs:
                if r.rid in chain:
                    n = len(chain[r.rid])
                    r.spec.drafts = flat[at:at + n]
                    at += n
        for r in reqs:
            if r.rid in q_rows:
                r.spec.q = torch.stack(q_rows[r.rid])

    def can_defer(self, reqs: list[Req]) -> bool:
        """Whether the pass after a plain step whose sampled tokens are still on the device may
        wait (`SpecDecoder._overlapped_plain_step`): once each request's token is appended, as
        `_may_wait` will judge it then (the forward computed every request's last token)."""
        return bool(self.max_lag) and all(self._within_lag(r, r.seq_len + 1) for r in reqs)

    def run_while_pending(self, reqs: list[Req]) -> None:
        """The pass after a plain step whose sampled tokens are still on the device: store the
        queued h^0 rows; the layers wait (`can_defer` held)."""
        complete = [r.spec.complete for r in reqs]
        self.run(reqs, {r.rid: 0 for r in reqs})
        # a pass that ran would have read the placeholders as tokens
        assert [r.spec.complete for r in reqs] == complete, "the MTP pass ran on tokens still on the device"

    def _may_wait(self, reqs: list[Req], num_drafts: dict[str, int]) -> bool:
        """Whether this pass may skip the layers: nobody drafts, every request decodes (its
        prompt is in), and each one's state stays within `max_lag` of its committed tokens after
        the next step commits one more (what the window spaces' extra history covers)."""
        return bool(self.max_lag) and not any(num_drafts.get(r.rid, 0) for r in reqs) and all(
            self._within_lag(r, r.seq_len) for r in reqs)

    def _within_lag(self, r: Req, seq_len: int) -> bool:
        """At length `seq_len` (its last token the one to decode): r decodes, and its state stays
        within `max_lag` of its committed tokens once the next step commits one more."""
        return r.num_computed == seq_len - 1 and seq_len + 1 - r.spec.complete <= self.max_lag

    def _graph_draws(self, reqs: list[Req]) -> bool:
        """Whether the chain graph can draw every request's drafts (`draft_sampling`)."""
        return self.graph.sampling is not None and all(draft_sampling.eligible(r) for r in reqs)

    def device_round_samples(self, r: Req, k: int) -> bool:
        """Whether sampled request `r` can verify its k drafts and have its next ones drawn on the
        device (`SpecDecoder._device_round`): the graph draws for it and its q rows are at hand."""
        return draft_sampling.verifies_on_device(self.graph.sampling if self.graph is not None else None, r, k)

    def _start_flight(self, out) -> None:
        """The chain graph's output -> drafts kept on the device (`DraftsInFlight`): not read back
        here, the next verify gathers them there. `out`: the draft logits [K, n, draft vocabulary]
        (argmax drafts), or (logits, drafts [K, n], q [K, n, V]) when the graph drew them; q is
        copied out of the graph's static tensor for the verify (the next replay rewrites it)."""
        logits, tokens, q = out if isinstance(out, tuple) else (out, None, None)
        if tokens is None:
            tokens = self.vocab.tokens(greedy_ids(logits))
        self.flight = DraftsInFlight.start(tokens.t().contiguous())
        self._flight_logits = logits if self.keep_logits else None
        self._flight_q = q.clone() if q is not None else None

    def _set_in_flight(self, r: Req, row: int, k: int) -> None:
        r.spec.set_in_flight(self.flight, row, k)
        q = self._flight_q
        r.spec.q = q[:k, row] if q is not None and not r.params.greedy else None
        logits = self._flight_logits
        r.spec.draft_logits = [] if logits is None else [self.vocab.full(logits[j, row].clone()) for j in range(k)]

    def device_round_ready(self, reqs: list[Req]) -> bool:
        """Whether a round of `reqs` can run its pass on the verify's device values
        (`run_after_verify`): the chain graph covers the batch and every request is steady (its
        frontiers at its seq_len)."""
        g = self.graph
        return (g is not None and bool(g.graphs) and len(reqs) <= g.max_bs
                and all(f == r.seq_len for r in reqs for f in r.spec.frontier))

    def device_round_reach(self, seq_len: int, k: int) -> int:
        """Positions a request's pages must cover for such a round at seq_len L: the pass stores
        draft rows up to T - 2 + k for any committed length T <= L + k + 1, and the next verify
        queued ahead (`verify_ahead`) writes up to T - 1 + k."""
        return seq_len + 2 * k + 1

    @torch.inference_mode()
    def run_after_verify(self, reqs: list[Req], batch, row_starts: list[int], samples: torch.Tensor,
                         count: torch.Tensor) -> None:
        """The pass of a round whose verify (`batch`) is still on the device
        (`SpecDecoder._device_round`): request b (seq_len L, frontiers at L) verified K drafts at
        forward rows row_starts[b] .. + K, sampled `samples[b]` and committed the first `count[b]`
        of them. Stores h^0 of every verify row, as `on_commit` does for committed rows (rows past
        the committed prefix are overwritten before they are read), and queues the chain graph on
        those device values. The request state moves on in `adopt_in_flight`, once the host has
        committed."""
        K = self.num_layers
        for r, start in zip(reqs, row_starts):
            self.on_commit(r, r.seq_len - 1, slice(start, start + K + 1), batch)
        self._store_queued_h0(self.runner.device)
        self._start_flight(self.graph.run_after_verify(reqs, samples, count))

    def adopt_in_flight(self, r: Req, row: int, k: int) -> None:
        """After `run_after_verify` and the commit: the pass caught request `r` up to its seq_len,
        and its next k drafts are row `row` of the pass."""
        r.spec.frontier = [r.seq_len] * self.num_layers
        self._set_in_flight(r, row, k)

    def _forward_layer(self, k: int, layer, items: list[_Rows], draft_hidden: dict, draft_token: dict, dev):
        """Build layer k's batch (catch-up rows then the draft row, per request) and run it.
        Returns (output hidden [rows, H], rid -> (first row, row count), (catch-up rows, conv slots
        to keep their h^k in) or None, the batch: its backend picks the final norm's path)."""
        ps = self.page_size
        tokens, positions, swa_locs, hid_locs, slots, lens = [], [], [], [], [], []
        keep_rows, keep_locs = [], []  # catch-up rows and the conv slots of their stored positions
        draft_rows, draft_ids, draft_h = [], [], []  # rows fed by the previous layer's draft (on the device)
        rows_of, row = {}, 0
        for it in items:
            r = it.req
            ids = r.token_ids(it.catch_up.start, it.catch_up.stop) if len(it.catch_up) else []
            n = len(it.catch_up) + int(it.draft)
            stored = list(it.catch_up)
            tokens += ids
            hid_locs += [page_slot(r.win_pages["conv"], p - 1, ps) for p in it.catch_up]  # h^{k-1} one position back
            if k < self.num_layers:
                keep_rows += range(row, row + len(it.catch_up))
                keep_locs += [page_slot(r.win_pages["conv"], p, ps) for p in it.catch_up]
            if it.draft:
                anchor = r.seq_len - 2
                stored.append(anchor + k)
                draft_rows.append(row + n - 1)
                draft_ids.append(draft_token[r.rid])
                draft_h.append(draft_hidden[r.rid])
                tokens.append(0)  # both filled on the device below
                hid_locs.append(0)
            positions += [p - k for p in stored]  # sequence indices: the math
            swa_locs += [page_slot(r.win_pages["swa"], p, ps) for p in stored]
            slots.append(r.slot)
            lens.append(n)
            rows_of[r.rid] = (row, n)
            row += n
        lists = {"ids": tokens, "pos": positions, "locs": swa_locs, "hid": hid_locs, "slots": slots,
                 "draft_rows": draft_rows, "keep_rows": keep_rows, "keep_locs": keep_locs}
        if self.runner.needs_device_metadata:  # the Triton extend kernel reads the lengths on the device
            lists.update(ForwardBatch.length_lists([0] * len(lens), lens))
        t = int64_to_device(lists, dev)
        ids_t = t["ids"]
        h_prev = self.site(k - 1)[t["hid"]]
        if draft_rows:
            ids_t = ids_t.index_copy(0, t["draft_rows"], torch.stack(draft_ids).to(ids_t.dtype))
            h_prev = h_prev.index_copy(0, t["draft_rows"], torch.stack(draft_h).to(h_prev.dtype))
        batch = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=ids_t, positions=t["pos"],
                             prefix_lens=[0] * len(lens), extend_lens=lens, logits_indices=ids_t[:0],
                             req_slots=t["slots"], out_cache_loc=None, win_out_locs={"swa": t["locs"]},
                             backend=self.runner.backend)
        if self.runner.needs_device_metadata:
            batch.set_device_metadata(t)
        batch.extras["req_slots_cpu"] = slots
        batch.extras["positions_cpu"] = positions
        emb = self.model.model.embed_tokens(ids_t)
        keep = (t["keep_rows"], t["keep_locs"]) if keep_rows else None
        return layer(emb, h_prev.to(emb.dtype), batch), rows_of, keep, batch


def _clear_drafts(reqs: list[Req]) -> None:
    """No drafts (yet) for this pass: token ids, their logits and q."""
    for r in reqs:
        r.spec.drafts, r.spec.draft_logits, r.spec.q = [], [], None


def page_slot(view: list, pos: int, page_size: int) -> int:
    """The token slot of position `pos` through a request's page view (a window space's pages)."""
    page = view[pos // page_size]
    assert page is not None, f"position {pos}'s window page was already trimmed"
    return page * page_size + pos % page_size
