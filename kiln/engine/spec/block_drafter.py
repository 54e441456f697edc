"""`BlockDraftRunner`: a block drafter (DFlash, MODELS.md 4; DSpark, 3.3) as a drafter inside the
engine (`--speculative-algorithm dflash|dspark`).

Context cache. The drafter's layers see the committed positions j < anchor only through their
keys and values of the context feature c_j = RMSNorm(fc(taps_j)), with taps_j the target's hidden
states entering `target_layer_ids` at j. Those K/V depend on the tokens up to j and nothing later,
so the engine keeps them as one more per-token component of the target's main page space
(`ComponentKind.DRAFT_KV`, one K and one V per drafter layer, stored at the target's token slot of
position j). Every target forward computes them for all its rows (`store_context`, called by the
runner inside the forward, so that a CUDA graph replays it with the forward; before
verification), exactly as the target writes its own K/V. Then:

- rollback is bookkeeping: rows of rejected drafts lie past `num_computed` and are overwritten
  before any block reads them (a block for anchor position T - 1 reads the context below T - 1
  only; on the kernel path also its own rows, which it writes first);
  "cropping the context back to the committed length" is `num_computed` itself;
- prefix-cache hits are exact: a cached page carries the drafter's K/V with the target's, so a
  request admitted with a matched prefix has its whole context, and retraction, HiCache's host and
  disk tiers and abort handle the component like any other of the main space;
- memory is accounted with the KV pool: 2 * num_layers * Hkv * D values per token (for a Qwen3-8B
  sized drafter of 5 layers, 8 KV heads of 128, bf16: 20 KB per token, the target's 144 KB).

Drafting. A request ready to decode (seq_len T, T - 1 tokens computed) runs one block at anchor
position T - 1: input [t_{T-1}, MASK x (B-1)] embedded by the target, all B rows (the block is
bidirectional, so fewer rows would change the outputs), keys = its context K/V at positions
0 .. T-2 read from the pool + the block's own; drafts = argmax of the target's LM head at block
positions 1..k (over `--speculative-token-map`'s tokens when one is given: `DraftVocab`; DFlash2:
the candidate selector's walk over them, `kiln.models.dflash2`), or, for
sampled requests under exact verification (`sample_drafts`), d_i drawn from
q_i = the sampler's processing of position i's logits with d_1..d_{i-1} counted as output, q kept
in `DraftState.q` for the verify. Every ready request's block runs in one batch:
- on the kernel path (`PagedBlockPass`, `kiln.engine.spec.block_pass`), without DFlash2's
  selector: the block rows' own K/V are written into the pool past the committed prefix and the
  blocks attend over the paged context, from one CUDA graph per batch size; greedy drafts stay on
  the device (`DraftsInFlight`) for the next verify to gather, sampled ones are drawn from the
  pass's logits on the host, or in a graph replayed after the pass's in a round on the device
  (when their processing reads only constants: `draft_sampling.eligible`);
- otherwise (the reference path): contexts gathered, padded and masked, split into groups when the
  padded contexts would exceed `max_padded_tokens`; the drafts are read back after the pass.
"""

from __future__ import annotations

from typing import Optional

import torch

from kiln.engine.cache.components import ComponentKind, StateSpec
from kiln.engine.request import Req
from kiln.engine.sampler import greedy_ids
from kiln.engine.spec import draft_sampling
from kiln.engine.spec.draft_sampling import DraftSampling
from kiln.engine.spec.draft_vocab import DraftVocab
from kiln.engine.spec.drafter import DraftState, DraftsInFlight
from kiln.engine.spec.sampled_verify import draw_drafts, row_view
from kiln.models.block_drafter import BlockDrafter


