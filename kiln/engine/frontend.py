"""The API side of a request, shared by the offline `Engine` and the server's TokenizerManager.

Before the scheduler: validate (clear `ValueError`s before anything is queued) and expand
`n = k` into k scheduler requests `f"{rid}-{i}"` (seed s -> s + i). After it: per sequence, run the
incremental detokenizer, cut at stop strings, and collect tokens, logprobs and finish reasons.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.engine.io import GenerateReq, ReqOutput, TokenLogprob
from kiln.engine.outputs import CompletionOutput, RequestOutput
from kiln.engine.request import SamplingParams


class RequestError(ValueError):
    """The request cannot be served as given; the message says what to change."""


def validate_request(prompt_ids: Sequence[int], params: SamplingParams, vocab_size: int,
                     context_length: int, max_logprobs: int = 20) -> None:
    """Raise `ValueError` (a `RequestError` or `SamplingParamsError`) naming the problem."""
    params.validate(vocab_size=vocab_size, max_logprobs=max_logprobs)
    if len(prompt_ids) == 0:
        raise RequestError("The prompt is empty; give at least one token of text.")
    bad = [t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"Prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]!r}")
    if len(prompt_ids) > context_length - 1:
        raise RequestError(
            f"The prompt has {len(prompt_ids)} tokens but this model's context length is "
            f"{context_length} (prompt + output); shorten the prompt to at most "
            f"{context_length - 1} tokens.")


def sub_rid(rid: str, index: int) -> str:
    """The scheduler-side id of sequence `index` of request `rid`."""
    return f"{rid}-{index}"


def expand_request(rid: str, prompt_ids: list[int], params: SamplingParams,
                   return_routed_experts: bool = False) -> list[GenerateReq]:
    """One `GenerateReq` per sample: the scheduler only sees n == 1."""
    reqs = []
    for i in range(params.n):
        p = copy.copy(params)
        p.n = 1
        p.stop, p.stop_token_ids = list(params.stop), list(params.stop_token_ids)
        if params.seed is not None:
            p.seed = params.seed + i
        reqs.append(GenerateReq(sub_rid(rid, i), list(prompt_ids), p, return_routed_experts))
    return reqs


@dataclass
class SeqDelta:
    """What one sequence gained from one scheduler output (text already cut at stop strings)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: Optional[str]
    matched_stop: Union[str, int, None]


@dataclass
class SequenceState:
    """One sampled sequence as the API side sees it."""

    index: int
    params: SamplingParams
    detok: Optional[IncrementalDetokenizer]  # None with skip_tokenizer_init: ids only
    hide_ids: frozenset  # stop token ids whose text is not shown when they end the sequence
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    _text_parts: list[str] = field(default_factory=list, repr=False)
    finished: bool = False
    finish_reason: Optional[str] = None
    matched_stop: Union[str, int, None] = None
    needs_abort: bool = False  # stopped on a stop string while the scheduler still runs it
    routed_experts: Any = None
    spec: Any = None  # SpecCounts: speculative decoding's acceptance for this sequence

    def update(self, out: ReqOutput) -> Optional[SeqDelta]:
        # Runs once per running sequence per step (512 times a step at batch 512), so it keeps
        # to plain attribute reads; the output's lists are fresh per step and not copied.
        if self.finished:
            return None  # tokens generated after a stop string are dropped
        if out.spec is not None:
            self.spec = out.spec
        if out.routed_experts is not None:
            self.routed_experts = out.routed_experts
        new_ids, new_lps = out.new_token_ids, out.new_logprobs
        detok = self.detok
        if detok is None:
            text = ""
        else:
            hidden: Sequence[int] = ()
            shown = new_ids
            if (out.finished and out.finish_reason == "stop" and new_ids and new_ids[-1] in self.hide_ids
                    and not self.params.include_stop_str_in_output):
                hidden, shown = new_ids[-1:], new_ids[:-1]
            before = len(detok.token_ids)
            text = detok.add(shown, finished=out.finished, hidden=hidden)
            consumed = len(detok.token_ids) - before
            if consumed < len(new_ids):  # a stop string ended the sequence inside these tokens
                new_ids, new_lps = new_ids[:consumed], new_lps[:consumed]
        self.token_ids += new_ids
        if new_lps:
            self.logprobs += new_lps
        if text:
            self._text_parts.append(text)
        if detok is not None and detok.stopped:
            self.finished, self.finish_reason, self.matched_stop = True, "stop", detok.matched_stop
            self.needs_abort = not out.finished
        elif out.finished:
            self.finished, self.finish_reason, self.matched_stop = True, out.finish_reason, out.matched_stop
        return SeqDelta(self.index, text, new_ids, new_lps, self.finished, self.finish_reason, self.matched_stop)

    @property
    def text(self) -> str:
        """The text so far (cut at a stop string): kept in chunks, joined when read."""
        if len(self._text_parts) > 1:
            self._text_parts[:] = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""

    @text.setter
    def text(self, value: str) -> None:
        self._text_parts = [value] if value else []


