"""Structured output: which tokens a request may sample next, so that its output matches a JSON
schema, a regular expression or an EBNF grammar (SGLang's `json_schema` / `regex` / `ebnf`, and
OpenAI's `response_format`), through xgrammar.

Each constrained request holds a `RequestGrammar`: an xgrammar `GrammarMatcher` (the grammar
compiled once per distinct text, against the model's tokenizer) and, for a reasoning model served
with `--reasoning-parser`, the reasoning block the constraint leaves free before the answer.
Before a step samples, `GrammarBackend.mask_logits` sets the logits of every token the grammar does
not allow next to -inf, row by row; after the step, `accept_token` advances the request's
grammar by the sampled token. The grammar allows the end-of-
sequence token only where the output is complete, so a constrained request ends by the usual EOS
check (or by its length, with an incomplete match). The mask for step N + 1 depends on the token
of step N, so the scheduler reads a step with a constrained request back before it queues the
next one (no overlap scheduling for that step).

With speculative decoding a verify scores k + 1 rows per round: row i is the target's choice
after the drafts d_1..d_i. `GrammarBackend.mask_rounds` advances the matcher over the drafts
while it fills each row's mask, then rolls it back: row i is masked with the grammar's state after
d_1..d_i, up to the first draft the grammar refuses (its row before gives it probability 0, so
the verify rejects it there and no later row is read). Greedy, rejection-sampling and block
verification then all run on the masked rows, so the output is what the constrained target alone
gives (greedy: token-identical). The drafts themselves are not constrained (a refused one costs
the rest of its round), and such a round takes the host path (`SpecDecoder._round_on_device`).
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional, Sequence

import torch

INSTALL_HINT = "structured output needs the xgrammar package: pip install xgrammar"
# Compiled grammars kept per backend (distinct schema / regex / EBNF texts); RL and eval loops
# send the same few over and over.
CACHE_SIZE = 64


class GrammarBackend:
    """Compiles constraints against one tokenizer and masks logits (one per engine rank)."""

    def __init__(self, load_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
        self._load_tokenizer = load_tokenizer  # called once, at the first constrained request
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: Any = None
        self._compiled: dict[tuple[str, str], Any] = {}

    def matcher(self, grammar: tuple[str, str]) -> Any:
        """A fresh matcher for (kind, text); ValueError naming the problem for a text that does
        not compile, or when xgrammar or a tokenizer is missing."""
        compiled = self._compiled.get(grammar)
        if compiled is None:
            compiled = self._compile(*grammar)  # the first one says so if xgrammar is missing
            if len(self._compiled) >= CACHE_SIZE:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[grammar] = compiled
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def _compile(self, kind: str, text: str) -> Any:
        compiler = self._get_compiler()
        try:
            if kind == "json_schema":
                json.loads(text)  # xgrammar's own message for bad JSON is less clear
                return compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "ebnf":
                return compiler.compile_grammar(text)
        except (ValueError, RuntimeError) as e:
            why = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e)).strip()  # xgrammar's log prefix
            raise ValueError(f"{kind} does not compile: {why}") from e
        raise ValueError(f"unknown structured-output kind {kind!r}")

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            try:
                import xgrammar as xgr
            except ImportError as e:
                raise ValueError(INSTALL_HINT) from e
            try:
                tokenizer = self._load_tokenizer()
            except (OSError, ValueError) as e:
                raise ValueError(f"structured output needs the model's tokenizer: {e}") from e
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def mask_logits(self, logits: torch.Tensor, grammars: Sequence[Optional["RequestGrammar"]]) -> None:
        """Set to -inf, in place, the logits [len(grammars), V] that row i's grammar does not
        allow next (rows without one, or inside a reasoning block, are left alone)."""
        self.mask_rounds(logits, [(g, ()) for g in grammars])

    def mask_rounds(self, logits: torch.Tensor, rounds: Sequence[tuple[Optional["RequestGrammar"], Sequence[int]]]) -> None:
        """Mask, in place, a verify's rows [sum(len(drafts) + 1), V]: round j (grammar, drafts)
        owns the next len(drafts) + 1 rows, and its row i gets the grammar's mask after drafts[:i].
        Rows past the first draft the grammar refuses, or past its end, stay unmasked: the verify
        never reads them. Each grammar is left where it was (rolled back). A plain step is the
        case of no drafts."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)  # all allowed
        rows, start = [], 0
        for grammar, drafts in rounds:
            if grammar is not None:
                taken = 0
                for i in range(len(drafts) + 1):
                    if grammar.is_terminated():
                        break
                    if grammar.fill(bitmask, start + i):
                        rows.append(start + i)
                    if i == len(drafts) or not grammar.accept_token(drafts[i]):
                        break
                    taken += 1
                if taken:
                    grammar.rollback(taken)
            start += len(drafts) + 1
        assert start == logits.shape[0], (start, logits.shape)
        if rows:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self.vocab_size,
                                            indices=rows)


