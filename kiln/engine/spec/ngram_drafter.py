"""`NgramDrafter`: drafts copied from the request's own tokens (prompt lookup; no draft model).

When the sequence's last n tokens occurred before, the tokens that followed that occurrence are
the drafts (Saxena's prompt lookup decoding; vLLM's `ngram` method, SGLang's `NGRAM` without its
token tree). It costs no weights and no forward, and wins where outputs copy their inputs: edits,
rewrites, extraction, code changes, retrieval-augmented answers, and repeated text.

The match, for a sequence s of length T (prompt + output, the last token just sampled):
  - the longest n in [min, max] (`--speculative-ngram-{min,max}-match-window-size`) such that
    s[T-n:T] == s[e-n:e] for some earlier end e < T; among the ends with that longest n, the
    latest (recent text predicts the continuation best);
  - drafts d_i = s[e + i - 1] for i = 1..K, where positions at or past T read the drafts
    themselves (an overlapping copy, as LZ77 does): a run that repeats with period p keeps
    repeating, and every match yields exactly K drafts.
Candidate ends come from a per-request index keyed by the last `min` tokens, built incrementally
from committed tokens only, so a rejected draft never enters it and rollback needs nothing.

The drafts are deterministic, so verification treats them as point masses: greedy for greedy
requests, and for sampled ones exactly the target's distribution (equivalent to rejection
sampling with a one-hot q; docs/speculative.md).

Batches on CUDA graphs. The verify forward replays a graph only when every request verifies the
same number of drafts (`CudaGraphRunner`'s uniform extends); a mixed batch runs eagerly. With
`uniform` set (the runner replays graphs), when any request of a pass has a match every ready
request drafts K: one without a match copies what followed its last token's latest occurrence
(in its last FALLBACK_SCAN tokens), or repeats that token. Those drafts are cheap guesses (rows
of a memory-bound verify) that keep the batch on its graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kiln.engine.request import Req
from kiln.engine.spec.drafter import DraftState

# Candidate ends checked per proposal, latest first: bounds the host's work on very repetitive
# sequences (a token that occurs thousands of times) at the cost of sometimes missing a longer
# but older match.
MAX_CANDIDATES = 32
# How far back a request without a match looks for its last token (`NgramIndex.fallback`): its
# drafts are guesses, and a scan of a long context per round would cost more than they are worth.
FALLBACK_SCAN = 256
DEFAULT_NUM_STEPS = 4


def resolve_ngram_steps(config) -> int:
    """The draft length for `--speculative-algorithm ngram`, with a clear error for bad flags."""
    lo, hi = config.speculative_ngram_min_match_window_size, config.speculative_ngram_max_match_window_size
    if not 1 <= lo <= hi:
        raise ValueError(f"--speculative-ngram-min-match-window-size ({lo}) must be at least 1 and at most "
                         f"--speculative-ngram-max-match-window-size ({hi})")
    if config.speculative_token_map:
        raise ValueError("--speculative-token-map restricts a draft model's LM head; "
                         "--speculative-algorithm ngram has none")
    k = config.speculative_num_steps if config.speculative_num_steps is not None else DEFAULT_NUM_STEPS
    if k < 1:
        raise ValueError(f"--speculative-num-steps must be at least 1; got {k}")
    return k


class NgramIndex:
    """The ends of every `min_n`-gram of a growing token sequence, for prompt lookup.

    `ends[key]` lists, in increasing order, the ends e (exclusive) with tokens[e - min_n:e] == key
    and e < len(tokens), i.e. the occurrences that have a following token."""

    def __init__(self, min_n: int, max_n: int):
        assert 1 <= min_n <= max_n, (min_n, max_n)
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.ends: dict[tuple, list[int]] = {}

    def extend(self, new_tokens: list[int]) -> None:
        """Append tokens; index every end that now has a following token."""
        toks, n = self.tokens, self.min_n
        first = len(toks)  # end `first` gets its following token now (if there are new tokens)
        toks.extend(new_tokens)
        for e in range(max(first, n), len(toks)):
            self.ends.setdefault(tuple(toks[e - n:e]), []).append(e)

    def match(self, query: Optional[list[int]] = None) -> tuple[int, int]:
        """(end e, match length n) of the longest, then latest, earlier occurrence of the sequence's
        suffix; (-1, 0) when its last `min_n` tokens never occurred before. `query`: match the
        suffix of these tokens instead (another sequence's), against every indexed end."""
        toks = self.tokens
        q = toks if query is None else query
        T = len(q)
        if T < self.min_n:
            return -1, 0
        cands = self.ends.get(tuple(q[T - self.min_n:]))
        if not cands:
            return -1, 0
        best_e, best_n = -1, 0
        for e in reversed(cands[-MAX_CANDIDATES:]):
            n = self.min_n
            while n < self.max_n and e - n - 1 >= 0 and n < T and toks[e - n - 1] == q[T - n - 1]:
                n += 1
            if n > best_n:
                best_e, best_n = e, n
                if n == self.max_n:
                    break
        return best_e, best_n

    def continuation(self, e: int, k: int) -> list[int]:
        """k tokens copied from end e on; positions past the sequence read the copy itself."""
        toks, T = self.tokens, len(self.tokens)
        out: list[int] = []
        for i in range(k):
            p = e + i
            out.append(toks[p] if p < T else out[p - T])
        return out

    def propose(self, k: int) -> list[int]:
        """The k drafts after the best match, or [] without one."""
        e, _ = self.match()
        return self.continuation(e, k) if e >= 0 else []

    def fallback(self, k: int) -> list[int]:
        """k guesses for a sequence without a match: what followed the latest earlier occurrence of
        its last token among the last FALLBACK_SCAN, else that token repeated."""
        toks = self.tokens
        last = toks[-1]
        for e in range(len(toks) - 1, max(len(toks) - FALLBACK_SCAN, 0), -1):  # an end whose last token is `last`
            if toks[e - 1] == last:
                return self.continuation(e, k)
        return [last] * k


@dataclass
class NgramState(DraftState):
    """A request's prompt-lookup index over its committed tokens, plus the drafts for its next verify."""

    index: Optional[NgramIndex] = field(default=None, repr=False)
    # With `NgramDrafter.shadow`: the one draft it would have proposed in a round without drafts
    # ([] when nothing matched), scored against the token that step commits
    shadow: Optional[list[int]] = None
    # The position `shadow` predicts when it was looked up while that token was still on the
    # device (`run_while_pending`): scored once the token is committed
    shadow_at: Optional[int] = None


class NgramDrafter:
    """Proposes each ready request's drafts by prompt lookup (module docstring); no device work."""

    keep_logits = False
    flight = None  # drafts are always on the host
    sample_drafts = False  # set by SpecDecoder; drafts are never sampled (point masses are exact)

    def __init__(self, num_steps: int, min_n: int, max_n: int, uniform: bool = False):
        self.num_steps = num_steps
        self.min_n, self.max_n = min_n, max_n
        self.uniform = uniform
        # Every ready request drafts K in every pass, guessing where nothing matches: how benchmarks
        # time full rounds on random weights (decode_batch.py --ngram-always-draft).
        self.always = False
        # A ready request offered no drafts still looks up its first one (`NgramState.shadow`):
        # drafting is free here, so --speculative-adaptive keeps seeing how often position 1
        # would be accepted while it runs plain decode rows.
        self.shadow = False

    def new_state(self, r: Req) -> NgramState:
        return NgramState(index=NgramIndex(self.min_n, self.max_n))

    def pages_needed(self, seq_len: int, k: int) -> int:
        """Only the committed positions: the drafter writes nothing (the scheduler grows each
        request's pages for its verify rows)."""
        return seq_len

    def min_pages_needed(self, seq_len: int, k: int) -> int:
        return seq_len

    def on_forward(self, batch) -> None:
        """Nothing: the index reads committed tokens when drafting."""

    def on_commit(self, r: Req, first_pos: int, rows: slice, batch) -> None:
        """Nothing: see `on_forward`."""

    def on_weights_changed(self) -> None:
        """Nothing: no weights."""

    def can_defer(self, reqs: list[Req]) -> bool:
        """A plain step's pass may run while its tokens are still on the device: it reads
        committed tokens only (`run_while_pending`)."""
        return True

    def run_while_pending(self, reqs: list[Req]) -> None:
        """The pass after a plain step whose sampled tokens are still on the device (each
        request's last token is a placeholder): index the committed tokens and look up the
        shadow of the pending position, which `SpecDecoder` scores once it is committed."""
        for r in reqs:
            state = r.spec
            state.drafts, state.shadow, state.shadow_at = [], None, None
            if not self.shadow:
                continue
            T = r.seq_len - 1  # the placeholder's position
            if len(state.index.tokens) < T:
                state.index.extend(r.token_ids(len(state.index.tokens), T))
            state.shadow, state.shadow_at = state.index.propose(1), T

    def drafts_ahead(self, reqs: list[Req], new_tokens: list[list[int]], k: int) -> Optional[list[list[int]]]:
        """The k drafts `run` will propose for each request once `new_tokens[i]` are committed, before
        the commit (`VerifyAhead.queue_host_drafted` queues the next verify with them). Indexes the
        new tokens now: they are committed next, and a request that stops inside them finishes, so
        its index is never read again. None unless every request gets k drafts (with `uniform`,
        the same fallback guesses as `run`)."""
        out = []
        for r, new in zip(reqs, new_tokens):
            index, T = r.spec.index, r.seq_len
            if len(index.tokens) < T:
                index.extend(r.token_ids(len(index.tokens), T))
            assert len(index.tokens) == T, "the index holds committed tokens only"
            index.extend(new)
            out.append(index.propose(k))
        if self.always or (self.uniform and any(out)):
            out = [d or r.spec.index.fallback(k) for r, d in zip(reqs, out)]
        return out if all(len(d) == k for d in out) else None

    def run(self, reqs: list[Req], num_drafts: dict[str, int]) -> None:
        """Index each ready request's newly committed tokens and draft up to `num_drafts[rid]`."""
        ready = []
        for r in reqs:
            k = num_drafts.get(r.rid, 0)
            state = r.spec
            state.drafts, state.shadow, state.shadow_at = [], None, None
            if k <= 0 and not (self.shadow and r.num_computed == r.seq_len - 1):  # nothing to look up
                continue
            index = state.index
            T = r.seq_len
            assert len(index.tokens) <= T, "the index holds committed tokens only"
            if len(index.tokens) < T:
                index.extend(r.token_ids(len(index.tokens), T))
            if k <= 0:  # a ready request offered no drafts: its first one, scored but not verified
                state.shadow = index.propose(1)
                continue
            state.drafts = index.propose(k)
            ready.append((r, k))
        if self.always or (self.uniform and any(r.spec.num_drafts for r, _ in ready)):
            for r, k in ready:
                if not r.spec.num_drafts:
                    r.spec.drafts = r.spec.index.fallback(k)
