"""The warm-up at startup: a few short requests served to completion before the first user's.

On CUDA a Triton kernel variant compiles the first time the process meets it: 0.1-2.5 s, or ~10
ms from Triton's disk cache. Capturing the CUDA graphs compiles greedy decode's kernels, but what
only a sampled request, a penalty or a prefill runs compiled inside the first request that needed
it: on a machine whose Triton cache was cold, ~3.9 s of the first sampled request went to the
sampler's and exact verification's compiles (`benchmarks/compile_log.py`; docs/benchmarks.md,
forty-fourth pass). SGLang serves a warm-up request after startup for the same reason
(`--skip-server-warmup` turns it off there and here).

`warm_up` serves one sampled request alone (the batch-1 variants: temperature 1 with a seed and no
filter, as RL rollouts sample; without top-k or top-p the sampler launches another variant of
its selection, and a seed draws its noise through its own kernels), then three together: filtered
sampling (top-k, top-p, min-p), the penalties and greedy, each with a short prompt (longer
prompts, whose prefill takes other kernels, and other batch sizes may still meet a variant of
their own). It then flushes the prefix cache and zeroes the counters /metrics exports, so that
nothing of it shows. Every tensor-parallel rank builds its own core and runs the same requests in
the same order.
"""

from __future__ import annotations

import logging
import time

from kiln.engine.io import GenerateReq
from kiln.engine.request import SamplingParams

logger = logging.getLogger(__name__)

PROMPT_TOKENS = 16
OUTPUT_TOKENS = 8
# Served in this order; one list is one batch (its requests at once).
PHASES: list[list[SamplingParams]] = [
    [SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=1.0, seed=0, ignore_eos=True)],
    [SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, ignore_eos=True),
     SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=1.0, repetition_penalty=1.1, presence_penalty=0.5,
                    frequency_penalty=0.5, ignore_eos=True),
     SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)],
]


def wants_warm_up(config, runner) -> bool:
    """Whether a core warms up at startup: its forwards run Triton kernels on CUDA (where they
    compile on first use) and `--skip-server-warmup` is off."""
    return (not config.skip_server_warmup and runner.device.type == "cuda"
            and getattr(runner.backend, "use_kernels", False))


def warm_up(core) -> float:
    """Serve `PHASES` on `core` (an idle `EngineCore`) to completion, flush its prefix cache and
    zero its counters. Returns the seconds it took."""
    assert not core.has_work(), "the warm-up runs on an idle core, before any request"
    t0 = time.perf_counter()
    vocab = core.info.vocab_size
    n = min(PROMPT_TOKENS, core.info.context_length - OUTPUT_TOKENS - 1)
    for phase, batch in enumerate(PHASES):
        for i, params in enumerate(batch):
            ids = [(7919 * (j + 1) + 104729 * i) % vocab for j in range(n)]  # distinct prompts: no shared prefix
            core.add_request(GenerateReq(rid=f"kiln-warmup-{phase}-{i}", input_ids=ids, params=params))
        while core.has_work():
            for out in core.step():
                if out.error is not None:
                    raise RuntimeError(f"the startup warm-up request {out.rid} failed: {out.error} "
                                       "(--skip-server-warmup starts without it)")
    core.flush_cache()
    _zero_counters(core.scheduler)
    seconds = time.perf_counter() - t0
    logger.info("warmed up in %.1f s (%d requests; --skip-server-warmup skips it)",
                seconds, sum(len(b) for b in PHASES))
    return seconds


def _zero_counters(scheduler) -> None:
    """Counters since start back to zero, in place (speculative decoding's decoder holds its
    `SpecCounts`)."""
    counters = scheduler.stats_counters
    if counters.spec is not None:
        counters.spec.__init__()
    counters.__init__(spec=counters.spec)