def resolve_block_drafter(config, source, model, context_length: int, device, dtype
                          ) -> tuple[BlockDrafter, int, Optional[dict]]:
    """(the drafter module, the draft length K, the drafter's identity for HiCache's disk keys)
    for `--speculative-algorithm dflash|dspark`, with clear errors when the flags or the
    checkpoints cannot serve it."""
    algo = config.speculative_algorithm
    identity = None
    if algo == "dspark":
        if config.speculative_draft_model_path:
            raise ValueError("--speculative-draft-model-path is only read with --speculative-algorithm dflash; "
                             "dspark drafts with the drafter inside the target's checkpoint")
        drafter = getattr(model, "dspark", None)
        if drafter is None:
            raise ValueError(f"--speculative-algorithm dspark needs a MiniMax-M3 checkpoint with dspark_config "
                             f"(MODELS.md 3.3); {type(model).__name__} has none")
        if drafter.config.mask_token_id is None:
            raise ValueError("--speculative-algorithm dspark: the checkpoint's dspark_config has no mask_token_id")
    else:
        import os

        from kiln.models.dflash import load_dflash

        path = config.speculative_draft_model_path
        seed = config.seed if source.load_format == "dummy" else None
        drafter = load_dflash(path, model.config, context_length, device, dtype, dummy_seed=seed)
        files = sorted(f for f in os.listdir(path) if f.endswith((".safetensors", ".json")))
        identity = {"path": os.path.realpath(path), "dummy_seed": seed,
                    "files": [(f, os.stat(os.path.join(path, f)).st_mtime_ns) for f in files]}
    B = drafter.config.block_size
    k = config.speculative_num_steps if config.speculative_num_steps is not None else B - 1
    if not 1 <= k <= B - 1:
        raise ValueError(f"--speculative-num-steps must be in [1, {B - 1}] (the drafter's block_size - 1); got {k}")
    return drafter, k, identity


def store_context(drafter: BlockDrafter, pool, route, taps: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor) -> None:
    """The drafter's context K/V of forward rows (taps [T, len(target_layer_ids) * H], their
    positions and token slots) into its DRAFT_KV `pool`. `route`: None for the reference ops, or
    what the drafter's layers read their kernel path from (a `ForwardBatch` or `LayerRoute`). The
    runner calls it inside every target forward (`ModelRunner.store_draft_context`), so a CUDA
    graph replays it with the forward: run eagerly after the forward, its ~10 launches were on a
    round's host path (fortieth session)."""
    c = drafter.context_features(taps.to(drafter.fc.weight.dtype), route)
    if route is not None:  # one launch per layer instead of two index_puts
        from kiln.kernels.kv_store import store_kv
    else:
        from kiln.ops.attention import store_kv
    for layer, (k, v) in enumerate(drafter.context_kv(c, positions, route)):
        store_kv(k, v, *pool.layer(layer), slots)


def draft_kv_spec(drafter: BlockDrafter) -> StateSpec:
    """The drafter's context K/V as a main-space component: K and V per drafter layer per token."""
    cfg = drafter.config
    return StateSpec(ComponentKind.DRAFT_KV, list(range(cfg.num_layers)), (cfg.num_key_value_heads, cfg.head_dim))


