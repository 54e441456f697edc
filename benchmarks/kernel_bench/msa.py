"""MSA decode: Triton kernels (`kiln.kernels.msa.msa_decode`) vs the reference
(`kiln.ops.msa.paged_msa_attention`), CUDA only.

    python -m benchmarks.kernel_bench.msa [--batch 1 8 64] [--context 8192 32768 131072]

Shapes: the MiniMax-M3 bench preset per rank (Hq=16, Hkv=G=4, D=DI=128, block 128, N=16), bf16,
every sequence at the full context, each position at a random cache slot (fragmented pages).
Times are medians of `triton.testing.do_bench`: the eager call (4 launches, at small sizes bound
by the host's launch cost), the same call replayed from a CUDA graph (how the engine's decode
runs), and each step alone replayed from a graph (`do_bench_cudagraph`; "attn" includes the
split merge). GB/s counts
the bytes the step must read: every index key of every sequence, plus K and V of the selected
tokens (at most N*B per sequence and kv head); tables, queries and scores are left out.
"""

from __future__ import annotations

import argparse

import torch


def decode_bytes(seq_lens, g, d, di, block, topk, elt) -> int:
    """Index keys of all positions + K/V of the selected tokens, per `select_blocks`."""
    total = 0
    for n in seq_lens:
        blocks = -(-n // block)
        sel = n if blocks <= topk else (topk - 1) * block + (n - (blocks - 1) * block)
        total += n * g * di * elt + 2 * sel * g * d * elt
    return total


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--no-reference", action="store_true", help="skip the (slow) reference op")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.kernel_bench.msa needs CUDA")

    import triton

    from kiln.kernels import msa as K
    from kiln.ops import msa as R

    hq, g, d, di, block, topk = 16, 4, 128, 128, 128, 16
    dtype, dev = torch.bfloat16, torch.device("cuda")
    scale = d ** -0.5
    slots = max(args.batch) * max(args.context)
    gen = torch.Generator(device=dev).manual_seed(0)
    # One set of caches for every configuration (bf16, 3 x slots x G x 128 x 2 bytes).
    k_cache = torch.randn(slots, g, d, device=dev, dtype=dtype, generator=gen)
    v_cache = torch.randn(slots, g, d, device=dev, dtype=dtype, generator=gen)
    ki_cache = torch.randn(slots, g, di, device=dev, dtype=dtype, generator=gen)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731

    def graphed(fn):
        torch.cuda.synchronize()  # do_bench_cudagraph runs fn on a stream of its own
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")

    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"# Hq={hq} G={g} D={d} DI={di} block={block} N={topk} {dtype}; times in ms (median)")
    # graph: one replay of a captured msa_decode (launch included); 2-launch: msa_decode as the engine
    # runs it (selection inside the attention kernel), 3-launch: with msa_select apart, both timed as
    # the stages are (do_bench_cudagraph: many calls in one graph); attn+sel: the attention kernel
    # selecting from the scores.
    cols = ["B", "ctx", "ref", "eager", "graph", "2-launch", "3-launch", "speedup", "GB/s", "scores", "select",
            "attn", "attn+sel"]
    print(" ".join(f"{c:>9}" for c in cols))
    for b in args.batch:
        for ctx in args.context:
            table = torch.randperm(slots, device=dev, generator=gen)[:b * ctx].view(b, ctx)
            req_slots = torch.arange(b, device=dev)
            seq_lens = torch.full((b,), ctx, dtype=torch.int64, device=dev)
            q = torch.randn(b, hq, d, device=dev, dtype=dtype, generator=gen)
            qI = torch.randn(b, g, di, device=dev, dtype=dtype, generator=gen)
            call = lambda: K.msa_decode(q, qI, k_cache, v_cache, ki_cache, table, req_slots, seq_lens,  # noqa: E731
                                        block, topk, scale)
            out = call()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            t_eager, t_graph = bench(call), bench(graph.replay)
            apart = lambda: K.msa_decode(q, qI, k_cache, v_cache, ki_cache, table, req_slots, seq_lens,  # noqa: E731
                                         block, topk, scale, select_in_attention=False)
            t_apart, t_two = graphed(apart), graphed(call)

            q_pos = seq_lens - 1
            scores = K.msa_decode_scores(qI, ki_cache, table, req_slots, q_pos, block)
            sel = K.msa_select(scores, q_pos, block, topk)
            t_scores = graphed(lambda: K.msa_decode_scores(qI, ki_cache, table, req_slots, q_pos, block))
            t_select = graphed(lambda: K.msa_select(scores, q_pos, block, topk))
            t_attn = graphed(lambda: K.msa_sparse_attention(q, k_cache, v_cache, table, req_slots, q_pos, sel,
                                                            block, scale))
            t_attn_sel = graphed(lambda: K.msa_sparse_attention(q, k_cache, v_cache, table, req_slots, q_pos, None,
                                                                block, scale, scores=scores, topk_blocks=topk))
            t_ref = float("nan")
            if not args.no_reference:
                ref_call = lambda: R.paged_msa_attention(q, qI, k_cache, v_cache, ki_cache, table,  # noqa: E731
                                                         list(range(b)), [ctx - 1] * b, [1] * b, block, topk, scale)
                ref = ref_call()
                err = (out.float() - ref.float()).abs().max().item()
                assert err < 5e-2, f"kernel differs from the reference by {err}"
                t_ref = bench(ref_call)
            gbs = decode_bytes([ctx] * b, g, d, di, block, topk, 2) / (t_graph * 1e-3) / 1e9
            row = [b, ctx, t_ref, t_eager, t_graph, t_two, t_apart, t_ref / t_graph, gbs, t_scores, t_select, t_attn,
                   t_attn_sel]
            print(" ".join(f"{x:>9}" if isinstance(x, int) else f"{x:>9.4f}" if x < 100 else f"{x:>9.1f}"
                           for x in row), flush=True)


if __name__ == "__main__":
    main()
