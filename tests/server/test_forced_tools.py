"""Forced tool calls (`tool_choice` "required" / a named function, `kiln.server.parsers.forced_tools`)
and structured output after a reasoning block, through the real app around the fake engine of
`test_parsers` (no model)."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

pytest.importorskip("openai")

from kiln.server.app import create_app  # noqa: E402
from tests.server.test_parsers import (TOOLS, WEATHER, FakeTokenizerManager, chat_both_ways, comparable,  # noqa: E402
                                       streamed_message)


# ---- tool_choice "required" / a named function (`kiln.server.parsers.forced_tools`) ----------
REQUIRED_ANSWER = ('[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}, '
                   '{"name": "search", "parameters": {"query": "events"}}]')


@pytest.mark.parametrize("chunk", [1, 7])
def test_forced_tool_choice_end_to_end(chunk):
    """The answer's JSON becomes tool calls, whole and streamed alike, with no --tool-call-parser;
    the engine gets the schema that forces it (each tool's parameters under its const name)."""
    from kiln.server.parsers.forced_tools import forced_tool_choice

    tm = FakeTokenizerManager(REQUIRED_ANSWER, None, None, chunk=chunk)
    seen = []
    submit = tm.submit
    tm.submit = lambda ids, params, *a, **kw: seen.append(params) or submit(ids, params, *a, **kw)
    full, chunks = chat_both_ways(tm, tools=TOOLS, tool_choice="required")
    want = [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "events"})]
    msg = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls" and not msg.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == want
    streamed, finish = streamed_message(chunks)
    assert finish == "tool_calls" and comparable(streamed) == comparable(msg.model_dump())
    assert seen[0].json_schema == forced_tool_choice(TOOLS, "required")[0]
    schema = json.loads(seen[0].json_schema)
    assert schema["minItems"] == 1 and [s["properties"]["name"]["const"] for s in schema["items"]["anyOf"]] == [
        "get_weather", "search"]

    tm = FakeTokenizerManager('{"city": "Oslo", "days": 2}', None, None, chunk=chunk)
    named = {"type": "function", "function": {"name": "get_weather"}}
    full, chunks = chat_both_ways(tm, tools=TOOLS, tool_choice=named)
    (call,) = full.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo", "days": 2})
    assert comparable(streamed_message(chunks)[0]) == comparable(full.choices[0].message.model_dump())
    assert forced_tool_choice(TOOLS, named)[0] == json.dumps(WEATHER["function"]["parameters"])
    assert json.loads(forced_tool_choice(TOOLS, "required", parallel_tool_calls=False)[0])["maxItems"] == 1


def test_forced_tool_calls_cut_short_stay_content():
    from kiln.server.parsers.forced_tools import ForcedToolCalls

    for name, text in [(None, '[{"name": "search", "parameters": {"que'), ("f", '{"a": '), ("f", "[1]"),
                       (None, '[{"name": "f"}]'), (None, "[]")]:
        assert ForcedToolCalls(name).parse(text) == (text, [])
        p = ForcedToolCalls(name)
        assert p.feed(text) == ("", []) and p.finish() == (text, [])


@pytest.mark.parametrize("tools, choice, match", [
    (None, "required", "has no tools"),
    (TOOLS, "always", "not one of"),
    (TOOLS, {"type": "function", "function": {"name": "fly"}}, "'fly', which is not in tools (get_weather, search)"),
    (TOOLS, {"type": "function"}, "a named tool_choice is"),
    ([{"type": "function"}], "required", "each tool must be"),
])
def test_forced_tool_choice_errors(tools, choice, match):
    from kiln.server.parsers.forced_tools import forced_tool_choice

    with pytest.raises(ValueError, match=re.escape(match)):
        forced_tool_choice(tools, choice)


def test_forced_tool_choice_with_another_constraint_is_400():
    tm = FakeTokenizerManager("[]", None, None)
    app = create_app(tm.config, tm)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kiln") as http:
            return await http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": "required",
                "response_format": {"type": "json_object"}})

    r = asyncio.run(go())
    assert r.status_code == 400 and "cannot be combined with response_format" in r.json()["error"]["message"]
    assert forced_tool_choice_is_none_for_auto()


def forced_tool_choice_is_none_for_auto() -> bool:
    from kiln.server.parsers.forced_tools import forced_tool_choice

    return all(forced_tool_choice(TOOLS, c) is None for c in (None, "auto", "none"))


class TagTokenizer:
    """Just enough of a tokenizer for the server's reasoning-tag lookup: each tag is one token."""

    ids = {"<think>": [7], "</think>": [8]}

    def encode(self, text, add_special_tokens=False):
        return self.ids.get(text, [0, 0])

    def decode(self, ids, skip_special_tokens=False):
        return ""


def test_structured_output_after_reasoning_end_to_end():
    """Under --reasoning-parser a constrained chat request tells the engine the block's tag ids (the
    constraint then starts after the block), and the parsers split reasoning from the answer; tool
    calls forced by tool_choice come after the reasoning too. Without separation, no tag ids."""
    tm = FakeTokenizerManager('<think>\nplan\n</think>{"a": 1}', "inkling", None, chunk=3)
    tm.tokenizer = TagTokenizer()
    seen = []
    submit = tm.submit
    tm.submit = lambda ids, params, *a, **kw: seen.append(params) or submit(ids, params, *a, **kw)
    full, chunks = chat_both_ways(tm, response_format={"type": "json_object"})
    msg = full.choices[0].message
    assert (msg.reasoning_content, msg.content) == ("plan", '{"a": 1}')
    assert comparable(streamed_message(chunks)[0]) == comparable(msg.model_dump())
    assert seen[0].reasoning_token_ids == (7, 8) and not seen[0].starts_in_reasoning
    seen.clear()
    chat_both_ways(tm, response_format={"type": "json_object"}, extra_body={"separate_reasoning": False})
    assert seen[0].reasoning_token_ids is None
    chat_both_ways(tm)  # no constraint: nothing to tell
    assert seen[-1].reasoning_token_ids is None

    tm = FakeTokenizerManager('<think>which tool</think>[{"name": "search", "parameters": {"query": "x"}}]',
                              "inkling", None, chunk=4)
    tm.tokenizer = TagTokenizer()
    full, chunks = chat_both_ways(tm, tools=TOOLS, tool_choice="required")
    msg = full.choices[0].message
    assert msg.reasoning_content == "which tool" and full.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [("search", {"query": "x"})]
    assert comparable(streamed_message(chunks)[0]) == comparable(msg.model_dump())
