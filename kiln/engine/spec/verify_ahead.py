"""`VerifyAhead`: the next round's verify forward queued on the device before this round's samples
are read back.

A steady MTP round on CUDA (`SpecDecoder._device_round`) queues verify N, its sampling and
acceptance counts, and the chain pass that drafts round N + 1, all without the host. Without
this, the host then reads the samples back, commits, schedules, builds verify N + 1's inputs from
host lists and launches it, and the GPU idles for whatever of that host work the chain pass does
not cover (docs/speculative.md, "On the H200").

Verify N + 1's inputs are a function of values already on the device: request b (seq_len L, c_b
tokens committed by round N) computes positions L - 1 + c_b .. L - 1 + c_b + K with the tokens
[samples[b, c_b - 1], the chain pass's K drafts of row b]; its write slots are the page tables'
entries at those positions (`_round_on_device` grew every request's pages to L + 2K + 1, so they
are there), and its prefix and sequence lengths move on by c_b. So right after the chain pass, verify
N's graph replays again with its static inputs moved on by the counts
(`CudaGraphRunner.replay_moved`), and the host reads round N's samples back and commits while the
GPU runs verify N + 1. The scheduler's next step takes that forward instead of building one
(`SpecDecoder.run_queued`).

Exactness. The queued forward is the one the host would build: same tokens, positions, slots and
lengths. A request that finished at round N's commit (a stop token, or an abort between the
steps) had its rows computed for nothing: they are ignored, and the others are verified over their
own rows on the host path. Its pages were released at the commit; whatever reuses them is queued
after the verify on the same stream (HiCache's copies wait for the compute stream first).

A verify is queued ahead only when the next step's batch is sure to be the same requests at the
same draft length: every running request is in it, nobody waits for admission, the next round's
length is K, and no request's next token is surely its last (max_tokens, the context). Pausing
generation drops a queued verify (`SpecDecoder.drop_queued`): requests may be retracted and the
weights updated before the next step. Not with tensor parallelism (the ranks
would have to agree on every condition; untested) or routed-expert capture (recorded on the host
per forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kiln.engine.batch import ForwardBatch
from kiln.engine.request import Req


@dataclass
class QueuedVerify:
    """A verify forward queued by the last round: its requests (row block i = reqs[i]), draft
    length, and the outputs (static-buffer views, valid until the next replay)."""

    reqs: list[Req]
    k: int
    flight: object  # the `DraftsInFlight` whose rows it verifies
    logits: torch.Tensor
    batch: ForwardBatch


class VerifyAhead:
    """Queues the next round's verify when nothing can change its batch (module docstring)."""

    def __init__(self, runner, enabled: bool):
        self.runner = runner
        self.enabled = enabled and runner.routing is None and runner.pc.tp_size == 1
        self.queued: Optional[QueuedVerify] = None

    def may_queue(self, batch: ForwardBatch, reqs: list[Req], k: int, next_k: int, sched) -> bool:
        """Whether round N (verify `batch` of `reqs` at draft length `k`) may queue round N + 1's
        verify: see the module docstring. `sched`: the scheduler (who waits, who runs)."""
        graphs = self.runner.graphs
        if not (self.enabled and graphs is not None and graphs.moves_on(batch) and next_k == k and not sched.waiting
                and len(sched.running) == len(reqs)):  # every running request is in the batch
            return False
        context = sched.context_length
        return all(len(r.output_ids) + 1 < r.params.max_tokens and r.seq_len + 1 < context for r in reqs)

    def queue(self, reqs: list[Req], k: int, samples: torch.Tensor, count: torch.Tensor, flight) -> None:
        """Queue verify N + 1: request b's rows are its last committed token samples[b, count[b] - 1]
        and the K drafts `flight.tokens[b]`, count[b] positions further on than verify N's."""
        assert self.queued is None, "a queued verify was never taken"
        # positions up to L - 1 + (K + 1) + K (request b at seq_len L; `_round_on_device` grew them)
        reach = [r.seq_len + 2 * k + 1 for r in reqs]
        assert all(len(r.pages) * self.runner.page_size >= n for r, n in zip(reqs, reach)), "past a request's pages"
        last = samples.gather(1, (count - 1)[:, None])
        ids = torch.cat([last.long(), flight.tokens[:, :k].long()], dim=1)
        self.runner.load_gate.wait_all()  # as `runner.forward` before a replay
        logits, batch = self.runner.graphs.replay_moved(count, ids, self.runner.backend.tables)
        self.queued = QueuedVerify(list(reqs), k, flight, logits, batch)

    def take(self) -> Optional[QueuedVerify]:
        q, self.queued = self.queued, None
        return q
