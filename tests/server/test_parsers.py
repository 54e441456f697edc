"""Reasoning and tool-call parsers: whole text vs every chunking of it, and through the real app.

The end-to-end tests build the FastAPI app around a fake TokenizerManager that streams a fixed
answer (no model, no engine process) and talk to it with the openai client over ASGI.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import uuid
from types import SimpleNamespace

import httpx
import pytest

# the client these tests drive (CI installs it; the GPU machines have none: `pytest -m gpu tests` skips them)
openai = pytest.importorskip("openai")

from kiln.config import EngineConfig
from kiln.engine.frontend import RequestState, SeqDelta
from kiln.server.app import create_app
from kiln.server.parsers.reasoning import REASONING_PARSERS, ReasoningParser, partial_tag_len
from kiln.server.parsers.tool_calls import (TOOL_CALL_PARSERS, HermesToolCallParser, MiniMaxToolCallParser,
                                            convert_value)
from kiln.server.serving import OutputParser
from kiln.server.tokenizer_manager import RequestHandle

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "scale": {"type": "number"}, "hours": {"type": "array"}, "where": {"type": "object"},
    "note": {"type": ["integer", "null"]}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}}}
TOOLS = [WEATHER, SEARCH]

MINIMAX_ANSWER = (
    "<think>\nThe user wants the weather. I'll call get_weather; maybe search too.\n</think>\n\n"
    "Let me check.\n<minimax:tool_call>\n"
    '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
    '<parameter name="days">3</parameter>\n<parameter name="metric">true</parameter>\n'
    '<parameter name="scale">1.5</parameter>\n<parameter name="hours">[9, 12]</parameter>\n'
    '<parameter name="where">{"lat": 48.8}</parameter>\n<parameter name="note">null</parameter>\n</invoke>\n'
    '<invoke name="search"><parameter name="query">\n  Paris <b>events</b>\n</parameter>'
    '<parameter name="limit">5</parameter></invoke>\n'
    "</minimax:tool_call>\n"
    '<minimax:tool_call><invoke name="unknown_tool"><parameter name="n">7</parameter></invoke></minimax:tool_call>\n')
MINIMAX_CALLS = [
    ("get_weather", {"city": "Paris", "days": 3, "metric": True, "scale": 1.5, "hours": [9, 12],
                     "where": {"lat": 48.8}, "note": None}),
    ("search", {"query": "  Paris <b>events</b>", "limit": 5}),
    ("unknown_tool", {"n": "7"}),  # no schema: strings
]

# (parser name, starts_in_reasoning, text, expected reasoning, expected content)
REASONING_CASES = [
    ("inkling", False, "<think>\nLet me add.\n2+2=4\n</think>\n\nThe answer is 4.", "Let me add.\n2+2=4",
     "The answer is 4."),
    ("minimax-m3", True, "I am already thinking.</think>Done.", "I am already thinking.", "Done."),
    ("inkling", False, "No reasoning at all, 1 < 2 and <b>bold</b>.", "",
     "No reasoning at all, 1 < 2 and <b>bold</b>."),
    ("inkling", False, "<think>cut off mid thought <", "cut off mid thought <", ""),
    ("inkling", False, "Answer ends with a partial tag <thin", "", "Answer ends with a partial tag <thin"),
    ("inkling", True, "thinking </thin", "thinking </thin", ""),
    ("inkling", False, "<think>a</think>b<think>c</think>d", "ac", "bd"),
    ("inkling", False, "<<think>x</think></think>y", "x", "<</think>y"),
    ("inkling", False, "<think></think>", "", ""),
    ("inkling", False, "<think>r</think>  spaced answer  ", "r", "spaced answer  "),
]

# (parser, tools, text, expected content, expected [(name, arguments)])
TOOL_CASES = [
    ("minimax-m3", TOOLS, MINIMAX_ANSWER.split("</think>\n\n")[1], "Let me check.", MINIMAX_CALLS),
    ("inkling", TOOLS, "Plain answer, no tools. <minimax:tool", "Plain answer, no tools. <minimax:tool", []),
    ("inkling", TOOLS, 'Malformed: <minimax:tool_call><invoke name="f">oops</invoke></minimax:tool_call> end',
     'Malformed: <minimax:tool_call><invoke name="f">oops</invoke></minimax:tool_call> end', []),
    ("inkling", TOOLS, "Junk <minimax:tool_call>hello</minimax:tool_call>",
     "Junk <minimax:tool_call>hello</minimax:tool_call>", []),
    ("inkling", TOOLS, 'Unclosed <minimax:tool_call><invoke name="search"><parameter name="query">x',
     'Unclosed <minimax:tool_call><invoke name="search"><parameter name="query">x', []),
    ("inkling", None, '<minimax:tool_call><invoke name="search"><parameter name="limit">5</parameter>'
     "</invoke></minimax:tool_call>", "", [("search", {"limit": "5"})]),
    ("minimax-m3", TOOLS, "Before.\n<minimax:tool_call><invoke name='search'></invoke></minimax:tool_call>\n\nAfter.",
     "Before.After.", [("search", {})]),
    ("hermes", TOOLS, 'I will search.\n<tool_call>\n{"name": "search", "arguments": {"query": "kiln", "limit": 2}}\n'
     '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>',
     "I will search.", [("search", {"query": "kiln", "limit": 2}), ("get_weather", {"city": "Oslo"})]),
    ("hermes", TOOLS, "<tool_call>{not json}</tool_call> and <tool_call>{\"name\": \"x\"}</tool_call>",
     "<tool_call>{not json}</tool_call> and", [("x", {})]),
    ("hermes", TOOLS, "Answer with a stray </tool_call> and <tool_ca", "Answer with a stray </tool_call> and <tool_ca",
     []),
]

def chunkings(text: str, seed: int = 0, randoms: int = 30):
    """1-, 2- and 3-character chunks, every split in two, and random chunk sizes."""
    for size in (1, 2, 3, 7):
        yield [text[i:i + size] for i in range(0, len(text), size)]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    rng = random.Random(seed)
    for _ in range(randoms):
        out, i = [], 0
        while i < len(text):
            n = rng.choice([0, 1, 1, 2, 3, 5, 8, 13])
            out.append(text[i:i + n])
            i += n
        yield out


def all_chunkings(text: str):
    """Every way to cut `text` into pieces (2^(n-1)): only for short texts."""
    for cuts in itertools.product([False, True], repeat=max(0, len(text) - 1)):
        pieces, start = [], 0
        for i, cut in enumerate(cuts, 1):
            if cut:
                pieces.append(text[start:i])
                start = i
        yield pieces + [text[start:]]


def stream_reasoning(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning, content = "", ""
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


def stream_tools(parser, pieces: list[str]) -> tuple[str, list[dict]]:
    content, deltas = "", []
    for piece in pieces:
        c, d = parser.feed(piece)
        content += c
        deltas += d
    c, d = parser.finish()
    return content + c, deltas + d


def calls_of(deltas: list[dict]) -> list[tuple[str, dict]]:
    return [(d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas]


# ---- reasoning -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name,starts,text,reasoning,content", REASONING_CASES)
def test_reasoning_parse_and_every_chunking(name, starts, text, reasoning, content):
    cls = REASONING_PARSERS[name]
    assert cls(starts_in_reasoning=starts).parse(text) == (reasoning, content)
    for pieces in chunkings(text):
        assert stream_reasoning(cls(starts_in_reasoning=starts), pieces) == (reasoning, content), pieces


@pytest.mark.parametrize("text,starts", [("<think>x</think>y", False), ("a</think> <th", True),
                                         ("<think>\n</thi", False)])
def test_reasoning_all_chunkings_of_short_texts(text, starts):
    expected = ReasoningParser(starts).parse(text)
    for pieces in all_chunkings(text):
        assert stream_reasoning(ReasoningParser(starts), pieces) == expected, pieces


def test_reasoning_never_emits_a_partial_tag():
    text = "<think>\nstep <one> and </thinking is not the end\n</think>\n\nThe answer <b>is</b> 4."
    for pieces in chunkings(text, randoms=100):
        p = ReasoningParser()
        for piece in pieces:
            r, c = p.feed(piece)
            # The tag that can come next is never cut: not even its first character is emitted.
            assert not partial_tag_len(c, "<think>") and not partial_tag_len(r, "</think>"), (r, c, pieces)
            assert "<think>" not in c and "</think>" not in r


def test_reasoning_holds_back_only_what_it_must():
    p = ReasoningParser()
    assert p.feed("Hello <") == ("", "Hello")  # " <" could start <think>
    assert p.feed("b>") == ("", " <b>")
    assert p.feed("<think>Hmm") == ("Hmm", "")
    assert p.feed("</") == ("", "")
    assert p.feed("think>  Done") == ("", "Done")
    assert p.finish() == ("", "")


# ---- tool calls ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name,tools,text,content,calls", TOOL_CASES)
def test_tool_calls_parse_and_every_chunking(name, tools, text, content, calls):
    cls = TOOL_CALL_PARSERS[name]
    got_content, got_calls = cls(tools).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert [c.index for c in got_calls] == list(range(len(calls)))
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)
    for pieces in chunkings(text, randoms=20):
        streamed, deltas = stream_tools(cls(tools), pieces)
        assert streamed == content, pieces
        assert calls_of(deltas) == calls, pieces
        assert [d["index"] for d in deltas] == list(range(len(calls)))
        assert all(d["type"] == "function" and d["id"].startswith("call_") for d in deltas)


def test_tool_call_deltas_never_carry_partial_tags():
    for pieces in chunkings(MINIMAX_ANSWER.split("</think>\n\n")[1], randoms=100):
        p = MiniMaxToolCallParser(TOOLS)
        for piece in pieces:
            c, _ = p.feed(piece)
            assert not partial_tag_len(c, "<minimax:tool_call>") and "<invoke" not in c and "parameter" not in c, pieces


def test_tool_call_arrives_whole_when_its_block_closes():
    p = HermesToolCallParser(TOOLS)
    assert p.feed('Sure. <tool_call>{"name": "search", ') == ("Sure.", [])
    c, deltas = p.feed('"arguments": {"query": "a"}}</tool_call>')
    assert c == "" and calls_of(deltas) == [("search", {"query": "a"})]
    assert p.finish() == ("", [])


def test_multiple_invokes_in_one_block():
    text = ('<minimax:tool_call><invoke name="search"><parameter name="query">a</parameter></invoke>'
            '<invoke name="search"><parameter name="query">b</parameter></invoke></minimax:tool_call>')
    _, calls = MiniMaxToolCallParser(TOOLS).parse(text)
    assert [json.loads(c.arguments)["query"] for c in calls] == ["a", "b"]


@pytest.mark.parametrize("raw,schema,value", [
    ("3", {"type": "integer"}, 3), (" 3.0 ", {"type": "integer"}, 3), ("3.5", {"type": "integer"}, "3.5"),
    ("2.5", {"type": "number"}, 2.5), ("7", {"type": "number"}, 7), ("True", {"type": "boolean"}, True),
    ("no", {"type": "boolean"}, "no"), ('{"a": [1]}', {"type": "object"}, {"a": [1]}),
    ("[1, 2]", {"type": "array"}, [1, 2]), ("[1, 2", {"type": "array"}, "[1, 2"),
    ("null", {"type": ["integer", "null"]}, None), ("4", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 4),
    ("\nline one\n  line two\n", {"type": "string"}, "line one\n  line two"), ("42", None, "42"),
    ("1", {"enum": [1, 2]}, 1), ("true", {"type": "integer"}, "true"),
])
def test_parameter_types_from_schema(raw, schema, value):
    got = convert_value(raw, schema)
    assert got == value and type(got) is type(value)


# ---- both, as the server runs them ---------------------------------------------------------------
OUTPUT_CASES = [
    (MINIMAX_ANSWER, "minimax-m3", "minimax-m3", False),
    (MINIMAX_ANSWER.replace("<think>", "", 1), "inkling", "inkling", True),
    ("<think>Simple.</think>\n\nHello there!", "inkling", "inkling", False),
    ('<think>use a tool</think><tool_call>{"name": "search", "arguments": {"query": "q"}}</tool_call>', "qwen3",
     "hermes", False),
]


def output_parser(reasoning: str, tools: str, starts: bool) -> OutputParser:
    return OutputParser(REASONING_PARSERS[reasoning](starts_in_reasoning=starts), TOOL_CALL_PARSERS[tools](TOOLS))


def merge_stream(deltas: list[dict]) -> dict:
    out = {"reasoning_content": "", "content": "", "tool_calls": []}
    for d in deltas:
        out["reasoning_content"] += d.get("reasoning_content", "")
        out["content"] += d.get("content", "")
        out["tool_calls"] += d.get("tool_calls", [])
    return out


def comparable(message: dict) -> dict:
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]
    return {"reasoning_content": message.get("reasoning_content") or "", "content": message.get("content") or "",
            "tool_calls": calls}


@pytest.mark.parametrize("text,reasoning,tools,starts", OUTPUT_CASES)
def test_output_parser_stream_equals_whole(text, reasoning, tools, starts):
    whole = output_parser(reasoning, tools, starts).parse(text)
    assert whole["reasoning_content"] and "<think>" not in whole["reasoning_content"]
    if "tool_calls" in whole:
        assert whole["content"] is None or "tool_call" not in whole["content"]
    for pieces in chunkings(text, randoms=20):
        p = output_parser(reasoning, tools, starts)
        deltas = [p.feed(piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]
        assert comparable(merge_stream(deltas)) == comparable(whole), pieces


# ---- end to end through the FastAPI app --------------------------------------------------------
class FakeTokenizerManager:
    """Stands in for TokenizerManager: every request streams `text` in `chunk`-character deltas."""

    def __init__(self, text: str, reasoning_parser: str | None, tool_call_parser: str | None, chunk: int = 3):
        self.config = EngineConfig(reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser)
        self.info = SimpleNamespace(name="fake-model", model_dir="/models/fake", context_length=4096,
                                    vocab_size=1000, eos_token_ids=(0,))
        self.text, self.chunk = text, chunk
        self.tokenizer = None
        self.dead = None
        self.handles: dict = {}
        self.templates: list[tuple[list[dict], list[dict] | None]] = []

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def chat_ids(self, messages, tools=None, **kwargs):
        self.templates.append((messages, tools))
        return [1, 2, 3]

    def validate(self, prompt_ids, params) -> None:
        pass

    def submit(self, prompt_ids, params, prompt=None, rid=None, routed=False, queue=None, stream=True):
        state = RequestState(rid or uuid.uuid4().hex, prompt, prompt_ids, params, tokenizer=None, stream=stream)
        return RequestHandle(state, queue if queue is not None else asyncio.Queue())

    async def stream(self, handles, is_disconnected=None):
        pieces = [self.text[i:i + self.chunk] for i in range(0, len(self.text), self.chunk)]
        for i, handle in enumerate(handles):
            for seq in handle.state.seqs:
                for k, piece in enumerate(pieces):
                    last = k == len(pieces) - 1
                    seq.text += piece
                    seq.token_ids.append(k)
                    if last:
                        seq.finished, seq.finish_reason = True, "stop"
                    await asyncio.sleep(0)
                    yield i, SeqDelta(seq.index, piece, [k], [], last, "stop" if last else None, None)

    def release(self, handle) -> None:
        pass

    def token_info(self, token_id: int):
        return str(token_id), [token_id]


def chat_both_ways(tm: FakeTokenizerManager, **kwargs):
    """(non-streaming response, streamed chunks) from the openai client over ASGI."""
    app = create_app(tm.config, tm)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kiln") as http:
            client = openai.AsyncOpenAI(base_url="http://kiln/v1", api_key="unused", http_client=http, max_retries=0)
            args = {"model": "fake-model", "messages": [{"role": "user", "content": "Weather in Paris?"}], **kwargs}
            full = await client.chat.completions.create(**args)
            chunks = [c async for c in await client.chat.completions.create(**args, stream=True)]
            return full, chunks

    return asyncio.run(go())


def streamed_message(chunks, index: int = 0) -> tuple[dict, str]:
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.index != index:
                continue
            d = choice.delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            for tc in d.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
                assert tc.id is None or tc.id.startswith("call_")
            finish = choice.finish_reason or finish
    tool_calls = [{"function": {"name": c["name"], "arguments": c["arguments"]}} for _, c in sorted(calls.items())]
    return {"reasoning_content": reasoning, "content": content, "tool_calls": tool_calls}, finish


@pytest.mark.parametrize("chunk", [1, 4])
def test_chat_end_to_end_reasoning_and_tool_calls(chunk):
    tm = FakeTokenizerManager(MINIMAX_ANSWER, "minimax-m3", "minimax-m3", chunk=chunk)
    full, chunks = chat_both_ways(tm, tools=TOOLS, n=2)
    assert tm.templates[0][1] == TOOLS  # the tools reach the chat template
    for choice in full.choices:
        msg = choice.message
        assert choice.finish_reason == "tool_calls"
        assert msg.reasoning_content == "The user wants the weather. I'll call get_weather; maybe search too."
        assert msg.content == "Let me check."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == MINIMAX_CALLS
        assert all(c.type == "function" and c.id.startswith("call_") for c in msg.tool_calls)
        streamed, finish = streamed_message(chunks, choice.index)
        assert finish == "tool_calls"
        assert comparable(streamed) == comparable(msg.model_dump())


def test_chat_end_to_end_without_tools_or_separation():
    answer = "<think>\nShort.\n</think>\n\nIt is sunny. <minimax:tool_call>x</minimax:tool_call>"
    tm = FakeTokenizerManager(answer, "inkling", "inkling", chunk=2)
    full, chunks = chat_both_ways(tm)  # no tools: tool calls are not parsed
    msg = full.choices[0].message
    assert (msg.reasoning_content, msg.content, msg.tool_calls) == (
        "Short.", "It is sunny. <minimax:tool_call>x</minimax:tool_call>", None)
    assert full.choices[0].finish_reason == "stop"
    streamed, finish = streamed_message(chunks)
    assert comparable(streamed) == comparable(msg.model_dump()) and finish == "stop"

    full, chunks = chat_both_ways(tm, extra_body={"separate_reasoning": False})
    assert full.choices[0].message.content == answer
    assert getattr(full.choices[0].message, "reasoning_content", None) is None
    assert streamed_message(chunks)[0]["content"] == answer


def test_chat_end_to_end_without_parsers_is_unchanged():
    tm = FakeTokenizerManager("<think>x</think>y", None, None)
    full, chunks = chat_both_ways(tm, tools=TOOLS)
    msg = full.choices[0].message
    assert msg.content == "<think>x</think>y" and msg.tool_calls is None
    assert "reasoning_content" not in msg.model_dump(exclude_none=True)
    assert streamed_message(chunks)[0]["content"] == msg.content


def test_unknown_parser_names_are_refused():
    with pytest.raises(ValueError, match="Unknown reasoning parser 'nope'"):
        create_app(EngineConfig(), FakeTokenizerManager("", "nope", None))
    with pytest.raises(ValueError, match="choose one of"):
        create_app(EngineConfig(), FakeTokenizerManager("", None, "nope"))
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--reasoning-parser", "minimax-m3", "--tool-call-parser", "hermes"])
    assert (args.reasoning_parser, args.tool_call_parser) == ("minimax-m3", "hermes")


class StubTokenizer:
    """Just what the chat handler asks of a tokenizer: the prompt's tail and the special tokens."""

    def __init__(self, prompt_tail: str, special: tuple[str, ...] = ()):
        self.prompt_tail = prompt_tail
        self.all_special_tokens = ["<|im_end|>", *special]
        self.added_tokens_decoder = {}

    def decode(self, ids, skip_special_tokens=False):
        return self.prompt_tail


