"""Request handlers behind the HTTP routes: chat, completions and native /generate.

Each turns its pydantic request into token ids and `SamplingParams`, submits through the
TokenizerManager, and shapes the deltas into OpenAI's (or SGLang's) JSON, whole or as SSE.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kiln.engine.frontend import RequestState, SeqDelta
from kiln.engine.io import TokenLogprob
from kiln.server.parsers.reasoning import ReasoningParser, get_reasoning_parser
from kiln.server.parsers.forced_tools import ForcedToolCalls
from kiln.server.parsers.tool_calls import ToolCallParser, get_tool_call_parser
from kiln.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                  GenerateRequest, TokenizeRequest)
from kiln.server.tokenizer_manager import (ClientDisconnected, EngineDeadError, RequestHandle,
                                           TokenizerManager)


CLIENT_CLOSED = 499  # nginx's status for "client closed the request"; nobody reads it


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Serving:
    """Builds responses for one served model."""

    def __init__(self, tm: TokenizerManager, served_name: str, aliases: set[str]):
        self.tm = tm
        self.name = served_name
        self.aliases = aliases | {served_name}
        config = getattr(tm, "config", None)
        names = [getattr(config, "reasoning_parser", None), getattr(config, "tool_call_parser", None)]
        self.reasoning_parser = get_reasoning_parser(names[0]) if names[0] else None
        self.tool_call_parser = get_tool_call_parser(names[1]) if names[1] else None
        self._special: Optional[set[str]] = None
        self._reasoning_tag_ids: Optional[tuple[int, int]] = None  # `_reasoning_ids`, found once

    def check_model(self, model: Optional[str]) -> None:
        if model and model not in self.aliases:
            raise APIError(f"The model {model!r} does not exist; this server serves {self.name!r} "
                           "(see /v1/models).", param="model")

    # ---- submitting ----------------------------------------------------------------------
    def _submit_all(self, prompts: list[tuple[Optional[str], list[int]]], params: Any,
                    rid: Optional[str] = None, routed: bool = False, stream: bool = True) -> list[RequestHandle]:
        """Validate every prompt, then submit them sharing one queue. `stream`: the response sends
        text as it is generated (else it is decoded once per sequence, at the end)."""
        queue: asyncio.Queue = asyncio.Queue()
        handles: list[RequestHandle] = []
        try:
            for _, ids in prompts:
                self.tm.validate(ids, params)
            for i, (text, ids) in enumerate(prompts):
                sub = None if rid is None else (rid if len(prompts) == 1 else f"{rid}_{i}")
                handles.append(self.tm.submit(ids, params, text, sub, routed, queue, stream=stream))
            return handles
        except EngineDeadError as e:
            raise APIError(str(e), status=503, type="service_unavailable") from e
        except ValueError as e:
            for h in handles:
                self.tm.release(h)
            # SamplingParams errors start with the field name ("top_p must be in (0, 1]...").
            field = re.match(r"^(\w+) must", str(e))
            raise APIError(str(e), param=field.group(1) if field else None) from e

    async def _collect(self, handles: list[RequestHandle], raw: Request) -> bool:
        """Wait until every handle is done; False if the client went away (requests aborted)."""
        try:
            async for _ in self.tm.stream(handles, raw.is_disconnected):
                pass
            return True
        except ClientDisconnected:
            return False
        except EngineDeadError as e:
            raise APIError(str(e), status=503, type="service_unavailable") from e
        except ValueError as e:
            raise APIError(str(e)) from e

    async def _events(self, handles: list[RequestHandle], raw: Request, chunks: Any,
                      usage_chunk: Optional[dict] = None) -> AsyncIterator[str]:
        """SSE body: `chunks(i, delta)` yields objects; errors become an error event; then the usage
        chunk (`usage_chunk` plus "usage", when asked for) and [DONE]."""
        try:
            async for i, delta in self.tm.stream(handles, raw.is_disconnected):
                for obj in chunks(i, delta):
                    yield sse(obj)
            if usage_chunk is not None:
                yield sse({**usage_chunk, "usage": self._usage(handles)})
        except ClientDisconnected:
            return
        except (ValueError, EngineDeadError) as e:
            status = 503 if isinstance(e, EngineDeadError) else 400
            yield sse(APIError(str(e), status=status).body())
        yield "data: [DONE]\n\n"

    # ---- /v1/chat/completions ------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        if not req.messages:
            raise APIError("'messages' is empty; send at least one message, e.g. "
                           "[{'role': 'user', 'content': 'Hello'}].", param="messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs=true.", param="top_logprobs")
        ids = self._chat_ids(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.tm.info.context_length - len(ids))
        params = req.sampling_params(max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        if params.grammar is not None and req.separate_reasoning and self.reasoning_parser is not None:
            # reasoning-aware structured output: the constraint is on the answer after the block
            params.reasoning_token_ids = self._reasoning_ids(self.reasoning_parser)
            params.starts_in_reasoning = self._prompt_ends_with(ids, self.reasoning_parser.start_tag)
        make_parser = self._output_parser(req, ids)
        if make_parser is not None and set(make_parser().tags()) & self._special_tokens():
            params.skip_special_tokens = False  # the parsers must see their tags in the text
        (handle,) = self._submit_all([(None, ids)], params, stream=bool(req.stream))
        rid, created = f"chatcmpl-{handle.state.rid}", int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.name}
        if req.stream:
            started: set[int] = set()
            parsers: dict[int, OutputParser] = {}
            called: set[int] = set()

            def chunks(_: int, d: SeqDelta):
                if d.index not in started:
                    started.add(d.index)
                    yield {**head, "choices": [{"index": d.index, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]}
                if make_parser is None:
                    delta = {"content": d.text} if d.text else {}
                else:
                    p = parsers.setdefault(d.index, make_parser())
                    delta = p.feed(d.text, d.finished)
                    if "tool_calls" in delta:
                        called.add(d.index)
                if delta or d.token_ids or d.finished:
                    lp = ({"content": self._chat_logprobs(d.token_ids, d.logprobs, req.top_logprobs or 0)}
                          if req.logprobs else None)
                    reason = "tool_calls" if d.finished and d.index in called else d.finish_reason
                    yield {**head, "choices": [{"index": d.index, "delta": delta, "logprobs": lp,
                                                "finish_reason": reason,
                                                **({"matched_stop": d.matched_stop} if d.finished else {})}]}

            usage = {**head, "choices": []} if req.include_usage else None
            return self._stream_response(self._events([handle], raw, chunks, usage))
        if not await self._collect([handle], raw):
            return Response(status_code=CLIENT_CLOSED)
        choices = []
        for s in handle.state.seqs:
            message: dict[str, Any] = {"role": "assistant", "content": s.text}
            reason = s.finish_reason
            if make_parser is not None:
                message.update(make_parser().parse(s.text))
                if message.get("tool_calls"):
                    reason = "tool_calls"
            choices.append({"index": s.index, "message": message,
                            "logprobs": ({"content": self._chat_logprobs(s.token_ids, s.logprobs, req.top_logprobs or 0)}
                                         if req.logprobs else None),
                            "finish_reason": reason, "matched_stop": s.matched_stop})
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": self.name,
                             "choices": choices, "usage": self._usage([handle])})

    def _output_parser(self, req: ChatCompletionRequest, ids: list[int]) -> Optional[Any]:
        """A factory of per-choice `OutputParser`s for this request, or None when nothing is parsed.
        Tool calls are parsed only when the request offers tools (and tool_choice is not "none"); a
        tool_choice that forces calls ("required", a named function) reads the constrained answer."""
        forced = req.forced_tools()
        reasoning = self.reasoning_parser if req.separate_reasoning else None
        tools = self.tool_call_parser if req.tools and req.tool_choice != "none" else None
        if reasoning is None and tools is None and forced is None:
            return None
        opened = reasoning is not None and self._prompt_ends_with(ids, reasoning.start_tag)

        def make() -> OutputParser:
            calls = ForcedToolCalls(forced[1]) if forced is not None else tools(req.tools) if tools else None
            return OutputParser(reasoning(starts_in_reasoning=True if opened else None) if reasoning else None, calls)

        return make

    def _reasoning_ids(self, parser: Any) -> Optional[tuple[int, int]]:
        """(start id, end id) of the reasoning parser's tags when each is one token of the
        tokenizer (else None: a constraint then covers the whole output, block included)."""
        tok = getattr(self.tm, "tokenizer", None)
        if self._reasoning_tag_ids is None and tok is not None:
            pair = [tok.encode(tag, add_special_tokens=False) for tag in (parser.start_tag, parser.end_tag)]
            if all(len(p) == 1 for p in pair):
                self._reasoning_tag_ids = (pair[0][0], pair[1][0])
        return self._reasoning_tag_ids

    def _special_tokens(self) -> set[str]:
        """Tokens that skip_special_tokens deletes from the text."""
        if self._special is None:
            tok = getattr(self.tm, "tokenizer", None)
            self._special = set(getattr(tok, "all_special_tokens", None) or ())
            self._special |= {t.content for t in (getattr(tok, "added_tokens_decoder", None) or {}).values()
                              if getattr(t, "special", False)}
        return self._special

    def _prompt_ends_with(self, ids: list[int], tag: str) -> bool:
        """Did the chat template open the tag (e.g. a generation prompt ending in "<think>\n")?"""
        tok = getattr(self.tm, "tokenizer", None)
        if tok is None or not ids:
            return False
        return tok.decode(ids[-8:], skip_special_tokens=False).rstrip().endswith(tag)

    # ---- /v1/completions -----------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        if req.echo and self.tm.tokenizer is None:
            raise APIError("echo=true needs a tokenizer to write the prompt back; this server runs with "
                           "--skip-tokenizer-init.", param="echo")
        prompts = self._prompts(req.prompt, "prompt")
        if req.max_tokens is None:
            req.max_tokens = max(1, self.tm.info.context_length - max(len(ids) for _, ids in prompts))
        params = req.sampling_params(req.max_tokens, req.logprobs)
        if req.echo and req.logprobs is not None:
            params.prompt_logprobs = req.logprobs  # echoed prompt tokens carry their logprobs too
        handles = self._submit_all(prompts, params, stream=bool(req.stream))
        n, created = params.n, int(time.time())
        rid = f"cmpl-{handles[0].state.rid}"
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.name}
        offsets = [0] * (len(handles) * n)
        if req.stream:
            echoed: set[int] = set()

            def chunks(i: int, d: SeqDelta):
                index = i * n + d.index
                text, ids, entries = d.text, d.token_ids, d.logprobs
                if req.echo and index not in echoed:  # the prompt leads the choice's first chunk
                    echoed.add(index)
                    text, ids, entries = self._with_prompt(handles[i].state, text, ids, entries)
                lp = self._completion_logprobs(ids, entries, offsets, index) if req.logprobs is not None else None
                if text or d.token_ids or d.finished:
                    yield {**head, "choices": [{"index": index, "text": text, "logprobs": lp,
                                                "finish_reason": d.finish_reason}]}

            usage = {**head, "choices": []} if req.include_usage else None
            return self._stream_response(self._events(handles, raw, chunks, usage))
        if not await self._collect(handles, raw):
            return Response(status_code=CLIENT_CLOSED)
        choices = []
        for i, h in enumerate(handles):
            for s in h.state.seqs:
                index = i * n + s.index
                text, ids, entries = s.text, s.token_ids, s.logprobs
                if req.echo:
                    text, ids, entries = self._with_prompt(h.state, text, ids, entries)
                lp = self._completion_logprobs(ids, entries, offsets, index) if req.logprobs is not None else None
                choices.append({"index": index, "text": text, "logprobs": lp,
                                "finish_reason": s.finish_reason, "matched_stop": s.matched_stop})
        return JSONResponse({**head, "choices": choices, "usage": self._usage(handles)})

    # ---- /generate (SGLang) --------------------------------------------------------------
    async def generate(self, req: GenerateRequest, raw: Request) -> Response:
        if (req.text is None) == (req.input_ids is None):
            raise APIError("Send exactly one of 'text' or 'input_ids'.", param="text")
        prompts = self._prompts(req.text if req.text is not None else req.input_ids,
                                "text" if req.text is not None else "input_ids")
        batched = isinstance(req.text, list) or (req.input_ids is not None and isinstance(req.input_ids[0], list))
        params = req.to_sampling_params()
        handles = self._submit_all(prompts, params, req.rid, req.return_routed_experts, stream=bool(req.stream))
        start = time.time()
        if req.stream:
            def chunks(i: int, d: SeqDelta):
                if d.text or d.token_ids or d.finished:
                    yield {"index": i * params.n + d.index,
                           **self._generate_item(req, handles[i].state, d.index, start)}

            return self._stream_response(self._events(handles, raw, chunks))
        if not await self._collect(handles, raw):
            return Response(status_code=CLIENT_CLOSED)
        items = [self._generate_item(req, h.state, s.index, start) for h in handles for s in h.state.seqs]
        return JSONResponse(items if batched or params.n > 1 else items[0])

    def _generate_item(self, req: GenerateRequest, state: RequestState, index: int, start: float) -> dict:
        s = state.seqs[index]
        if s.finish_reason == "length":
            reason: Any = {"type": "length", "length": len(s.token_ids)}
        elif s.finish_reason is not None:
            reason = {"type": s.finish_reason, "matched": s.matched_stop}
        else:
            reason = None
        meta: dict[str, Any] = {
            "id": state.rid if state.params.n == 1 else f"{state.rid}-{index}",
            "finish_reason": reason, "prompt_tokens": len(state.prompt_ids),
            "completion_tokens": len(s.token_ids), "cached_tokens": state.cached_tokens,
            "cached_tokens_details": _tiers([state]),
            "e2e_latency": time.time() - start, "weight_version": self.tm.weight_version,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for t, (lp, _) in zip(s.token_ids, s.logprobs)]
            meta["output_top_logprobs"] = [[[tlp, tid, None] for tid, tlp in top[:req.top_logprobs_num]]
                                           for _, top in s.logprobs]
            if req.logprob_start_len >= 0 and state.prompt_logprobs is not None:
                start_at = req.logprob_start_len
                pl = state.prompt_logprobs[start_at:]
                ids = state.prompt_ids[start_at:]
                meta["input_token_logprobs"] = [[None if e is None else e[0], t, None] for t, e in zip(ids, pl)]
                meta["input_top_logprobs"] = [None if e is None else [[tlp, tid, None] for tid, tlp in e[1]]
                                              for e in pl]
        if s.routed_experts is not None:
            meta["routed_experts"] = _jsonable(s.routed_experts)
        if s.spec is not None:  # spec_verify_ct, spec_accept_length, per-position acceptance rates
            meta.update(s.spec.to_dict())
        return {"text": s.text, "output_ids": list(s.token_ids), "meta_info": meta}

    # ---- /tokenize, /detokenize ----------------------------------------------------------
    def tokenize(self, req: TokenizeRequest) -> dict:
        """{"tokens", "count", "max_model_len"} (lists for a batch of prompts): the ids the
        generation endpoints would prefill for the same `prompt` or `messages`."""
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("Send exactly one of 'prompt' (a string or a list of strings) and 'messages' "
                           "(a chat, as in /v1/chat/completions).", param="prompt")
        if req.messages is not None:
            batch, single = [self._chat_ids(req, req.add_generation_prompt)], True
        else:
            single = isinstance(req.prompt, str)
            texts = [req.prompt] if single else req.prompt
            try:
                batch = [self.tm.encode(t, add_special_tokens=req.add_special_tokens) for t in texts]
            except ValueError as e:
                raise APIError(str(e), param="prompt") from e
        out: dict[str, Any] = {"tokens": batch, "count": [len(ids) for ids in batch],
                               "max_model_len": self.tm.info.context_length}
        if req.return_token_strs:
            out["token_strs"] = [self.tm.tokenizer.convert_ids_to_tokens(ids) for ids in batch]
        if single:
            out = {k: v[0] if isinstance(v, list) else v for k, v in out.items()}
        return out

    def detokenize(self, req: DetokenizeRequest) -> dict:
        """{"text"} (SGLang's name) and the same under "prompt" (vLLM's); a list for a batch."""
        self.check_model(req.model)
        if self.tm.tokenizer is None:
            raise APIError("This server was started with --skip-tokenizer-init; it has no tokenizer to "
                           "detokenize with.")
        single = not req.tokens or isinstance(req.tokens[0], int)
        batch = [req.tokens] if single else req.tokens
        vocab = self.tm.info.vocab_size
        for i, ids in enumerate(batch):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise APIError(f"Token ids must be integers in [0, {vocab}); got {bad[:5]!r}"
                               + (f" in tokens[{i}]" if not single else "") + ".", param="tokens")
        texts = [self.tm.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens) for ids in batch]
        text = texts[0] if single else texts
        return {"text": text, "prompt": text}

    # ---- shared pieces -------------------------------------------------------------------
    def _chat_ids(self, req: Any, add_generation_prompt: bool = True) -> list[int]:
        """The prompt ids of a request's `messages` (+ `tools`, `chat_template_kwargs`) through the
        chat template: /v1/chat/completions and /tokenize share them."""
        messages = [m.to_template(i) for i, m in enumerate(req.messages)]
        try:
            return self.tm.chat_ids(messages, tools=req.tools, add_generation_prompt=add_generation_prompt,
                                    **(req.chat_template_kwargs or {}))
        except ValueError as e:
            raise APIError(str(e), param="messages") from e

    def _prompts(self, prompt: Any, param: str) -> list[tuple[Optional[str], list[int]]]:
        """Normalise str | list[str] | list[int] | list[list[int]] into (text, ids) pairs."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise APIError(f"'{param}' is empty; send a string, a list of strings, or token ids.", param=param)
        out = []
        for p in prompt:
            if isinstance(p, str):
                try:
                    out.append((p, self.tm.encode(p)))
                except ValueError as e:
                    raise APIError(str(e), param=param) from e
            else:
                out.append((None, list(p)))
        return out

    def _usage(self, handles: list[RequestHandle]) -> dict:
        prompt = sum(len(h.state.prompt_ids) for h in handles)
        completion = sum(h.state.completion_tokens for h in handles)
        cached = sum(h.state.cached_tokens for h in handles)
        # cached_tokens stays OpenAI's total; cached_tokens_details (a Kiln extension) splits it by
        # the cache tier that served it: device, host (HiCache L2) and disk (L3).
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached,
                                          "cached_tokens_details": _tiers([h.state for h in handles])}}

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[TokenLogprob], top: int) -> list[dict]:
        """OpenAI chat shape: token text, logprob, utf-8 bytes, and the top alternatives."""
        def entry(tid: int, lp: float) -> dict:
            text, raw = self.tm.token_info(tid)
            return {"token": text, "logprob": lp, "bytes": raw}

        return [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in alts[:top]]}
                for t, (lp, alts) in zip(token_ids, logprobs)]

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[TokenLogprob], offsets: list[int],
                             index: int) -> dict:
        """Legacy completions shape; `offsets[index]` carries text_offset across stream chunks. An
        entry of None (an echoed prompt's first token) has no logprob and no top list."""
        tokens, values, tops, text_offset = [], [], [], []
        for t, entry in zip(token_ids, logprobs):
            text = self.tm.token_info(t)[0]
            tokens.append(text)
            values.append(None if entry is None else entry[0])
            tops.append(None if entry is None else {self.tm.token_info(a)[0]: alp for a, alp in entry[1]})
            text_offset.append(offsets[index])
            offsets[index] += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": text_offset}

    def _with_prompt(self, state, text: str, ids: list[int], entries) -> tuple[str, list[int], list]:
        """`echo`: the prompt's text, ids and logprob entries ahead of the completion's (the first
        prompt token's entry is None, as OpenAI and vLLM answer)."""
        prompt = state.prompt if state.prompt is not None else self.tm.tokenizer.decode(state.prompt_ids)
        prompt_entries = state.prompt_logprobs or [None] * len(state.prompt_ids)
        return prompt + text, list(state.prompt_ids) + list(ids), list(prompt_entries) + list(entries or [])

    def _stream_response(self, body: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class OutputParser:
    """One choice's answer through the reasoning parser, then the tool-call parser (either optional).
    `parse` reads the whole text into message fields; `feed` streams it into delta fields."""

    def __init__(self, reasoning: Optional[ReasoningParser], tools: Optional[ToolCallParser]):
        self.reasoning, self.tools = reasoning, tools

    def parse(self, text: str) -> dict:
        out: dict[str, Any] = {}
        if self.reasoning is not None:
            reasoning, text = self.reasoning.parse(text)
            out["reasoning_content"] = reasoning or None
        out["content"] = text
        if self.tools is not None:
            content, calls = self.tools.parse(text)
            out["content"] = content if content or not calls else None
            if calls:
                out["tool_calls"] = [c.to_openai() for c in calls]
        return out

    def feed(self, text: str, finished: bool) -> dict:
        reasoning, content, calls = "", text, []
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if finished:
                r, c = self.reasoning.finish()
                reasoning, content = reasoning + r, content + c
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if finished:
                c, more = self.tools.finish()
                content, calls = content + c, calls + more
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta

    def tags(self) -> list[str]:
        parsers = [p for p in (self.reasoning, self.tools) if p is not None]
        return [p.start_tag for p in parsers] + [p.end_tag for p in parsers]


def _jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):
        return x.tolist()
    return x


def _tiers(states) -> dict[str, int]:
    """Cached prompt tokens by tier, summed over requests (all device when HiCache is off)."""
    out = {"device": 0, "host": 0, "disk": 0}
    for st in states:
        tiers = st.cached_tokens_details or {"device": st.cached_tokens}
        for k in out:
            out[k] += tiers.get(k, 0)
    return out
