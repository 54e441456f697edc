"""`Scheduler`: decides what runs in each forward, runs it, and turns logits into tokens.

One step = one forward over a mixed batch:
  1. every running request that has a token to decode (1 token each), growing its pages and,
     when memory runs out, retracting the newest running requests (their computed pages go to
     the prefix cache, so recompute is often a cache hit);
  2. running requests still in chunked prefill, then new requests admitted in policy order,
     each taking a prompt chunk under the step's token budget and the running-request cap.
Sampling, finish checks, prefix caching of finished requests and incremental outputs follow.

With speculative decoding (`kiln.engine.spec.speculative`), a decode computes the request's last
token plus its drafts, and the `SpecDecoder` verifies, commits, rolls back and drafts after the
forward; overlap scheduling is off then, except for adaptive plain steps between plain steps
(`SpecDecoder._overlapped_plain_step`, through `sample_pending`) and steady rounds (MTP, block
drafters, prompt lookup), which may queue the next step's verify themselves (`SpecDecoder.run_queued`
takes it).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Optional

import torch

from kiln.config import EngineConfig
from kiln.engine.batch import ForwardBatch, ForwardMode, int64_to_device
from kiln.engine.cache.manager import CacheManager, cdiv
from kiln.engine.cache.pools import write_pages_batched
from kiln.engine.grammar import GrammarBackend, accept_token, request_grammar
from kiln.engine.io import GenerateReq, ReqOutput, SchedulerStats
from kiln.engine.request import FinishReason, Req, ReqStatus, SamplingParamsError
from kiln.engine.sampled_step import SampledStep
from kiln.engine.sampler import SamplingBatch, compute_logprobs, select_rows
from kiln.engine.seeded_noise import SeededStream
from kiln.engine.spec.build import make_spec_decoder
from kiln.engine.step_inputs import PENDING, StepInputs

logger = logging.getLogger(__name__)



class Scheduler:
    def __init__(self, config: EngineConfig, runner, cache: CacheManager, eos_token_ids: list[int],
                 context_length: int, vocab_size: int, grammar: Optional[GrammarBackend] = None):
        """`grammar`: what compiles structured-output constraints (None: such requests are refused)."""
        self.config = config
        self.grammar = grammar
        self.runner = runner
        self.cache = cache
        self.eos_token_ids = tuple(eos_token_ids)
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.page_size = cache.page_size
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.outbox: list[ReqOutput] = []
        self.stats_counters = SchedulerStats()
        self.check_after_step = False  # tests turn this on
        # Admission reserves this fraction of each running request's remaining output tokens
        # (SGLang's new_token_ratio): it jumps to 1 after a retraction and decays back, so memory
        # pressure makes admission conservative instead of thrashing between admit and retract.
        self.new_token_ratio = self.INIT_NEW_TOKEN_RATIO
        # Speculative decoding: drafts, verification and rollback (None: off).
        self.spec = make_spec_decoder(self)
        # Overlap scheduling (CUDA): the sampled step whose tokens are still on the device. Off with
        # speculation: the next round's inputs are the drafts of this one, known only on the host.
        self.overlap = (runner.device.type == "cuda" and not config.disable_overlap_schedule
                        and self.spec is None)
        self.pending: Optional[SampledStep] = None

    INIT_NEW_TOKEN_RATIO = 0.5
    MIN_NEW_TOKEN_RATIO = 0.1
    NEW_TOKEN_RATIO_DECAY = 0.005

    # ---- requests in -----------------------------------------------------------------------
    def add_request(self, g: GenerateReq) -> None:
        try:
            self._validate(g)
            grammar = None if g.params.grammar is None else request_grammar(self.grammar, g.params)
        except (SamplingParamsError, ValueError) as e:
            self.outbox.append(ReqOutput(rid=g.rid, new_token_ids=[], finished=True,
                                         finish_reason=FinishReason.ABORT.value, error=str(e)))
            return
        req = Req(rid=g.rid, prompt_ids=list(g.input_ids), params=g.params,
                  eos_token_ids=self.eos_token_ids, return_routed_experts=g.return_routed_experts,
                  arrival=time.monotonic(), grammar=grammar)
        if g.params.seed is not None:
            req.generator = SeededStream(g.params.seed)
        if g.params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        self.waiting.append(req)

    def _validate(self, g: GenerateReq) -> None:
        if not g.input_ids:
            raise ValueError("the prompt is empty; send at least one token")
        if len(g.input_ids) >= self.context_length:
            raise ValueError(f"the prompt has {len(g.input_ids)} tokens but the context length is "
                             f"{self.context_length}; shorten the prompt")
        if any((not isinstance(t, int)) or t < 0 or t >= self.vocab_size for t in g.input_ids):
            raise ValueError(f"input token ids must be integers in [0, {self.vocab_size})")
        g.params.validate(self.vocab_size, self.config.max_logprobs)
        if g.return_routed_experts and self.runner.routing is None:
            raise ValueError("return_routed_experts needs a MoE model served with --enable-return-routed-experts"
                             if self.runner.has_moe else "return_routed_experts: this model has no MoE layers")

    def abort(self, rid: str) -> None:
        for q in (self.waiting, self.running):
            for r in list(q):
                if r.rid == rid:
                    q.remove(r)
                    self.cache.release(r)
                    if r.output_ids and r.output_ids[-1] == PENDING:
                        r.output_ids.pop()
                    self._finish(r, FinishReason.ABORT)
                    self.outbox.append(ReqOutput.of(r, 0))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.outbox or self.pending)

    # ---- one step --------------------------------------------------------------------------
    def step(self) -> list[ReqOutput]:
        """Schedule, run one forward, sample, and return the outputs that are ready.

        With overlap scheduling the forward of this step is queued on the device *before* the
        tokens of the previous step are read back (`_commit`), so the host work of reading them,
        checking stops and scheduling the next step hides behind the device's work. The inputs of
        requests whose last token is still on the device (`PENDING` in `output_ids`) are gathered
        there; requests that turn out to have finished at the previous step ran one row for
        nothing, which is discarded."""
        self.new_token_ratio = max(self.MIN_NEW_TOKEN_RATIO, self.new_token_ratio - self.NEW_TOKEN_RATIO_DECAY)
        if self.spec is not None and self.spec.run_queued():  # the last round queued this step's verify
            return self._step_done()
        plan = self._schedule()
        if plan:
            self.cache.before_forward()  # HiCache: host -> device loads land before the forward
        launched = self._forward(plan) if plan else None
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._commit(pending)
        if launched is not None:
            logits, sample_reqs, sample_rows, prompt_lp = launched
            self._record_prompt_logprobs(logits, prompt_lp)
            if self.spec is not None:
                batch, row_starts = self._last_forward
                self.spec.after_forward(plan, logits, sample_reqs, sample_rows, batch, row_starts)
                sample_reqs = []
            alive = [(r, i) for r, i in zip(sample_reqs, sample_rows) if not r.finished]
            if alive:
                rows, reqs = select_rows(logits, [i for _, i in alive]), [r for r, _ in alive]
                # a grammar's next mask needs this step's tokens on the host: no overlap for this step
                if self.overlap and not any(r.grammar is not None for r in reqs):
                    self.sample_pending(rows, reqs)
                else:
                    self._commit(self._sample(rows, reqs))
        return self._step_done()

    def _step_done(self) -> list[ReqOutput]:
        if self.check_after_step:
            self.check_integrity()
        out, self.outbox = self.outbox, []
        return out

    def _schedule(self) -> list[tuple[Req, int, int]]:
        """Pick (req, start, end) token ranges to compute this step."""
        budget = self.config.max_prefill_tokens
        plan: list[tuple[Req, int, int]] = []
        # 1. decodes, oldest first; retract the newest when pages run out. One pass sorts the
        # running requests (this runs for every running request every step: at hundreds of them
        # the per-request Python work is a small model's step time, docs/architecture.md "Host work per step").
        decodes, prefilling, finishing = [], [], []
        ctx = self.context_length
        for r in self.running:
            out = r.output_ids
            seq_len = len(r.prompt_ids) + len(out)
            left = seq_len - r.num_computed  # remaining_prefill()
            if left == 1:
                # No step for a request whose token still on the device is its last by length: it
                # finishes at this step's commit, which gives its pages back.
                if out and out[-1] == PENDING and (len(out) >= r.params.max_tokens or seq_len >= ctx):
                    finishing.append(r)
                else:
                    decodes.append(r)
            elif left > 1:
                prefilling.append(r)
        i = 0
        grow, spec = self.cache.grow, self.spec
        # The decodes' new pages reach the page tables in one copy after the loop: each is a
        # distinct planned request growing past what it held, so the writes never overlap (a
        # retraction's own writes go to a victim outside the plan, and slots are reassigned only
        # by admissions, after the flush).
        table_writes: list = []
        while i < len(decodes):
            r = decodes[i]
            end = r.seq_len + (spec.num_drafts(r) if spec else 0)  # + drafts to verify
            if grow(r, end, table_writes):
                plan.append((r, r.num_computed, end))
                budget -= end - r.num_computed
                i += 1
                continue
            if self.spec is not None and self.spec.drop_drafts(r):
                continue  # verify nothing this round rather than retract someone
            victim = self._pick_victim(exclude=[p[0] for p in plan] + [r] + finishing)
            if victim is None:
                if not plan and not finishing:  # alone and out of pages: nothing can ever free memory for it
                    self.running.remove(r)
                    self._fail(r, "the KV pool is too small for this request; raise --max-total-tokens")
                break
            self._retract(victim)
            if victim in decodes[i:]:
                decodes.remove(victim)
        write_pages_batched(table_writes, self.page_size)
        # 2. ongoing chunked prefills (those the decodes did not retract)
        for r in prefilling:
            if budget <= 0:
                break
            if r.status != ReqStatus.RUNNING:
                continue
            n = self._chunk(r, budget, bool(plan))
            if n and self.cache.grow(r, r.num_computed + n):
                plan.append((r, r.num_computed, r.num_computed + n))
                budget -= n
        if not plan and len(self.running) > 1 and not finishing:
            # Prefilling requests hold pages but none can grow: free the newest to break the tie
            # (unless some request finishes at the commit, which gives its pages back).
            self._retract(self.running[-1])
            return self._schedule()
        # 3. admit new requests
        self._order_waiting()
        reserved = None  # tokens the running requests still need (`_reserved_pages`), kept as they join
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            r = self.waiting[0]
            if r.output_ids and r.output_ids[-1] == PENDING:
                break  # retracted while its last token was on the device: readmit after the commit
            self.cache.match(r, max_tokens=self._max_match(r))
            n = self._chunk(r, budget, bool(plan))
            if reserved is None:
                reserved = sum(self._reserved_tokens(x) for x in self.running)
            reserve = self._reserved_pages(reserved)
            total = cdiv(r.num_computed + n, self.page_size)
            need = total - len(r.pages)
            if n == 0 or need + reserve > self.cache.available_pages or not self.cache.assign_slot(r):
                self.cache.unmatch(r)  # its cached pages count as available again: compare the total
                if not self.running and not plan and n and total > self.cache.available_pages:
                    self._reject_too_large(r)
                    continue
                break
            if not self.cache.grow(r, r.num_computed + n):  # a window space ran short
                self.cache.release(r, cache=False)
                break
            self.waiting.popleft()
            if r.num_retractions == 0:
                r.cached_tokens = r.num_computed
                r.cached_tiers = dict(r.match_tiers)
                self.stats_counters.prompt_tokens_total += len(r.prompt_ids)
                self.stats_counters.cached_tokens_total += r.num_computed
                self.stats_counters.add_tier_hits(r.cached_tiers)
            r.status = ReqStatus.RUNNING
            if self.spec is not None:
                self.spec.on_admit(r)
            self.running.append(r)
            reserved += self._reserved_tokens(r)
            plan.append((r, r.num_computed, r.num_computed + n))
            budget -= n
        return plan

    def _reserved_pages(self, tokens: Optional[float] = None) -> int:
        """Pages the running requests are expected to still need for their outputs; `tokens`:
        the sum of their `_reserved_tokens`, when the caller keeps it."""
        if tokens is None:
            tokens = sum(self._reserved_tokens(r) for r in self.running)
        return cdiv(int(tokens), self.page_size) + len(self.running)

    def _reserved_tokens(self, r: Req) -> float:
        """Tokens one running request is expected to still need (`_reserved_pages`' terms)."""
        tokens = max(r.remaining_prefill() - 1, 0) + (r.params.max_tokens - len(r.output_ids)) * self.new_token_ratio
        if self.spec is not None:
            # Beyond its committed tokens a request holds, at some point of a round, the
            # positions its verify writes before rolling back (K), or those its drafter's pass
            # writes (a block drafter's paged pass: its block, B - 1). Between steady rounds on
            # the device it keeps up to 2K + 1 (`SpecDecoder._make_room`'s hold); those pages are
            # already out of the pool's available count, so this reserve stays on the safe side.
            T = r.seq_len
            tokens += max(self.spec.num_steps, self.spec.drafter.pages_needed(T, self.spec.num_steps) - T)
        return tokens

    def _chunk(self, r: Req, budget: int, batch_nonempty: bool) -> int:
        """How many of the request's remaining tokens to compute now."""
        remaining = r.remaining_prefill()
        limit = self.config.chunked_prefill_size
        cap = self.cache.max_chunk_tokens()
        if cap is not None:  # window spaces must hold the whole chunk while it is computed
            limit = cap if limit <= 0 else min(limit, cap)
        if limit <= 0:  # chunking disabled: all or nothing (alone, it may exceed the budget)
            return remaining if (remaining <= budget or not batch_nonempty) else 0
        return min(remaining, limit, budget)

    def _order_waiting(self) -> None:
        if self.config.schedule_policy == "lpm" and self.cache.tree is not None and len(self.waiting) > 1:
            def cached_len(r: Req) -> int:
                pages, _ = self.cache.tree.match_prefix(r.all_ids)
                return len(pages)
            self.waiting = deque(sorted(self.waiting, key=lambda r: -cached_len(r)))

    def _pick_victim(self, exclude: list[Req]) -> Optional[Req]:
        for r in reversed(self.running):
            if r not in exclude:
                return r
        return None

    def _retract(self, r: Req) -> None:
        """Preempt: drop the request's pages (computed ones stay in the prefix cache) and queue it
        to recompute prompt + output so far."""
        if r.return_routed_experts and r.slot != -1:
            # Its routing so far, read while it still has a slot: if the token still on the device
            # ends it at the commit, `_end` returns this (a readmitted request reads its own).
            r.routed_experts = self.runner.routing.of_request(r.pages, r.num_computed)
        self.running.remove(r)
        self.cache.release(r)
        r.status = ReqStatus.WAITING
        r.num_retractions += 1
        self.stats_counters.num_retractions_total += 1
        self.new_token_ratio = 1.0
        self.waiting.appendleft(r)
        logger.debug("retracted %s at %d tokens", r.rid, r.seq_len)

    def _max_match(self, r: Req) -> Optional[int]:
        # Prompt logprobs need the logits of every prompt position not yet scored.
        if r.prompt_logprobs is not None and r.prompt_logprobs_done < len(r.prompt_ids) - 1:
            return r.prompt_logprobs_done
        return None

    def _reject_too_large(self, r: Req) -> None:
        self.waiting.popleft()
        self._fail(r, f"the request needs {r.seq_len} tokens of KV cache but the pool holds only "
                      f"{self.cache.available_pages * self.page_size}; raise --max-total-tokens")

    def _fail(self, r: Req, message: str) -> None:
        self.cache.release(r, cache=False)
        self._finish(r, FinishReason.ABORT)
        out = ReqOutput.of(r, 0)
        out.error = message
        self.outbox.append(out)

    # ---- forward + sampling ----------------------------------------------------------------
    def _forward(self, plan: list[tuple[Req, int, int]]):
        """Build the batch of `plan` and queue its forward. Returns (logits, requests that sample,
        their logit rows, prompt-logprob work)."""
        dev = self.runner.device
        windows = self.cache.windows
        x = StepInputs.build(plan, self.page_size, windows, self.pending.rows if self.pending else None, self.spec)
        mode = ForwardMode.DECODE if all(e - s == 1 for _, s, e in plan) else ForwardMode.EXTEND
        slots = [r.slot for r, _, _ in plan]
        prefix_lens, extend_lens = [s for _, s, _ in plan], [e - s for _, s, e in plan]
        meta = ForwardBatch.length_lists(prefix_lens, extend_lens) if self.runner.needs_device_metadata else {}
        t = int64_to_device({"ids": x.ids, "pos": x.pos, "logits": x.logit_rows, "slots": slots, "locs": x.locs,
                             "pend_at": x.pending_at, "pend_src": x.pending_src, "draft_at": x.draft_at,
                             "draft_src": x.draft_src, **{f"win:{c}": v for c, v in x.win_locs.items()}, **meta}, dev)
        input_ids = t["ids"]
        if x.pending_at:  # the previous step's tokens, read on the device (no host round trip)
            input_ids = input_ids.index_copy(0, t["pend_at"], self.pending.out.token_ids[t["pend_src"]])
        if x.draft_at:  # the last drafter pass's tokens, read on the device too
            input_ids = input_ids.index_copy(0, t["draft_at"], self.spec.flight.tokens.view(-1)[t["draft_src"]])
        batch = ForwardBatch(
            mode=mode, input_ids=input_ids, positions=t["pos"],
            prefix_lens=prefix_lens, extend_lens=extend_lens,
            logits_indices=t["logits"], req_slots=t["slots"], out_cache_loc=t["locs"],
            win_out_locs={c: t[f"win:{c}"] for c in x.win_locs})
        batch.extras["req_slots_cpu"] = slots
        batch.extras["out_cache_loc_cpu"] = x.locs  # routing capture files ids under these (no device read)
        if meta:
            batch.set_device_metadata(t)
        logits = self.runner.forward(batch)
        if self.spec is not None:  # the SpecDecoder commits, caches and trims after verifying
            self._last_forward = (batch, x.row_starts)
            for r, start, end in plan:
                r.num_computed = min(end, r.seq_len)  # the drafts' positions are not committed yet
            return logits, x.sample_reqs, x.sample_rows, x.prompt_lp
        for r, start, end in plan:
            r.num_computed = end
            if end - start > 1:
                # Cache prompt pages as soon as they are computed, windowed state included, so
                # concurrent requests with the same prefix (n > 1, shared system prompts) reuse
                # them; decode pages are cached when the request ends.
                self.cache.cache(r)
            if windows:
                self.cache.trim(r)  # windowed state that fell out of every query's reach
        return logits, x.sample_reqs, x.sample_rows, x.prompt_lp

    def _record_prompt_logprobs(self, logits: torch.Tensor, items) -> None:
        for r, lo, first_row in items:
            hi = min(r.num_computed, len(r.prompt_ids) - 1)
            rows = logits[first_row:first_row + hi - lo]
            temps = torch.full((rows.shape[0],), r.params.temperature, device=rows.device)
            lp = compute_logprobs(rows, temps)
            targets = torch.tensor(r.prompt_ids[lo + 1:hi + 1], device=rows.device)
            chosen = lp.gather(1, targets[:, None]).squeeze(1).tolist()
            k = r.params.prompt_logprobs
            if k:
                tv, ti = lp.topk(k, dim=-1)
                tops = [list(zip(a, b)) for a, b in zip(ti.tolist(), tv.tolist())]
            else:
                tops = [[] for _ in chosen]
            r.prompt_logprobs.extend(zip(chosen, tops))
            r.prompt_logprobs_done = hi

    def _sample(self, logits: torch.Tensor, reqs: list[Req]) -> "SampledStep":
        """Queue sampling of one token per request; each request's output gets a `PENDING`
        placeholder until `_commit` reads the tokens back (a grammar's mask goes on first)."""
        sb = SamplingBatch.from_reqs(reqs, self.runner.device)
        if any(r.grammar is not None for r in reqs):
            self.grammar.mask_logits(logits, [r.grammar for r in reqs])
        out = self.runner.sampler(logits, sb)
        for r in reqs:
            r.output_ids.append(PENDING)
        sampled = SampledStep(reqs, out, {r.rid: i for i, r in enumerate(reqs)})
        sampled.start_copy()
        return sampled

    def sample_pending(self, logits: torch.Tensor, reqs: list[Req]) -> None:
        """Sample one token per request and leave them on the device (overlap scheduling): the
        next step's forward gathers them there, and its `step` reads them back (`_commit`)."""
        assert self.pending is None, "the previous step's tokens are still on the device"
        self.pending = self._sample(logits, reqs)

    def _commit(self, sampled: "SampledStep") -> None:
        """Read sampled tokens back (the host synchronisation of a step), put them in place of the
        placeholders, and finish the requests that stop."""
        tokens, lps, top_ids, top_lps = sampled.fetch()
        finished = ReqStatus.FINISHED
        for i, (r, t) in enumerate(zip(sampled.reqs, tokens)):
            if r.status is finished:  # aborted while its token was on the device
                continue
            assert r.output_ids[-1] == PENDING, f"{r.rid}: no placeholder for the sampled token"
            r.output_ids[-1] = t
            reason = self._accept_token(r, t, None if lps is None else self._logprob_entry(r, i, lps, top_ids, top_lps))
            if reason is not None:
                self._end(r, reason)
            self.outbox.append(ReqOutput.of(r, 1))

    @staticmethod
    def _logprob_entry(r: Req, i: int, lps, top_ids, top_lps):
        """Row i's (logprob, top list) when the request asked for logprobs, else None."""
        if r.params.logprobs is None or lps is None:
            return None
        k = r.params.logprobs
        return lps[i], list(zip(top_ids[i][:k], top_lps[i][:k])) if k else []

    def _accept_token(self, r: Req, t: int, logprob) -> Optional[FinishReason]:
        """Count a token just placed at the end of the request's output; returns why the request
        stops there, if it does."""
        self.stats_counters.generation_tokens_total += 1
        if logprob is not None:
            r.output_logprobs.append(logprob)
        if r.grammar is not None:
            accept_token(r.grammar, t, r.rid)
            if r.grammar.is_terminated():  # its stop token: the output is complete (ignore_eos or not)
                return FinishReason.STOP
        return self._check_finish(r, t)

    def _end(self, r: Req, reason: FinishReason) -> None:
        """Finish a request that stopped: routed experts read back, pages released."""
        if r.return_routed_experts and r.slot != -1:
            r.routed_experts = self.runner.routing.of_request(r.pages, r.seq_len - 1)
        (self.running if r.status == ReqStatus.RUNNING else self.waiting).remove(r)
        self._finish(r, reason)
        self.cache.release(r)

    def _check_finish(self, r: Req, t: int) -> Optional[FinishReason]:
        p = r.params
        n_out = len(r.output_ids)
        if n_out >= p.min_tokens:
            if (t in r.eos_token_ids and not p.ignore_eos) or t in p.stop_token_ids:
                return FinishReason.STOP
        if n_out >= p.max_tokens or r.seq_len >= self.context_length:
            return FinishReason.LENGTH
        return None

    def _finish(self, r: Req, reason: FinishReason) -> None:
        r.status = ReqStatus.FINISHED
        r.finish_reason = reason

    # ---- maintenance -----------------------------------------------------------------------
    def flush_cache(self) -> bool:
        if self.running or self.waiting:
            return False
        self.cache.flush()
        return True

    def check_integrity(self) -> None:
        self.cache.check_integrity(self.running)

    def stats(self) -> SchedulerStats:
        s = self.stats_counters
        s.num_running = len(self.running)
        s.num_waiting = len(self.waiting)
        s.kv_used_tokens = self.cache.used_tokens()
        s.kv_total_tokens = self.cache.allocator.capacity * self.page_size
        if self.cache.hicache is not None:
            s.set_hicache(self.cache.hicache.snapshot(), self.page_size)
        snap = SchedulerStats(**vars(s))
        snap.spec = s.spec.copy() if s.spec is not None else None
        return snap
