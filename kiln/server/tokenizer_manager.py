"""The API process's side of the engine: tokenize, validate, send, and route outputs back.

HTTP handlers call `submit()`, then iterate `stream()` for `SeqDelta`s. One asyncio task receives
every `BatchOutput` from the engine process and routes each `ReqOutput` to its request's queue,
running the incremental detokenizer on the way (stop strings abort the sequence in the engine).
When the client goes away, `stream()` aborts the request so the engine frees its pages.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from kiln.config import EngineConfig
from kiln.engine.frontend import (RequestError, RequestState, SeqDelta, expand_request, parse_sub_rid,
                                  validate_request)
from kiln.engine.io import (AbortReq, BatchOutput, ControlResult, FlushCacheReq, FlushCacheResult,
                            SchedulerStats, StatsReq)
from kiln.engine.request import SamplingParams

logger = logging.getLogger("kiln.server")

DISCONNECT_POLL_S = 0.5  # how often a waiting handler checks that its client is still there
CONTROL_TIMEOUT_S = 30.0  # flush / stats replies; the engine answers between two steps
RL_CONTROL_TIMEOUT_S = 600.0  # weight loads and memory moves can take a while


class EngineDeadError(RuntimeError):
    """The engine process stopped; the server cannot serve requests any more."""


class ClientDisconnected(Exception):
    """The HTTP client went away while its request was running."""


@dataclass
class RequestHandle:
    """A submitted request. Its deltas arrive on `queue` as (handle, delta), and (handle, None)
    once it is done; several handles (a batch of prompts) may share one queue."""

    state: RequestState
    queue: asyncio.Queue
    released: bool = False


class TokenizerManager:
    """Holds the tokenizer and the ZMQ sockets to the engine process (one per API process)."""

    def __init__(self, config: EngineConfig, info: Any, to_engine_addr: str, from_engine_addr: str,
                 engine_alive: Optional[Callable[[], bool]] = None):
        self.config = config
        self.info = info
        self.to_engine_addr = to_engine_addr
        self.from_engine_addr = from_engine_addr
        self.engine_alive = engine_alive or (lambda: True)
        self.tokenizer = None
        if not config.skip_tokenizer_init:
            from kiln.loader import load_tokenizer

            self.tokenizer = load_tokenizer(info.model_dir, config.tokenizer_path, config.chat_template)
        self.handles: dict[str, RequestHandle] = {}
        # The label of the served weights (SGLang's weight_version): set by weight updates that name
        # one and by /update_weight_version, reported in /generate's meta_info.
        self.weight_version = "default"
        self.dead: Optional[str] = None
        self._stats_waiters: collections.deque[asyncio.Future] = collections.deque()
        self._flush_waiters: collections.deque[asyncio.Future] = collections.deque()
        self._rl_waiters: collections.deque[asyncio.Future] = collections.deque()
        self._token_cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_decoder = _byte_decoder()
        self._send = None
        self._recv = None
        self._task: Optional[asyncio.Task] = None

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Open the sockets and start routing engine outputs (call inside the server's loop)."""
        import zmq
        import zmq.asyncio

        self._zctx = zmq.Context()
        self._send = self._zctx.socket(zmq.PUSH)  # sync: sends never block a PUSH below its HWM
        self._send.connect(self.to_engine_addr)
        self._actx = zmq.asyncio.Context()
        self._recv = self._actx.socket(zmq.PULL)
        self._recv.bind(self.from_engine_addr)
        self._task = asyncio.create_task(self._recv_loop(), name="kiln-engine-outputs")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down anyway
                pass
        for s in (self._send, self._recv):
            if s is not None:
                s.close(linger=0)

    # ---- input side ----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("This server was started with --skip-tokenizer-init; send token ids, not text.")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def chat_ids(self, messages: list[dict], tools: Optional[list[dict]] = None, add_generation_prompt: bool = True,
                 **kwargs: Any) -> list[int]:
        """Token ids of a conversation plus (by default) the assistant's generation prompt."""
        if self.tokenizer is None:
            raise RequestError("This server was started with --skip-tokenizer-init; chat needs a tokenizer.")
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # template errors are about the messages (e.g. role order)
            raise RequestError(f"The chat template rejected these messages: {e}") from e
        return self.tokenizer.encode(text, add_special_tokens=False)

    def new_rid(self) -> str:
        return uuid.uuid4().hex

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the problem (sampling values, prompt length, token ids)."""
        validate_request(prompt_ids, params, self.info.vocab_size, self.info.context_length,
                         self.config.max_logprobs)

    def submit(self, prompt_ids: list[int], params: SamplingParams, prompt: Optional[str] = None,
               rid: Optional[str] = None, return_routed_experts: bool = False,
               queue: Optional[asyncio.Queue] = None, stream: bool = True) -> RequestHandle:
        """Validate, expand n and send to the engine. Raises ValueError before sending anything.
        Validate every prompt of a batch with `validate` first, so a bad one queues nothing.
        `stream`: the caller reads text as it is generated (else it is decoded once, at the end)."""
        if self.dead:
            raise EngineDeadError(self.dead)
        self.validate(prompt_ids, params)
        rid = rid or self.new_rid()
        if rid in self.handles:
            raise RequestError(f"Request id {rid!r} is already running; use a unique rid.")
        state = RequestState(rid, prompt, prompt_ids, params, self.tokenizer, self.info.eos_token_ids, stream=stream)
        handle = RequestHandle(state, queue if queue is not None else asyncio.Queue())
        self.handles[rid] = handle
        for req in expand_request(rid, prompt_ids, params, return_routed_experts):
            self._send.send_pyobj(req)
        return handle

    async def stream(self, handles: list[RequestHandle],
                     is_disconnected: Optional[Callable[[], Awaitable[bool]]] = None
                     ) -> AsyncIterator[tuple[int, SeqDelta]]:
        """Yield (handle index, delta) until every handle is done (they must share one queue).

        Aborts whatever is unfinished if the client disconnects or the consumer stops early
        (cancellation, an exception, or closing the iterator), so the engine frees its pages.
        """
        queue = handles[0].queue
        assert all(h.queue is queue for h in handles), "stream() needs handles that share a queue"
        index = {id(h): i for i, h in enumerate(handles)}
        pending = len(handles)
        getter: Optional[asyncio.Future] = None
        loop = asyncio.get_running_loop()
        next_check = loop.time() + DISCONNECT_POLL_S
        try:
            while pending:
                if getter is None:
                    getter = asyncio.ensure_future(queue.get())
                # A persistent getter: wait_for would cancel the get and could lose an item.
                done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
                # Check on a clock, not only when idle: a busy request streams deltas every step.
                if is_disconnected is not None and loop.time() >= next_check:
                    next_check = loop.time() + DISCONNECT_POLL_S
                    if await is_disconnected():
                        raise ClientDisconnected()
                if not done:
                    continue
                (handle, delta), getter = getter.result(), None
                if delta is None:
                    pending -= 1
                    if handle.state.error is not None:
                        raise (EngineDeadError if self.dead else RequestError)(handle.state.error)
                    continue
                yield index[id(handle)], delta
        finally:
            if getter is not None:
                getter.cancel()
            for h in handles:
                self.release(h)

    def release(self, handle: RequestHandle) -> None:
        """Forget a request; abort its unfinished sequences so the engine frees their pages."""
        if handle.released:
            return
        handle.released = True
        self.handles.pop(handle.state.rid, None)
        self._abort_unfinished(handle)

    def abort(self, rid: str) -> bool:
        """Abort a request by its id (or one sequence by its scheduler id f"{rid}-{i}")."""
        handle = self.handles.get(rid)
        if handle is not None:
            self._abort_unfinished(handle)
            return True
        parent, _, index = rid.rpartition("-")
        handle = self.handles.get(parent)
        if handle is not None and index.isdigit() and int(index) < len(handle.state.seqs):
            self._send_abort(rid)
            return True
        return False

    def abort_all(self) -> int:
        """Abort every request of this server; returns how many."""
        handles = list(self.handles.values())
        for handle in handles:
            self._abort_unfinished(handle)
        return len(handles)

    def _abort_unfinished(self, handle: RequestHandle) -> None:
        for rid in handle.state.unfinished_rids():
            self._send_abort(rid)

    def _send_abort(self, rid: str) -> None:
        if self._send is not None and not self.dead:
            self._send.send_pyobj(AbortReq(rid))

    # ---- control -------------------------------------------------------------------------
    async def get_stats(self) -> SchedulerStats:
        return await self._control(StatsReq(), self._stats_waiters)

    async def flush_cache(self) -> FlushCacheResult:
        return await self._control(FlushCacheReq(), self._flush_waiters)

    async def rl_control(self, msg: Any) -> ControlResult:
        """Send one RL control message (kiln.engine.io.CONTROL_REQS); the engine's ControlResult."""
        return await self._control(msg, self._rl_waiters, RL_CONTROL_TIMEOUT_S)

    async def _control(self, msg: Any, waiters: collections.deque, timeout: float = CONTROL_TIMEOUT_S) -> Any:
        if self.dead:
            raise EngineDeadError(self.dead)
        fut = asyncio.get_running_loop().create_future()
        waiters.append(fut)
        self._send.send_pyobj(msg)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            fut.cancel()  # stays queued: a late reply is matched to it, not to the next caller
            raise EngineDeadError(f"The engine did not answer {type(msg).__name__} in {timeout}s.")

    # ---- output side ---------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        import zmq

        while True:
            if not await self._recv.poll(1000, zmq.POLLIN):
                if not self.engine_alive():
                    self._engine_died("The engine process exited; restart the server (see its log).")
                    return
                continue
            msg = await self._recv.recv_pyobj()
            try:
                self._route(msg)
            except Exception:  # noqa: BLE001 - one bad output must not stop routing for all
                logger.exception("Failed to route engine output %s", type(msg).__name__)

    def _route(self, msg: Any) -> None:
        if isinstance(msg, BatchOutput):
            for out in msg.outputs:
                parent, index = parse_sub_rid(out.rid)
                handle = self.handles.get(parent)
                if handle is None or index >= len(handle.state.seqs):
                    continue  # released already (client gone, or cut at a stop string)
                state = handle.state
                delta = state.update(index, out)
                seq = state.seqs[index]
                if seq.needs_abort:  # a stop string matched while the engine still runs it
                    seq.needs_abort = False
                    self._send_abort(out.rid)
                if delta is not None:
                    handle.queue.put_nowait((handle, delta))
                if state.done:
                    for rid in state.unfinished_rids():  # an error ends every sibling
                        self._send_abort(rid)
                    handle.queue.put_nowait((handle, None))
                    self.handles.pop(parent, None)
        elif isinstance(msg, SchedulerStats):
            _resolve(self._stats_waiters, msg)
        elif isinstance(msg, FlushCacheResult):
            _resolve(self._flush_waiters, msg)
        elif isinstance(msg, ControlResult):
            _resolve(self._rl_waiters, msg)
        else:
            logger.error("Unknown engine message %r ignored", type(msg).__name__)

    def _engine_died(self, why: str) -> None:
        logger.error(why)
        self.dead = why
        for handle in list(self.handles.values()):
            handle.state.error = why
            handle.queue.put_nowait((handle, None))
        self.handles.clear()
        for waiters in (self._stats_waiters, self._flush_waiters, self._rl_waiters):
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_exception(EngineDeadError(why))

    # ---- token text for logprobs ---------------------------------------------------------
    def token_info(self, token_id: int) -> tuple[str, list[int]]:
        """(text, utf-8 bytes) of one token, as OpenAI's logprobs show it."""
        hit = self._token_cache.get(token_id)
        if hit is not None:
            return hit
        if self.tokenizer is None:
            raw = f"<{token_id}>".encode()
        else:
            piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
            m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
            if m:  # sentencepiece byte fallback
                raw = bytes([int(m.group(1), 16)])
            elif piece and all(c in self._byte_decoder for c in piece):  # byte-level BPE
                raw = bytes(self._byte_decoder[c] for c in piece)
            else:  # sentencepiece: U+2581 marks a space
                raw = piece.replace("\u2581", " ").encode()
        hit = (raw.decode("utf-8", errors="replace"), list(raw))
        self._token_cache[token_id] = hit
        return hit


def _resolve(waiters: collections.deque, value: Any) -> None:
    """Replies come in request order: the oldest waiter gets this one (even if it gave up)."""
    if waiters:
        fut = waiters.popleft()
        if not fut.done():
            fut.set_result(value)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}
