"""The sampling work of a sampled speculative round, kernel by kernel, on one GPU.

    python -m benchmarks.kernel_bench.sampled_round [--vocab 49216] [--chunks 8192,2048,1024]

A sampled MTP round (K drafts, exact verification) runs, per draft layer, the filter of
`kiln.kernels.sampling` (torch's softmax, `_select_kernel`, `_apply_kernel`) and the exponential
race (`sample_from_probs`), and once per round the same filter over the verify's K + 1 rows and
the verification (`kiln.kernels.spec_verify.verify`); a plain sampled decode step runs the fused
`sample`. Medians in us of each op replayed from a CUDA graph (`do_bench_cudagraph`: the engine
replays these inside its graphs or back to back), at each `_apply_kernel` chunk size in
`--chunks` (the kernel's programs per row: V / chunk; the verification's chunk is the same, at most
4096), for 1, 4, 8 and 32 rows, T = 1 with no
filter (an RL rollout) and with top-p 0.9.
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=49216)
    ap.add_argument("--chunks", default="8192,2048,1024", help="_apply_kernel chunk sizes to time")
    ap.add_argument("--rows", default="1,4,8,32")
    ap.add_argument("--select", default=None,
                    help="Instead of the table: time filtered_probs at top-p 0.9 for these `_select_kernel` "
                         "shapes, 'num_warps:BLOCK:BLOCK_P:NP' comma-separated (e.g. 8:4096:1024:8)")
    args = ap.parse_args()
    import triton

    from kiln.kernels import sampling, spec_verify
    from kiln.kernels.softmax import temperature_softmax

    def graphed(fn) -> float:
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3

    dev, V = "cuda", args.vocab
    gen = torch.Generator(device=dev).manual_seed(0)
    defaults = sampling.APPLY["CHUNK"], spec_verify.CHUNK
    if args.select:
        _select_sweep(args, graphed, dev, V, gen)
        return
    print(f"# {torch.cuda.get_device_name()}, V = {V}; us per op (CUDA-graph medians)")
    print("rows  top_p  chunk  softmax  filtered_probs  sample_from_probs  sample  verify_tokenwise  verify_block")
    for rows in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(rows, V, device=dev, generator=gen) * 3
        e = torch.empty(rows, V, device=dev).exponential_(generator=gen)
        k = 3
        B = max(rows // (k + 1), 1)
        p = torch.softmax(torch.randn(B, k + 1, V, device=dev, generator=gen) * 3, -1)
        q = torch.softmax(torch.randn(B, k, V, device=dev, generator=gen) * 3, -1)
        d = torch.randint(0, V, (B, k), device=dev, generator=gen)
        u = torch.rand(B, k + 1, device=dev, generator=gen)
        for top_p in (1.0, 0.9):
            params = (torch.ones(rows, device=dev), torch.zeros(rows, dtype=torch.int64, device=dev),
                      torch.full((rows,), top_p, device=dev), torch.zeros(rows, device=dev))
            for chunk in (int(c) for c in args.chunks.split(",")):
                sampling.APPLY["CHUNK"], spec_verify.CHUNK = chunk, min(chunk, 4096)
                probs = sampling.filtered_probs(logits, *params)
                row = [graphed(lambda: temperature_softmax(logits, params[0])),
                       graphed(lambda: sampling.filtered_probs(logits, *params)),
                       graphed(lambda: sampling.sample_from_probs(probs, e)),
                       graphed(lambda: sampling.sample(logits, *params, e)),
                       graphed(lambda: spec_verify.verify(p, q, d, u[:, :k], u[:, k], block=False)),
                       graphed(lambda: spec_verify.verify(p, q, d, u[:, :k], u[:, k], block=True))]
                print(f"{rows:4d}  {top_p:5.2f}  {chunk:5d}  " + "  ".join(f"{x:7.1f}" for x in row), flush=True)
    sampling.APPLY["CHUNK"], spec_verify.CHUNK = defaults


def _select_sweep(args, graphed, dev, V, gen) -> None:
    """filtered_probs at top-p 0.9 (and top-k 50 with top-p 0.95) per `_select_kernel` shape."""
    from kiln.kernels import sampling

    default = dict(sampling.SELECT)
    print(f"# {torch.cuda.get_device_name()}, V = {V}; filtered_probs us (CUDA-graph medians)")
    print("rows  warps  BLOCK  BLOCK_P  NP  top-p 0.9  top-k 50 + top-p 0.95")
    for rows in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(rows, V, device=dev, generator=gen) * 3
        ones, zeros = torch.ones(rows, device=dev), torch.zeros(rows, device=dev)
        ks0, ks50 = torch.zeros(rows, dtype=torch.int64, device=dev), torch.full((rows,), 50, device=dev)
        for shape in args.select.split(","):
            warps, block, block_p, np_ = (int(x) for x in shape.split(":"))
            sampling.SELECT.update(num_warps=warps, BLOCK=block, BLOCK_P=block_p, NP=np_)
            want = sampling.filtered_probs(logits, ones, ks0, torch.full((rows,), 0.9, device=dev), zeros)
            row = [graphed(lambda: sampling.filtered_probs(logits, ones, ks0, ones * 0.9, zeros)),
                   graphed(lambda: sampling.filtered_probs(logits, ones, ks50, ones * 0.95, zeros))]
            sampling.SELECT.clear()
            sampling.SELECT.update(default)
            same = torch.equal((want > 0), (sampling.filtered_probs(logits, ones, ks0, ones * 0.9, zeros) > 0))
            print(f"{rows:4d}  {warps:5d}  {block:5d}  {block_p:7d}  {np_:2d}  " + "  ".join(f"{x:9.1f}" for x in row)
                  + ("" if same else "  (kept set differs from the default shape's)"), flush=True)


if __name__ == "__main__":
    main()
