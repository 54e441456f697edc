"""`ModelRunner`: owns the model weights, the state pools and the sampler on one device, and runs
forwards. Everything that touches device memory lives here; the scheduler only does bookkeeping.
"""

from __future__ import annotations

import logging

import torch

from kiln.config import EngineConfig
from kiln.dist.parallel import SINGLE, ParallelContext
from kiln.engine.batch import ForwardBatch
from kiln.engine.cache.components import ComponentKind
from kiln.engine.cache.layer_gate import LayerGate
from kiln.engine.cuda_graph import MAX_VERIFY_TOKENS, CudaGraphRunner
from kiln.engine.cache.pools import KVPool, MergedStatePool, ReqToTokenPool, TokenStatePool
from kiln.engine.paged_backend import PagedBackend
from kiln.engine.pinned_weights import PinnedWeights
from kiln.engine.routing import RoutingCapture, moe_shape
from kiln.engine.sampler import Sampler
from kiln.engine.spec.adaptive import adaptive_steps
from kiln.kernels import interpreting, kernels_supported
from kiln.loader import ModelSource, cast_parameters, init_dummy_weights, iter_weights
from kiln.models.registry import get_model_class, parse_model_config

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, pc: ParallelContext = SINGLE):
        self.config = config
        assert pc.tp_size == config.tp_size, f"tp_size {config.tp_size} but the parallel context has {pc.tp_size} ranks"
        self.pc = pc
        self.device = torch.device(config.resolved_device())
        if self.device.type == "cuda" and pc.tp_size > 1:
            self.device = torch.device("cuda", pc.tp_rank)
        self.dtype = config.resolved_dtype()
        self.model_config = parse_model_config(source.config)
        self.context_length = config.context_length or self.model_config.max_position_embeddings
        self.model = self._load_model(source, pc)
        self.use_kernels = self._want_kernels()
        if self.use_kernels:  # process-wide, like torch.backends flags; captured graphs keep it
            from kiln.kernels.launch import set_pdl  # imports triton, which CPU builds may lack

            set_pdl(not config.disable_pdl, early_trigger=config.pdl_early_trigger)
        # Kernels read per-sequence lengths from the device, not from host lists.
        self.needs_device_metadata = self.use_kernels
        # Speculative decoding: the draft length, and the state the drafter keeps in the page spaces.
        # MTP: the first `spec_steps` MTP layers' own state. Block drafters (dflash, dspark): the
        # drafter module, its context K/V (DRAFT_KV, main space) and the target layers it taps.
        self.spec_steps, num_mtp, draft_specs = 0, 0, []
        self.mtp_catch_up_lag = 0  # committed tokens the MTP state may lag (window spaces keep as many more)
        self.draft_model, self.draft_identity, self.capture_layers = None, None, ()
        if config.speculative_algorithm == "mtp":
            from kiln.engine.spec.mtp_drafter import resolve_mtp_steps

            self.spec_steps = num_mtp = resolve_mtp_steps(config, self.model)
            if config.speculative_adaptive:  # plain steps may leave the MTP catch-up for later
                from kiln.engine.spec.mtp_drafter import CATCH_UP_LAG

                self.mtp_catch_up_lag = CATCH_UP_LAG
        elif config.speculative_algorithm in ("dflash", "dspark"):
            from kiln.engine.spec.block_drafter import draft_kv_spec, resolve_block_drafter

            self.draft_model, self.spec_steps, self.draft_identity = resolve_block_drafter(
                config, source, self.model, self.context_length, self.device, self.dtype)
            self.capture_layers = tuple(self.draft_model.config.target_layer_ids)
            draft_specs = [draft_kv_spec(self.draft_model)]
        elif config.speculative_algorithm == "ngram":  # drafts from the request's own tokens: no state
            from kiln.engine.spec.ngram_drafter import resolve_ngram_steps

            self.spec_steps = resolve_ngram_steps(config)
        if config.speculative_draft_model_path and config.speculative_algorithm != "dflash":
            raise ValueError("--speculative-draft-model-path is only read with --speculative-algorithm dflash")
        self.specs = (self.model.state_specs(num_mtp=num_mtp) if num_mtp else self.model.state_specs()) + draft_specs
        self.page_size = config.page_size
        self.req_to_token = ReqToTokenPool(config.max_running_requests, self.context_length, self.device)
        # HiCache's copies on the pool buffers, waited for layer by layer (cache/layer_gate.py)
        self.load_gate = LayerGate()
        self._build_pools()
        self.sampler = Sampler(seed=config.seed, device=self.device)
        num_moe, top_k = moe_shape(self.model)
        self.has_moe = num_moe > 0
        self.routing = RoutingCapture(self.num_pages, self.page_size, num_moe, top_k) \
            if config.enable_return_routed_experts and num_moe else None
        self.graphs = None
        if self._want_graphs():
            self.graphs = self._new_graphs()
            self.graphs.capture()

    def _want_kernels(self) -> bool:
        choice = self.config.kernel_backend
        if choice == "triton" and self.device.type == "cpu" and interpreting():
            return True  # tests: the engine's kernel path under Triton's CPU interpreter
        if choice == "reference" or self.device.type != "cuda":
            return False
        if not kernels_supported(self.device):
            if choice == "triton":
                raise RuntimeError("--kernel-backend triton needs the triton package (pip install triton)")
            logger.warning("triton is not installed: running the PyTorch reference ops on CUDA")
            return False
        return True

    def gemv_max_rows(self) -> int:
        """`--gemv-max-rows`, resolved. Unset means 1 (batch-1 decode) where the GEMV was measured
        ahead of cuBLAS: the kernel path with PDL (NVIDIA sm_90+; without PDL its weight stream
        cannot start early and cuBLAS is faster) on one GPU (`--tp-size 2` with the GEMV has not
        run on GPUs yet). 0 elsewhere; the CPU's tests ask for the interpreter's GEMV explicitly."""
        rows = self.config.gemv_max_rows
        if rows is not None:
            return rows
        if not self.use_kernels or self.device.type != "cuda" or self.pc.tp_size > 1:
            return 0
        from kiln.kernels.launch import pdl_supported

        return int(pdl_supported(self.device))

    def _want_graphs(self) -> bool:
        # Graph replay needs kernels that take lengths as device tensors (the reference ops read
        # host lists).
        return self.device.type == "cuda" and self.use_kernels and not self.config.disable_cuda_graph

    def _new_graphs(self) -> CudaGraphRunner:
        """The graph runner (not captured yet): decode, and with speculative decoding the verify
        forward of a full round (the last token + `spec_steps` drafts per request), and of every
        shorter round `--speculative-adaptive` may choose."""
        shapes = [1]
        if self.spec_steps:
            steps = adaptive_steps(self.spec_steps) if self.config.speculative_adaptive else [self.spec_steps]
            shapes += [k + 1 for k in steps if k]
        return CudaGraphRunner(self._forward_eager, min(self.config.cuda_graph_max_bs, self.config.max_running_requests),
                               list(self.window_tables), self.device, tokens_per_seq=shapes,
                               capture_context=self._graph_capture_context, use_kernels=self.use_kernels)

    def _graph_capture_context(self, bs: int, q: int):
        """PDL's early trigger for graphs of at most `--pdl-early-trigger-max-tokens` rows (all
        of them with `--pdl-early-trigger`): it gains at batch 1 and 8 but costs at batch 64.
        Not for speculative verify graphs (q > 1; unless --pdl-early-trigger): there it gained
        nothing at batch 1 and 8, and K = 3 rounds at batch 32 ran ~0.6-0.9 ms slower with it
        (docs/benchmarks.md, fourteenth pass; why is not established). A speculative engine's
        decode graphs (q = 1: `--speculative-adaptive`'s plain steps) take it as plain decode's:
        adaptive MTP's mostly plain steps went 1.63-1.64 -> 1.48-1.49 ms at batch 1 on an H100
        (thirty-fifth pass)."""
        from kiln.kernels.launch import early_trigger

        cfg = self.config
        small = bs * q <= cfg.pdl_early_trigger_max_tokens and (q == 1 or not self.spec_steps)
        return early_trigger(cfg.pdl_early_trigger or small)

    def _graph_reserve_bytes(self) -> int:
        """GPU memory kept out of the KV pools for the decode graphs' activations: the largest
        captured batch's logits (fp32, a few copies through sampling) plus hidden and MLP
        activations, doubled for the allocator's rounding. Sized generously: a capture that runs
        out of memory is fatal, a few hundred MB less KV cache is not."""
        if not self._want_graphs():
            return 0
        mc, bs = self.model_config, min(self.config.cuda_graph_max_bs, self.config.max_running_requests)
        if self.spec_steps:  # the verify graphs' rows (capped like CudaGraphRunner caps them)
            bs = max(bs, min(bs * (self.spec_steps + 1), MAX_VERIFY_TOKENS))
        width = 8 * mc.hidden_size + 4 * getattr(mc, "intermediate_size", 4 * mc.hidden_size)
        per_row = 4 * mc.vocab_size * 4 + width * self.dtype.itemsize
        return 2 * bs * per_row + (512 << 20)

    def _build_pools(self) -> None:
        """One page space for the components kept for every token (FULL_KV, INDEX_K), one window
        space per windowed component (SWA_KV: "swa", CONV: "conv"), sized from memory."""
        specs = {k: [s for s in self.specs if s.kind == k] for k in ComponentKind}
        ps = self.page_size
        per_token = {
            "main": sum(s.bytes_per_token(self.dtype) for s in
                        specs[ComponentKind.FULL_KV] + specs[ComponentKind.INDEX_K] + specs[ComponentKind.DRAFT_KV]),
            "swa": sum(s.bytes_per_token(self.dtype) for s in specs[ComponentKind.SWA_KV]),
            "conv": sum(s.bytes_per_token(self.dtype) for s in specs[ComponentKind.CONV]),
        }
        # Tokens of history each window space must keep: SWA reads W - 1 earlier keys, ShortConv K - 1.
        self.window_history = {}
        if specs[ComponentKind.SWA_KV]:
            self.window_history["swa"] = max(s.window for s in specs[ComponentKind.SWA_KV]) - 1
        if specs[ComponentKind.CONV]:
            self.window_history["conv"] = max(s.window for s in specs[ComponentKind.CONV])
        # a late MTP catch-up row reads the window state of its own position, not the newest one's
        self.window_history = {c: h + self.mtp_catch_up_lag for c, h in self.window_history.items()}
        main_tokens, win_tokens = self._pool_tokens(per_token)
        self.num_pages = main_tokens // ps + 1  # + the scratch page
        self.window_pages = {c: t // ps + 1 for c, t in win_tokens.items()}
        slots = self.num_pages * ps
        self.full_kv = KVPool(specs[ComponentKind.FULL_KV][0], slots, self.dtype, self.device) \
            if specs[ComponentKind.FULL_KV] else None
        self.index_k = TokenStatePool(specs[ComponentKind.INDEX_K][0], slots, self.dtype, self.device) \
            if specs[ComponentKind.INDEX_K] else None
        self.draft_kv = KVPool(specs[ComponentKind.DRAFT_KV][0], slots, self.dtype, self.device) \
            if specs[ComponentKind.DRAFT_KV] else None
        self.swa_kv = KVPool(specs[ComponentKind.SWA_KV][0], self.window_pages["swa"] * ps, self.dtype, self.device) \
            if specs[ComponentKind.SWA_KV] else None
        self.conv = MergedStatePool([TokenStatePool(s, self.window_pages["conv"] * ps, self.dtype, self.device)
                                     for s in specs[ComponentKind.CONV]]) if specs[ComponentKind.CONV] else None
        self.window_tables = {c: torch.zeros_like(self.req_to_token.table) for c in self.window_pages}
        tables = {"main": self.req_to_token.table, **self.window_tables}
        self.backend = PagedBackend(self.full_kv, tables, swa_kv=self.swa_kv, index_k=self.index_k, conv=self.conv,
                                    use_kernels=self.use_kernels, gate=self.load_gate,
                                    gemv_max_rows=self.gemv_max_rows(),
                                    moe_gemv_max_tokens=self.config.moe_gemv_max_tokens,
                                    gemv_prefetch_bytes=self.config.gemv_l2_prefetch_mb << 20,
                                    fused_router_gate=self.config.fused_router_gate,
                                    fold_norms_max_hidden=self.config.fold_norms_max_hidden,
                                    early_kv_max_bs=self.config.attention_early_kv_max_bs,
                                    prologue_max_bs=self.config.attention_prologue_max_bs,
                                    msa_prologue=not self.config.disable_msa_prologue,
                                    msa_prologue_scores=not self.config.disable_msa_prologue_scores,
                                    qkv_rope=not self.config.disable_fused_qkv_rope,
                                    norm_epilogue=not self.config.disable_norm_epilogue)
        total = sum(p.nbytes() for p in (self.full_kv, self.index_k, self.draft_kv, self.swa_kv, self.conv)
                    if p is not None)
        logger.info("state pools: %d main pages x %d tokens%s (%.2f GB)", self.num_pages, ps,
                    "".join(f", {c}: {n} pages" for c, n in self.window_pages.items()), total / 1e9)

    def _pool_tokens(self, per_token: dict[str, int]) -> tuple[int, dict[str, int]]:
        """Main-space tokens and window-space tokens. Window spaces get enough for one prefill
        chunk plus every running request's window, and SWA at least `swa_full_tokens_ratio` of
        the main space (SGLang's default split)."""
        cfg, ps = self.config, self.page_size
        chunk = cfg.max_prefill_tokens if cfg.chunked_prefill_size <= 0 else min(cfg.max_prefill_tokens, cfg.chunked_prefill_size)
        # + the positions a speculative round verifies or drafts beyond a request's committed tokens
        floor = {c: chunk + cfg.max_running_requests * (h + 2 * ps + self.spec_steps)
                 for c, h in self.window_history.items()}
        ratio = {c: (cfg.swa_full_tokens_ratio if c == "swa" else 0.0) for c in self.window_history}
        if cfg.max_total_tokens:
            main = cfg.max_total_tokens
        else:
            if self.device.type == "cuda":
                # The model is built in fp32, then cast (`_load_model`): the freed fp32 blocks stay in
                # torch's cache, which the driver counts as used, and the budget would miss them (half
                # the fp32 model at bf16; ~11.5 GB on Inkling `bench`, which then found no room for its
                # KV cache on an H100: docs/benchmarks.md, thirty-fourth pass).
                torch.cuda.empty_cache()
                free, total = torch.cuda.mem_get_info(self.device)
                budget = total * cfg.mem_fraction_static - (total - free) - self._graph_reserve_bytes()
            else:
                budget = cfg.cpu_kv_cache_gb * 1e9
            fixed = sum(floor[c] * per_token[c] for c in floor)
            per_main = per_token["main"] + sum(ratio[c] * per_token[c] for c in ratio)
            main = int(max(budget - fixed, 0) // per_main)
            if main < 2 * ps:
                raise ValueError(self._no_memory_message(budget, chunk, floor, per_token))
        main = self.pc.min_int(main)  # every rank must hold the same pages (same scheduler decisions)
        if main < 2 * ps:
            raise ValueError(f"no memory left for the KV cache (main space: {main} tokens, at least "
                             f"{2 * ps} needed); raise --max-total-tokens or --mem-fraction-static")
        return main, {c: max(floor[c], int(ratio[c] * main)) for c in self.window_history}

    def _no_memory_message(self, budget: float, chunk: int, floor: dict[str, int], per_token: dict[str, int]) -> str:
        """Why the KV budget left no main space, and the flags that would fix it. A hybrid's window
        spaces are sized first, for every running request's whole window (`_pool_tokens`): at 256
        requests Inkling `bench`'s 4K sliding window alone wants ~43 GB, more than an 80 GB GPU
        has left after its weights (docs/benchmarks.md, thirty-fourth pass)."""
        cfg = self.config
        gb = lambda b: f"{b / 1e9:.1f} GB" if b >= 1e9 else f"{b / 1e6:.1f} MB"  # noqa: E731
        msg = f"no memory left for the KV cache: {gb(max(budget, 0))} of KV budget"
        if not floor:
            return msg + "; raise --mem-fraction-static (or --cpu-kv-cache-gb on the CPU), or use a smaller model"
        windows = sum(floor[c] * per_token[c] for c in floor)
        per_req = sum((floor[c] - chunk) // max(cfg.max_running_requests, 1) * per_token[c] for c in floor)
        # requests whose windows fill half the budget, the other half left to the main space
        spare = budget / 2 - sum(chunk * per_token[c] for c in floor)
        fits = int(spare // per_req) if per_req > 0 and spare > 0 else 0
        msg += (f", and the window spaces ({', '.join(floor)}) take {gb(windows)} to hold a whole window for each of "
                f"--max-running-requests {cfg.max_running_requests}")
        hint = f"lower --max-running-requests (about {fits} fit)" if fits else "lower --max-running-requests"
        return msg + f"; {hint}, or raise --mem-fraction-static (or --cpu-kv-cache-gb on the CPU)"

    def _load_model(self, source: ModelSource, pc: ParallelContext) -> torch.nn.Module:
        cls = get_model_class(self.model_config.model_type)
        with torch.device(self.device):
            model = cls(self.model_config, pc, max_positions=self.context_length)
        cast_parameters(model, self.dtype)  # the serving dtype (routers fp32); buffers stay fp32
        if source.load_format == "dummy":
            init_dummy_weights(model, self.config.seed)
        else:
            model.load_weights(iter_weights(source))
        _stack_decode_weights(model)
        return model.eval()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in fp32: replayed from a CUDA graph for
        decode batches that have one, else eager."""
        if self.graphs is not None and self.graphs.can_run(batch):
            self.load_gate.wait_all()  # a replay cannot wait between layers
            logits = self.graphs.replay(batch)
        else:
            logits = self._forward_eager(batch)
            self.load_gate.wait_all()  # buffers the forward did not touch (the drafter may read them)
        if self.routing is not None:
            self.routing.record(batch.extras.get("routed_experts"), batch.out_cache_loc,
                                batch.extras.get("out_cache_loc_cpu"))
        return logits

    def _forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        batch.backend = self.backend
        batch.capture_layers = self.capture_layers  # a block drafter's taps (empty: none)
        batch.record_routing = self.routing is not None
        hidden = self.model(batch)
        batch.extras["hidden"] = hidden  # final hidden states [T, H] (speculative decoding's drafter reads them)
        if self.draft_model is not None and batch.num_tokens:
            self.store_draft_context(batch)
        return self.model.compute_logits(hidden, batch)

    def store_draft_context(self, batch: ForwardBatch) -> None:
        """A block drafter's context K/V of every row of this forward, from its taps
        (`kiln.engine.spec.block_drafter.store_context`): inside the forward, so that a CUDA graph
        replays it with the forward."""
        from kiln.engine.spec.block_drafter import store_context

        store_context(self.draft_model, self.draft_kv, batch if self.use_kernels else None, batch.taps(),
                      batch.positions, batch.out_cache_loc)
        batch.captured.clear()  # the taps are not needed any more

    @torch.no_grad()
    def update_weights(self, named_tensors) -> set[str]:
        """Copy some checkpoint tensors (on-disk names) into the live weights, in place: dtype,
        device, sharding and stacking as at load time. Unlike a checkpoint load, a subset is fine.

        Goes through the model's own `load_weights(strict=False)`, so names map exactly as when
        loading; unknown names still raise KeyError."""
        return self.model.load_weights(named_tensors, strict=False)

    # ---- memory release (RL colocation) ----------------------------------------------------
    def _pool_tensors(self) -> list[tuple[object, object]]:
        """(container, key) of every state-pool tensor: list/dict slots that hold one tensor."""
        refs: list[tuple[object, object]] = []
        for pool in (self.full_kv, self.swa_kv, self.draft_kv):
            if pool is not None:
                refs += [(pool.k, i) for i in range(len(pool.k))] + [(pool.v, i) for i in range(len(pool.v))]
        pools = [self.index_k] + (list(self.conv.pools) if self.conv is not None else [])
        for pool in pools:
            if pool is not None:
                refs += [(pool.buffers, k) for k in pool.buffers]
        return refs

    @property
    def kv_released(self) -> bool:
        return getattr(self, "_released_pools", None) is not None

    def release_state_pools(self) -> int:
        """Free every state-pool tensor (replaced by empty ones); returns the bytes freed. The
        caller makes sure no request holds pages."""
        if self.kv_released:
            return 0
        saved, freed = [], 0
        for holder, key in self._pool_tensors():
            t = holder[key]
            saved.append((holder, key, tuple(t.shape), t.dtype))
            freed += t.numel() * t.element_size()
            holder[key] = torch.empty(0, dtype=t.dtype, device=t.device)
        self._released_pools = saved
        if self.graphs is not None:  # drop the graphs' own memory pool too
            self.graphs = self._new_graphs()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def resume_state_pools(self) -> None:
        """Re-allocate the pools released by `release_state_pools` (same sizes, zeroed)."""
        saved, self._released_pools = getattr(self, "_released_pools", None), None
        for holder, key, shape, dtype in saved or ():
            holder[key] = torch.zeros(shape, dtype=dtype, device=self.device)
        self._recapture_graphs()

    def _recapture_graphs(self) -> None:
        """Graphs hold the addresses of the pools and weights they were captured with: after a
        release + resume those are new allocations, so the graphs are captured again, without
        warm-ups: every shape ran at the first capture."""
        if self.graphs is not None and not self.kv_released and not self.weights_released:
            self.graphs = self._new_graphs()
            self.graphs.capture(warmups=0)

    @property
    def weights_released(self) -> bool:
        return getattr(self, "_weights_on_cpu", False)

    def release_weights(self) -> None:
        """Move the parameters and buffers to pinned host memory (CUDA only; on CPU there is
        nothing to free)."""
        if self.device.type == "cuda" and not self.weights_released:
            if getattr(self, "_pinned", None) is None:
                self._pinned = PinnedWeights()
            self._pinned.offload(self._weight_modules())
            self._weights_on_cpu = True
            torch.cuda.empty_cache()

    def _weight_modules(self) -> list:
        # a DFlash drafter is not part of the model
        return [self.model] + ([self.draft_model] if self.draft_model is not None else [])

    def resume_weights(self) -> None:
        if self.weights_released:
            self._pinned.restore(self._weight_modules(), self.device)
            _stack_decode_weights(self.model)  # restored weights are separate tensors again
            self._weights_on_cpu = False
            self._recapture_graphs()


def _stack_decode_weights(model: torch.nn.Module) -> None:
    """Lay out the weights that a model's decode step reads as one matrix (`stack_decode_weights`,
    `kiln.layers.stacked_weights`), where it has such."""
    stack = getattr(model, "stack_decode_weights", None)
    if stack is not None:
        stack()
