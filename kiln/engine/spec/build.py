"""`make_spec_decoder`: the scheduler's speculative decoder for `--speculative-algorithm`, its
drafter built and, with CUDA graphs on, its pass captured."""

from __future__ import annotations

from typing import Optional

from kiln.engine.spec.speculative import SpecDecoder

# Largest batch whose drafter pass (MTP chain, block drafter) is captured: the graphs keep K
# fp32 draft-logit rows per request over the draft vocabulary, and speculation pays off at small
# batches.
DRAFT_GRAPH_MAX_BS = 64


def make_spec_decoder(scheduler) -> Optional[SpecDecoder]:
    """The scheduler's speculative decoder for `--speculative-algorithm`, or None. The runner has
    already resolved the draft length and loaded what the drafter needs (`runner.spec_steps`,
    `runner.draft_model`)."""
    algo = scheduler.config.speculative_algorithm
    runner = scheduler.runner
    if algo is None:
        return None
    token_map = None
    if scheduler.config.speculative_token_map:
        from kiln.engine.spec.draft_vocab import load_token_map

        token_map = load_token_map(scheduler.config.speculative_token_map, runner.model.lm_head.vocab_size)
    if algo == "mtp":
        from kiln.engine.spec.mtp_drafter import MTPDrafter

        drafter = MTPDrafter(runner, runner.spec_steps, token_map, max_lag=runner.mtp_catch_up_lag)
        spec = SpecDecoder(scheduler, drafter)  # first: it tells the drafter whether drafts are sampled
        if runner.graphs is not None:  # CUDA graphs on: the steady-decode pass too
            drafter.use_graphs(min(runner.graphs.max_bs, DRAFT_GRAPH_MAX_BS))
        return spec
    if algo in ("dflash", "dspark"):
        from kiln.engine.spec.block_drafter import BlockDraftRunner

        drafter = BlockDraftRunner(runner, runner.spec_steps, token_map)
        spec = SpecDecoder(scheduler, drafter)  # first: it tells the drafter whether drafts are sampled
        if runner.graphs is not None and drafter.paged is not None:  # CUDA graphs on: the block pass too
            drafter.use_graphs(min(runner.graphs.max_bs, DRAFT_GRAPH_MAX_BS))
        return spec
    if algo == "ngram":
        from kiln.engine.spec.ngram_drafter import NgramDrafter

        cfg = scheduler.config
        return SpecDecoder(scheduler, NgramDrafter(runner.spec_steps, cfg.speculative_ngram_min_match_window_size,
                                                   cfg.speculative_ngram_max_match_window_size,
                                                   uniform=runner.graphs is not None))
    raise ValueError(f"--speculative-algorithm {algo!r} is not one of mtp, dflash, dspark, ngram")
