"""`EngineCore`: model runner + cache + scheduler built from an `EngineConfig`.

This is what a scheduler process runs (and what the offline `Engine` drives in-process). It takes
token ids in and gives token ids out; tokenization and detokenization live elsewhere.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

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

    # ---- weight updates (RL) -----------------------------------------------------------------
    # In place, between rollouts: the engine must be idle (no running or waiting requests), and the
    # prefix cache is flushed afterwards because its KV was computed with the old weights.

    def _require_idle(self, what: str) -> None:
        if self.has_work():
            raise RuntimeError(f"{what}: the engine has requests in flight; finish or abort them first")

    def update_weights_from_tensor(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy (on-disk name, tensor) pairs into the weights (any subset); returns how many."""
        self._require_idle("update_weights_from_tensor")
        named = list(named_tensors)
        self.runner.update_weights(named)
        self.flush_cache()
        return len(named)

    def load_lora_adapter(self, name: str, adapter: Any) -> None:
        """Merge a LoRA adapter into the weights: W = W_base + (alpha / r) B @ A per targeted
        tensor, computed in fp32 from a kept copy of W_base. `adapter`: a PEFT adapter directory,
        or {"state_dict": PEFT tensors, "config": adapter_config dict}.

        One merged adapter at a time: loading any adapter (a new version of `name`, or another
        name) first restores the base weights. Native multi-LoRA batching (several adapters served
        side by side, selected per request) is future work."""
        from kiln.rl.lora import merged_delta, read_adapter, scaling_of
        from kiln.rl.sync import checkpoint_views

        self._require_idle("load_lora_adapter")
        state, config = read_adapter(adapter) if isinstance(adapter, str) else \
            (adapter["state_dict"], adapter["config"])
        deltas = merged_delta(state, scaling_of(config))
        self._restore_lora_base()
        views = dict(checkpoint_views(self.runner.model))
        unknown = sorted(set(deltas) - set(views))
        if unknown:
            raise KeyError(f"adapter {name!r} targets tensors this model does not have: {unknown[:4]}")
        self._lora_base = {n: views[n].clone() for n in deltas}
        merged = ((n, (self._lora_base[n].float() + d.to(self._lora_base[n].device)).to(views[n].dtype))
                  for n, d in deltas.items())
        self.runner.update_weights(merged)
        self._lora_name = name
        self.flush_cache()

    def unload_lora_adapter(self, name: str) -> None:
        """Restore the base weights under adapter `name`."""
        self._require_idle("unload_lora_adapter")
        if getattr(self, "_lora_name", None) != name:
            raise KeyError(f"LoRA adapter {name!r} is not loaded")
        self._restore_lora_base()
        self.flush_cache()

    def _restore_lora_base(self) -> None:
        base = getattr(self, "_lora_base", None)
        if base:
            self.runner.update_weights(base.items())
        self._lora_base, self._lora_name = {}, None
