"""Requests as the engine sees them: sampling parameters, finish reasons, and `Req`.

`SamplingParams` is the user-facing contract (OpenAI / SGLang / vLLM names). `Req` is one
sequence inside the scheduler; a request with `n > 1` becomes `n` `Req`s that share their prompt
through the prefix cache.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional


class SamplingParamsError(ValueError):
    """A user-supplied sampling parameter is out of range; the message names the fix."""


@dataclass
class SamplingParams:
    """How to sample one request. Defaults follow vLLM/SGLang (temperature 1, no filtering)."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    # Logprobs: None = off; an int k >= 0 returns the chosen token's logprob plus the top k.
    logprobs: Optional[int] = None
    # Prompt logprobs: None = off; an int k >= 0 as above, for every prompt position after the first.
    prompt_logprobs: Optional[int] = None
    # Structured output (SGLang's names; at most one): the output must match this JSON schema (a
    # JSON string), regular expression or EBNF grammar (`kiln.engine.grammar`).
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    # A reasoning model's block before its answer, (start id, end id): a constraint above then
    # applies to the answer after the block, which stays free (the server sets it for chat
    # requests under --reasoning-parser). `starts_in_reasoning`: the prompt opened the block.
    reasoning_token_ids: Optional[tuple[int, int]] = None
    starts_in_reasoning: bool = False
    # OpenAI's logit_bias: token id -> a value in [-100, 100] added to its logit before sampling
    # (after the penalties; -100 all but bans a token, 100 all but forces it).
    logit_bias: Optional[dict[int, float]] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: Optional[int] = None, max_logprobs: int = 20) -> None:
        """Raise `SamplingParamsError` naming the offending field and its allowed range."""

        def bad(msg: str) -> None:
            raise SamplingParamsError(msg)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if not _finite(self.temperature) or self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < -1):
            bad(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if not _finite(self.frequency_penalty) or not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        if not _finite(self.presence_penalty) or not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= max_logprobs):
                bad(f"{name} must be an integer in [0, {max_logprobs}], got {v!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            bad("stop must be a string or a list of non-empty strings")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                bad(f"stop_token_ids must be token ids in [0, {vocab_size}), got {t!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad(f"logit_bias must map token ids to values in [-100, 100], got {self.logit_bias!r}")
            for t, v in self.logit_bias.items():
                if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                    bad(f"logit_bias keys must be token ids in [0, {vocab_size}), got {t!r}")
                if not _finite(v) or not -100.0 <= v <= 100.0:
                    bad(f"logit_bias values must be in [-100, 100], got {v!r} for token {t}")
        grammars = [n for n in ("json_schema", "regex", "ebnf") if getattr(self, n) is not None]
        if len(grammars) > 1:
            bad(f"give at most one of json_schema, regex and ebnf, got {' and '.join(grammars)}")
        if grammars and (not isinstance(getattr(self, grammars[0]), str) or not getattr(self, grammars[0])):
            bad(f"{grammars[0]} must be a non-empty string")
        ids = self.reasoning_token_ids
        if ids is not None and (len(ids) != 2 or not all(
                isinstance(t, int) and t >= 0 and (vocab_size is None or t < vocab_size) for t in ids)):
            bad(f"reasoning_token_ids must be (start id, end id) in [0, {vocab_size}), got {ids!r}")
        if grammars and self.min_tokens:
            bad(f"min_tokens cannot be combined with {grammars[0]}: the constraint decides where the output ends")

    @property
    def grammar(self) -> Optional[tuple[str, str]]:
        """(kind, text) of the structured-output constraint, or None."""
        for kind in ("json_schema", "regex", "ebnf"):
            if getattr(self, kind) is not None:
                return kind, getattr(self, kind)
        return None


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class SamplingRow(NamedTuple):
    """One request's sampling constants in the sampler's column order (`SamplingBatch.from_reqs`).

    Computed once per `Req` (its params do not change once it is queued), so that a step gathers
    the rows of a batch with one `zip` instead of reading a dozen fields per request: at hundreds
    of running requests the per-request reads were a large share of a small model's step."""

    temperature: float
    top_p: float
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    top_k: int  # 0 = disabled
    greedy: bool
    num_top_logprobs: int  # -1 = no logprobs
    needs_prompt_ids: bool  # the repetition penalty reads the prompt
    needs_output_ids: bool  # any penalty reads the output
    min_tokens: int
    suppress_ids: tuple[int, ...]  # EOS and stop ids, masked while the output is under min_tokens
    seeded: bool
    logit_bias: tuple[tuple[int, float], ...]  # (token id, value) added after the penalties

    @classmethod
    def of(cls, params: SamplingParams, eos_token_ids: tuple[int, ...]) -> "SamplingRow":
        rep = params.repetition_penalty != 1.0
        return cls(float(params.temperature), float(params.top_p), float(params.min_p),
                   float(params.repetition_penalty), float(params.frequency_penalty),
                   float(params.presence_penalty), max(int(params.top_k), 0), params.greedy,
                   params.logprobs if params.logprobs is not None else -1, rep,
                   rep or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0,
                   params.min_tokens, tuple(eos_token_ids) + tuple(params.stop_token_ids),
                   params.seed is not None, tuple((params.logit_bias or {}).items()))


class FinishReason(str, enum.Enum):
    """Why a sequence stopped; the values are OpenAI's `finish_reason` strings."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # client disconnect, explicit abort, or flush


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or retracted and waiting to recompute)
    RUNNING = "running"  # holds a request slot and KV pages
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    """One sequence inside the scheduler.

    KV bookkeeping: `num_computed` tokens of `all_ids` have K/V in the pool; `pages` are the pages
    holding them in order (the first `num_cached_pages` are shared with the prefix cache and locked
    through `cache_node`). `all_ids = prompt_ids + output_ids`.
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    return_routed_experts: bool = False
    arrival: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: Optional[FinishReason] = None
    # KV state
    slot: int = -1  # row in ReqToTokenPool
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_pages: int = 0  # leading pages owned by the prefix cache (locked)
    cache_node: object = None  # radix node locked on our behalf
    # Windowed components (sliding-window KV, ShortConv inputs): per component, the page of each
    # logical page index, or None once it fell out of the window (or was never held).
    win_pages: dict = field(default_factory=dict)
    win_trimmed: dict = field(default_factory=dict)  # per component: pages before this are None
    # Tokens whose state is complete in every component, when some component lags the computed
    # prefix (speculative decoding's MTP caches); the prefix cache takes pages only up to here.
    # None: num_computed.
    cache_limit: Optional[int] = None
    spec: object = None  # speculative decoding state (kiln.engine.spec.drafter.DraftState)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    cached_tiers: dict = field(default_factory=dict)  # those tokens by tier: device / host / disk
    match_tiers: dict = field(default_factory=dict)  # the latest prefix match, by tier (CacheManager)
    num_retractions: int = 0
    # A seeded request's draws (`kiln.engine.seeded_noise.SeededStream`), kept across retraction so
    # seeded streams stay reproducible.
    generator: object = None
    # Structured output: the xgrammar matcher of the request's constraint (`kiln.engine.grammar`).
    grammar: object = None
    # Logprob results accumulated until sent
    output_logprobs: list = field(default_factory=list)  # per output token: (logprob, top list)
    prompt_logprobs: Optional[list] = None  # per prompt position: None for 0, else (logprob, top)
    prompt_logprobs_done: int = 0  # prompt positions whose logprobs were computed
    routed_experts: object = None  # int32 [seq_len - 1, moe layers, k], filled when finished
    _sampling_row: Optional[SamplingRow] = field(default=None, repr=False)

    @property
    def sampling_row(self) -> SamplingRow:
        """`params` as the sampler's constants (computed on first use; params are fixed once queued)."""
        if self._sampling_row is None:
            self._sampling_row = SamplingRow.of(self.params, self.eos_token_ids)
        return self._sampling_row

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (a decode step needs one token of a long
        sequence, for every running request)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n:end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_output(self) -> int:
        """Output tokens so far (what min_tokens counts; `SamplingBatch.from_reqs` reads it)."""
        return len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status == ReqStatus.FINISHED

    def remaining_prefill(self) -> int:
        """Tokens that still need a forward before this request can sample."""
        return self.seq_len - self.num_computed
