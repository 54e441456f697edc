"""The offline API: `kiln.Engine` drives the engine core in-process (scripts, RL rollouts).

    with Engine() as llm:
        outs = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=16))

One lock guards the core; whoever holds it steps it and routes every output to its request, so
synchronous `generate` calls and concurrent `async_generate` calls (driven by one background
thread) all batch together in the same scheduler. Control calls (stats, pause, weight updates,
memory release) from other threads get the lock between two steps (`CoreLock`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from kiln.config import EngineConfig
from kiln.engine.frontend import RequestError, RequestState, expand_request, parse_sub_rid, validate_request
from kiln.engine.gc_tuning import restore_gc, tune_gc
from kiln.engine.io import GenerateReq
from kiln.engine.outputs import CompletionOutput, RequestOutput
from kiln.engine.request import SamplingParams

Prompts = Union[str, list[str], list[int], list[list[int]]]
ParamsArg = Union[SamplingParams, Sequence[SamplingParams], None]

logger = logging.getLogger("kiln.offline")

__all__ = ["Engine", "RequestOutput", "CompletionOutput", "SamplingParams"]


class CoreLock:
    """The lock around the engine core. Threads that drive generation step in a tight loop, and
    `threading.Lock` is not fair: a control call from another thread (stats, pause, weight
    updates, memory release) could wait for a whole generation. So control calls take it through
    `control()`, and a driver steps aside after each step while one is waiting
    (`yield_to_control`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._count = threading.Lock()
        self.waiting = 0  # control calls waiting for or holding the lock

    def __enter__(self) -> "CoreLock":  # a driver's step
        self._lock.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()

    @contextlib.contextmanager
    def control(self) -> Iterator[None]:
        with self._count:
            self.waiting += 1
        try:
            with self._lock:
                yield
        finally:
            with self._count:
                self.waiting -= 1

    def yield_to_control(self) -> None:
        """Called by a driver between steps, without the lock: wait while a control call is pending."""
        while self.waiting:
            time.sleep(0.0002)


class _Tracked:
    """A request in flight: its state, and a callback run (under the core lock) on each update."""

    def __init__(self, state: RequestState, reqs: list[GenerateReq],
                 on_update: Optional[Callable[["_Tracked"], None]] = None):
        self.state = state
        self.reqs = reqs
        self.on_update = on_update
        self.text_deltas: Optional[list[str]] = None  # a list for streaming callers only


class Engine:
    """An LLM engine in this process. Options are `EngineConfig` fields (see `kiln serve --help`)."""

    def __init__(self, model_path: Optional[str] = None, **options: Any):
        config = EngineConfig.from_kwargs(model_path=model_path, **options)
        from kiln.engine.core import EngineCore

        self._setup(config, EngineCore(config))

    @classmethod
    def from_core(cls, core: Any, config: Optional[EngineConfig] = None, tokenizer: Any = None) -> "Engine":
        """Wrap an existing core (tests, or code that built the core itself)."""
        self = cls.__new__(cls)
        self._setup(config or EngineConfig(), core, tokenizer)
        return self

    def _setup(self, config: EngineConfig, core: Any, tokenizer: Any = None) -> None:
        self.config = config
        self.core = core
        self.info = core.info
        if tokenizer is None and not config.skip_tokenizer_init:
            from kiln.loader import load_tokenizer

            tokenizer = load_tokenizer(self.info.model_dir, config.tokenizer_path, config.chat_template)
        self.tokenizer = tokenizer
        self._lock = CoreLock()
        self._tracked: dict[str, tuple[_Tracked, int]] = {}  # scheduler rid -> (request, index)
        self._inbox: "queue.SimpleQueue[tuple[str, Any]]" = queue.SimpleQueue()
        self._wake = threading.Event()
        self._driver: Optional[threading.Thread] = None
        self._closed = False
        self._ids = itertools.count()
        self._gc_before = tune_gc()  # collections stop walking the model and libraries (undone in shutdown)

    # ---- public API ----------------------------------------------------------------------
    def generate(self, prompts: Prompts, sampling_params: ParamsArg = None, return_routed_experts: bool = False,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a batch; returns one `RequestOutput` per prompt, in order."""
        tracked = self._prepare(prompts, sampling_params, return_routed_experts)
        bar = None
        if use_tqdm and len(tracked) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(tracked), desc="Generating", unit="req")
        # Requests leave `pending` as they finish (on_update runs under the core lock, on the
        # thread that stepped the core), so each step checks completion in O(1): scanning every
        # request's state per step cost ~1.5 ms at 2048 requests on a 2-core CPU, beside GPU steps
        # of ~10 ms for a small model at batch 512 (docs/serving.md, "Offline").
        pending = {id(t) for t in tracked}

        def on_update(t: _Tracked) -> None:
            if t.state.done:
                pending.discard(id(t))

        for t in tracked:
            t.on_update = on_update
            self._inbox.put(("add", t))
        try:
            self._drive_until(lambda: not pending, bar, lambda: len(tracked) - len(pending))
        except BaseException:
            self._abort(tracked)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [self._result(t) for t in tracked]

    async def async_generate(self, prompts: Prompts, sampling_params: ParamsArg = None,
                             return_routed_experts: bool = False) -> list[RequestOutput]:
        """Awaitable `generate`; concurrent calls are batched together by one driver thread."""
        tracked = self._prepare(prompts, sampling_params, return_routed_experts)
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        pending = {id(t) for t in tracked}

        def on_update(t: _Tracked) -> None:  # runs on whichever thread stepped the core
            if t.state.done:
                pending.discard(id(t))
                if not pending:
                    loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        for t in tracked:
            t.on_update = on_update
        self._ensure_driver()
        for t in tracked:
            self._inbox.put(("add", t))
        self._wake.set()
        try:
            await done
        except BaseException:  # cancelled: free the scheduler's pages
            self._abort(tracked)
            raise
        return [self._result(t) for t in tracked]

    def generate_stream(self, prompt: Union[str, list[int]], sampling_params: Optional[SamplingParams] = None
                        ) -> Iterator[str]:
        """Yield the text of one prompt (n == 1) as it is generated."""
        (t,) = self._prepare(prompt if isinstance(prompt, str) else [prompt], sampling_params, False, stream=True)
        if t.state.params.n != 1:
            raise ValueError("generate_stream streams one sequence; use n=1 or generate().")
        t.text_deltas = []
        self._inbox.put(("add", t))
        try:
            while True:
                self._drive_until(lambda: t.state.done or bool(t.text_deltas))
                while t.text_deltas:
                    yield t.text_deltas.pop(0)
                if t.state.done:
                    break
        finally:
            self._abort([t])
        self._result(t)  # raise a scheduler-side error, if any

    def chat(self, messages: Union[list[dict], list[list[dict]]], sampling_params: ParamsArg = None,
             use_tqdm: bool = True, tools: Optional[list[dict]] = None, **template_kwargs: Any
             ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then `generate`."""
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer; this engine was started with skip_tokenizer_init.")
        if not messages:
            raise ValueError("messages is empty; pass a list of {'role': ..., 'content': ...} dicts.")
        convs = [messages] if isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, tools=tools, **template_kwargs) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, messages: list[dict], tools: Optional[list[dict]] = None, **kwargs: Any) -> list[int]:
        """Token ids of a conversation followed by the assistant's generation prompt."""
        text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=True, **kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False while requests are running."""
        with self._lock.control():
            return self.core.flush_cache()

    def stats(self) -> Any:
        with self._lock.control():
            return self.core.stats()

    # ---- RL control (SGLang's Engine mirrors; see EngineCore for the rules) -------------------
    # Weight updates need no running request unless generation is paused. While paused, or with
    # the KV cache released, requests wait (generate() blocks until continue_generation /
    # resume_memory_occupation is called from another thread).

    def update_weights_from_tensor(self, named_tensors: Any, flush_cache: bool = True) -> int:
        """Copy (on-disk name, tensor) pairs into the engine's weights; flushes the prefix cache."""
        with self._lock.control():
            return self.core.update_weights_from_tensor(named_tensors, flush_cache=flush_cache)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl",
                                  timeout_s: float = 600.0) -> None:
        """Join a trainer's weight update group (`kiln.dist.weight_update_group`); blocks until
        every member has joined, so the trainer opens its end from another thread or process."""
        with self._lock.control():
            self.core.init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name,
                                                backend, timeout_s)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True) -> int:
        """Receive these tensors from the group's rank 0, in order, into the weights; returns how many."""
        with self._lock.control():
            return self.core.update_weights_from_distributed(names, dtypes, shapes, group_name, flush_cache)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        with self._lock.control():
            self.core.destroy_weights_update_group(group_name)

    def start_profile(self, output_dir: Optional[str] = None, num_steps: Optional[int] = None,
                      activities: tuple = ("CPU", "GPU"), with_stack: bool = False, record_shapes: bool = False,
                      profile_prefix: str = "") -> str:
        """Trace the next steps with torch.profiler (`kiln.engine.profiler`) into `output_dir`
        (default: the engine's `profile_dir`); returns the trace's file, written at
        `stop_profile()` or after `num_steps` steps."""
        from kiln.engine.profiler import ProfileOptions

        opts = ProfileOptions(output_dir or self.core.config.profile_dir, num_steps, tuple(activities), with_stack, record_shapes, profile_prefix)
        with self._lock.control():
            return self.core.start_profile(opts)

    def stop_profile(self) -> str:
        """End the trace and write it; returns its file."""
        with self._lock.control():
            return self.core.stop_profile()

    def update_weights_from_model(self, model: Any, flush_cache: bool = True) -> int:
        """Copy a colocated Kiln model's weights (same definition, unsharded) into the engine's,
        tensor for tensor; returns the bytes written (`EngineCore.update_weights_from_model`)."""
        with self._lock.control():
            return self.core.update_weights_from_model(model, flush_cache=flush_cache)

    def update_weights_from_disk(self, model_path: str, flush_cache: bool = True) -> int:
        """Load a checkpoint of the same architecture into the live weights; returns tensors read."""
        with self._lock.control():
            return self.core.update_weights_from_disk(model_path, flush_cache=flush_cache)

    def load_lora_adapter(self, name: str, adapter: Any) -> None:
        """Merge a LoRA adapter (PEFT directory or {"state_dict", "config"}) into the weights."""
        with self._lock.control():
            self.core.load_lora_adapter(name, adapter)

    def load_lora_from_model(self, name: str, model: Any) -> None:
        """Merge a colocated LoRA model's adapter (the trainer's) by stacked tensor
        (`EngineCore.load_lora_from_model`)."""
        with self._lock.control():
            self.core.load_lora_from_model(name, model)

    def unload_lora_adapter(self, name: str) -> None:
        """Restore the base weights."""
        with self._lock.control():
            self.core.unload_lora_adapter(name)

    def pause_generation(self, mode: str = "abort") -> int:
        """Stop stepping: "abort" aborts every request, "retract" sends running ones back to the
        queue, "in_place" keeps them (and their KV). Returns how many were aborted/retracted."""
        with self._lock.control():
            n = self.core.pause_generation(mode)
            self._step_locked()  # route the abort outputs
            return n

    def continue_generation(self) -> None:
        with self._lock.control():
            self.core.continue_generation()
        self._wake.set()

    def release_memory_occupation(self, tags: Optional[list[str]] = None) -> dict:
        """Free device memory: tags "kv_cache" and/or "weights" (default both)."""
        with self._lock.control():
            return self.core.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        with self._lock.control():
            self.core.resume_memory_occupation(tags)
        self._wake.set()

    def shutdown(self) -> None:
        """Stop the driver thread and release the core."""
        self._closed = True
        self._wake.set()
        if self._driver is not None:
            self._driver.join(timeout=10)
            self._driver = None
        close = getattr(self.core, "shutdown", None)
        if callable(close):
            close()
        if getattr(self, "_gc_before", None) is not None:
            restore_gc(self._gc_before)  # what tune_gc froze can be collected again (cycles included)
            self._gc_before = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- preparing requests --------------------------------------------------------------
    def _prepare(self, prompts: Prompts, sampling_params: ParamsArg, return_routed_experts: bool,
                 stream: bool = False) -> list[_Tracked]:
        """Tokenize and validate everything first, so a bad prompt queues nothing. Text is decoded as
        it is generated only for `stream` (generate_stream); otherwise once, at the end."""
        if self._closed:
            raise RuntimeError("This Engine was shut down; create a new one.")
        batch = _as_batch(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(batch):
                raise ValueError(f"Got {len(sampling_params)} sampling_params for {len(batch)} prompts; "
                                 "pass one SamplingParams, or one per prompt.")
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params or SamplingParams()] * len(batch)
        tracked = []
        for prompt, params in zip(batch, params_list):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError("Text prompts need a tokenizer; pass token ids (skip_tokenizer_init is set).")
                text, ids = prompt, self.tokenizer.encode(prompt)
            else:
                text, ids = None, list(prompt)
            validate_request(ids, params, self.info.vocab_size, self.info.context_length, self.config.max_logprobs)
            rid = f"offline-{next(self._ids)}"
            state = RequestState(rid, text, ids, params, self.tokenizer, self.info.eos_token_ids, stream=stream)
            tracked.append(_Tracked(state, expand_request(rid, ids, params, return_routed_experts)))
        return tracked

    @staticmethod
    def _result(t: _Tracked) -> RequestOutput:
        if t.state.error is not None:
            raise RequestError(t.state.error)
        return t.state.to_output()

    # ---- driving the core (all under self._lock) -----------------------------------------
    def _drive_until(self, cond: Callable[[], bool], bar: Any = None,
                     num_done: Callable[[], int] = lambda: 0) -> None:
        idle = 0
        while not cond():
            with self._lock:
                if cond():
                    break
                stepped = self._step_locked()
            self._lock.yield_to_control()
            if bar is not None:  # updated on this thread only: tqdm is not thread-safe
                bar.update(num_done() - bar.n)
            if not stepped and getattr(self.core, "blocked", False):
                time.sleep(0.01)  # paused / KV released: another thread resumes us
                continue
            idle = 0 if stepped else idle + 1
            if idle > 3:
                raise RuntimeError("The engine core went idle with requests unfinished; this is a bug in "
                                   "the core (has_work() returned False too early).")
        if bar is not None:
            bar.update(bar.total - bar.n)

    def _step_locked(self) -> bool:
        """Add queued requests, run one scheduler step and route its outputs; False if idle."""
        self._drain_inbox_locked()
        if not self.core.has_work():
            return False
        try:
            outs = self.core.step()
        except Exception as e:
            self._fail_all(f"The engine core failed ({type(e).__name__}: {e}); create a new Engine.")
            raise
        for out in outs:
            entry = self._tracked.get(out.rid)
            if entry is None:
                continue  # e.g. the abort notice of a sequence already cut at a stop string
            t, index = entry
            delta = t.state.update(index, out)
            if t.text_deltas is not None and delta is not None and delta.text:
                t.text_deltas.append(delta.text)
            seq = t.state.seqs[index]
            if seq.needs_abort:
                seq.needs_abort = False
                self.core.abort(out.rid)
            if seq.finished or out.finished:
                self._tracked.pop(out.rid, None)
            if t.state.done:
                for rid in t.state.unfinished_rids():  # an error ends every sibling
                    self._tracked.pop(rid, None)
                    self.core.abort(rid)
            if t.on_update is not None:
                t.on_update(t)
        return True

    def _drain_inbox_locked(self) -> None:
        while True:
            try:
                kind, t = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                for req in t.reqs:
                    self._tracked[req.rid] = (t, parse_sub_rid(req.rid)[1])
                    self.core.add_request(req)
            else:  # abort
                for rid in t.state.sub_rids():
                    if self._tracked.pop(rid, None) is not None:
                        self.core.abort(rid)

    def _abort(self, tracked: list[_Tracked]) -> None:
        for t in tracked:
            if not t.state.done:
                self._inbox.put(("abort", t))
        self._wake.set()

    def _ensure_driver(self) -> None:
        if self._driver is None or not self._driver.is_alive():
            self._driver = threading.Thread(target=self._driver_loop, name="kiln-engine-driver", daemon=True)
            self._driver.start()

    def _fail_all(self, why: str) -> None:
        """End every tracked request with an error, so no caller waits forever."""
        failed = {id(t): t for t, _ in self._tracked.values()}
        for rid in list(self._tracked):
            try:
                self.core.abort(rid)
            except Exception:  # noqa: BLE001 - best effort on a core that just failed
                pass
        self._tracked.clear()
        for t in failed.values():
            t.state.error = why
            if t.on_update is not None:
                t.on_update(t)

    def _driver_loop(self) -> None:
        while not self._closed:
            with self._lock:
                try:
                    self._step_locked()
                except Exception:  # noqa: BLE001 - its waiters were failed; a new call restarts us
                    logger.exception("Engine driver stopped")
                    return
                busy = self.core.has_work()
            self._lock.yield_to_control()
            if not busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()


def _as_batch(prompts: Prompts) -> list[Union[str, list[int]]]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("prompts must be a string, a list of strings, a list of token ids, or a list "
                         f"of token-id lists; got {type(prompts).__name__} {prompts!r:.80}")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [list(prompts)]
    batch: list[Union[str, list[int]]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            batch.append(p)
        elif isinstance(p, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            batch.append(list(p))
        else:
            raise ValueError(f"prompts[{i}] must be a string or a list of token ids; got {p!r:.80}")
    return batch
