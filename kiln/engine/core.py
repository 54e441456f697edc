"""`EngineCore`: model runner + cache + scheduler built from an `EngineConfig`.

This is what a scheduler process runs (and what the offline `Engine` drives in-process). It takes
token ids in and gives token ids out; tokenization and detokenization live elsewhere.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from kiln.config import EngineConfig
from kiln.engine.cache.allocator import PageAllocator
from kiln.engine.cache.manager import CacheManager, WindowSpace
from kiln.engine.cache.radix import RadixCache
from kiln.engine.io import GenerateReq, ReqOutput, SchedulerStats
from kiln.engine.runner import ModelRunner
from kiln.engine.scheduler import Scheduler
from kiln.loader import ModelSource, resolve_model
from kiln.loader.tokenizer import eos_token_ids

logger = logging.getLogger(__name__)


@dataclass
class ModelInfo:
    name: str  # served model name
    model_dir: str  # HF directory (config.json + tokenizer files), after GGUF conversion
    vocab_size: int
    context_length: int
    eos_token_ids: list[int]
    max_total_tokens: int = 0


class EngineCore:
    """Model runner + scheduler. Not thread-safe: one thread drives it."""

    def __init__(self, config: EngineConfig, source: Optional[ModelSource] = None):
        self.config = config
        source = source or resolve_model(config.model_path, config.load_format)
        self.runner = ModelRunner(config, source)
        mc = self.runner.model_config
        allocator = PageAllocator(self.runner.num_pages, config.page_size)
        windows = [WindowSpace(c, PageAllocator(n, config.page_size), self.runner.window_tables[c],
                               self.runner.window_history[c]) for c, n in self.runner.window_pages.items()]
        tree = None if config.disable_radix_cache else RadixCache(
            allocator, config.page_size, {w.name: w.allocator for w in windows})
        self.cache = CacheManager(allocator, self.runner.req_to_token, tree, windows)
        eos = eos_token_ids(source.model_dir, source.config, None)
        self.info = ModelInfo(
            name=config.served_model_name or source.name, model_dir=source.model_dir,
            vocab_size=mc.vocab_size, context_length=self.runner.context_length,
            eos_token_ids=list(eos), max_total_tokens=allocator.capacity * config.page_size)
        self.scheduler = Scheduler(config, self.runner, self.cache, self.info.eos_token_ids,
                                   self.info.context_length, mc.vocab_size)

    def add_request(self, req: GenerateReq) -> None:
        self.scheduler.add_request(req)

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def step(self) -> list[ReqOutput]:
        return self.scheduler.step()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
