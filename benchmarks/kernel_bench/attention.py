"""Paged decode attention: Triton (`kiln.kernels.attention.decode_attention`) vs the reference
(`kiln.ops.attention.paged_decode_attention`), CUDA only.

    python -m benchmarks.kernel_bench.attention [--batch 1 8 64] [--context 1024 8192 32768]
                                           [--shape llama-3.1-8b inkling-bench] [--no-reference]
                                           [--table-len 131072] [--min-split-keys 64 256]
                                           [--max-splits 32 128] [--merge-kernel]

Shapes: Llama-3.1-8B (Hq=32, Hkv=8, D=128) and the Inkling bench preset's sliding-window layers
(Hq=16, Hkv=4, D=128, rel bias R=1024, window 4096), bf16, every sequence at the full context,
pages of 16 tokens in random order. Times are medians of `triton.testing.do_bench` (which flushes
the L2 before each call): the eager call, the same call replayed alone from a CUDA graph (graph
launch included), and `in-graph`: the time one call adds inside a graph of 20 calls, each after
an L2 flush, less the flushes alone (how it runs inside the engine's whole-step decode graph).
`--table-len`: the page table's width, which sizes the split grid as in the engine (whose table
spans the longest context it allows); by default the grid is sized for the context itself. The
splits are merged inside the attention kernel, as in the engine (`--merge-kernel`: by a second
kernel). `--min-split-keys` / `--max-splits`: one row per value of the module's MIN_SPLIT_KEYS
(the least keys per split) / MAX_SPLITS. GB/s = K+V bytes the step must read (min(ctx, window)
keys per sequence and kv head) / in-graph time; % is of the H200's nominal 4.8 TB/s.
"""

from __future__ import annotations

import argparse
import itertools

import torch

SHAPES = {
    "llama-3.1-8b": dict(hq=32, hkv=8, d=128, window=None, rel_len=None),
    "inkling-bench": dict(hq=16, hkv=4, d=128, window=4096, rel_len=1024),
}
PAGE = 16
NOMINAL_BW = 4.8e12
IN_GRAPH_CALLS = 20


def in_graph_time(call, flush: torch.Tensor, bench) -> float:
    """ms one call adds inside a CUDA graph of IN_GRAPH_CALLS calls, each after an L2 flush."""
    graphs = []
    for with_call in (True, False):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(IN_GRAPH_CALLS):
                flush.zero_()
                if with_call:
                    call()
        graphs.append(graph)
    return (bench(graphs[0].replay) - bench(graphs[1].replay)) / IN_GRAPH_CALLS


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--no-reference", action="store_true", help="skip the (slow) reference op")
    ap.add_argument("--merge-kernel", action="store_true",
                    help="merge the splits in a second kernel (default: inside the attention kernel, as the engine)")
    ap.add_argument("--table-len", type=int, default=0,
                    help="page-table width (sizes the split grid, as the engine's table does); 0: the context")
    ap.add_argument("--min-split-keys", type=int, nargs="+", default=[None],
                    help="values of MIN_SPLIT_KEYS to time (default: the module's own)")
    ap.add_argument("--max-splits", type=int, nargs="+", default=[None],
                    help="values of MAX_SPLITS to time (default: the module's own)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.kernel_bench.attention needs CUDA")

    from kiln.kernels import decode_attention as module

    # Swept values are set on the module for each row; the module's own are restored at the end.
    defaults = getattr(module, "MIN_SPLIT_KEYS", 0), module.MAX_SPLITS
    try:
        _sweep(args, *defaults)
    finally:
        module.MIN_SPLIT_KEYS, module.MAX_SPLITS = defaults


