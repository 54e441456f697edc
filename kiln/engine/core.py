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
from kiln.engine.cache.hicache import build_hicache
from kiln.engine.cache.hicache_config import HiCacheConfig
from kiln.engine.cache.manager import CacheManager, WindowSpace
from kiln.engine.cache.radix import RadixCache
from kiln.engine.grammar import GrammarBackend
from kiln.engine.io import MEMORY_TAGS, PAUSE_MODES, GenerateReq, ReqOutput, SchedulerStats
from kiln.engine.profiler import EngineProfiler, ProfileOptions
from kiln.dist.parallel import SINGLE, ParallelContext
from kiln.dist.weight_update_group import DEFAULT_GROUP, WeightUpdateGroups, tensor_specs
from kiln.engine.runner import ModelRunner
from kiln.engine.scheduler import Scheduler
from kiln.engine.warmup import wants_warm_up, warm_up
from kiln.loader import ModelSource, load_tokenizer, resolve_model
from kiln.loader.tokenizer import eos_token_ids
from kiln.models.registry import parse_model_config

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

    def __init__(self, config: EngineConfig, source: Optional[ModelSource] = None, pc: ParallelContext = SINGLE):
        """`pc`: this process's tensor-parallel rank (`kiln.dist.init`); every rank builds its own
        EngineCore and must be given the same requests in the same order."""
        self.config = config
        hicache = HiCacheConfig.from_engine_config(config)  # bad HiCache flags fail before loading
        source = source or resolve_model(config.model_path, config.load_format)
        self.runner = ModelRunner(config, source, pc)
        mc = self.runner.model_config
        allocator = PageAllocator(self.runner.num_pages, config.page_size)
        windows = [WindowSpace(c, PageAllocator(n, config.page_size), self.runner.window_tables[c],
                               self.runner.window_history[c]) for c, n in self.runner.window_pages.items()]
        tree = None if config.disable_radix_cache else RadixCache(
            allocator, config.page_size, {w.name: w.allocator for w in windows})
        self.cache = CacheManager(allocator, self.runner.req_to_token, tree, windows)
        if hicache is not None:
            self.cache.hicache = build_hicache(hicache, tree, self.runner, source, config)
        eos = eos_token_ids(source.model_dir, source.config, None)
        self.info = ModelInfo(
            name=config.served_model_name or source.name, model_dir=source.model_dir,
            vocab_size=mc.vocab_size, context_length=self.runner.context_length,
            eos_token_ids=list(eos), max_total_tokens=allocator.capacity * config.page_size)
        grammar = GrammarBackend(lambda: load_tokenizer(source.model_dir, config.tokenizer_path),
                                 mc.vocab_size, self.info.eos_token_ids)
        self.scheduler = Scheduler(config, self.runner, self.cache, self.info.eos_token_ids,
                                   self.info.context_length, mc.vocab_size, grammar)
        self._forget_lora_base()  # no adapter merged
        self.weight_groups = WeightUpdateGroups()
        self.profiler = EngineProfiler(pc.tp_rank, self.runner.device.type)
        if wants_warm_up(config, self.runner):  # compile what the first requests would (kiln/engine/warmup.py)
            warm_up(self)

    def add_request(self, req: GenerateReq) -> None:
        self.scheduler.add_request(req)

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def step(self) -> list[ReqOutput]:
        """One scheduler step; while paused or with the KV cache released, only pending outputs
        (aborts, rejections) go out and nothing is computed."""
        if self.blocked:
            out, self.scheduler.outbox = self.scheduler.outbox, []
            return out
        out = self.scheduler.step()
        if self.profiler.active:
            self.profiler.after_step()
        if not self.scheduler.has_work():
            self.cache.on_idle()
        if self._flush_when_idle and not (self.scheduler.running or self.scheduler.waiting):
            self.scheduler.flush_cache()
            self._flush_when_idle = False
        return out

    def has_work(self) -> bool:
        if self.blocked:
            return bool(self.scheduler.outbox)
        return self.scheduler.has_work()

    @property
    def blocked(self) -> bool:
        """True while generation is paused or the KV cache is released: requests wait."""
        return self.paused is not None or self.runner.kv_released

    def shutdown(self) -> None:
        """Release what outlives a dropped core by itself: the HiCache host pool's page-locked
        memory (`HostPool.close`; without this it waits for a later safe point) after landing
        its pending disk writes. The core is not used afterwards."""
        if self.cache.hicache is not None:
            self.cache.hicache.close()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def start_profile(self, opts: ProfileOptions) -> str:
        """Trace the next steps with torch.profiler (`kiln.engine.profiler`); returns the file
        this rank's trace goes to (at `stop_profile`, or after `opts.num_steps` steps)."""
        return self.profiler.start(opts)

    def stop_profile(self) -> str:
        return self.profiler.stop()

    # ---- RL control (SGLang's control endpoints) ---------------------------------------------
    # Weight updates happen in place, between steps. They need no running request, unless
    # generation is paused: after pause_generation("retract") the requests wait without pages and
    # recompute everything with the new weights; after pause_generation("in_place") they keep their
    # pages, so the KV computed so far (old weights) stays in use when generation continues, as in
    # SGLang's in_place mode. The prefix cache is flushed (its KV came from the old weights) right
    # away when no request holds pages, else as soon as the engine next goes idle.

    paused: Optional[str] = None
    _flush_when_idle = False

    def _require_idle(self, what: str) -> None:
        if self.scheduler.running and self.paused is None:
            raise RuntimeError(f"{what}: requests are running; call pause_generation first (or wait "
                               "until they finish)")
        if self.scheduler.waiting and self.paused is None and not self.runner.kv_released:
            raise RuntimeError(f"{what}: requests are waiting; call pause_generation first (or wait "
                               "until they finish)")

    def _after_weight_update(self, flush: bool = True) -> None:
        if self.cache.hicache is not None:  # disk pages of these weights get keys of their own
            self.cache.hicache.weights_changed()
        if self.scheduler.spec is not None:  # the draft head's copy of the token map's rows
            self.scheduler.spec.drafter.on_weights_changed()
        if not flush:
            return
        if self.scheduler.running:  # in_place pause: their pages stay; flush once idle
            self._flush_when_idle = True
        else:  # waiting requests hold no pages
            self.cache.flush()

    def update_weights_from_tensor(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                                   flush_cache: bool = True) -> int:
        """Copy (on-disk name, tensor) pairs into the weights (any subset); returns how many."""
        self._require_idle("update_weights_from_tensor")
        named = list(named_tensors)
        self.runner.update_weights(named)
        self._after_weight_update(flush_cache)
        return len(named)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = DEFAULT_GROUP, backend: str = "nccl",
                                  timeout_s: float = 600.0) -> None:
        """Join a trainer's weight update group as rank rank_offset + this tensor-parallel rank
        (`kiln.dist.weight_update_group`); blocks until every member has joined."""
        self.weight_groups.init(group_name, master_address, master_port, rank_offset + self.runner.pc.tp_rank,
                                world_size, backend, timeout_s)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = DEFAULT_GROUP, flush_cache: bool = True) -> int:
        """Receive the named tensors from the group's rank 0 (one broadcast each, in this order)
        and load them as `update_weights_from_tensor` does; returns how many. Once the specs and
        the group check out, every tensor is received before anything else can fail (running
        requests, an unknown name), so rank 0's broadcasts never wait on an engine that gave up."""
        specs = tensor_specs(names, dtypes, shapes)
        received = self.weight_groups.receive(group_name, specs, self.runner.device)
        return self.update_weights_from_tensor(received, flush_cache=flush_cache)

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> None:
        self.weight_groups.destroy(group_name)

    def update_weights_from_model(self, model: torch.nn.Module, flush_cache: bool = True) -> int:
        """Copy a colocated Kiln model's weights (the trainer's: the same model definition,
        unsharded) into the live weights, tensor for tensor; returns the bytes written. Raises
        `WeightLayoutMismatch` (a ValueError) before copying anything if the two hold different
        tensors; `update_weights_from_tensor` takes checkpoint names instead. A LoRA adapter merged
        before is dropped, as with a checkpoint load."""
        from kiln.engine.model_copy import copy_weights

        self._require_idle("update_weights_from_model")
        if self.runner.weights_released:
            raise RuntimeError("update_weights_from_model: the weights are released; call "
                               "resume_memory_occupation(['weights']) first")
        nbytes = copy_weights(self.runner.model, model)
        self._forget_lora_base()
        self._after_weight_update(flush_cache)
        return nbytes

    def update_weights_from_disk(self, model_path: str, flush_cache: bool = True) -> int:
        """Load every tensor of a checkpoint (same architecture and shapes) into the live weights;
        returns how many tensors were read. A LoRA adapter merged before is dropped."""
        from kiln.loader import iter_weights

        self._require_idle("update_weights_from_disk")
        source = resolve_model(model_path, "auto" if self.config.load_format == "dummy" else self.config.load_format)
        if source.load_format == "dummy":
            raise ValueError(f"{model_path!r} has no weights to load")
        mine, theirs = self.runner.model_config, parse_model_config(source.config)
        for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size"):
            if getattr(mine, key, None) != getattr(theirs, key, None):
                raise ValueError(f"{model_path!r} is a different architecture: {key} is "
                                 f"{getattr(theirs, key, None)!r}, the served model has {getattr(mine, key, None)!r}")
        count = [0]

        def counted():
            for item in iter_weights(source):
                count[0] += 1
                yield item

        self.runner.model.load_weights(counted(), strict=True)
        self._forget_lora_base()
        self._after_weight_update(flush_cache)
        return count[0]

    def pause_generation(self, mode: str = "abort") -> int:
        """Stop stepping. "abort": abort every request; "retract": running requests go back to
        the waiting queue (their computed pages stay in the prefix cache); "in_place": requests
        keep their pages. Returns how many requests were aborted or retracted."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        sched, n = self.scheduler, 0
        if mode == "abort":
            rids = [r.rid for r in list(sched.running) + list(sched.waiting)]
            for rid in rids:
                sched.abort(rid)
            n = len(rids)
        elif mode == "retract":
            for r in reversed(list(sched.running)):  # newest first: appendleft keeps the order
                sched._retract(r)
                n += 1
        if sched.spec is not None:  # a verify queued ahead would use the old weights and requests' places
            sched.spec.drop_queued()
        self.paused = mode
        return n

    def continue_generation(self) -> None:
        self.paused = None

    def release_memory_occupation(self, tags: Optional[list[str]] = None) -> dict:
        """Free device memory by tag: "kv_cache" (the state pools; the prefix cache is flushed
        first and no request may hold pages), "weights" (parameters to pinned host memory; a no-op on CPU)."""
        tags = _check_tags(tags)
        extra: dict = {}
        if "kv_cache" in tags and not self.runner.kv_released:
            if self.scheduler.running:
                raise RuntimeError("release_memory_occupation(kv_cache): requests hold KV pages; call "
                                   "pause_generation with mode 'retract' or 'abort' first (or wait until idle)")
            self.cache.flush()
            extra["kv_cache_bytes"] = self.runner.release_state_pools()
        if "weights" in tags:
            self.runner.release_weights()
            extra["weights_on_cpu"] = self.runner.weights_released
        return extra

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        tags = _check_tags(tags)
        if "weights" in tags:
            self.runner.resume_weights()
        if "kv_cache" in tags and self.runner.kv_released:
            self.runner.resume_state_pools()
            self.cache.allocator.reset()
            for w in self.cache.windows.values():
                w.allocator.reset()

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
        self._after_weight_update()

    def load_lora_from_model(self, name: str, model: torch.nn.Module) -> None:
        """`load_lora_adapter` from a colocated LoRA model (`kiln.rl.lora`: the trainer's, same
        model definition, unsharded): scaling * B @ A per stacked tensor (q/k/v, gate/up, the
        experts) added to this engine's base in fp32, instead of per checkpoint tensor; the same
        merge, and the same rules (one adapter at a time; unload restores the base). Raises
        `WeightLayoutMismatch` (a ValueError) before changing anything if the adapted tensors are
        not this model's by name and shape."""
        from kiln.engine.model_copy import WeightLayoutMismatch
        from kiln.rl.lora import adapted_tensors, lora_delta

        self._require_idle("load_lora_from_model")
        if self.runner.weights_released:
            raise RuntimeError("load_lora_from_model: the weights are released; call "
                               "resume_memory_occupation(['weights']) first")
        ours, names = dict(self.runner.model.named_parameters()), adapted_tensors(model)
        for n in names:
            if n not in ours or ours[n].shape != model.get_parameter(n).shape:
                raise WeightLayoutMismatch(f"adapted tensor {n!r} is not one of this model's (name or shape)")
        self._restore_lora_base()
        with torch.no_grad():
            for n in names:
                p = ours[n]
                self._lora_base_params[n] = base = p.detach().clone()
                p.copy_((base.float() + lora_delta(model, n).to(p.device)).to(p.dtype))
        self._lora_name = name
        self._after_weight_update()

    def unload_lora_adapter(self, name: str) -> None:
        """Restore the base weights under adapter `name`."""
        self._require_idle("unload_lora_adapter")
        if self._lora_name != name:
            raise KeyError(f"LoRA adapter {name!r} is not loaded")
        self._restore_lora_base()
        self._after_weight_update()

    def _restore_lora_base(self) -> None:
        # The base of the merged tensors: by checkpoint name (load_lora_adapter) or by in-memory
        # name (load_lora_from_model).
        if self._lora_base:
            self.runner.update_weights(self._lora_base.items())
        if self._lora_base_params:
            params = dict(self.runner.model.named_parameters())
            with torch.no_grad():
                for n, t in self._lora_base_params.items():
                    params[n].copy_(t)
        self._forget_lora_base()

    def _forget_lora_base(self) -> None:
        """New full weights replace the base a merged adapter would be undone to."""
        self._lora_base, self._lora_base_params, self._lora_name = {}, {}, None


def _check_tags(tags: Optional[list[str]]) -> list[str]:
    if tags is None:
        return list(MEMORY_TAGS)
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad or not isinstance(tags, (list, tuple)):
        raise ValueError(f"tags must be a list of {', '.join(MEMORY_TAGS)}; got {tags!r}")
    return list(tags)