class BlockDraftRunner:
    """Keeps the drafter's context K/V in the DRAFT_KV pool and drafts one block per ready request
    (the `kiln.engine.spec.drafter` contract)."""

    # Padded context rows (requests x longest context) one block batch may gather per layer.
    max_padded_tokens = 1 << 16

    def __init__(self, runner, num_steps: int, token_map: Optional[list[int]] = None):
        self.runner = runner
        self.target = runner.model
        self.drafter: BlockDrafter = runner.draft_model
        # The draft head: the target's LM head over `token_map` only (`--speculative-token-map`)
        self.vocab = DraftVocab(self.target.lm_head, token_map)
        self.pool = runner.draft_kv
        self.table = runner.req_to_token.table
        self.num_steps = num_steps
        self.block_size = self.drafter.config.block_size
        self.keep_logits = False  # tests: keep each draft's logits on the request
        # Exact verification of sampled requests: their drafts are drawn from q (SpecDecoder sets it)
        self.sample_drafts = False
        self.context_length = runner.context_length
        # The kernel path: blocks attend over the paged context (`PagedBlockPass`), their drafts
        # left on the device (`flight`); the padded reference path otherwise.
        # DFlash2's candidate selector walks the draft positions on the host: no paged pass.
        self.paged = None
        if runner.use_kernels:
            from kiln.engine.spec.block_pass import PagedBlockPass

            if self.drafter.candidate_selector is None:
                from kiln.engine.spec.build import DRAFT_GRAPH_MAX_BS

                self.paged = PagedBlockPass(self, max_bs=min(runner.config.max_running_requests, DRAFT_GRAPH_MAX_BS))
        self.flight = None  # the last pass's drafts when the paged pass made them (still on the device)
        self._flight_logits = None  # their logits, when keep_logits (`run_after_verify`)
        self._flight_q = None  # their q rows [n, K, V], when sampled requests' drafts were drawn on the device
        self.sampling = None  # DraftSampling: sampled drafts drawn on the device in a device round (`use_graphs`)

    def use_graphs(self, max_bs: int, capturer=None) -> None:
        """Capture the paged block pass (`kiln.engine.spec.block_pass`) for batch sizes up to
        `max_bs` (the kernel path without DFlash2's selector: `paged` is set)."""
        from kiln.engine.spec.block_pass import PagedBlockPass

        assert self.paged is not None, "no paged block pass on this path"
        self.paged = PagedBlockPass(self, max_bs)
        if self.sample_drafts:  # a device round's pass draws sampled requests' drafts in its graphs
            self.sampling = DraftSampling(self.paged.max_bs, self.num_steps, self.runner.device,
                                          self.runner.config.seed)
        self.paged.capture(capturer)

    # ---- the drafter contract --------------------------------------------------------------
    def new_state(self, r: Req) -> DraftState:
        """Nothing to rebuild: the matched prefix's pages hold the drafter's context K/V."""
        return DraftState()

    def pages_needed(self, seq_len: int, k: int) -> int:
        """The committed positions; on the kernel path also the block's (its rows' K/V are written
        at anchor .. anchor + B - 1, `kiln.engine.spec.block_pass`), within the context."""
        if self.paged is None:
            return seq_len
        return max(seq_len, min(seq_len - 1 + self.block_size, self.context_length))

    def min_pages_needed(self, seq_len: int, k: int) -> int:
        """The committed positions: the padded pass stores nothing past them, and a request
        whose pages stop short of its block drafts there (`_split_paged`)."""
        return seq_len

    def on_forward(self, batch) -> None:
        """Nothing: the runner stored the context K/V of every row of the target forward inside
        it (`ModelRunner.store_draft_context`, `store_context` below)."""

    def on_commit(self, r: Req, first_pos: int, rows: slice, batch) -> None:
        """Nothing: the forward stored every row."""

    def on_weights_changed(self) -> None:
        """The draft head's copy of the hot LM-head rows follows the new weights."""
        self.vocab.refresh()

    def context_kv(self, r: Req, n: Optional[int] = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per drafter layer, the kept K and V [n, Hkv, D] of the request's positions 0..n-1
        (default: every computed one). For tests and debugging."""
        n = r.num_computed if n is None else n
        slots = self.table[r.slot, :n]
        return [(self.pool.k[i][slots], self.pool.v[i][slots]) for i in range(len(self.pool.k))]

    def can_defer(self, reqs: list[Req]) -> bool:
        """A pass that drafts nothing does nothing (the forward stored every row's context), so it
        may run while a plain step's tokens are still on the device (`run_while_pending`)."""
        return True

    def run_while_pending(self, reqs: list[Req]) -> None:
        """The pass after a plain step whose sampled tokens are still on the device: no drafts."""
        self.run(reqs, {})

    @torch.inference_mode()
    def run(self, reqs: list[Req], num_drafts: dict[str, int]) -> None:
        """Draft `num_drafts[rid]` tokens (0: none) for every ready request into `req.spec.drafts`."""
        self.flight = None
        for r in reqs:
            r.spec.drafts, r.spec.draft_logits, r.spec.q = [], [], None
        ready = [r for r in reqs if num_drafts.get(r.rid, 0) > 0]
        paged, padded = self._split_paged(ready)
        if paged:
            self._draft_paged(paged, [num_drafts[r.rid] for r in paged])
        for group in self._groups(padded):
            self._draft(group, [num_drafts[r.rid] for r in group])

    # ---- a round without the host between verify and draft (`SpecDecoder._device_round`) -------
    def device_round_ready(self, reqs: list[Req]) -> bool:
        """Whether a round of `reqs` can run its pass on the verify's device values
        (`run_after_verify`): the paged pass is captured for the batch. (The caller checks that
        every request is greedy-drafted, or `device_round_samples`, and inside the context at
        `device_round_reach`.)"""
        p = self.paged
        return p is not None and bool(p.graphs) and len(reqs) <= p.max_bs

    def device_round_samples(self, r: Req, k: int) -> bool:
        """Whether sampled request `r` can verify its k drafts and have its next ones drawn on the
        device: its processing reads only constants (`draft_sampling.eligible`; positions are drawn
        independently of each other, so all K at once) and its q rows are at hand."""
        return draft_sampling.verifies_on_device(self.sampling, r, k)

    def device_round_reach(self, seq_len: int, k: int) -> int:
        """Positions a request's pages must cover for such a round at seq_len L: the block at
        anchor T - 1 (T <= L + k + 1 committed) writes up to T + B - 2, and the next verify queued
        ahead (`verify_ahead`) up to T - 1 + k."""
        return seq_len + k + max(self.block_size, k + 1)

    @torch.inference_mode()
    def run_after_verify(self, reqs: list[Req], batch, row_starts: list[int], samples: torch.Tensor,
                         count: torch.Tensor) -> None:
        """The pass of a round whose verify is still on the device: request b committed the first
        `count[b]` of `samples[b]`, so its block's anchor is its last committed token
        (`PagedBlockPass.run_after_verify`). The verify's forward stored its context K/V already
        (its rejected rows lie past the anchor, rewritten before a block reads them). The drafts
        stay on the device; `adopt_in_flight` hands them to each request after the commit."""
        sampled = self.sampling is not None and not all(r.params.greedy for r in reqs)
        out = self.paged.run_after_verify(reqs, samples, count, sampled=sampled)
        tokens, logits = out[0], out[1]
        # q: the graph's static rows, read by the next verify before the next pass rewrites them
        self._flight_q = out[2] if sampled else None
        self.flight = DraftsInFlight.start(tokens.clone())
        self._flight_logits = logits if self.keep_logits else None

    def adopt_in_flight(self, r: Req, row: int, k: int) -> None:
        """After `run_after_verify` and the commit: request `r`'s next k drafts are row `row` of the pass."""
        r.spec.set_in_flight(self.flight, row, k)
        q = self._flight_q
        r.spec.q = q[row, :k] if q is not None and not r.params.greedy else None
        logits = self._flight_logits
        r.spec.draft_logits = [] if logits is None else [self.vocab.full(logits[row, j].clone()) for j in range(k)]

    def _split_paged(self, reqs: list[Req]) -> tuple[list[Req], list[Req]]:
        """(the requests the paged pass drafts, the rest for the padded pass). The paged pass
        needs each request's whole block's pages inside the context (`PagedBlockPass.can_run`),
        and there is none with DFlash2's selector walk. Sampled requests take it too: their drafts
        are drawn from its logits afterwards (`_draft_paged`). The two passes write disjoint rows
        of the drafter's cache, so one step can run both."""
        if self.paged is None:
            return [], reqs
        paged, padded = [], []
        for r in reqs:
            (paged if self.paged.can_run([r]) else padded).append(r)
        return paged, padded

    def _draft_paged(self, reqs: list[Req], ks: list[int]) -> None:
        """Draft on the paged pass. Greedy drafts (its argmax tokens) stay on the device
        (`DraftsInFlight`); a sampled request's, under exact verification, are drawn from the
        pass's logits position by position (`_sample`, as after the padded pass), so they and
        their q are on the host."""
        tokens, logits = self.paged.run(reqs)
        self.flight = DraftsInFlight.start(tokens.clone())
        sampled = [i for i, r in enumerate(reqs) if self.sample_drafts and not r.params.greedy]
        drawn = {}
        if sampled:  # over the whole vocabulary (-inf off a token map: q is 0 there)
            full = self.vocab.full(logits[sampled])
            row_of = {i: n for n, i in enumerate(sampled)}
            drawn = self._sample(lambda j, at, prev: full[[row_of[i] for i in at], j], reqs, ks, sampled, None)
        for i, (r, k) in enumerate(zip(reqs, ks)):
            if i in drawn:
                r.spec.drafts, r.spec.q, rows = drawn[i]
                if self.keep_logits:
                    r.spec.draft_logits = list(rows.clone())
                continue
            r.spec.set_in_flight(self.flight, i, k)
            if self.keep_logits:  # copies: the graph's logits are overwritten by the next pass
                r.spec.draft_logits = [self.vocab.full(logits[i, j].clone()) for j in range(k)]

    def _groups(self, reqs: list[Req]) -> list[list[Req]]:
        """Requests in batches whose padded contexts stay under `max_padded_tokens`."""
        groups: list[list[Req]] = []
        longest = 0
        for r in sorted(reqs, key=lambda r: r.num_computed):
            n = r.num_computed
            if groups and (len(groups[-1]) + 1) * max(longest, n) <= self.max_padded_tokens:
                groups[-1].append(r)
            else:
                groups.append([r])
            longest = n
        return groups

    def _draft(self, reqs: list[Req], ks: list[int]) -> None:
        dev = self.runner.device
        for r in reqs:
            assert r.num_computed == r.seq_len - 1, f"{r.rid}: drafting needs every token but the last computed"
        ctx_lens = [r.num_computed for r in reqs]
        R, C, B = len(reqs), max(ctx_lens), self.block_size
        anchors = [r.token_ids(r.seq_len - 1, r.seq_len)[0] for r in reqs]
        mask_id = self.drafter.config.mask_token_id
        host = torch.tensor([t for a in anchors for t in [a] + [mask_id] * (B - 1)] + ctx_lens +
                            [r.slot for r in reqs], dtype=torch.int64)
        t = host.to(dev)
        ids, lens, slots = t[:R * B], t[R * B:R * B + R], t[R * B + R:]
        ctx_mask = torch.arange(C, device=dev)[None, :] < lens[:, None]  # [R, C]
        # Padding reads slot 0 (never a request's token): masked out, and a valid index.
        locs = torch.where(ctx_mask, self.table[slots, :C], 0)
        ctx_kv = [(self.pool.k[i][locs], self.pool.v[i][locs]) for i in range(len(self.pool.k))]
        emb = self.target.model.embed_tokens(ids).view(R, B, -1)
        hidden = self.drafter.forward_blocks(emb.to(self.drafter.fc.weight.dtype), lens, ctx_kv, ctx_mask)
        kmax = max(ks)
        h = hidden[:, 1:kmax + 1]
        sub = self.vocab.logits(h.reshape(R * kmax, -1).to(emb.dtype)).view(R, kmax, -1)
        sub = self.drafter.process_logits(sub)  # x output_multiplier, soft cap (1 and none by default)
        sampled = [i for i, r in enumerate(reqs) if self.sample_drafts and not r.params.greedy]
        selector = self.drafter.candidate_selector
        if selector is None:
            tokens = self.vocab.tokens(greedy_ids(sub)).tolist()
            # over the whole vocabulary, -inf off a token map (q is 0 there): only where read
            logits = self.vocab.full(sub) if sampled or self.keep_logits else None
            logits_at = lambda j, at, prev: logits[at, j]  # noqa: E731  (independent of earlier drafts)
        else:  # DFlash2: position j's logits depend on the token chosen at j - 1
            full = self.vocab.full(sub)
            prepared = selector.prepare(h, full)  # top-k and projection once, for walk and draws
            walked, logits = selector.walk(h, full, ids.view(R, B)[:, 0], prepared)
            tokens = walked.tolist()
            V = full.shape[-1]
            logits_at = lambda j, at, prev: selector.position_logits(prepared, j, at, prev, V)  # noqa: E731
        drawn = self._sample(logits_at, reqs, ks, sampled, anchors if selector is not None else None)
        for i, (r, k) in enumerate(zip(reqs, ks)):
            if i in drawn:
                r.spec.drafts, r.spec.q, rows = drawn[i]
            else:
                r.spec.drafts, rows = [int(x) for x in tokens[i][:k]], None
            if self.keep_logits:  # the logits each draft was chosen from
                r.spec.draft_logits = list((rows if rows is not None else logits[i, :k]).clone())

    def _sample(self, logits_at, reqs: list[Req], ks: list[int], rows: list[int], anchor_ids: Optional[list[int]]
                ) -> dict[int, tuple[list[int], torch.Tensor, torch.Tensor]]:
        """Drafts drawn from q for the requests at `rows` (sampled, under exact verification):
        {row: (d_1..d_k, q [k, V], the logits q was processed from [k, V])}. `logits_at(j, at,
        prev)` gives block position j's draft logits [len(at), V] for the rows `at`, whose previous
        tokens are `prev` [len(at)] (the anchor, then d_{j-1}; only DFlash2's selector reads them:
        None without `anchor_ids`).
        q_j is the sampler's processing of them with d_1..d_{j-1} counted as output (penalties,
        min_tokens), so positions are drawn in order, every request at once."""
        drafts: dict[int, list[int]] = {i: [] for i in rows}
        q_rows: dict[int, list[torch.Tensor]] = {i: [] for i in rows}
        raw: dict[int, list[torch.Tensor]] = {i: [] for i in rows}
        dev = self.runner.device
        for j in range(max((ks[i] for i in rows), default=0)):
            at = [i for i in rows if ks[i] > j]
            views = [row_view(reqs[i], drafts[i], dev) for i in at]
            prev = None if anchor_ids is None else \
                torch.tensor([drafts[i][-1] if j else anchor_ids[i] for i in at], device=dev)
            logits = logits_at(j, at, prev)
            tokens, q = draw_drafts(self.runner.sampler, logits, views)
            for m, i in enumerate(at):
                drafts[i].append(tokens[m])
                q_rows[i].append(q[m])
                raw[i].append(logits[m])
        return {i: (drafts[i], torch.stack(q_rows[i]), torch.stack(raw[i])) for i in rows}
