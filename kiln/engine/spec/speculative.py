"""`SpecDecoder`: the speculative decode round, for the whole batch, inside the scheduler's step.

A round for a request that is ready to decode (seq_len L, L - 1 tokens computed, drafts
d_1..d_k from the previous step's pass):
  1. schedule: the request computes positions L-1 .. L-1+k with tokens [t_{L-1}, d_1..d_k] in
     the step's one target forward (an extend of k + 1 tokens on top of its cache, mixed with the
     other requests' prefill chunks and rounds);
  2. verify: every one of the k + 1 rows is sampled by the engine's sampler (penalties and
     min_tokens see the drafts before the row as output); n = the longest prefix with
     sample_i == d_i (`verify.verify_greedy`); the request emits sample_0 .. sample_n. For greedy
     requests this is greedy verification; for sampled requests it is exact too (each emitted
     token is a draw from the target given the emitted prefix: the drafts act as point masses,
     notes/algorithms.md 1.5), just with lower acceptance than rejection sampling. With
     --speculative-use-rejection-sampling / --speculative-use-block-verification, a sampled
     request whose drafter gave q rows (the distributions its drafts were sampled from) is
     verified instead by `sampled_verify.verify_rounds` (token-wise rejection sampling or block
     verification on the processed p and q) and emits d_1..d_n plus the residual/bonus token;
  3. commit and roll back: tokens are appended with the usual finish checks (a stop inside the
     accepted run drops the rest); `num_computed` = L + n, so the K/V, sliding-window K/V and
     ShortConv inputs the rejected positions wrote are beyond the computed prefix (overwritten
     before anything reads them) and their pages are freed; the kept ShortConv state is the
     verify-time inputs of the accepted positions, already in place;
  4. the drafter pass (`drafter.run`): catch up the drafter's state over the newly committed
     tokens and draft the next round's tokens. The drafter is `MTPDrafter` (mtp: one batch per
     MTP layer), `BlockDraftRunner` (dflash, dspark: one block forward for all ready requests) or
     `NgramDrafter` (ngram: prompt lookup on the host); the contract is in `kiln.engine.spec.drafter`.
Prefill chunks go through the same step: their rows feed the drafter, and a request whose prompt
is done gets its first drafts right away. The prefix cache only takes pages whose state is
complete in every component (`Req.cache_limit`, e.g. the MTP frontier), so cached pages stay exact.
Overlap scheduling is off with speculation (plain steps between plain steps aside, below). On
CUDA the verify forward of a round in which every request verifies the same number of drafts
replays from a CUDA graph (`CudaGraphRunner`'s uniform-extend shapes); the drafter reads the
replayed hidden states. A pass replayed from the MTP chain graph, or a block drafter's paged
pass, leaves its drafts on the device (`DraftsInFlight`): the step returns, the next step is
scheduled and its verify forward queued (gathering the drafts on the device) while the GPU still
drafts, and the host reads the drafts back only to verify. When every request of the step is in
a steady greedy-drafted round of an MTP chain graph or a block drafter's captured paged pass
(`_round_on_device`), the verify's samples feed that pass on the device too (`_device_round`):
the GPU runs verify -> draft back to back and the host commits behind it; when nothing can
change the next step's batch, the next round's verify is queued right behind that pass, its
inputs moved on by the counts on the device (`verify_ahead`), and the next step takes it
(`run_queued`) instead of scheduling one. Every round drafts K tokens up to the
request's last one (the commit stops at max_tokens), so the verify stays on its graph. With
--speculative-adaptive the step's K is chosen from measured step times and acceptance (`adaptive.AdaptiveDraftLength`), one length for the
whole batch (0: plain decode rows), each with its verify graph. A plain step that the next step
follows with plain rows too, where the drafter's pass needs none of its tokens (`Drafter.can_defer`),
is run like plain decode under overlap scheduling (`_overlapped_plain_step`): its samples stay on
the device and the next step's forward is queued before they are read back.
"""

from __future__ import annotations

from typing import Optional

import torch

