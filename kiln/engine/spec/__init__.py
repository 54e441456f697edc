"""Speculative decoding: verification math.

`verify` holds pure, deterministic, batched functions (greedy prefix matching,
token-wise rejection sampling, and Sun et al. block verification) that take the
target's and the draft's final sampling distributions plus explicit uniforms.
See notes/algorithms.md section 1.
"""