# A constrained request's phase: before its first token (it may open a reasoning block), inside
# the block (unconstrained), or in the answer (constrained).
OPENING, REASONING, ANSWER = "opening", "reasoning", "answer"


class RequestGrammar:
    """One request's constraint: its xgrammar matcher, and with `reasoning` = (start id, end id)
    the reasoning block before the answer, which the constraint leaves free (vLLM's and SGLang's
    reasoning-aware structured output). Without it the whole output is the answer. With it, the
    first token may also open the block (unless the prompt already did: `in_reasoning`); inside
    it nothing is masked, and the answer after its end token is constrained from the grammar's
    start. `accept_token` / `rollback` move through the phases as they move the matcher."""

    HISTORY = 64  # tokens a rollback can undo (a verify's drafts: at most the block size)

    def __init__(self, matcher: Any, reasoning: Optional[tuple[int, int]] = None, in_reasoning: bool = False):
        self.matcher = matcher
        self.start_id, self.end_id = reasoning if reasoning is not None else (None, None)
        self.phase = ANSWER if reasoning is None else REASONING if in_reasoning else OPENING
        self._history: list[tuple[str, bool]] = []  # per accepted token: (phase before, matcher moved)

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into `bitmask[row]`; False when nothing is masked (inside
        the reasoning block)."""
        if self.phase == REASONING:
            return False
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.phase == OPENING:  # the block's start is allowed too
            word, bit = divmod(self.start_id, 32)
            value = int(bitmask[row, word]) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
        return True

    def accept_token(self, token: int) -> bool:
        """Advance by `token`; False (and nothing moves) if the constraint does not allow it."""
        before, moved = self.phase, False
        if self.phase == REASONING:
            if token == self.end_id:
                self.phase = ANSWER
        elif self.phase == OPENING and token == self.start_id:
            self.phase = REASONING
        else:
            if not self.matcher.accept_token(token):
                return False
            self.phase, moved = ANSWER, True
        self._history.append((before, moved))
        del self._history[:-self.HISTORY]
        return True

    def rollback(self, num_tokens: int) -> None:
        assert num_tokens <= len(self._history), (num_tokens, len(self._history))
        for _ in range(num_tokens):
            self.phase, moved = self._history.pop()
            if moved:
                self.matcher.rollback(1)

    def is_terminated(self) -> bool:
        return self.phase == ANSWER and self.matcher.is_terminated()


def request_grammar(backend: Optional[GrammarBackend], params: Any) -> RequestGrammar:
    """The constraint state a new request with `params.grammar` starts from (its reasoning block
    first, with `params.reasoning_token_ids`); ValueError naming the fix when the engine cannot
    constrain it."""
    if backend is None:
        raise ValueError("this engine has no structured-output backend")
    return RequestGrammar(backend.matcher(params.grammar), params.reasoning_token_ids, params.starts_in_reasoning)


def accept_token(grammar: RequestGrammar, token: int, rid: str) -> None:
    """Advance a request's constraint by the token it sampled (a masked token: always allowed)."""
    ok = grammar.accept_token(token)
    assert ok, f"{rid}: sampled token {token} that its grammar does not allow"


def response_format_grammar(response_format: Optional[dict]) -> Optional[tuple[str, str]]:
    """OpenAI's `response_format` as (kind, text): {"type": "json_object"} any JSON object,
    {"type": "json_schema", "json_schema": {"schema": {...}}} that schema, {"type": "text"} or
    None no constraint. ValueError naming the fix otherwise."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return "json_schema", json.dumps({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
        return "json_schema", json.dumps(schema)
    raise ValueError(f"response_format type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'")