def test_chat_template_that_opens_the_think_block_and_special_tags():
    tm = FakeTokenizerManager("Still thinking.\n</think>\n\nDone.", "inkling", None)
    tm.tokenizer = StubTokenizer("<|im_start|>assistant\n<think>\n")
    params = []
    submit = tm.submit
    tm.submit = lambda ids, p, *a, **k: params.append(p) or submit(ids, p, *a, **k)
    full, chunks = chat_both_ways(tm)
    msg = full.choices[0].message
    assert (msg.reasoning_content, msg.content) == ("Still thinking.", "Done.")
    assert comparable(streamed_message(chunks)[0]) == comparable(msg.model_dump())
    assert all(p.skip_special_tokens for p in params)  # <think> is plain text here: nothing to change

    tm.tokenizer = StubTokenizer("<|im_start|>assistant\n", special=("<think>", "</think>"))
    params.clear()
    full, _ = chat_both_ways(tm)
    assert (full.choices[0].message.reasoning_content, full.choices[0].message.content) == (
        None, "Still thinking.\n</think>\n\nDone.")  # the template did not open a block: no reasoning
    assert params and not any(p.skip_special_tokens for p in params)  # the tags must reach the parser


def test_assistant_tool_calls_are_sent_to_the_template_as_mappings():
    from kiln.server.protocol import ChatMessage

    call = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"query": "a", "limit": 2}'}}
    msg = ChatMessage(role="assistant", content="", tool_calls=[call], reasoning_content="why").to_template(0)
    assert msg["tool_calls"][0]["function"]["arguments"] == {"query": "a", "limit": 2}
    assert msg["reasoning_content"] == "why" and call["function"]["arguments"].startswith("{")  # not mutated
    bad = {"function": {"name": "search", "arguments": "not json"}}
    assert ChatMessage(role="assistant", tool_calls=[bad]).to_template(0)["tool_calls"] == [bad]


def test_calls_rendered_by_the_init_model_template_parse_back():
    """What the Inkling / MiniMax-M3 chat template writes for a call, the parser reads back."""
    from kiln.models import init_model
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from kiln.server.protocol import ChatMessage

    args = {"city": "Paris", "days": 3, "metric": True, "hours": [9, 12], "where": {"lat": 48.8}}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}}
    messages = [ChatMessage(role="user", content="Weather?").to_template(0),
                ChatMessage(role="assistant", content="Checking.", reasoning_content="Need a tool.",
                            tool_calls=[call]).to_template(1)]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **k: json.dumps(x, ensure_ascii=False)
    text = env.from_string(init_model.CHAT_TEMPLATE).render(messages=messages, tools=TOOLS,
                                                            add_generation_prompt=False)
    answer = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = output_parser("inkling", "inkling", False).parse(answer)
    assert parsed["reasoning_content"] == "Need a tool." and parsed["content"] == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed["tool_calls"]] == [
        ("get_weather", args)]
