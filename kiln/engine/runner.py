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
from kiln.engine.cache.pools import KVPool, ReqToTokenPool
from kiln.engine.sampler import Sampler
from kiln.layers.attention import PagedAttentionBackend
from kiln.loader import ModelSource, init_dummy_weights, iter_weights
from kiln.models.config import ModelConfig
from kiln.models.registry import get_model_class

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, pc: ParallelContext = SINGLE):
        self.config = config
        self.device = torch.device(config.resolved_device())
        self.dtype = config.resolved_dtype()
        self.model_config = ModelConfig.from_dict(source.config)
        self.context_length = config.context_length or self.model_config.max_position_embeddings
        self.model = self._load_model(source, pc)
        self.specs = self.model.state_specs()
        self.page_size = config.page_size
        self.num_pages = self._num_pages()
        num_slots = self.num_pages * self.page_size
        self.kv_pools = {}
        for spec in self.specs:
            assert spec.kind == ComponentKind.FULL_KV, f"{spec.kind} pools arrive with the hybrid models"
            self.kv_pools[spec.kind] = KVPool(spec, num_slots, self.dtype, self.device)
        self.req_to_token = ReqToTokenPool(config.max_running_requests, self.context_length, self.device)
        self.backend = PagedAttentionBackend(self.kv_pools[ComponentKind.FULL_KV], self.req_to_token.table)
        self.sampler = Sampler(seed=config.seed, device=self.device)
        logger.info("KV pool: %d pages x %d tokens (%.2f GB)", self.num_pages, self.page_size,
                    sum(p.nbytes() for p in self.kv_pools.values()) / 1e9)

    def _load_model(self, source: ModelSource, pc: ParallelContext) -> torch.nn.Module:
        cls = get_model_class(self.model_config.model_type)
        with torch.device(self.device):
            model = cls(self.model_config, pc, max_positions=self.context_length)
        # Parameters take the serving dtype; buffers (RoPE tables) stay fp32.
        for p in model.parameters():
            p.data = p.data.to(self.dtype)
        if source.load_format == "dummy":
            init_dummy_weights(model, self.config.seed)
        else:
            model.load_weights(iter_weights(source))
        return model.eval()

    def _num_pages(self) -> int:
        per_token = sum(s.bytes_per_token(self.dtype) for s in self.specs)
        if self.config.max_total_tokens:
            tokens = self.config.max_total_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free
            budget = total * self.config.mem_fraction_static - used_by_others
            tokens = int(max(budget, 0) // per_token)
        else:
            tokens = int(self.config.cpu_kv_cache_gb * 1e9 // per_token)
        pages = tokens // self.page_size + 1  # + the scratch page
        if pages < 2:
            raise ValueError("no memory left for the KV cache; lower the model size or raise "
                             "--mem-fraction-static / --max-total-tokens")
        return pages

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in fp32."""
        batch.backend = self.backend
        hidden = self.model(batch)
        return self.model.compute_logits(hidden, batch)
