"""OpenAI's `tool_choice: "required"` and `tool_choice: {"type": "function", "function": {"name":
...}}`: the answer must be tool calls, so it is constrained by a JSON schema (structured output,
`kiln.engine.grammar`) built from the request's tools, whatever the model's own tool-call format,
as vLLM does. No `--tool-call-parser` is needed.

- a named function: the answer is that function's arguments, a JSON object matching its
  `parameters` schema; it becomes one call;
- "required": the answer is a JSON array of at least one `{"name": ..., "parameters": {...}}`,
  each name one of the tools' and its parameters matching that tool's schema; each item becomes a
  call. With `parallel_tool_calls: false`, exactly one (a small model may otherwise repeat the
  same call until `max_tokens`).

`ForcedToolCalls` reads the answer into calls with the interface of `ToolCallParser`: `parse`
for a whole answer; `feed` and `finish` for a stream, which gets the calls whole at the end (the
JSON is complete only then). An answer that is not valid JSON (cut by `max_tokens`) stays
content, as with the other parsers.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from kiln.server.parsers.tool_calls import ToolCall

ANY_OBJECT: dict = {"type": "object"}


def _functions(tools: Optional[list[dict]]) -> dict[str, dict]:
    """name -> parameters schema of the request's OpenAI function tools."""
    out: dict[str, dict] = {}
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError("each tool must be {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}")
        params = fn.get("parameters")
        out[fn["name"]] = params if isinstance(params, dict) and params else ANY_OBJECT
    return out


def forced_tool_choice(tools: Optional[list[dict]], tool_choice: Any,
                       parallel_tool_calls: bool = True) -> Optional[tuple[str, Optional[str]]]:
    """For a tool_choice that forces calls: (the JSON schema text the answer must match, the named
    function or None for "required"); None for "auto", "none" or no tool_choice. ValueError
    naming the fix for a choice that cannot be met. `parallel_tool_calls=False` (OpenAI's flag)
    makes "required" one call."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if isinstance(tool_choice, str) and tool_choice != "required":
        raise ValueError(f"tool_choice {tool_choice!r} is not one of 'none', 'auto', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}")
    functions = _functions(tools)
    if not functions:
        raise ValueError("tool_choice forces a tool call, but the request has no tools; send 'tools' or "
                         "use tool_choice 'auto'")
    if tool_choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": params},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, params in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        return json.dumps(schema), None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ValueError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}")
    if name not in functions:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools ({', '.join(functions)})")
    return json.dumps(functions[name]), name


class ForcedToolCalls:
    """The calls of an answer constrained by `forced_tool_choice` (the `ToolCallParser` interface
    `OutputParser` uses). `name`: the named function, or None for "required"."""

    start_tag = end_tag = ""  # no tags: the whole answer is the calls

    def __init__(self, name: Optional[str]):
        self.name = name
        self._buf = ""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole answer: ("", calls), or (text, []) if it is not complete JSON."""
        try:
            value = json.loads(text)
        except ValueError:
            return text, []
        if self.name is not None:
            return ("", [ToolCall(0, self.name, text.strip())]) if isinstance(value, dict) else (text, [])
        if not (isinstance(value, list) and value and all(
                isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("parameters"), dict)
                for c in value)):
            return text, []
        return "", [ToolCall(i, c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for i, c in enumerate(value)]

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """Nothing until the answer is complete (`finish`)."""
        self._buf += delta
        return "", []

    def finish(self) -> tuple[str, list[dict]]:
        content, calls = self.parse(self._buf)
        self._buf = ""
        return content, [c.to_delta() for c in calls]
