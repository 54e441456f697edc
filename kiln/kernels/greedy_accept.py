"""A greedy round's committed counts in one launch.

After a greedy verify on the device, each request commits its drafts up to the first that differs
from the verify's argmax, plus that argmax: count = accepted prefix + 1, which the drafter's pass
reads on the device right behind the verify (`kiln.engine.spec.speculative`). As PyTorch ops
(`kiln.engine.spec.verify.committed_counts`, the reference: compare, cast, cumprod, sum, add)
that is six launches on the round's critical path, ~9 us of GPU time on an H100 (forty-fifth
session); here one program per request reads its K + 1 samples and K drafts.
`tests/kernels/test_greedy_accept.py` compares the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.launch import pdl_launch, wait_for_previous


# The drafts are a strided view of the verify's inputs; the batch and strides change with it.
@triton.jit(do_not_specialize=["K", "stride_s", "stride_d"])
def _counts_kernel(samples_ptr, drafts_ptr, out_ptr, K, stride_s, stride_d, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < K
    s = tl.load(samples_ptr + b * stride_s + i, mask=ok, other=0)
    d = tl.load(drafts_ptr + b * stride_d + i, mask=ok, other=0)
    first_miss = tl.min(tl.where(ok & (s != d.to(s.dtype)), i, K), axis=0)
    tl.store(out_ptr + b, (first_miss + 1).to(tl.int64))


def committed_counts(samples: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """`kiln.engine.spec.verify.committed_counts` in one launch (rows may be strided; columns
    contiguous)."""
    n, K = drafts.shape
    assert samples.shape == (n, K + 1) and samples.stride(1) == 1 and drafts.stride(1) == 1, \
        (samples.shape, samples.stride(), drafts.shape, drafts.stride())
    out = torch.empty(n, dtype=torch.int64, device=samples.device)
    if n:
        _counts_kernel[(n,)](samples, drafts, out, K, samples.stride(0), drafts.stride(0),
                             BLOCK=triton.next_power_of_2(max(K, 1)), num_warps=1, **pdl_launch(samples.device))
    return out
