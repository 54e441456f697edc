"""`VerifyAhead`: the next round's verify forward queued on the device before this round's samples
are read back.

A steady round on CUDA (`SpecDecoder._device_round`: an MTP chain graph, or a block drafter's
paged pass on graphs) queues verify N, its sampling and acceptance counts, and the drafter's pass
that drafts round N + 1, all without the host. Without
this, the host then reads the samples back, commits, schedules, builds verify N + 1's inputs from
host lists and launches it, and the GPU idles for whatever of that host work the drafter's pass
does not cover (docs/speculative.md, "On the H200").

Verify N + 1's inputs are a function of values already on the device: request b (seq_len L, c_b
tokens committed by round N) computes positions L - 1 + c_b .. L - 1 + c_b + K with the tokens
[samples[b, c_b - 1], the drafter pass's K drafts of row b]; its write slots are the page tables'
entries at those positions (`_round_on_device` grew every request's pages to `device_round_reach`,
so they are there), and its prefix and sequence lengths move on by c_b. So right after the
drafter's pass, verify N's graph replays again with its static inputs moved on by the counts
(`CudaGraphRunner.replay_moved`, one kernel: `kiln.kernels.verify_moves`), and the host reads
round N's samples back and commits while the GPU runs verify N + 1. The scheduler's next step takes that forward instead of building one
(`SpecDecoder.run_queued`). Prompt lookup drafts on the host, so its round queues the next verify
between the read-back and the commit instead (`queue_host_drafted`, with the drafts
`NgramDrafter.drafts_ahead` proposes from the tokens about to be committed).

Exactness. The queued forward is the one the host would build: same tokens, positions, slots and
lengths. A request that finished at round N's commit (a stop token, or an abort between the
steps) had its rows computed for nothing: they are ignored (what a drafter stores per row goes to
the scratch slot), and the others are verified over their own rows on the host path. Its pages
were released at the commit; whatever reuses them is queued after the verify on the same stream
(HiCache's copies wait for the compute stream first).

Which rounds queue ahead is --speculative-verify-ahead's choice: by default ('all') every round
that can, 'prompt-lookup' only prompt lookup's. A round on the device already runs the host's
commit and the next verify's input build while the GPU drafts, so queuing ahead there only pays
if the moves above cost the GPU less than the host's build left it idle: with the moves as ~13
PyTorch ops an H200 measured MTP K = 3 rounds 5% slower at batch 1; with the one kernel, as fast
at batch 1 and 4-16% faster at batch 8 and 32 (MTP, DFlash; docs/benchmarks.md, thirty-second and
thirty-third passes).

A verify is queued ahead only when the next step's batch is sure to be the same requests at the
same draft length: every running request is in it, nobody waits for admission, the next round's
length is K, and no request's next token is surely its last (max_tokens, the context). Pausing
generation drops a queued verify (`SpecDecoder.drop_queued`): requests may be retracted and the
weights updated before the next step. Not with tensor parallelism (the ranks would have to agree
on every condition; untested) or routed-expert capture (recorded on the host per forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kiln.config import VERIFY_AHEAD_MODES
from kiln.engine.batch import ForwardBatch, int64_to_device
from kiln.engine.request import Req


@dataclass
class QueuedVerify:
    """A verify forward queued by the last round: its requests (row block i = reqs[i]), draft
    length, its drafts, and the outputs (static-buffer views, valid until the next replay)."""

    reqs: list[Req]
    k: int
    flight: object  # the `DraftsInFlight` whose rows it verifies (drafts on the device), or None
    drafts: Optional[list[list[int]]]  # the drafts it verifies when they came from the host
    logits: torch.Tensor
    batch: ForwardBatch


class VerifyAhead:
    """Queues the next round's verify when nothing can change its batch (module docstring)."""

    def __init__(self, runner, mode: str, overlap: bool, counts):
        """`mode`: --speculative-verify-ahead; `overlap`: overlap scheduling is on (CUDA and not
        --disable-overlap-schedule). `counts`: the engine's `SpecCounts`, whose
        `verifies_queued_ahead` this keeps."""
        assert mode in VERIFY_AHEAD_MODES, mode
        self.runner = runner
        # `enabled`: rounds drafted on the host (prompt lookup) queue ahead; `after_device_rounds`:
        # rounds on the device (MTP, block drafters) too, unless 'prompt-lookup' (module docstring)
        self.enabled = mode != "off" and overlap and runner.routing is None and runner.pc.tp_size == 1
        self.after_device_rounds = self.enabled and mode == "all"
        self.counts = counts
        self.queued: Optional[QueuedVerify] = None

    def may_queue(self, batch: ForwardBatch, reqs: list[Req], k: int, next_k: int, sched) -> bool:
        """Whether round N (verify `batch` of `reqs` at draft length `k`) may queue round N + 1's
        verify: see the module docstring. `sched`: the scheduler (who waits, who runs)."""
        graphs = self.runner.graphs
        if not (self.enabled and graphs is not None and graphs.moves_on(batch, len(reqs)) and next_k == k
                and not sched.waiting and len(sched.running) == len(reqs)):  # every running request is in the batch
            return False
        # every position verify N + 1 can write (up to L + 2k) inside the context
        context = sched.context_length
        return all(len(r.output_ids) + 1 < r.params.max_tokens and context - r.seq_len > 2 * k for r in reqs)

    def queue(self, reqs: list[Req], k: int, shift: torch.Tensor, last: torch.Tensor, last_at_shift: bool,
              next_drafts: torch.Tensor, reach: list[int], flight=None,
              drafts: Optional[list[list[int]]] = None) -> None:
        """Queue verify N + 1: request b's rows are [its last committed token, next_drafts[b]]
        ([n, k] on the device), shift[b] positions further on than verify N's; the token is
        last[b, shift[b] - 1] if `last_at_shift` (round N's samples), else last[b, 0]
        (`CudaGraphRunner.replay_moved`). `reach`: the tokens each request's pages must cover (the
        caller grew them); `flight` / `drafts`: the drafts' origin, for `SpecDecoder.run_queued`'s
        check."""
        assert self.queued is None, "a queued verify was never taken"
        ps = self.runner.page_size
        assert all(len(r.pages) * ps >= n for r, n in zip(reqs, reach)), "past a request's pages"
        self.runner.load_gate.wait_all()  # as `runner.forward` before a replay
        logits, batch = self.runner.graphs.replay_moved(shift, last, last_at_shift, next_drafts,
                                                        self.runner.backend.tables)
        self.queued = QueuedVerify(list(reqs), k, flight, drafts, logits, batch)
        self.counts.verifies_queued_ahead += 1

    # ---- drafts from the host (prompt lookup) ------------------------------------------------
    def may_queue_host_drafted(self, spec, plan, batch) -> bool:
        """Whether the `SpecDecoder` `spec`'s host round may queue the next round's verify with
        drafts proposed before the commit: the drafter can (`drafts_ahead`), every request verifies
        K drafts from its last token, and `may_queue` holds."""
        K, sched = spec.num_steps, spec.sched
        reqs = [r for r, _, _ in plan]
        return (hasattr(spec.drafter, "drafts_ahead") and self.may_queue(batch, reqs, K, spec.next_k, sched)
                and all(e - s == K + 1 and s == r.seq_len - 1 for r, s, e in plan))

    def queue_host_drafted(self, spec, group, got: dict, accepted: list[int]) -> None:
        """Between a host round's read-back and its commit (`SpecDecoder._verify_and_commit`): the
        drafts each request's next round will verify (`drafter.drafts_ahead`, from the tokens this
        round commits), and that verify queued, so the GPU works while the host commits, schedules
        and drafts. Not when someone would draft fewer than K (nothing matched) or its pages
        cannot grow."""
        K, tokens = spec.num_steps, got["token_ids"]
        reqs, new, row = [], [], 0
        for (r, drafts, _, _), n in zip(group, accepted):
            reqs.append(r)
            new.append(tokens[row:row + n + 1])
            row += len(drafts) + 1
        drafts = spec.drafter.drafts_ahead(reqs, new, K)
        reach = [r.seq_len + len(t) + K for r, t in zip(reqs, new)]  # positions up to L' - 1 + K
        if drafts is None or not all(spec.cache.grow(r, n) for r, n in zip(reqs, reach)):
            return
        # one pinned, asynchronous copy (a pageable one would wait for the stream)
        rows = [i for x, d in zip(new, drafts) for i in [x[-1]] + d]
        t = int64_to_device({"shift": [len(x) for x in new], "ids": rows}, self.runner.device)
        ids = t["ids"].view(len(reqs), K + 1)
        self.queue(reqs, K, t["shift"], ids, False, ids[:, 1:], reach, drafts=drafts)

    def take(self) -> Optional[QueuedVerify]:
        q, self.queued = self.queued, None
        return q
