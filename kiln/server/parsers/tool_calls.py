"""Tool-call parsers: turn tool-call blocks in the model's answer into OpenAI `tool_calls`.

A parser knows its block tags (`<minimax:tool_call>...</minimax:tool_call>`,
`<tool_call>...</tool_call>`) and how to read one block's inside (`parse_block`). Text outside
the blocks is content. `parse(text)` reads a complete output; `feed(delta)` streams: content is
emitted as soon as it cannot be part of a start tag, and each block's calls are emitted whole, in
OpenAI's streaming shape, once its end tag arrives. Both give the same result for any chunking.

Rules shared by both: whitespace right before and right after a parsed block is dropped (so
"Let me check.\\n<block>" has content "Let me check."); a block that does not parse, or one that
never closes, is left in the content unchanged.
"""

from __future__ import annotations

import abc
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from kiln.server.parsers.reasoning import partial_tag_len


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    index: int  # position among the calls of one choice
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        """The entry of `message.tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def to_delta(self) -> dict:
        """The whole call as one entry of a streaming `delta.tool_calls`."""
        return {"index": self.index, **self.to_openai()}


class ToolCallParser(abc.ABC):
    start_tag: str = ""
    end_tag: str = ""

    def __init__(self, tools: Optional[list[dict]] = None):
        """`tools`: the request's OpenAI tool list; parameter schemas type the arguments."""
        self.schemas: dict[str, dict] = {}
        for tool in tools or ():
            fn = tool.get("function", tool) if isinstance(tool, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                params = fn.get("parameters")
                self.schemas[fn["name"]] = params if isinstance(params, dict) else {}
        self._count = 0
        self._buf = ""  # outside: a possible partial start tag; inside: the open block so far
        self._inside = False
        self._held = ""  # trailing whitespace of the content, dropped if a parsed block follows
        self._lstrip = False  # the content so far ends with a parsed block

    @abc.abstractmethod
    def parse_block(self, inner: str) -> Optional[list[tuple[str, dict]]]:
        """[(name, arguments)] of one block's inside, or None if it is malformed."""

    # ---- whole text ----------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, tool calls) of a complete answer."""
        content, calls, pos, after_block = "", [], 0, False
        while True:
            i = text.find(self.start_tag, pos)
            segment = text[pos:] if i < 0 else text[pos:i]
            content += segment.lstrip() if after_block else segment
            if i < 0:
                return content, calls
            j = text.find(self.end_tag, i + len(self.start_tag))
            if j < 0:  # never closed: plain text
                return content + text[i:], calls
            parsed = self.parse_block(text[i + len(self.start_tag):j])
            if parsed is None:
                content += text[i:j + len(self.end_tag)]
                after_block = False
            else:
                content = content.rstrip()
                calls += self._calls(parsed)
                after_block = True
            pos = j + len(self.end_tag)

    # ---- streaming -----------------------------------------------------------------------
    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """(content_delta, tool-call deltas) that `delta` makes certain."""
        out: list[str] = []
        deltas: list[dict] = []
        self._buf += delta
        while True:
            if not self._inside:
                i = self._buf.find(self.start_tag)
                if i < 0:
                    keep = partial_tag_len(self._buf, self.start_tag)
                    self._text(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                self._text(self._buf[:i], out)
                self._buf, self._inside = self._buf[i:], True
            j = self._buf.find(self.end_tag, len(self.start_tag))
            if j < 0:
                break
            block, self._buf, self._inside = self._buf[: j + len(self.end_tag)], self._buf[j + len(self.end_tag):], False
            parsed = self.parse_block(block[len(self.start_tag): j])
            if parsed is None:
                self._text(block, out)
            else:
                self._held, self._lstrip = "", True
                deltas += [c.to_delta() for c in self._calls(parsed)]
        return "".join(out), deltas

    def finish(self) -> tuple[str, list[dict]]:
        """What is still held back once the output is complete (an unclosed block is content)."""
        out: list[str] = []
        self._text(self._buf, out)
        out.append(self._held)
        self._buf, self._held, self._inside = "", "", False
        return "".join(out), []

    def _text(self, s: str, out: list[str]) -> None:
        if self._lstrip:
            s = s.lstrip()
            if not s:
                return
            self._lstrip = False
        s = self._held + s
        body = s.rstrip()
        self._held = s[len(body):]
        if body:
            out.append(body)

    def _calls(self, parsed: list[tuple[str, dict]]) -> list[ToolCall]:
        calls = []
        for name, args in parsed:
            calls.append(ToolCall(self._count, name, json.dumps(args, ensure_ascii=False)))
            self._count += 1
        return calls


# ---- MiniMax XML -----------------------------------------------------------------------------
_NAME = r"""\s+name\s*=\s*(?:"([^"]*)"|'([^']*)')\s*>"""
_INVOKE = re.compile(r"\s*<invoke" + _NAME + r"(.*?)</invoke>\s*", re.S)
_PARAM = re.compile(r"\s*<parameter" + _NAME + r"(.*?)</parameter>\s*", re.S)


def _full_matches(pattern: re.Pattern, text: str) -> Optional[list[re.Match]]:
    """Consecutive matches covering all of `text`, or None if anything else is there."""
    matches, pos = [], 0
    while pos < len(text):
        m = pattern.match(text, pos)
        if m is None or m.end() == pos:
            return None
        matches.append(m)
        pos = m.end()
    return matches


class MiniMaxToolCallParser(ToolCallParser):
    """`<minimax:tool_call><invoke name="f"><parameter name="p">v</parameter>...</invoke>...</minimax:tool_call>`
    (Inkling and MiniMax-M3, MODELS.md 6). Values are typed by the tool's JSON schema."""

    start_tag = "<minimax:tool_call>"
    end_tag = "</minimax:tool_call>"

    def parse_block(self, inner: str) -> Optional[list[tuple[str, dict]]]:
        invokes = _full_matches(_INVOKE, inner)
        if not invokes:
            return None
        calls = []
        for inv in invokes:
            name = inv.group(1) if inv.group(1) is not None else inv.group(2)
            params = _full_matches(_PARAM, inv.group(3)) if inv.group(3).strip() else []
            if not name or params is None:
                return None
            props = self.schemas.get(name, {}).get("properties")
            props = props if isinstance(props, dict) else {}
            args = {}
            for p in params:
                key = p.group(1) if p.group(1) is not None else p.group(2)
                args[key] = convert_value(p.group(3), props.get(key))
            calls.append((name, args))
        return calls


def convert_value(raw: str, schema: Any) -> Any:
    """A parameter's text as its schema's type; a string when untyped or when nothing fits."""
    text = raw.strip()
    for t in _schema_types(schema):
        if t == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if t == "null" and text.lower() in ("null", "none"):
            return None
        if t in ("integer", "number", "object", "array"):
            try:
                value = json.loads(text)
            except ValueError:
                continue
            if t == "integer" and isinstance(value, float) and value.is_integer():
                value = int(value)
            ok = {"integer": int, "number": (int, float), "object": dict, "array": list}[t]
            if isinstance(value, ok) and not isinstance(value, bool):
                return value
    # A string keeps its inner whitespace; only the newlines around the value are layout.
    if raw.startswith("\n"):
        raw = raw[1:]
    return raw[:-1] if raw.endswith("\n") else raw


def _schema_types(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    types = [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list) else []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            types += _schema_types(sub)
    if not types and "enum" in schema:
        types = sorted({_json_type(v) for v in schema["enum"]})
    return [x for x in types if x != "string"]  # a string needs no conversion: the fallback


def _json_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return "null" if v is None else "string"


# ---- Hermes JSON -----------------------------------------------------------------------------
class HermesToolCallParser(ToolCallParser):
    """`<tool_call>{"name": "f", "arguments": {...}}</tool_call>` (Llama family, Qwen2.5/3)."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def parse_block(self, inner: str) -> Optional[list[tuple[str, dict]]]:
        try:
            obj = json.loads(inner)
        except ValueError:
            return None
        calls = []
        for item in obj if isinstance(obj, list) else [obj]:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
                return None
            args = item.get("arguments", item.get("parameters", {}))
            if isinstance(args, str):  # some models send the arguments already encoded
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            if not isinstance(args, dict):
                return None
            calls.append((item["name"], args))
        return calls or None


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "inkling": MiniMaxToolCallParser,
    "minimax-m3": MiniMaxToolCallParser,
    "hermes": HermesToolCallParser,
}


def get_tool_call_parser(name: str) -> type[ToolCallParser]:
    try:
        return TOOL_CALL_PARSERS[name]
    except KeyError:
        raise ValueError(f"Unknown tool-call parser {name!r}; choose one of {sorted(TOOL_CALL_PARSERS)}.") from None