from kiln.engine.cache.manager import cdiv
from kiln.engine.io import ReqOutput
from kiln.engine.request import Req, ReqStatus
from kiln.engine.sampled_step import sample_readback
from kiln.engine.sampler import SamplingBatch, select_rows
from kiln.engine.spec.adaptive import AdaptiveDraftLength
from kiln.engine.spec.metrics import SpecCounts
from kiln.engine.spec.drafter import Drafter
from kiln.engine.spec.sampled_verify import verify_method, verify_on_device, verify_rounds, verify_views
from kiln.engine.spec.verify import accepted_prefixes, committed_counts
from kiln.engine.spec.verify_ahead import VerifyAhead
from kiln.engine.step_inputs import PENDING


class SpecDecoder:
    """The speculative round for the whole batch, around one `Drafter`."""

    def __init__(self, scheduler, drafter: Drafter):
        self.sched = scheduler
        self.runner = scheduler.runner
        self.cache = scheduler.cache
        self.drafter = drafter
        self.num_steps = drafter.num_steps
        # 'tokenwise' / 'block': sampled requests draw their drafts from q and verify exactly
        # (sampled_verify); None: drafts are argmax and verified as point masses.
        self.method = verify_method(scheduler.config)
        drafter.sample_drafts = self.method is not None
        self.page_size = scheduler.page_size
        scheduler.stats_counters.spec = SpecCounts()
        # --speculative-adaptive: the draft length of each round is chosen from measured step times
        # and acceptance (`adaptive`); `step_k` is what this step's rounds were offered, `next_k`
        # what the drafter pass drafts for the next step
        self.adaptive = AdaptiveDraftLength(self.num_steps) if scheduler.config.speculative_adaptive else None
        if self.adaptive is not None and hasattr(drafter, "shadow"):
            drafter.shadow = True  # free drafts (ngram): position 1 is scored in plain steps too
        self.step_k = self.next_k = self.num_steps
        # Plain steps between plain steps under overlap scheduling (`_overlapped_plain_step`):
        # on CUDA with overlap on, where plain steps are chosen (adaptive) and the drafter can wait
        overlap = self.runner.device.type == "cuda" and not scheduler.config.disable_overlap_schedule
        self.overlap_plain_steps = self.adaptive is not None and overlap
        # A steady round may queue the next round's verify before reading its samples back
        # (`verify_ahead`; which rounds do: --speculative-verify-ahead)
        self.ahead = VerifyAhead(self.runner, scheduler.config.speculative_verify_ahead, overlap,
                                 scheduler.stats_counters.spec)

    # ---- hooks the scheduler calls -------------------------------------------------------
    def on_admit(self, r: Req) -> None:
        """(Re)admission, after the prefix match: the drafter state restarts at the matched prefix."""
        counts = r.spec.counts if r.spec is not None else SpecCounts()
        r.spec = self.drafter.new_state(r)
        r.spec.counts = counts
        r.cache_limit = r.spec.complete

    def num_drafts(self, r: Req) -> int:
        return r.spec.num_drafts if r.spec is not None else 0

    def draft_ids(self, r: Req, k: int) -> tuple[list[int], Optional[int]]:
        """The first k drafts for the forward's input ids, without waiting for the device: (their
        values, None) when known on the host, else (k placeholders, the request's row in
        `self.flight.tokens`), for the scheduler to gather on the device. Drafts of an older
        pass than the last one are read back here."""
        flight = r.spec.in_flight
        if flight is not None and flight[0] is self.flight:
            return [0] * k, flight[1]
        return r.spec.drafts[:k], None

    def drop_drafts(self, r: Req) -> bool:
        """Out of pages: verify no drafts this round (a plain decode). False if there were none."""
        had = r.spec is not None and r.spec.num_drafts > 0
        if had:
            r.spec.drafts, r.spec.q = [], None
        return had

    @property
    def flight(self):
        """The last drafter pass's drafts still on the device (`DraftsInFlight`), or None."""
        return self.drafter.flight

    # ---- after the target forward --------------------------------------------------------
    @torch.inference_mode()
    def after_forward(self, plan: list[tuple[Req, int, int]], logits: torch.Tensor, sample_reqs: list[Req],
                      sample_rows: list[int], batch, row_starts: list[int]) -> None:
        """Hand the forward's rows to the drafter, verify + commit every sampling request, then
        run the drafter pass for the plan's requests that are still running, then trim windows
        and cache prompt pages."""
        self.step_k = self.next_k
        self._score_committed_shadows(plan)
        decoding = sum(start == r.seq_len - 1 for r, start, _ in plan)  # requests in a round (or a plain row)
        if decoding:
            self.sched.stats_counters.spec.record_step(self.step_k)
        if self.adaptive is not None:
            # steady: every request of the step in a round of the same length
            self.adaptive.step_done(len(plan), self.step_k if decoding and decoding == len(plan) else None)
            k = self.adaptive.choose(len(plan))
            # every tensor-parallel rank runs its own controller on its own clock; the forward's
            # shapes must agree, so rank 0's choice is everyone's
            self.next_k = self.runner.pc.broadcast_int(k)
        self.drafter.on_forward(batch)
        if self._plain_step_overlaps(plan, sample_reqs):
            self._overlapped_plain_step(plan, logits, sample_rows, batch, row_starts)
        elif self._round_on_device(plan, sample_reqs, sample_rows, logits.shape[0]):
            self._device_round(plan, logits, batch, row_starts)
        else:
            self._host_round(plan, logits, sample_reqs, sample_rows, batch, row_starts)

    def _score_committed_shadows(self, plan) -> None:
        """Score the shadow drafts looked up while their token was on the device (prompt lookup
        in overlapped plain steps, `NgramDrafter.run_while_pending`): the token is committed now."""
        if self.adaptive is None:
            return
        for r, _, _ in plan:
            at = getattr(r.spec, "shadow_at", None)
            token = r.token_ids(at, at + 1) if at is not None and at < r.seq_len else [PENDING]
            if token != [PENDING]:
                shadow = r.spec.shadow
                self.adaptive.observe_round(1, len(shadow), int(shadow == token))
                r.spec.shadow, r.spec.shadow_at = None, None

    def _plain_step_overlaps(self, plan, sample_reqs: list[Req]) -> bool:
        """Whether this step's rows are all plain decode rows (k = 0), the next step's will be too,
        and the drafter can leave its pass for later: then nothing of the next step needs this
        step's tokens on the host. Requests that finished at the commit of the previous step's
        tokens (their row was already in this forward) are left out."""
        if not self.overlap_plain_steps or self.step_k or self.next_k or not plan or len(sample_reqs) != len(plan):
            return False
        if any(r.grammar is not None for r, _, _ in plan):  # the next mask needs this step's token
            return False
        for (r, start, end), s in zip(plan, sample_reqs):
            if s is not r or (not r.finished and (end - start != 1 or end != r.seq_len)):
                return False
        live = [r for r, _, _ in plan if not r.finished]
        return bool(live) and self.drafter.can_defer(live)

    def _overlapped_plain_step(self, plan, logits: torch.Tensor, sample_rows: list[int], batch,
                               row_starts: list[int]) -> None:
        """Sample like plain decode and leave the tokens on the device (`Scheduler.sample_pending`:
        the next step's forward gathers them there, its `_commit` reads them back). A k = 0 round
        verifies nothing, so its sample is exactly plain decode's; the drafter gets the committed
        row's state now (its input token was committed already) and its pass waits."""
        live = [i for i, (r, _, _) in enumerate(plan) if not r.finished]  # a finished one's row is dropped
        plan = [plan[i] for i in live]
        sample_rows, row_starts = [sample_rows[i] for i in live], [row_starts[i] for i in live]
        reqs = [r for r, _, _ in plan]
        # The previous step's pass may still be drafting on the device (it drafted for a step
        # that then verified none) and nothing here waits for it: keep the pages it writes (what
        # it needed at the request's length then), as `_device_round` does
        in_flight = self.drafter.flight is not None
        for (r, start, _), row in zip(plan, row_starts):
            self.drafter.on_commit(r, start, slice(row, row + 1), batch)
        self.sched.sample_pending(select_rows(logits, sample_rows), reqs)
        self.drafter.run_while_pending(reqs)
        for r in reqs:
            k = self._make_room(r, keep=self.drafter.pages_needed(r.seq_len - 1, self.num_steps) if in_flight else 0)
            assert k == 0, r.rid
            r.cache_limit = r.spec.complete
            self.cache.trim(r)

    def _host_round(self, plan, logits: torch.Tensor, sample_reqs: list[Req], sample_rows: list[int], batch,
                    row_starts: list[int]) -> None:
        """Verify and commit on the host, then run the drafter pass from the committed tokens. A
        drafter that drafts on the host from committed tokens alone (prompt lookup) may have the
        next round's verify queued between the read-back and the commit
        (`VerifyAhead.queue_host_drafted`)."""
        ends = {r.rid: end for r, _, end in plan}
        ahead = self.ahead.may_queue_host_drafted(self, plan, batch)
        self._verify_and_commit(logits, sample_reqs, sample_rows, ends,
                                before_commit=(lambda *a: self.ahead.queue_host_drafted(self, *a)) if ahead else None)
        queued = self.ahead.queued is not None
        alive = [(r, s, e, row) for (r, s, e), row in zip(plan, row_starts) if not r.finished]
        num_drafts = {}
        for r, start, _, row in alive:
            done = r.num_computed - start  # committed rows of this forward
            self.drafter.on_commit(r, start, slice(row, row + done), batch)
            # a verify queued ahead writes up to T - 1 + K: keep its pages
            num_drafts[r.rid] = self._make_room(r, keep=r.seq_len + self.num_steps if queued else 0)
        self.drafter.run([r for r, *_ in alive], num_drafts)
        for r, start, end, _ in alive:
            r.cache_limit = r.spec.complete
            if min(end, r.seq_len) - start > 1:  # prompt chunks: cached as soon as complete
                self.cache.cache(r)
            self.cache.trim(r)

    def _make_room(self, r: Req, keep: int = 0, hold: int = 0) -> int:
        """Pages for the pass, and how many tokens the request drafts. A request ready to decode
        needs what the drafter writes (`pages_needed`; MTP: its committed positions for the
        catch-up and the draft rows' stored positions up to T - 2 + k; a block drafter's paged
        pass: its block's positions up to T - 2 + B, or only the committed ones on its padded pass
        when the pool is short); pages beyond that (rejected positions of this round) are freed,
        except below `keep` positions (a pass already queued writes there) and below `hold`
        positions (pages it holds already and is expected to need again next round: not freed,
        not grown for)."""
        T = r.seq_len
        if r.num_computed != T - 1:  # still in prefill: catch up on what its pages hold
            return 0
        # Not capped by max_tokens: the commit stops at it anyway, and a round of the full length
        # keeps the verify forward on its CUDA graph (a shorter one would run eagerly)
        k = max(min(self.next_k, self.sched.context_length - T), 0)
        need = max(self.drafter.pages_needed(T, k), keep)
        if len(r.pages) > cdiv(need, self.page_size):
            if len(r.pages) > cdiv(max(need, hold), self.page_size):
                self.cache.shrink(r, max(need, hold))
        elif not self.cache.grow(r, need):
            # Short of pages: the drafter's pass that needs fewest may still draft (a block
            # drafter's padded pass), else no drafts this round.
            low = max(self.drafter.min_pages_needed(T, k), keep)
            if low >= need or not self.cache.grow(r, low):
                k = 0
                self.cache.grow(r, T)  # if even this fails the pass stops at the pages it has
        return k

    def _verify_and_commit(self, logits: torch.Tensor, reqs: list[Req], first_rows: list[int],
                           ends: dict[str, int], before_commit=None) -> None:
        """Verify every round: sampled requests whose drafter gave q rows by rejection sampling or
        block verification (`sampled_verify`) when a flag asks for it, the others by sampling every
        row from the target (point masses; greedy verification for greedy requests).
        `before_commit(group, got, accepted)` runs between the read-back and the commit when every
        round is verified by point masses."""
        dev = self.runner.device
        point, exact = [], []  # (req, drafts, first row, q rows)
        for r, first in zip(reqs, first_rows):
            if r.finished:
                continue
            k = ends[r.rid] - r.seq_len
            drafts = r.spec.drafts[:k]
            q = getattr(r.spec, "q", None)
            if self.method is not None and drafts and q is not None and not r.params.greedy:
                exact.append((r, drafts, first, q[:k]))
            else:
                point.append((r, drafts, first, None))
        for group, verify in ((point, self._verify_point), (exact, self._verify_exact)):
            if not group:
                continue
            views, rows = [], []
            for r, drafts, first, _ in group:
                views += verify_views(r, drafts, dev)
                rows += range(first, first + len(drafts) + 1)
            scored = select_rows(logits, rows)
            if any(r.grammar is not None for r, *_ in group):  # structured output: each row's own mask
                self.sched.grammar.mask_rounds(scored, [(r.grammar, drafts) for r, drafts, _, _ in group])
            got, accepted = verify(scored, SamplingBatch.from_reqs(views, dev), group)
            if before_commit is not None and not exact:
                before_commit(group, got, accepted)
            self._commit(group, got, accepted)

    def _verify_point(self, logits: torch.Tensor, sb: SamplingBatch, group) -> tuple[dict, list[int]]:
        """Sample every row; n = the longest prefix with sample_i == d_i. Returns (the sampler
        output read back, accepted per round)."""
        got = sample_readback(self.runner.sampler(logits, sb)).lists()
        return got, accepted_prefixes([d for _, d, _, _ in group], got["token_ids"])

    def _verify_exact(self, logits: torch.Tensor, sb: SamplingBatch, group) -> tuple[dict, list[int]]:
        out, accepted = verify_rounds(self.runner.sampler, logits, sb, [d for _, d, _, _ in group],
                                      torch.cat([q for *_, q in group]), [r.generator for r, *_ in group], self.method)
        return sample_readback(out).lists(), accepted

    # ---- a round without the host between verify and draft ---------------------------------
    def _round_on_device(self, plan, sample_reqs: list[Req], sample_rows: list[int], rows: int) -> bool:
        """Whether this step's verify (`rows` logit rows) can feed the drafter's pass on the device
        (the MTP chain graph, a block drafter's paged pass on graphs: `device_round_ready`): the
        forward is the plan's rounds and nothing else (a verify queued ahead may hold rows of
        requests that finished since), every request of it verifies K greedy-drafted (point-mass)
        tokens or, under exact verification, K tokens drawn from q rows the drafter can draw on the
        device too (`device_round_samples`), and its pages grow to what the pass of a round of any
        acceptance and the next round's verify queued ahead write (`device_round_reach`), inside
        the context. Anything else takes the host path (`_verify_and_commit` + `drafter.run`)."""
        drafter, K = self.drafter, self.num_steps
        ready = getattr(drafter, "device_round_ready", None)
        if ready is None or not plan or len(sample_reqs) != len(plan) or rows != len(plan) * (K + 1):
            return False
        if any(r.grammar is not None for r, _, _ in plan):  # its masks are made on the host from the drafts
            return False
        for i, ((r, start, end), s, srow) in enumerate(zip(plan, sample_reqs, sample_rows)):
            L = r.seq_len
            if (s is not r or srow != i * (K + 1) or r.finished or start != L - 1 or end != L + K
                    or not self._drafts_verify_on_device(r, K)
                    or drafter.device_round_reach(L, K) > self.sched.context_length):
                return False
        reqs = [r for r, _, _ in plan]
        return ready(reqs) and all(self.cache.grow(r, drafter.device_round_reach(r.seq_len, K)) for r in reqs)

    def _drafts_verify_on_device(self, r: Req, k: int) -> bool:
        """Whether r's k drafts can be verified in a round on the device: argmax drafts (no q rows:
        point masses), or, for a sampled request under exact verification, drafts the drafter can
        draw on the device too (`device_round_samples`)."""
        if self.method is None or r.params.greedy:
            return r.spec.q is None
        samples_ok = getattr(self.drafter, "device_round_samples", None)
        return samples_ok is not None and samples_ok(r, k)

    def _device_round(self, plan, logits: torch.Tensor, batch, row_starts: list[int]) -> None:
        """Verify, then queue the drafter's pass fed from the verify's samples on the device (the
        accepted counts and committed tokens never visit the host first), then read the samples
        back and commit while the GPU drafts. The host's acceptance must equal the device's.
        A round with sampled requests under exact verification verifies every request by
        `verify_on_device` (greedy ones with one-hot q rows: the same tokens as point masses)."""
        dev, K, drafter = self.runner.device, self.num_steps, self.drafter
        reqs = [r for r, _, _ in plan]
        n = len(reqs)
        assert logits.shape[0] == n * (K + 1), (logits.shape, n, K)
        drafts = [r.spec.drafts[:K] for r in reqs]
        views = [v for r, d in zip(reqs, drafts) for v in verify_views(r, d, dev)]
        sb = SamplingBatch.from_reqs(views, dev)  # every row is a verify row
        on_device = batch.input_ids.view(n, K + 1)[:, 1:]  # the drafts as the verify read them
        exact = self.method is not None and not all(r.params.greedy for r in reqs)
        if exact:
            one_hot = (torch.zeros(n, K, logits.shape[1], device=dev).scatter_(2, on_device.unsqueeze(2), 1.0)
                       if any(r.params.greedy for r in reqs) else None)
            q = torch.stack([one_hot[i] if r.params.greedy else r.spec.q[:K] for i, r in enumerate(reqs)])
            out, accepted_t = verify_on_device(self.runner.sampler, logits, sb, on_device, q,
                                               [r.generator for r in reqs], self.method)
            count = accepted_t + 1
        else:
            out = self.runner.sampler(logits, sb)
            count = self._committed_counts(out.token_ids.view(n, K + 1), on_device)
        samples = out.token_ids.view(n, K + 1)
        readback = sample_readback(out, count=count)  # queued before the pass: waits for the verify only
        drafter.run_after_verify(reqs, batch, row_starts, samples, count)
        if self.ahead.after_device_rounds and self.ahead.may_queue(batch, reqs, K, self.next_k, self.sched):
            self.ahead.queue(reqs, K, count, samples, True, self.flight.tokens[:, :K],
                             [drafter.device_round_reach(r.seq_len, K) for r in reqs], flight=self.flight)
        got = readback.lists()
        accepted = accepted_prefixes(drafts, got["token_ids"])
        if exact:  # a rejected draft's replacement may equal it: the count says where the run stopped
            assert all(a + 1 >= c for a, c in zip(accepted, got["count"])), (accepted, got["count"])
            accepted = [c - 1 for c in got["count"]]
        assert [a + 1 for a in accepted] == got["count"], (accepted, got["count"])
        self._commit([(r, d, 0, None) for r, d in zip(reqs, drafts)], got, accepted)
        if all(r.finished for r in reqs):
            self.drop_queued()  # every row of a verify queued ahead was for nothing: no step takes it
        for i, r in enumerate(reqs):
            if r.finished:
                continue
            # the pass wrote inside `pages_needed(T)` (MTP: up to T - 2 + K; a block: T + B - 2)
            # and a verify queued ahead writes up to T - 1 + K: keep those pages until they have
            # run (a page freed now could be refilled by a HiCache load on its own stream before
            # then). Hold what the next round on the device grows to, so that a steady round does
            # not free a page to take it again (and rewrite the page tables) one round later.
            T = r.seq_len
            drafter.adopt_in_flight(r, i, self._make_room(r, keep=T + K, hold=drafter.device_round_reach(T, K)))
            r.cache_limit = r.spec.complete
            self.cache.trim(r)

    def _committed_counts(self, samples: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """A greedy round's committed counts on the device (`verify.committed_counts`), in one
        launch on the kernel path."""
        if self.runner.backend.use_kernels:
            from kiln.kernels.greedy_accept import committed_counts as kernel  # needs Triton

            return kernel(samples, drafts)
        return committed_counts(samples, drafts)

    def run_queued(self) -> bool:
        """The scheduler's step when the last round queued this one's verify (`verify_ahead`):
        verify, commit and draft on its rows instead of scheduling a forward. Requests that finished
        since it was queued are left out (their rows were computed for nothing). False when no
        verify was queued or every request it had is gone. Drafts from the host that the drafter
        proposed differently after the commit (a request that matched finished inside its tokens,
        so the others' fallback guesses were not wanted) are replaced by the queued ones: the
        verification is exact whatever the drafts."""
        q = self.ahead.take()
        if q is None:
            return False
        K = q.k
        live = [(i, r) for i, r in enumerate(q.reqs) if r.status is ReqStatus.RUNNING]  # retracted: see drop_queued
        for i, r in live:
            assert r.num_computed == r.seq_len - 1, f"{r.rid}: not where its queued verify moved it"
            flight = r.spec.in_flight
            if q.drafts is None:  # drafts on the device: the pass's row i
                assert r.spec.num_drafts == K and flight is not None and flight[0] is q.flight and flight[1] == i, r.rid
            elif r.spec.drafts != q.drafts[i]:
                r.spec.drafts = list(q.drafts[i])
        if not live:
            return False
        for i, r in enumerate(q.reqs):
            if r.status is not ReqStatus.RUNNING:
                # its pages were released at the commit: what the drafter stores per forward row
                # (a block drafter's context K/V, `on_forward`) goes to the scratch slot instead
                q.batch.out_cache_loc[i * (K + 1):(i + 1) * (K + 1)].zero_()
        plan = [(r, r.seq_len - 1, r.seq_len + K) for _, r in live]
        rows = [i * (K + 1) for i, _ in live]
        for r, _, _ in plan:
            r.num_computed = r.seq_len  # as `Scheduler._forward` does: the drafts' positions are not committed yet
        self.sched.cache.before_forward()  # as before any forward (HiCache bookkeeping)
        self.after_forward(plan, q.logits, [r for r, _, _ in plan], rows, q.batch, rows)
        return True

    def drop_queued(self) -> None:
        """Forget a verify queued ahead (generation paused: requests may be retracted and weights
        updated before the next step). Harmless: everything it wrote is at positions the forward
        built instead rewrites before anything reads them."""
        self.ahead.take()

    def _commit(self, group, got: dict, accepted: list[int]) -> None:
        """Append each round's emitted tokens (row i of a round holds its i-th emitted token) with
        the usual finish checks, and roll back past the accepted drafts. `got`: the sampler output
        read back (`sample_readback(...).lists()`)."""
        sched = self.sched
        tokens = got["token_ids"]
        lps, top_ids, top_lps = got.get("logprobs"), got.get("top_ids"), got.get("top_logprobs")
        row = 0
        for (r, drafts, _, _), n in zip(group, accepted):
            k = len(drafts)
            if k:
                r.spec.counts.record(k, n)
                sched.stats_counters.spec.record(k, n)
            if self.adaptive is not None:
                shadow = getattr(r.spec, "shadow", None)
                if self.step_k:
                    self.adaptive.observe_round(max(self.step_k, k), k, n)
                elif shadow is not None:  # what position 1 would have done (`NgramDrafter.shadow`)
                    self.adaptive.observe_round(1, len(shadow), int(shadow == tokens[row:row + 1]))
            L = r.seq_len
            reason, emitted = None, 0
            for i in range(n + 1):
                t = tokens[row + i]
                r.output_ids.append(t)
                emitted += 1
                reason = sched._accept_token(r, t, sched._logprob_entry(r, row + i, lps, top_ids, top_lps))
                if reason is not None:
                    break
            # positions L-1 .. L-1+n were forwarded with committed tokens
            r.num_computed = L + min(n, emitted)
            r.spec.drafts, r.spec.q = [], None
            if reason is not None:
                sched._end(r, reason)
            sched.outbox.append(ReqOutput.of(r, emitted))
            row += k + 1