class RequestState:
    """All sequences of one request, plus what the scheduler reports once (usage, prompt logprobs)."""

    def __init__(self, rid: str, prompt: Optional[str], prompt_ids: list[int], params: SamplingParams,
                 tokenizer: Any, eos_token_ids: Sequence[int] = (), stream: bool = True):
        """`stream`: the caller reads text as it is generated. When it does not, sequences without
        stop strings decode their text once, at the end (`IncrementalDetokenizer`'s `defer`)."""
        self.rid = rid
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        hide = frozenset(params.stop_token_ids) | frozenset(eos_token_ids)
        self.seqs = [
            SequenceState(i, params, IncrementalDetokenizer(tokenizer, prompt_ids, params, defer=not stream)
                          if tokenizer else None, hide)
            for i in range(params.n)
        ]
        self.prompt_logprobs: Optional[list] = None
        self.cached_tokens = 0
        self.cached_tokens_details: Optional[dict] = None  # by tier: device / host / disk
        self.error: Optional[str] = None
        self.num_open = params.n  # sequences not finished yet (`done` is read for every output)

    def sub_rids(self) -> list[str]:
        return [sub_rid(self.rid, s.index) for s in self.seqs]

    def unfinished_rids(self) -> list[str]:
        return [sub_rid(self.rid, s.index) for s in self.seqs if not s.finished]

    @property
    def done(self) -> bool:
        return self.error is not None or self.num_open == 0

    def update(self, index: int, out: ReqOutput) -> Optional[SeqDelta]:
        """Apply one scheduler output for sequence `index`; None if it changes nothing."""
        if out.error is not None:
            self.error = out.error
            return None
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs
        if index == 0 and out.cached_tokens:
            self.cached_tokens = out.cached_tokens
        if index == 0 and out.cached_tokens_details:
            self.cached_tokens_details = out.cached_tokens_details
        seq = self.seqs[index]
        was_open = not seq.finished
        delta = seq.update(out)
        if was_open and seq.finished:
            self.num_open -= 1
        return delta

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    def to_output(self) -> RequestOutput:
        want_lp = self.params.logprobs is not None
        outs = [CompletionOutput(s.index, s.text, list(s.token_ids), s.finish_reason,
                                 list(s.logprobs) if want_lp else None, s.matched_stop, s.routed_experts,
                                 s.spec)
                for s in self.seqs]
        return RequestOutput(self.rid, self.prompt, list(self.prompt_ids), outs, self.prompt_logprobs,
                             self.cached_tokens, self.cached_tokens_details)


def parse_sub_rid(rid: str) -> tuple[str, int]:
    """Inverse of `sub_rid`."""
    parent, _, index = rid.rpartition("-")
    return parent, int(index)
