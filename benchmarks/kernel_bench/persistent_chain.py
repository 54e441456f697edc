"""Would one persistent kernel run a batch-1 GEMV chain nearer its bytes than one launch per GEMV?

    python -m benchmarks.kernel_bench.persistent_chain [--layers 24] [--shapes o,qkvr,8b] [--rows 1,4]
                                                       [--per-sm 1,2,4,8] [--block-n 2,4,8] [--out F]

CUDA for the timings; the kernel also runs in Triton's interpreter (tests/benchmarks/test_persistent_chain.py).

Issue 4's 70% of the roofline at batch 1 is out of reach for the hybrids (~41%) because each of a
step's ~15 launches per layer costs ~2-4 us beyond its bytes (docs/benchmarks.md, twenty-second
and twenty-sixth passes): even with attention, the gate and the MoE cut, the dense GEMVs alone
took 0.49 ms for 0.20 ms of bytes. Deeper pipelines did not help (`stream_gemv.py`); what was left
untried is a kernel per layer or per step, whose programs stay resident, hand each other their
results through device-side counters instead of a kernel boundary, and load the next GEMV's
weights while the current one is reduced. This measures that idea on the simplest chain before
anyone builds it into the engine: `--layers` dependent GEMVs y_i = W_i x_i (bf16, distinct
weights; x_i = the first K columns of y_{i-1}) of M = `--rows` rows (1: a batch-1 decode step; 4:
a K = 3 speculative verify, which the engine sends to cuBLAS), as

- `cublas`: `x @ W.T`, one launch per GEMV from a CUDA graph;
- `kiln` / `kiln+pdl` / `kiln+trigger`: the engine's GEMV, one launch per GEMV from a CUDA graph,
  without PDL, with it, and with it and the early trigger (what a batch-1 decode graph uses);
- `persistent PxBN`: one launch of `_chain_kernel` with P programs per SM. Work items are
  (GEMV i, a tile of BN weight rows = BN columns of y_i), taken in order from an atomic ticket; an
  item loads its weight tile, then waits until every tile of GEMV i - 1 has counted itself done,
  then reads x_i and stores its columns of y_i.
  An item waits only on items with smaller tickets, which programs already running hold, so the
  chain cannot deadlock however many programs are resident (and in the interpreter program 0 takes
  every ticket in order).

Per variant: us per GEMV, the bytes' time at the measured copy bandwidth, their share, and the
largest error against the fp32 chain. The answer on an H100 (docs/benchmarks.md, thirty-sixth
pass): no; the persistent chain costs what the engine's GEMV with PDL and the early trigger costs
(o: 4.49 against 4.58 us for 2.77 us of bytes) or more, so what a dependent GEMV pays beyond its
bytes is the hand-off through L2, not the kernel boundary.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

SHAPES = {"o": (2048, 2048), "qkvr": (3584, 2048), "8b": (4096, 4096)}


@triton.jit
def _chain_kernel(W, X0, Y, DONE, TICKET, total, tiles, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Work items t = i * tiles + j (GEMV i, columns j * BLOCK_N ..) from TICKET until `total`:
    Y[i, :, cols] = x_i @ W[i, cols].T for M rows, with x_0 = X0 and x_i = Y[i - 1, :, :K]; DONE[i]
    counts GEMV i's finished tiles."""
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, K)
    t = tl.atomic_add(TICKET, 1, sem="relaxed", scope="gpu")
    while t < total:
        i = t // tiles
        cols = (t % tiles) * BLOCK_N + rn
        # weights first: no item writes them, so they stream while GEMV i - 1 finishes
        w = tl.load(W + i.to(tl.int64) * N * K + cols[:, None] * K + rk[None, :])
        if i > 0:
            ready = tl.atomic_add(DONE + i - 1, 0, sem="acquire", scope="gpu")
            while ready < tiles:
                ready = tl.atomic_add(DONE + i - 1, 0, sem="acquire", scope="gpu")
        for m in tl.static_range(M):
            if i == 0:
                x = tl.load(X0 + m * K + rk)
            else:
                # past L1, which is not coherent with the other SMs' stores
                x = tl.load(Y + ((i - 1).to(tl.int64) * M + m) * N + rk, cache_modifier=".cg")
            y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
            tl.store(Y + (i.to(tl.int64) * M + m) * N + cols, y.to(Y.dtype.element_ty))
        # every warp's columns are stored before the release (one thread issues the atomic)
        tl.debug_barrier()
        tl.atomic_add(DONE + i, 1, sem="release", scope="gpu")
        t = tl.atomic_add(TICKET, 1, sem="relaxed", scope="gpu")


