"""The contract between `SpecDecoder` (the speculative round) and a drafter.

A drafter is chosen by `--speculative-algorithm`: `MTPDrafter` (mtp), `BlockDraftRunner`
(dflash, dspark) or `NgramDrafter` (ngram). Per step, after the target forward over the step's
mixed batch, `SpecDecoder` calls, in this order:

  1. `on_forward(batch)`: before verification, with every row of the forward (prefill chunks and
     verify rows, committed or not). A drafter whose per-token state lives in the engine's page
     spaces writes it here for every row, like the target's own K/V: rows past the committed
     prefix are overwritten before anything reads them (rollback is bookkeeping).
  2. verification and commit (`num_computed` becomes the committed length);
  3. `on_commit(req, first_pos, rows, batch)` for each request still running: `rows` are the
     forward's rows of its newly committed positions first_pos .. first_pos + len(rows) - 1;
  4. `run(reqs, num_drafts)`: catch up and draft `num_drafts[rid]` tokens (0: none) for the
     requests that are ready to decode, into `req.spec` (a `DraftState`).

A plain step (no drafts) followed by another may run under overlap scheduling
(`SpecDecoder._overlapped_plain_step`) when `can_defer(reqs)` says the pass needs none of the
step's sampled tokens: then `on_commit` is called for the step's rows (their input tokens are
committed) and `run_while_pending(reqs)` replaces `run`, while each request's last token is still a
placeholder on the device that must not be read.

`DraftState.drafts` are the tokens the next round verifies. `DraftState.q` is for drafters that
*sample* their drafts: row i is the distribution d_{i+1} was drawn from ([k, V], the final
sampling distribution after temperature/top-k/top-p/min-p/penalties), what token-wise rejection
sampling and block verification need. None means the drafts are deterministic (greedy argmax):
verification then treats them as point masses, which is exact too (notes/algorithms.md 1.5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from kiln.engine.request import Req
from kiln.engine.sampled_step import HostReadback
from kiln.engine.spec.metrics import SpecCounts


@dataclass
class DraftsInFlight:
    """One drafter pass's drafts, still on the device: `tokens` [n, K] int64, row i for the pass's
    i-th request, with their pinned read-back queued right behind them (`HostReadback`), so that
    reading them (`fetch`) waits for the pass only, not for the verify forward queued after it.

    This lets a round's host work (outputs, scheduling, the next verify's inputs) run while the
    GPU still drafts: the next verify reads its draft tokens on the device (`SpecDecoder.draft_ids`),
    and the host reads them back only to verify, after that forward is queued."""

    tokens: torch.Tensor
    readback: HostReadback

    @classmethod
    def start(cls, tokens: torch.Tensor) -> "DraftsInFlight":
        return cls(tokens, HostReadback({"tokens": tokens}))

    def fetch(self) -> list[list[int]]:
        return self.readback.lists()["tokens"]


@dataclass
class DraftState:
    """A request's drafter state: its drafts for the next verify and its acceptance counters.

    `drafts` reads back drafts still on the device (`in_flight`: the pass and this request's row)
    the first time it is read; `num_drafts` and `in_flight` do not wait for them."""

    _drafts: list[int] = field(default_factory=list)
    q: Optional[torch.Tensor] = None  # [len(drafts), V] when sampled, None for greedy drafts
    counts: SpecCounts = field(default_factory=SpecCounts)  # this request's acceptance
    draft_logits: list = field(default_factory=list)  # per draft [V], when the drafter keeps them (tests)
    in_flight: Optional[tuple[DraftsInFlight, int]] = None
    _num_in_flight: int = 0

    @property
    def drafts(self) -> list[int]:
        if self.in_flight is not None:
            flight, row = self.in_flight
            self._drafts = flight.fetch()[row][:self._num_in_flight]
            self.in_flight = None
        return self._drafts

    @drafts.setter
    def drafts(self, tokens: list[int]) -> None:
        self._drafts, self.in_flight = tokens, None

    def set_in_flight(self, flight: DraftsInFlight, row: int, k: int) -> None:
        """The drafts are row `row` of `flight` (its first k tokens), not read back yet."""
        self._drafts, self.in_flight, self._num_in_flight = [], (flight, row), k

    @property
    def num_drafts(self) -> int:
        return self._num_in_flight if self.in_flight is not None else len(self._drafts)

    @property
    def complete(self) -> Optional[int]:
        """Tokens whose drafter state is complete (caps prefix caching); None: every computed one."""
        return None


class Drafter(Protocol):
    """What `SpecDecoder` needs of a drafter (see the module docstring for the call order)."""

    num_steps: int  # the longest draft
    keep_logits: bool  # keep each draft's logits in `DraftState.draft_logits` (tests)
    flight: Optional[DraftsInFlight]  # the last pass's drafts when still on the device, else None

    def new_state(self, r: Req) -> DraftState:
        """State for a request just (re)admitted with `r.num_computed` tokens from the prefix cache."""

    def pages_needed(self, seq_len: int, k: int) -> int:
        """Positions the request's pages must cover to draft k tokens after this step."""

    def min_pages_needed(self, seq_len: int, k: int) -> int:
        """The fewest positions with which the request still drafts k tokens, on a slower pass
        when the pool cannot give it `pages_needed` (a block drafter's padded pass)."""

    def on_forward(self, batch) -> None: ...

    def on_commit(self, r: Req, first_pos: int, rows: slice, batch) -> None: ...

    def on_weights_changed(self) -> None:
        """After the target's weights changed in place (RL updates, LoRA merges): refresh any copy."""

    def run(self, reqs: list[Req], num_drafts: dict[str, int]) -> None: ...

    def can_defer(self, reqs: list[Req]) -> bool:
        """Whether the pass after a plain step may run before the step's tokens are read back."""

    def run_while_pending(self, reqs: list[Req]) -> None:
        """That pass (no drafts; the requests' last tokens are placeholders on the device)."""
