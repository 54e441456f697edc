"""Speculative decoding (docs/speculative.md).

`speculative` holds the round (`SpecDecoder`: verify, commit, rollback); `drafter` the contract a
drafter follows; `mtp_drafter` (Inkling's MTP chain), `block_drafter` (DFlash, DSpark) and
`ngram_drafter` (prompt lookup, no model) the drafters; `verify` pure, deterministic, batched
verification functions (greedy prefix matching, token-wise rejection sampling, Sun et al. block
verification) over the target's and the draft's final sampling distributions plus explicit
uniforms (notes/algorithms.md section 1); `metrics` the acceptance counters.
"""