def _sweep(args, default_min_keys: int, default_max_splits: int) -> None:
    """One row per (shape, batch, context, least keys per split, most splits)."""
    import triton

    from kiln.kernels import decode_attention as module
    from kiln.kernels.decode_attention import decode_attention, pick_num_splits
    from kiln.ops.attention import paged_decode_attention

    dtype, dev = torch.bfloat16, torch.device("cuda")
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"# {dtype}, page {PAGE}, times in ms (median); speedup = ref / graph; GB/s and % of "
          "4.8 TB/s from the in-graph time")
    cols = ["shape", "B", "ctx", "splits", "min_keys", "ref", "eager", "graph", "in-graph", "speedup", "GB/s", "%peak"]
    flush = torch.empty(32 * 2 ** 20, dtype=torch.int32, device=dev)  # 128 MB > the 60 MB L2
    print(f"{cols[0]:>14}" + "".join(f"{c:>9}" for c in cols[1:]))
    for name in args.shape:
        s = SHAPES[name]
        hq, hkv, d, window, rel_len = s["hq"], s["hkv"], s["d"], s["window"], s["rel_len"]
        scale = d ** -0.5
        pages = max(args.batch) * max(args.context) // PAGE + 1
        gen = torch.Generator(device=dev).manual_seed(0)
        # One pair of caches per shape, large enough for the biggest batch x context.
        k_cache = torch.randn(pages * PAGE, hkv, d, device=dev, dtype=dtype, generator=gen)
        v_cache = torch.randn(pages * PAGE, hkv, d, device=dev, dtype=dtype, generator=gen)
        for b, ctx, min_keys, max_splits in itertools.product(args.batch, args.context, args.min_split_keys,
                                                               args.max_splits):
            n_pages = b * -(-ctx // PAGE)
            page_ids = torch.randperm(pages, device=dev, generator=gen)[:n_pages]
            table = (page_ids[:, None] * PAGE + torch.arange(PAGE, device=dev)).view(b, -1)[:, :ctx]
            width = max(args.table_len, ctx)
            table = torch.nn.functional.pad(table.to(torch.int32), (0, width - ctx)).contiguous()
            module.MIN_SPLIT_KEYS = default_min_keys if min_keys is None else min_keys
            module.MAX_SPLITS = default_max_splits if max_splits is None else max_splits
            req_slots = torch.arange(b, device=dev)
            seq_lens = torch.full((b,), ctx, dtype=torch.int64, device=dev)
            q = torch.randn(b, hq, d, device=dev, dtype=dtype, generator=gen)
            rel = None if rel_len is None else torch.randn(b, hq, rel_len, device=dev, generator=gen)
            counters = torch.zeros(b * hkv, dtype=torch.int32, device=dev)
            call = lambda: decode_attention(q, k_cache, v_cache, table, req_slots, seq_lens,  # noqa: E731
                                            scale, window, rel, max_len=None if args.table_len else ctx,
                                            split_counters=None if args.merge_kernel else counters)
            out = call()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            t_eager, t_graph = bench(call), bench(graph.replay)
            t_in = in_graph_time(call, flush, bench)
            t_ref = float("nan")
            if not args.no_reference:
                ref_call = lambda: paged_decode_attention(q, k_cache, v_cache, table, req_slots,  # noqa: E731
                                                          seq_lens, scale, window, rel)
                try:
                    ref = ref_call()
                    err = (out.float() - ref.float()).abs().max().item()
                    assert err < 5e-2, f"kernel differs from the reference by {err}"
                    del ref
                    t_ref = bench(ref_call)
                except torch.OutOfMemoryError:
                    pass  # the reference gathers (and upcasts) the whole padded context
            keys = min(ctx, window) if window else ctx
            kv_bytes = b * keys * hkv * d * 2 * k_cache.element_size()
            gbs = kv_bytes / (t_in * 1e-3) / 1e9
            splits = pick_num_splits(b, hkv, min(width, window) if window else width, dev, module.MIN_SPLIT_KEYS)
            row = [b, ctx, splits, module.MIN_SPLIT_KEYS, t_ref, t_eager, t_graph, t_in, t_ref / t_graph, gbs,
                   100 * gbs * 1e9 / NOMINAL_BW]
            print(f"{name:>14}" + "".join(f"{x:>9}" if isinstance(x, int) else f"{x:>9.4f}" if x < 100
                                          else f"{x:>9.1f}" for x in row), flush=True)
            graph = table = q = rel = None  # free before the next configuration
            torch.cuda.empty_cache()
        k_cache = v_cache = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
