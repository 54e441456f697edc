"""Reasoning parsers: split `<think>...</think>` from the answer, whole (`parse`) or while streaming (`feed`).

Both give the same split for any chunking of the text. Outside a think block only the start tag
is a tag, inside it only the end tag. Whitespace next to a tag is dropped (the "\\n" after
`<think>`, the "\\n\\n" after `</think>`), so streaming holds back trailing whitespace until
something else follows, and holds back any text that could be the start of the next tag: a
fragment of a tag is never emitted.

A chat template may open the think block in the prompt (it ends with `<think>`); then the output
starts inside it: `starts_in_reasoning=True` (the server sets it from the prompt).
"""

from __future__ import annotations

from typing import Optional


class ReasoningParser:
    """`<think>reasoning</think>content`; a later think block also counts as reasoning."""

    start_tag = "<think>"
    end_tag = "</think>"
    starts_in_reasoning_default = False

    def __init__(self, starts_in_reasoning: Optional[bool] = None):
        if starts_in_reasoning is None:
            starts_in_reasoning = self.starts_in_reasoning_default
        self.starts_in_reasoning = starts_in_reasoning
        self._in_reasoning = starts_in_reasoning
        self._buf = ""  # not yet classified: a possible partial tag
        self._held = ""  # trailing whitespace of the current segment, dropped if a tag follows
        self._lstrip = starts_in_reasoning  # the current segment follows a tag

    # ---- whole text ----------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a complete output."""
        parts: dict[bool, list[str]] = {True: [], False: []}
        inside, after_tag, pos = self.starts_in_reasoning, self.starts_in_reasoning, 0
        while True:
            tag = self.end_tag if inside else self.start_tag
            i = text.find(tag, pos)
            segment = text[pos:] if i < 0 else text[pos:i].rstrip()
            parts[inside].append(segment.lstrip() if after_tag else segment)
            if i < 0:
                return "".join(parts[True]), "".join(parts[False])
            inside, after_tag, pos = not inside, True, i + len(tag)

    # ---- streaming -----------------------------------------------------------------------
    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning_delta, content_delta) that `delta` makes certain."""
        out = ([], [])
        self._buf += delta
        while True:
            tag = self.end_tag if self._in_reasoning else self.start_tag
            i = self._buf.find(tag)
            if i < 0:
                keep = partial_tag_len(self._buf, tag)
                self._text(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
                break
            self._text(self._buf[:i], out)
            self._held = ""  # whitespace before a tag is dropped
            self._buf = self._buf[i + len(tag):]
            self._in_reasoning, self._lstrip = not self._in_reasoning, True
        return "".join(out[0]), "".join(out[1])

    def finish(self) -> tuple[str, str]:
        """What is still held back once the output is complete (a partial tag is plain text)."""
        out = ([], [])
        self._text(self._buf, out)
        self._buf = ""
        (out[0] if self._in_reasoning else out[1]).append(self._held)
        self._held = ""
        return "".join(out[0]), "".join(out[1])

    def _text(self, s: str, out: tuple[list[str], list[str]]) -> None:
        if self._lstrip:
            s = s.lstrip()
            if not s:
                return
            self._lstrip = False
        s = self._held + s
        body = s.rstrip()
        self._held = s[len(body):]
        if body:
            (out[0] if self._in_reasoning else out[1]).append(body)


def partial_tag_len(buf: str, tag: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `tag` (0 if none)."""
    for p in range(max(0, len(buf) - len(tag) + 1), len(buf)):
        if tag.startswith(buf[p:]):
            return len(buf) - p
    return 0


class ThinkReasoningParser(ReasoningParser):
    """`<think>...</think>`: Inkling and MiniMax-M3 (MODELS.md 6), Qwen3, DeepSeek-R1."""


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "inkling": ThinkReasoningParser,
    "minimax-m3": ThinkReasoningParser,
    "qwen3": ThinkReasoningParser,
    "deepseek-r1": ThinkReasoningParser,  # its newer templates open the block: detected from the prompt
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"Unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}.") from None
