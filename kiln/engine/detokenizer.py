"""Incremental detokenization with stop strings.

Decoding one token at a time is wrong for byte-level BPE (a character may span tokens) and for
sentencepiece (a token's leading space depends on its neighbour). We follow vLLM: keep a
`prefix_offset` and a `read_offset` into the token list, decode `ids[prefix:]` and
`ids[prefix:read]`, and emit only the difference, and only once it no longer ends in an
incomplete character (U+FFFD).

Stop strings are checked on the output text. While streaming, a suffix that could still become a
stop string is held back, so no fragment of a stop string is ever emitted.

A sequence nobody streams and no stop string can end (`defer`) is decoded once, when it finishes:
the text is decode(context + output) after decode(context), two Rust calls per sequence instead of
two per token (at batch 512 those calls were the largest host cost of offline generation). It is
the streamed text, except where a character's bytes are split by MAX_PENDING_TOKENS or more tokens
that add no text (skipped special tokens): a stream has shown replacement characters by then, the
single decode joins the bytes into the character.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

from kiln.engine.request import SamplingParams

# Prompt tokens decoded as left context, so the first output token gets its leading space right.
INITIAL_CONTEXT = 5
# A character is at most 4 UTF-8 bytes, so a window still ending in U+FFFD after this many tokens
# holds a real replacement character (or invalid bytes); emit it instead of waiting forever.
MAX_PENDING_TOKENS = 6
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas for one sequence.

    `add(ids)` returns the new text that is safe to show. Once a stop string appears,
    `stopped` is True, `matched_stop` holds it, `text` is cut before it (after it with
    `include_stop_str_in_output`) and later tokens are ignored. `token_ids` are the output tokens
    consumed up to and including the one that completed the stop string.

    The text is kept as the chunks already returned plus a short pending tail (what a stop string
    could still start in), so a token costs the same at the 10,000th as at the first: appending to
    one growing string copied it every token.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], params: SamplingParams, defer: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        # A fast tokenizer's Rust decoder, called directly: what transformers' decode returns with
        # clean_up_tokenization_spaces=False, without its Python layers (1.9 against 5.1 us a call
        # on a 2-core CPU; two calls per token, for every running sequence).
        self._backend = tokenizer.backend_tokenizer if _fast_decode_ok(tokenizer) else None
        if self._backend is not None:
            self._decode = functools.partial(self._backend.decode, skip_special_tokens=self.skip_special_tokens)
        else:
            self._decode = functools.partial(tokenizer.decode, skip_special_tokens=self.skip_special_tokens,
                                             clean_up_tokenization_spaces=False)
        self.stop: list[str] = [s for s in params.stop if s]
        self.include_stop = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._ids: list[int] = list(prompt_ids[-INITIAL_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._emitted: list[str] = []  # text already returned, in chunks
        self._pending = ""  # text after it: held back while it could start a stop string
        self.token_ids: list[int] = []
        self.stopped = False
        self.matched_stop: Optional[str] = None
        # No text until the sequence finishes (module docstring); never with stop strings, which
        # must be found as the text grows.
        self.defer = defer and not self.stop

    @property
    def text(self) -> str:
        """The output text so far (cut at the stop string once stopped)."""
        return "".join(self._emitted) + self._pending

    # ---- public ---------------------------------------------------------------------------
    def add(self, token_ids: Sequence[int], finished: bool = False, hidden: Sequence[int] = ()) -> str:
        """Consume new output tokens; return the text delta safe to emit now.

        `finished`: the sequence ended, so flush held-back text and any incomplete character.
        `hidden`: tokens that count as output but add no text (a stop token id when the stop is
        not to be included in the output).
        """
        if self.defer:
            self.token_ids.extend(token_ids)
            self.token_ids.extend(hidden)
            self._ids.extend(token_ids)
            if finished:
                self._append_text(self._decode_all())
            return self._take(final=finished)
        if not self.stopped:
            for tid in token_ids:
                self.token_ids.append(tid)
                delta = self._decode_next(tid)
                if delta:
                    self._append_text(delta)
                    if self.stopped:
                        break
            else:
                self.token_ids.extend(hidden)
                if finished:
                    self._append_text(self._flush_pending())
        return self._take(final=finished or self.stopped)

    # ---- decoding -------------------------------------------------------------------------
    def _decode_next(self, tid: int) -> str:
        self._ids.append(tid)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        pending = len(self._ids) - self._read_offset
        if len(full) > len(prefix) and (not full.endswith(REPLACEMENT) or pending >= MAX_PENDING_TOKENS):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return full[len(prefix):]
        return ""

    def _decode_all(self) -> str:
        """A deferred sequence's whole text, in one decode after its context (module docstring)."""
        assert self._prefix_offset == 0, "a deferred sequence decodes once"
        return self._decode(self._ids)[len(self._decode(self._ids[:self._read_offset])):]

    def _flush_pending(self) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix):]

    # ---- stop strings ---------------------------------------------------------------------
    def _append_text(self, delta: str) -> None:
        if not delta:
            return
        old_len = len(self._pending)
        self._pending += delta
        if self.stop:
            self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> None:
        # A match must end in the new text, and cannot start before the pending text: `_take`
        # holds back the longest suffix that could begin a stop string, so text already
        # returned never starts one. Text before `start` was already searched.
        start = max(0, old_len - self._max_stop_len + 1)
        best: Optional[tuple[int, str]] = None
        for s in self.stop:
            i = self._pending.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return
        i, s = best
        self._pending = self._pending[: i + len(s)] if self.include_stop else self._pending[:i]
        self.stopped = True
        self.matched_stop = s

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string (it
        lies within the pending text, for the reason in `_check_stop`)."""
        hold = 0
        text = self._pending
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def _take(self, final: bool) -> str:
        hold = 0 if final or not self.stop else self._held_back()
        pending = self._pending
        if hold:
            delta, self._pending = pending[:-hold], pending[-hold:]
        else:
            delta, self._pending = pending, ""
        if delta:
            self._emitted.append(delta)
        return delta


# Where transformers defines the decode path of a fast tokenizer: the Rust decoder plus an optional
# clean-up (v5 `TokenizersBackend`, v4 `PreTrainedTokenizerFast`).
_PLAIN_DECODE_MODULES = ("transformers.tokenization_utils_base", "transformers.tokenization_utils_tokenizers",
                         "transformers.tokenization_utils_fast")


def _fast_decode_ok(tokenizer: Any) -> bool:
    """True when `tokenizer.decode` is transformers' own decode of a fast tokenizer (neither
    `decode` nor `_decode` overridden by a class that post-processes the text), so its Rust
    backend gives the same text with clean_up_tokenization_spaces=False."""

    def owner(name: str) -> Optional[str]:
        cls = next((c for c in type(tokenizer).__mro__ if name in vars(c)), None)
        return cls.__module__ if cls is not None else None

    return (getattr(tokenizer, "backend_tokenizer", None) is not None
            and owner("decode") in _PLAIN_DECODE_MODULES and owner("_decode") in _PLAIN_DECODE_MODULES)
