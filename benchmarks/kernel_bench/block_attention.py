"""A block drafter's attention: its B rows over their request's keys, as `decode_attention` with one
row per sequence (the block pass before the fifty-second session) against `block_attention` (one
program per run of rows, KV head and split), CUDA only.

    python -m benchmarks.kernel_bench.block_attention [--batch 1 8] [--context 1024 8192 32768]
                                                      [--block 16] [--min-split-keys 64 256 1024]
                                                      [--programs-per-sm 1 2 4] [--table-len 131088]

Shape: MiniMax-M3 `bench`'s DSpark drafter (and Inkling `bench`'s DFlash drafter): Hq = 16,
Hkv = 4, D = 128, bf16, pages of 16 tokens in random order; every block's keys are its context
plus its own B rows (seq_len = context + B). `--table-len`: the page table's width, which sizes
the split grid as in the engine, whose block pass passes no `max_len` (the table spans the
longest context it allows; 0: context + B). Times: the time one call adds inside a CUDA graph
of 20 calls, each after an L2 flush, less the flushes alone (medians of
`triton.testing.do_bench`; `benchmarks.kernel_bench.attention.in_graph_time`), which is how it
runs inside the pass's graph after the layer's projections have left the K/V cold. GB/s = the
K+V bytes the call must read (each request's keys once) / that time. Each variant is checked
against the reference (`paged_decode_attention`) first. One `block` row per least keys per split
x programs per SM (the module's MIN_SPLIT_KEYS and PROGRAMS_PER_SM, set for the row).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.kernel_bench.attention import in_graph_time

PAGE = 16
HQ, HKV, D = 16, 4, 128


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--block", type=int, default=16, help="rows per block (B)")
    ap.add_argument("--min-split-keys", type=int, nargs="+", default=[64, 256, 1024],
                    help="block_attention's least keys per split, one row each")
    ap.add_argument("--programs-per-sm", type=int, nargs="+", default=[1],
                    help="block_attention's PROGRAMS_PER_SM, one row each")
    ap.add_argument("--table-len", type=int, default=131088, help="page-table width (0: context + B)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.kernel_bench.block_attention needs CUDA")
    import triton

    from kiln.kernels import block_attention as module
    from kiln.kernels.block_attention import block_attention
    from kiln.kernels.decode_attention import decode_attention
    from kiln.ops.attention import paged_decode_attention

    dtype, dev, B = torch.bfloat16, torch.device("cuda"), args.block
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    flush = torch.empty(32 * 2 ** 20, dtype=torch.int32, device=dev)  # 128 MB > the 50-60 MB L2
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"# Hq {HQ} Hkv {HKV} D {D} B {B}, {dtype}, page {PAGE}; us one call adds in a graph (L2 flushed)")
    print(f"{'batch':>6}{'ctx':>7}{'variant':>20}{'us':>9}{'GB/s':>8}{'vs rows':>9}")
    gen = torch.Generator(device=dev).manual_seed(0)
    for b in args.batch:
        for ctx in args.context:
            n_keys = ctx + B
            pages = b * -(-n_keys // PAGE)
            k_cache = torch.randn(pages * PAGE + PAGE, HKV, D, device=dev, dtype=dtype, generator=gen)
            v_cache = torch.randn_like(k_cache)
            page_ids = torch.randperm(pages, device=dev, generator=gen) + 1  # page 0: padding
            table = (page_ids[:, None] * PAGE + torch.arange(PAGE, device=dev)).view(b, -1)[:, :n_keys]
            width = max(args.table_len, n_keys)
            table = torch.nn.functional.pad(table.to(torch.int32), (0, width - n_keys)).contiguous()
            slots = torch.arange(b, device=dev).repeat_interleave(B)
            lens = torch.full((b * B,), n_keys, dtype=torch.int64, device=dev)
            q = torch.randn(b * B, HQ, D, device=dev, dtype=dtype, generator=gen)
            scale = D ** -0.5
            ref = paged_decode_attention(q, k_cache, v_cache, table, slots, lens, scale).float()
            variants = {"rows (decode)": lambda: decode_attention(q, k_cache, v_cache, table, slots, lens, scale)}
            for m in args.min_split_keys:
                for p in args.programs_per_sm:
                    variants[f"block >={m} {p}/SM"] = (m, p)
            kv_bytes = b * n_keys * HKV * D * 2 * k_cache.element_size()
            base = None
            default = module.PROGRAMS_PER_SM
            for name, call in variants.items():
                if isinstance(call, tuple):  # a block row: its split settings
                    m, module.PROGRAMS_PER_SM = call
                    call = (lambda m=m: block_attention(q, k_cache, v_cache, table, slots, lens, scale, B,
                                                        min_split_keys=m))
                err = (call().float() - ref).abs().max().item()
                assert err < 5e-2, f"{name}: differs from the reference by {err}"
                us = 1e3 * in_graph_time(call, flush, bench)
                base = base or us
                print(f"{b:>6}{ctx:>7}{name:>20}{us:>9.2f}{kv_bytes / us / 1e3:>8.0f}{base / us:>8.2f}x", flush=True)
                module.PROGRAMS_PER_SM = default
            del k_cache, v_cache, table, q, ref
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
