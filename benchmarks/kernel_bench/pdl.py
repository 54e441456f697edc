"""What programmatic dependent launch (PDL, Hopper) saves per kernel boundary, CUDA only.

    python -m benchmarks.kernel_bench.pdl

A decode step at batch 1 is a chain of small dependent kernels (norms, RoPE, attention, merge,
gates) between GEMMs. With PDL a kernel is launched while its predecessor still runs and waits
on the device (`griddepcontrol.wait`) before touching memory, so the launch itself leaves the
critical path. This times chains replayed from a CUDA graph (how the engine decodes):

- `norm x64`: 64 one-row RMSNorms (width 4096, bf16), each reading the previous one's output;
- `gemv+norm x32`: 32 x (a 1 x 4096 x 4096 cuBLAS GEMM, then an RMSNorm of its output);

each with the norm launched plainly, with PDL (wait only), and with PDL plus an early
`griddepcontrol.launch_dependents` (the next kernel may launch once every program has started).
Medians in us per chain and per norm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _norm_kernel(X, W, Y, eps, N: tl.constexpr, BLOCK: tl.constexpr, WAIT: tl.constexpr,
                 TRIGGER: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)  # not written by anyone: before the wait
    if WAIT:
        gdc_wait()
    if TRIGGER:
        gdc_launch_dependents()
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    tl.store(Y + offs, (x * r * w).to(Y.dtype.element_ty), mask=mask)


def main() -> None:
    dev, dt, n = "cuda", torch.bfloat16, 4096
    w = torch.rand(n, device=dev, dtype=dt) + 0.5
    mat = torch.randn(n, n, device=dev, dtype=dt) / 64
    bufs = [torch.randn(1, n, device=dev, dtype=dt) for _ in range(2)]

    def norm(x, y, mode):
        _norm_kernel[(1,)](x, w, y, 1e-6, N=n, BLOCK=n, WAIT=mode != "plain",
                           TRIGGER=mode == "pdl+trigger", launch_pdl=mode != "plain", num_warps=8)

    def norm_chain(mode):
        for i in range(64):
            norm(bufs[i % 2], bufs[(i + 1) % 2], mode)

    def gemv_chain(mode):
        for _ in range(32):
            h = torch.nn.functional.linear(bufs[0], mat)
            norm(h, bufs[0], mode)

    ref = None
    print(f"{'chain':<16}{'mode':<14}{'us/chain':>10}{'us/norm':>10}")
    for name, chain, count in (("norm x64", norm_chain, 64), ("gemv+norm x32", gemv_chain, 32)):
        for mode in ("plain", "pdl", "pdl+trigger"):
            bufs[0].copy_(torch.linspace(-1, 1, n, device=dev, dtype=dt))
            chain(mode)
            torch.cuda.synchronize()
            out = bufs[0].clone()
            if mode == "plain":
                ref = out
            else:  # same math, same order: PDL must not change a bit
                assert torch.equal(out, ref), f"{name} {mode}: result differs from the plain launch"
            torch.cuda.synchronize()
            us = triton.testing.do_bench_cudagraph(lambda: chain(mode), rep=100, return_mode="median") * 1e3
            print(f"{name:<16}{mode:<14}{us:>10.1f}{us / count:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
