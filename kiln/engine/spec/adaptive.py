"""`AdaptiveDraftLength`: each round's draft length chosen from what the rounds measure
(`--speculative-adaptive`).

A fixed K pays only while a verify row costs less than the tokens it is expected to add: at batch
1 on a GPU the K extra rows are nearly free, at batch 64 on a CPU (or a large batch on a GPU) each
costs about a decode row, and a drafter that is rarely right (prompt lookup on chat, a weak MTP
head) then makes decoding slower than plain decode. SGLang's `--speculative-adaptive` moves K
with an EMA of the acceptance length; its throughput-aware strategy scores each K by expected
tokens over a step cost profiled at startup. Kiln scores the same way, with both halves measured
while serving:

- expected tokens per request and round for draft length k, E(k) = 1 + sum_{i<=k} prod_{j<=i}
  a_j, from per-position conditional acceptance rates a_j (accepted given every earlier position
  was; a request offered k drafts that proposed fewer fails at the first missing one). A
  position's counts decay by 2% in each step that observed it, so the rates follow the workload
  and keep their last value (not the prior) through steps that draft less;
- the wall time of a steady step (every request of the step in a round of the same k, and the
  step before it too) per batch-size bucket (powers of two) and k: the least of its last 3
  intervals between two steps' forwards, which cover the forward, the verify, the drafter pass
  and the host's work.

Each step the batch's decoding requests all get the k with the best E(k) / cost(k) among the
candidates: 0 (plain decode rows), the powers of two below K, and K. So the verify keeps one shape
per step and replays a CUDA graph (the runner captures a verify graph per candidate). Lengths a
bucket has not timed are estimated: on the line through two it has timed (a verify row costs
about the same whatever k), else from the nearest bucket's line scaled to its one timed length.
The first bucket times K, then 0 (for three steps each: the first step after a switch is not
timed); a length whose estimate scores best is timed before it is used, and the others are tried
again for two steps now and then, every `probe_every` timed steps for one that scores close to
the best and (score ratio)^3 times more rarely for worse ones. The probes also refresh the
acceptance rates while plain decode is winning. Greedy output is the same whatever k is chosen
(each round is exact); what changes is time.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

logger = logging.getLogger(__name__)


def adaptive_steps(max_steps: int) -> list[int]:
    """The draft lengths `--speculative-adaptive` chooses from for K = `max_steps`: 0, the powers of
    two below K, and K (K = 4: 0, 1, 2, 4; K = 3: 0, 1, 2, 3)."""
    assert max_steps >= 1, max_steps
    steps, p = {0, max_steps}, 1
    while p < max_steps:
        steps.add(p)
        p *= 2
    return sorted(steps)


@dataclass
class _Timing:
    """The last few wall times of one (bucket, k) step, and when it was last timed (in timed steps
    of its bucket). Their minimum is the step's time: noise on the host only ever adds (a GC pause,
    another process, a new shape's first run), and one slow step must not switch the length for
    the many steps until its next probe; a window of 3 still follows the growth of the context."""

    recent: deque = field(default_factory=lambda: deque(maxlen=3))
    seconds: float = 0.0
    last: int = 0

    def add(self, seconds: float, when: int) -> None:
        self.recent.append(seconds)
        self.seconds = min(self.recent)
        self.last = when


class AdaptiveDraftLength:
    """Chooses the draft length of the next round (module docstring). The caller reports every
    verified round (`observe_round`) and every step once its forward is queued (`step_done`),
    then asks `choose` for the length the drafter pass drafts for the next step."""

    DECAY = 0.98  # acceptance counts kept per step that observed the position (~50 such steps)
    # steps a tried length runs (its first step after a switch is not timed): three the first time
    # in a bucket, so that one slow step does not decide; two to add a time later
    FIRST_PROBE_STEPS, PROBE_STEPS = 3, 2
    MAX_PROBE_SPACING = 64  # a candidate is probed at least every 64 x probe_every timed steps

    def __init__(self, max_steps: int, probe_every: int = 64, switch_margin: float = 0.02,
                 clock: Callable[[], float] = time.perf_counter):
        self.steps = adaptive_steps(max_steps)
        self.max_steps = max_steps
        self.probe_every = probe_every
        self.switch_margin = switch_margin
        self.clock = clock
        # conditional acceptance per draft position 1..K: decayed (accepted, offered) counts, with
        # a prior of one half-accepted offer so that an untried position looks worth trying
        self.accepted = [0.0] * max_steps
        self.offered = [0.0] * max_steps
        self._seen = [False] * max_steps  # positions observed since the last step
        self.timings: dict[tuple[int, int], _Timing] = {}
        self.timed_steps: dict[int, int] = {}  # bucket -> steps timed in it
        self.current = max_steps  # the k chosen for the next round
        self.probe: Optional[tuple[int, int, int]] = None  # (bucket, k, steps left)
        self._last_end: Optional[float] = None
        self._last_step: Optional[tuple[int, int]] = None  # (bucket, k) of the previous step if steady

    # ---- what the rounds measure ---------------------------------------------------------
    def observe_round(self, offered: int, proposed: int, accepted: int) -> None:
        """One request's verified round: it was offered `offered` drafts, its drafter proposed
        `proposed` of them and the first `accepted` were accepted."""
        assert 0 <= accepted <= proposed <= offered <= self.max_steps, (offered, proposed, accepted)
        for i in range(min(accepted + 1, offered)):  # position i + 1 was reached
            self.offered[i] += 1.0
            self.accepted[i] += float(i < accepted)
            self._seen[i] = True

    def rate(self, position: int) -> float:
        """The conditional acceptance rate of draft position `position` (1-based)."""
        i = position - 1
        return (self.accepted[i] + 0.5) / (self.offered[i] + 1.0)

    def expected_tokens(self, k: int) -> float:
        """Tokens a request is expected to emit in a round with k drafts (1 for k = 0)."""
        total, run = 1.0, 1.0
        for i in range(1, k + 1):
            run *= self.rate(i)
            total += run
        return total

    def step_done(self, batch_size: int, k: Optional[int]) -> None:
        """Once per step, at the same point of each (its forward queued, its verify not yet run):
        `k` is the draft length every request of the step was offered when the step was steady
        (all `batch_size` requests in a round of k drafts, 0 for plain decode rows), else None. The
        interval since the previous call is one step period (the previous step's verify, commit
        and drafter pass, this step's scheduling and forward; on a GPU the host waits there for
        the previous forward), timed when both steps were steady with the same bucket and k.
        Called before `choose` decides the next step; decays the acceptance counts of the
        positions observed since the last call."""
        now = self.clock()
        d = self.DECAY
        for i in range(self.max_steps):  # only positions seen this step: no news is not forgetting
            if self._seen[i]:
                self.accepted[i] *= d
                self.offered[i] *= d
                self._seen[i] = False
        key = (bucket(batch_size), k) if k is not None else None
        if key is not None and key == self._last_step and self._last_end is not None:
            self._record(key, now - self._last_end)
        self._last_end, self._last_step = now, key

    def _record(self, key: tuple[int, int], seconds: float) -> None:
        b = key[0]
        self.timed_steps[b] = self.timed_steps.get(b, 0) + 1
        self.timings.setdefault(key, _Timing()).add(seconds, self.timed_steps[b])

    # ---- the choice --------------------------------------------------------------------------
    def _profile(self, b: int) -> dict[int, float]:
        """Step times of bucket b for the lengths it timed, and for the others an estimate: linear
        in k through two timed lengths (each verify row costs about the same), else the nearest
        such bucket's profile scaled to b's one timed length (or taken as is when b timed none:
        only ratios matter for the choice). Empty when nothing can be estimated."""
        own = self._linear(b)
        if own is not None:
            return own
        timed = {k: self.timings[(b, k)].seconds for k in self.steps if (b, k) in self.timings}
        near = sorted({bb for bb, _ in self.timings if bb != b}, key=lambda bb: abs(bb.bit_length() - b.bit_length()))
        for bb in near:
            ref = self._linear(bb)
            if ref is not None:
                if not timed:
                    return ref
                (j, t), = timed.items()
                return {k: timed.get(k, t * ref[k] / ref[j]) for k in self.steps}
        return {}

    def _linear(self, b: int) -> Optional[dict[int, float]]:
        """Bucket b's step times, the untimed lengths on the line through its shortest and longest
        timed ones; None with fewer than two timed."""
        timed = {k: self.timings[(b, k)].seconds for k in self.steps if (b, k) in self.timings}
        if len(timed) < 2:
            return None
        lo, hi = min(timed), max(timed)
        slope = (timed[hi] - timed[lo]) / (hi - lo)
        return {k: timed.get(k, max(timed[lo] + slope * (k - lo), 1e-9)) for k in self.steps}

    def choose(self, batch_size: int) -> int:
        """The draft length of the next round for `batch_size` decoding requests."""
        steps = self.steps
        b = bucket(batch_size)
        if self.probe is not None and self.probe[0] == b and self.probe[2] > 0:
            self.probe = (b, self.probe[1], self.probe[2] - 1)
            return self._set(self.probe[1])
        self.probe = None
        cost = self._profile(b)
        if not cost:  # nothing to estimate from: time K, then plain decode rows (a line through both)
            k = next(k for k in (max(steps), 0) if (b, k) not in self.timings)
            return self._start_probe(b, k)
        scores = {k: self.expected_tokens(k) / cost[k] for k in steps}
        best = max(steps, key=lambda k: scores[k])
        if scores[best] <= scores[self.current] * (1.0 + self.switch_margin):
            best = self.current  # hysteresis: keep the current length unless another is clearly better
        if (b, best) not in self.timings:  # the best is an estimate: time it
            return self._start_probe(b, best)
        # Probe the others again, the worse ones more rarely: a candidate r times worse than the
        # best waits r^3 times longer (a probe of a length that costs several decode rows is what
        # the probing costs); one never timed in this bucket counts as timed at its start
        n = self.timed_steps.get(b, 0)
        last = {k: self.timings[(b, k)].last if (b, k) in self.timings else 0 for k in steps}
        due = [k for k in steps if k != best and n - last[k]
               >= self.probe_every * min((scores[best] / scores[k]) ** 3, self.MAX_PROBE_SPACING)]
        if due:
            return self._start_probe(b, max(due, key=lambda k: scores[k]))
        return self._set(best)

    def _start_probe(self, b: int, k: int) -> int:
        steps = self.PROBE_STEPS if (b, k) in self.timings else self.FIRST_PROBE_STEPS
        self.probe = (b, k, steps - 1)
        return self._set(k)

    def _set(self, k: int) -> int:
        if k != self.current and self.probe is None:
            logger.debug("speculative draft length %d -> %d", self.current, k)
        self.current = k
        return k


def bucket(batch_size: int) -> int:
    """The batch-size bucket step times are kept for: the power of two at or above it."""
    return 1 << max(batch_size - 1, 0).bit_length()