def persistent_chain(weights: torch.Tensor, x0: torch.Tensor, out: torch.Tensor, counters: torch.Tensor,
                     programs: int, block_n: int = 4) -> torch.Tensor:
    """The chain of `weights` [L, N, K] (N >= K, N a multiple of block_n, K a power of two) from x0
    [M, K] in one launch of `programs` programs; out [L, M, N] gets every y_i. `counters` is an
    int32 buffer of at least L + 1 zeros (DONE, then TICKET), left at (tiles, .., L * tiles +
    programs)."""
    L, N, K = weights.shape
    M = x0.shape[0]
    assert x0.shape == (M, K) and out.shape == (L, M, N), (x0.shape, out.shape)
    assert N >= K and N % block_n == 0 and K & (K - 1) == 0, (N, K, block_n)
    assert counters.dtype == torch.int32 and counters.numel() >= L + 1
    tiles = N // block_n
    _chain_kernel[(programs,)](weights, x0, out, counters, counters[L:], L * tiles, tiles, M=M, N=N, K=K,
                               BLOCK_N=block_n, num_warps=4)
    return out


def reference_chain(weights: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """The same chain in fp32 PyTorch, each y_i rounded to the weights' dtype as the kernel stores
    it: [L, M, N]."""
    K = weights.shape[2]
    x, ys = x0, []
    for w in weights:
        y = (x.float() @ w.float().T).to(weights.dtype)
        ys.append(y)
        x = y[:, :K]
    return torch.stack(ys)


def _time_graph(run) -> tuple[float, torch.Tensor]:
    """Median seconds of one replay of `run` captured in a CUDA graph, and what the captured run
    returned (its static outputs, as the last replay left them)."""
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = run()
    return triton.testing.do_bench(graph.replay, rep=200, return_mode="median") * 1e-3, result


def main() -> None:
    from benchmarks.kernel_bench.gemv import copy_bandwidth
    from kiln.kernels.gemv import gemv
    from kiln.kernels.launch import early_trigger, set_pdl

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--shapes", default="o,qkvr,8b")
    ap.add_argument("--rows", default="1,4", help="activation rows M to try (1: decode at batch 1; 4: a K = 3 verify)")
    ap.add_argument("--per-sm", default="1,2,4,8", help="persistent programs per SM to try")
    ap.add_argument("--block-n", default="2,4,8", help="columns per persistent work item to try")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s; {torch.cuda.get_device_name()}, {sms} SMs", flush=True)
    results = []
    L = args.layers
    for shape in args.shapes.split(","):
        N, K = SHAPES[shape]
        weights = (torch.randn(L, N, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
        counters = torch.zeros(L + 1, device="cuda", dtype=torch.int32)
        bound = N * K * 2 / bw
        for M in map(int, args.rows.split(",")):
            x0 = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            want = reference_chain(weights, x0).float()
            out = torch.empty(L, M, N, device="cuda", dtype=torch.bfloat16)
            print(f"\n{shape} {N}x{K}, {M} row(s), {L} GEMVs: bytes {bound * 1e6:.2f} us per GEMV")
            print(f"{'variant':<20}{'us':>9}{'share':>9}{'max err':>10}")

            def one_per_gemv(op, x0=x0):
                def chain():
                    x, ys = x0, []
                    for i in range(L):
                        ys.append(op(x, weights[i]))
                        x = ys[-1][:, :K]
                    return ys
                return chain

            variants = [("cublas", one_per_gemv(lambda x, w: x @ w.T), False, False)]
            variants += [(f"kiln{tag}", one_per_gemv(gemv), pdl, trig)
                         for tag, pdl, trig in (("", False, False), ("+pdl", True, False), ("+trigger", True, True))]
            variants += [(f"persistent {p}x{bn}", (p, bn), None, None)
                         for p in map(int, args.per_sm.split(",")) for bn in map(int, args.block_n.split(","))]
            for name, how, pdl, trig in variants:
                try:
                    if callable(how):
                        set_pdl(pdl)
                        with early_trigger(trig):
                            t, ys = _time_graph(how)
                        got = torch.stack(ys)
                    else:
                        def run(per_sm=how[0], bn=how[1], x0=x0, out=out):
                            counters.zero_()
                            return persistent_chain(weights, x0, out, counters, per_sm * sms, bn)
                        t, got = _time_graph(run)
                    torch.cuda.synchronize()
                    err = (got.float() - want).abs().max().item()
                    assert err < 5e-2 * want.abs().max().item(), f"wrong output: max error {err}"
                except Exception as e:  # a variant the compiler or the GPU refuses: say so, go on
                    print(f"{name:<20} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                t /= L
                print(f"{name:<20}{t * 1e6:>9.2f}{bound / t:>9.1%}{err:>10.2e}", flush=True)
                results.append(dict(shape=shape, rows=M, variant=name, us=t * 1e6, share=bound / t, err=err))
            set_pdl(True)
        del weights
    print("\nbest of each kind, us per GEMV (share of the bytes' time):")
    for key in dict.fromkeys((r["shape"], r["rows"]) for r in results):
        rows = [r for r in results if (r["shape"], r["rows"]) == key]
        best = {kind: min((r for r in rows if r["variant"].startswith(kind)), key=lambda r: r["us"], default=None)
                for kind in ("cublas", "kiln", "persistent")}
        print(f"  {key[0]} x{key[1]}: " + ", ".join(f"{r['variant']} {r['us']:.2f} ({r['share']:.0%})"
                                                    for r in best.values() if r is not None))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
