"""An LM head at a few rows: cuBLAS (`F.linear`, then `.float()`, as `ParallelLMHead.compute_logits`
does off the GEMV path) against Kiln's GEMV with fp32 output (`gemv(..., float_out=True)`); CUDA only.

    python -m benchmarks.kernel_bench.lm_head [--rows 1 2 3 4 5] [--vocab 49216] [--hidden 2048] [--sweep]

A speculative verify's LM head takes K + 1 rows per request (4 at K = 3, batch 1) and an MTP draft
head one per request; the engine runs one row on the GEMV's FMA loop and 2..16 on its MMA loop
with the head tile (`kiln.layers.decode_gemv.head_logits`, `gemv_tiles.dot_tile`), the GEMV column
here. Each variant is replayed from a CUDA graph over COPIES distinct weight copies in turn (so that
the ~200 MB matrix is not served from L2); medians in microseconds, with the share of the measured
copy bandwidth the weight bytes reach, and the largest difference of the two results. `--sweep`
also times the GEMV with every candidate tile (`candidate_tiles`) at each row count: the FMA tiles
up to FMA_MAX_ROWS, the MMA tiles (`DOT_TILES`, 16 rows padded) past it (docs/benchmarks.md,
forty-seventh to forty-ninth passes).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

COPIES = 4


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--vocab", type=int, default=49216, help="default: the hybrid presets' vocabulary")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--sweep", action="store_true", help="time the GEMV with every candidate tile too")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.kernel_bench.lm_head needs CUDA")
    import triton

    from benchmarks.kernel_bench.gemv import copy_bandwidth, tile_name
    from kiln.kernels.gemv import gemv
    from kiln.kernels.gemv_tiles import candidate_tiles

    dev, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    heads = [torch.randn(args.vocab, args.hidden, generator=gen, device=dev).div_(args.hidden ** 0.5).to(dtype)
             for _ in range(COPIES)]
    bw = copy_bandwidth()
    nbytes = args.vocab * args.hidden * torch.finfo(dtype).bits // 8
    print(f"LM head {args.vocab} x {args.hidden} {dtype} on {torch.cuda.get_device_name()}, copy bandwidth "
          f"{bw / 1e12:.3f} TB/s, weight bytes {nbytes / 1e6:.0f} MB ({nbytes / bw * 1e6:.1f} us)")
    head = f"{'rows':>4} {'cuBLAS+cast us':>14} {'frac':>5} {'GEMV us':>8} {'frac':>5} {'max diff':>9}"
    print(head)
    print("-" * len(head))
    for m in args.rows:
        x = torch.randn(m, args.hidden, generator=gen, device=dev).to(dtype)

        def cublas():
            return [F.linear(x, w).float() for w in heads]

        def kiln():  # as `kiln.layers.decode_gemv.head_logits` runs it: the MMA loop past one row
            return [gemv(x, w, float_out=True, mma=m > 1) for w in heads]

        us = {}
        for name, fn in (("cublas", cublas), ("kiln", kiln)):
            fn()
            us[name] = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3 / COPIES
        diff = (cublas()[0] - kiln()[0]).abs().max().item()
        frac = {k: nbytes / bw / (v * 1e-6) for k, v in us.items()}
        print(f"{m:>4} {us['cublas']:>14.1f} {frac['cublas']:>5.1%} {us['kiln']:>8.1f} {frac['kiln']:>5.1%} "
              f"{diff:>9.2e}")
        if args.sweep:  # (past FMA_MAX_ROWS: the MMA tiles)
            for tile in candidate_tiles(m):
                def tiled(tile=tile):
                    return [gemv(x, w, tile=tile, float_out=True) for w in heads]

                tiled()
                t_us = triton.testing.do_bench_cudagraph(tiled, rep=100, return_mode="median") * 1e3 / COPIES
                t_diff = (cublas()[0] - tiled()[0]).abs().max().item()
                print(f"{'':>4} {'tile ' + tile_name(tile):>14} {'':>5} {t_us:>8.1f} {nbytes / bw / (t_us * 1e-6):>5.1%} "
                      f"{t_diff:>9.2e}")


if __name__ == "__main__":
    main()
