"""How many bytes a batch-1 GEMV keeps in flight, and what that costs it; CUDA only (sm_90 for TMA).

    python -m benchmarks.kernel_bench.stream_gemv [--layers 24] [--shapes o,up] [--out stream.json]

Kiln's decode GEMVs (`kiln.kernels.gemv`, `kiln.kernels.moe_gemv`) load their weight tiles into
registers, the next tile while the current one is multiplied, so a program has one tile in
flight and an SM as many as its registers allow resident programs. The twenty-sixth pass
(docs/benchmarks.md) found the MoE's gate/up GEMV's resident programs streaming at ~10 GB/s each,
one 8 KB tile pair in flight, so that neither more tiles per program nor fewer waves helped.
Asynchronous copies into shared memory are not bounded by registers: with `num_stages` S the
loop keeps S - 1 tiles in flight per program, in up to 228 KB of shared memory per SM.

This times chains of `--layers` dependent GEMVs y = W x (bf16, distinct weights, so nothing stays
in L2; each GEMV's x is the previous one's first K outputs) from a CUDA graph, without PDL, for:

- `kiln`:        the engine's GEMV with its rule's tile (`kiln.kernels.gemv.gemv`);
- `ld SxBNxBK`:  a plain GEMV whose weight tiles are `tl.load`s in a `tl.range(num_stages=S)` loop
                 (Triton may turn them into asynchronous copies);
- `tma SxBNxBK`: the same with the tiles loaded through a TMA tensor descriptor (shared memory,
                 S stages);

and prints per variant the time per GEMV, the bytes at the copy bandwidth and their share. The
answer on an H200 (docs/benchmarks.md, twenty-sixth pass): no; every kind pays about the same
fixed ~1.6-2.5 us per GEMV beyond its bytes.
Shapes: `o` 2048x2048 (Inkling's o_proj), `qkvr` 3584x2048, `up` 16384x2048 (the bytes of the MoE
gate/up GEMV's 8 slots as one matrix), `8b` 4096x4096. Every variant's output is checked against
fp32 matmul first.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from benchmarks.kernel_bench.gemv import copy_bandwidth
from kiln.kernels.gemv import gemv
from kiln.kernels.launch import set_pdl

SHAPES = {"o": (2048, 2048), "qkvr": (3584, 2048), "up": (16384, 2048), "8b": (4096, 4096)}
# (stages, BLOCK_N, BLOCK_K, warps)
LD_VARIANTS = [(1, 4, 512, 4), (2, 4, 512, 4), (3, 4, 512, 4), (4, 4, 256, 4), (3, 8, 256, 4), (4, 8, 256, 4),
               (6, 4, 256, 4), (4, 16, 128, 4), (6, 8, 128, 4), (4, 8, 256, 8)]
TMA_VARIANTS = [(2, 8, 256, 4), (3, 8, 256, 4), (4, 8, 256, 4), (4, 16, 256, 4), (6, 8, 128, 4), (4, 4, 256, 4),
                (8, 8, 128, 4), (4, 32, 128, 4)]


@triton.jit
def _gemv_ld_kernel(w_ptr, x_ptr, y_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    STAGES: tl.constexpr):
    """y[rows] = W[rows] @ x over K in BLOCK_K steps, weight tiles as plain loads."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + k0 + rk[None, :])
        x = tl.load(x_ptr + k0 + rk)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))


@triton.jit
def _gemv_tma_kernel(w_desc, x_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STAGES: tl.constexpr):
    """As `_gemv_ld_kernel`, the weight tiles through a TMA descriptor into shared memory."""
    n0 = tl.program_id(0) * BLOCK_N
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = w_desc.load([n0, k0])
        x = tl.load(x_ptr + k0 + rk)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + n0 + tl.arange(0, BLOCK_N), tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))


def make_call(kind: str, variant: tuple):
    """A function (w, x, y) -> y for one variant (N a multiple of BLOCK_N, K of BLOCK_K)."""
    if kind == "kiln":
        return lambda w, x, y: gemv(x[None], w)[0]
    stages, bn, bk, warps = variant
    if kind == "ld":
        def call(w, x, y):
            _gemv_ld_kernel[(w.shape[0] // bn,)](w, x, y, w.shape[0], w.shape[1], w.stride(0), BLOCK_N=bn, BLOCK_K=bk,
                                                 STAGES=stages, num_warps=warps)
            return y
        return call
    from triton.tools.tensor_descriptor import TensorDescriptor

    def call(w, x, y):
        desc = TensorDescriptor.from_tensor(w, [bn, bk])
        _gemv_tma_kernel[(w.shape[0] // bn,)](desc, x, y, w.shape[0], w.shape[1], BLOCK_N=bn, BLOCK_K=bk,
                                              STAGES=stages, num_warps=warps)
        return y
    return call


def time_chain(call, weights, x0, outs) -> float:
    """Median seconds of one replay of the chain (each GEMV's x: the previous output's first K)."""
    K = weights[0].shape[1]

    def run():
        x = x0
        for w, y in zip(weights, outs):
            x = call(w, x, y)[:K]
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return triton.testing.do_bench(graph.replay, rep=200, return_mode="median") * 1e-3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--shapes", default="o,up")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    set_pdl(False)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s; {torch.cuda.get_device_name()}", flush=True)
    results = []
    for shape in args.shapes.split(","):
        N, K = SHAPES[shape]
        weights = [(torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16) for _ in range(args.layers)]
        outs = [torch.empty(N, device="cuda", dtype=torch.bfloat16) for _ in range(args.layers)]
        x0 = torch.randn(K, device="cuda", dtype=torch.bfloat16)
        want = weights[0].float() @ x0.float()
        bound = N * K * 2 / bw
        print(f"\n{shape} {N}x{K}: bytes {bound * 1e6:.2f} us per GEMV")
        print(f"{'variant':<22}{'us':>9}{'share':>9}{'max err':>10}")
        variants = [("kiln", None)] + [("ld", v) for v in LD_VARIANTS] + [("tma", v) for v in TMA_VARIANTS]
        for kind, v in variants:
            name = kind if v is None else f"{kind} {v[0]}x{v[1]}x{v[2]}/w{v[3]}"
            try:
                call = make_call(kind, v)
                err = (call(weights[0], x0, outs[0]).float() - want).abs().max().item()
                assert err < 5e-2 * want.abs().max().item(), f"wrong output: max error {err}"
                t = time_chain(call, weights, x0, outs) / args.layers
            except Exception as e:  # a variant the compiler or the GPU refuses: say so, go on
                print(f"{name:<22} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            print(f"{name:<22}{t * 1e6:>9.2f}{bound / t:>9.1%}{err:>10.2e}", flush=True)
            results.append(dict(shape=shape, variant=name, us=t * 1e6, share=bound / t, err=err))
        del weights, outs
    set_pdl(True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
