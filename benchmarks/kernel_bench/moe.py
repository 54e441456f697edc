"""MoE: Triton kernels (`kiln.kernels.moe`) vs the PyTorch references (`kiln.ops.moe`), CUDA only.

    python -m benchmarks.kernel_bench.moe [--tokens 1 8 64 256 8192] [--sweep]
    python -m benchmarks.kernel_bench.moe --gemv [T ...]

Shapes: the Inkling / MiniMax-M3 `bench` presets' MoE (E=64, k=6, H=2048, I=512, bf16), Inkling's
two shared experts. Rows:
- experts: `fused_experts` (routed only) vs `experts_ref`;
- +shared: `fused_experts(shared=...)` vs `experts_ref + shared_experts_ref` (fp32 sum, one cast);
- sink gate / minimax gate: the gate kernels (router GEMM + fused top-k) vs the references.
Times are medians in microseconds. "eager" is `triton.testing.do_bench` (L2 flushed before each
call); "graph" replays the call from a CUDA graph, as the engine's decode does, over 8 copies of
the weights in turn so that they are not served from L2. The references sync the host
(`experts_ref` loops over the experts that got tokens), so they have eager times only. GB/s (decode
sizes) counts the expert weights the call must read once: those of the experts hit, plus the
shared ones, over the graph time.

`--sweep` times the fused call with other tile configs per token count and prints the best ones
(how `kiln.kernels.moe.pick_config` was chosen).

`--gemv` (instead of the table above) times `fused_experts`' two paths against each other at T=1
(or the given token counts) on the Inkling and MiniMax-M3 bench presets' MoE, read from
`kiln.models.presets`: Inkling's S=2 weighted shared experts of width I, MiniMax-M3's one
unweighted shared expert of width num_shared_experts * I (as `kiln.layers.moe` builds them). Both
replay from a CUDA graph over COPIES copies of the weights; TB/s counts the expert weight bytes a
call must read (the experts hit, plus the shared ones). The grouped path is forced with an
explicit config, the GEMV path past one token with `gemv_max_tokens` (the engine's `--moe-gemv-max-tokens`).
"""

from __future__ import annotations

import argparse
import json
from typing import Optional

import torch

E, K, H, I, S = 64, 6, 2048, 512, 2
COPIES = 8


def _weights(n, dtype, dev, gen, e=E, h=H, i=I, shared_inter=S * I):
    def rnd(*shape, fan_in):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).div_(fan_in ** 0.5).to(dtype)

    return [dict(w13=rnd(e, 2 * i, h, fan_in=h), w2=rnd(e, h, i, fan_in=i),
                 sw13=rnd(2 * shared_inter, h, fan_in=h), sw2=rnd(h, shared_inter, fan_in=i)) for _ in range(n)]


def _graph_time(fn) -> float:
    """Median microseconds of one `fn()` replayed from a CUDA graph."""
    import triton

    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def _eager_time(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def _inputs(t, dtype, dev, gen):
    x = torch.randn(t, H, generator=gen, device=dev).to(dtype)
    # Routing as the gate would do it: k distinct experts per token, from random logits.
    ids = torch.rand(t, E, generator=gen, device=dev).argsort(dim=1)[:, :K]
    w = torch.rand(t, K, generator=gen, device=dev)
    sw = torch.rand(t, S, generator=gen, device=dev)
    return x, ids, w, sw


def _weight_bytes(ids, elt) -> int:
    hit = torch.unique(ids).numel()
    return (hit * 3 * I * H + 3 * S * I * H) * elt


def _candidates(t):
    from kiln.kernels.moe import MoEConfig

    m = t * K / E
    bms = [16] if m <= 1 else [16, 32] if m <= 12 else [16, 32, 64] if m <= 48 else [64, 128]
    ups = [(32, 128, 4, 4), (64, 128, 4, 3), (32, 256, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3),
           (64, 64, 8, 4)]
    downs = [(64, 128, 4, 4), (128, 64, 4, 4), (32, 256, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4),
             (256, 64, 8, 3)]
    if m <= 1:  # a few tokens (a speculative verify at batch 1): narrow N tiles, long K steps, as the GEMV's
        ups += [(16, 128, 4, 4), (16, 256, 4, 3), (16, 512, 4, 2), (32, 512, 4, 2)]
        downs += [(16, 256, 4, 3), (32, 128, 4, 4), (32, 512, 4, 2), (64, 256, 4, 3)]
    return MoEConfig, bms, ups, downs


def sweep(tokens, dtype, dev, gen, best_out: Optional[dict] = None) -> None:
    """Time the candidate tiles per token count; `best_out` (if given) gets each count's fastest
    config and its time beside the default's."""
    from kiln.kernels.moe import fused_experts, pick_config

    layers = _weights(COPIES, dtype, dev, gen)
    print("\nsweep: fused_experts(+shared), graph median us; tiles (BLOCK_N, BLOCK_K, warps, stages)")
    for t in tokens:
        x, ids, w, sw = _inputs(t, dtype, dev, gen)
        MoEConfig, bms, ups, downs = _candidates(t)
        default = pick_config(t, K, E, H, I)

        def run(cfg):
            def fn():
                for L in layers:
                    fused_experts(x, L["w13"], L["w2"], ids, w, shared=(L["sw13"], L["sw2"], sw), config=cfg)
            try:
                fn()
                return _graph_time(fn) / COPIES
            except Exception as exc:  # e.g. out of shared memory for a big tile
                print(f"  T={t} {cfg}: {type(exc).__name__}")
                return float("inf")

        results = {}
        for bm in bms:  # gate/up tiles and BLOCK_M with the default down tiles
            for up in ups:
                cfg = MoEConfig(bm, up, default.down)
                results[cfg] = run(cfg)
        best = min(results, key=results.get)
        for down in downs:  # then the down tiles with the best of those
            cfg = MoEConfig(best.block_m, best.up, down)
            if cfg not in results:
                results[cfg] = run(cfg)
        if default not in results:
            results[default] = run(default)
        ranked = sorted(results.items(), key=lambda kv: kv[1])
        if best_out is not None:
            top = ranked[0][0]
            best_out[t] = dict(block_m=top.block_m, up=list(top.up), down=list(top.down), us=ranked[0][1],
                               default_us=results[default])
        print(f"T={t}: default {default} {results[default]:.1f} us")
        for cfg, us in ranked[:3]:
            print(f"   {us:8.1f} us  BLOCK_M={cfg.block_m} up={cfg.up} down={cfg.down}")


def bench_shapes() -> list[tuple]:
    """(arch, E, k, H, I, shared chunks, shared weights given) of the hybrid bench presets' MoE."""
    from kiln.models.presets import PRESETS

    shapes = []
    for arch in ("inkling", "minimax_m3"):
        c = PRESETS[arch]["bench"]
        shapes.append((arch, c["num_experts"], c["num_experts_per_tok"], c["hidden_size"],
                       c["moe_intermediate_size"], c["num_shared_experts"], arch == "inkling"))
    return shapes


def gemv_vs_grouped(tokens, dtype, dev, gen) -> None:
    print(f"fused_experts at few tokens: grouped path vs GEMV path, {dtype}, graph median us per call, "
          f"TB/s of expert weights read")
    head = (f"{'model':<11} {'E':>3} {'k':>2} {'H':>5} {'I':>4} {'C':>2} {'T':>3} {'MB':>6} "
            f"{'grouped':>8} {'TB/s':>5} {'gemv':>8} {'TB/s':>5} {'speedup':>7} {'max diff':>9}")
    print(head)
    print("-" * len(head))
    for shape in bench_shapes():
        _gemv_vs_grouped_rows(shape, tokens, dtype, dev, gen)
        torch.cuda.empty_cache()  # the next shape's copies


def _gemv_vs_grouped_rows(shape, tokens, dtype, dev, gen) -> None:
    from kiln.kernels import moe as KM

    arch, e, k, h, i, chunks, weighted = shape
    elt = torch.finfo(dtype).bits // 8
    layers = _weights(COPIES, dtype, dev, gen, e=e, h=h, i=i, shared_inter=chunks * i)
    for t in tokens:
        x = torch.randn(t, h, generator=gen, device=dev).to(dtype)
        ids = torch.rand(t, e, generator=gen, device=dev).argsort(dim=1)[:, :k]
        w = torch.rand(t, k, generator=gen, device=dev)
        sw = torch.rand(t, chunks, generator=gen, device=dev) if weighted else None
        nbytes = (torch.unique(ids).numel() + chunks) * 3 * i * h * elt

        def calls(config, gemv_max_tokens=None):
            def fn():
                return [KM.fused_experts(x, L["w13"], L["w2"], ids, w, shared=(L["sw13"], L["sw2"], sw),
                                         config=config, gemv_max_tokens=gemv_max_tokens) for L in layers]
            return fn

        grouped = calls(KM.pick_config(t, k, e, h, i))
        gemv = calls(None, gemv_max_tokens=t)
        grouped_us = _graph_time(grouped) / COPIES
        gemv_us = _graph_time(gemv) / COPIES
        diff = (gemv()[0].float() - grouped()[0].float()).abs().max().item()
        print(f"{arch:<11} {e:>3} {k:>2} {h:>5} {i:>4} {chunks:>2} {t:>3} {nbytes / 1e6:>6.1f} "
              f"{grouped_us:>8.1f} {nbytes / grouped_us / 1e6:>5.2f} {gemv_us:>8.1f} "
              f"{nbytes / gemv_us / 1e6:>5.2f} {grouped_us / gemv_us:>6.2f}x {diff:>9.2e}")


# Candidate one-token tiles (BLOCK_N, BLOCK_K, warps) that `--gemv-sweep` times
UP_TILES = ((2, 1024, 4), (4, 1024, 4), (4, 512, 4), (8, 512, 4), (8, 256, 4), (16, 256, 4), (4, 2048, 8),
            (8, 1024, 8))
DOWN_TILES = ((2, 512, 4), (4, 512, 4), (8, 512, 4), (16, 512, 8), (8, 256, 4), (16, 256, 4), (4, 256, 4),
              (2, 256, 4))


def gemv_sweep(dtype, dev, gen) -> None:
    """The one-token path at T=1 with each candidate gate/up tile (down tile as shipped), then each
    down tile (gate/up at the best one), against the grouped path: how `kiln.kernels.moe_gemv.GEMV_*_TILE` are chosen."""
    from kiln.kernels import moe as KM
    from kiln.kernels import moe_gemv as KG

    saved = KG.GEMV_UP_TILE, KG.GEMV_DOWN_TILE
    for arch, e, k, h, i, chunks, weighted in bench_shapes():
        layers = _weights(COPIES, dtype, dev, gen, e=e, h=h, i=i, shared_inter=chunks * i)
        x = torch.randn(1, h, generator=gen, device=dev).to(dtype)
        ids = torch.rand(1, e, generator=gen, device=dev).argsort(dim=1)[:, :k]
        w = torch.rand(1, k, generator=gen, device=dev)
        sw = torch.rand(1, chunks, generator=gen, device=dev) if weighted else None
        nbytes = (k + chunks) * 3 * i * h * torch.finfo(dtype).bits // 8

        def timed(config=None):
            fn = lambda: [KM.fused_experts(x, L["w13"], L["w2"], ids, w, shared=(L["sw13"], L["sw2"], sw),  # noqa: E731
                                           config=config) for L in layers]
            us = _graph_time(fn) / COPIES
            return f"{us:7.1f} us {nbytes / us / 1e6:5.2f} TB/s"

        print(f"{arch}: grouped {timed(KM.pick_config(1, k, e, h, i))}")
        best = (float("inf"), saved[0])
        for tile in UP_TILES:
            KG.GEMV_UP_TILE, KG.GEMV_DOWN_TILE = tile, saved[1]
            line = timed()
            print(f"{arch}: up {tile} down {saved[1]}: {line}")
            best = min(best, (float(line.split()[0]), tile))
        for tile in DOWN_TILES:
            KG.GEMV_UP_TILE, KG.GEMV_DOWN_TILE = best[1], tile
            print(f"{arch}: up {best[1]} down {tile}: {timed()}")
        KG.GEMV_UP_TILE, KG.GEMV_DOWN_TILE = saved
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 8192])
    ap.add_argument("--sweep", action="store_true", help="time other tile configs too")
    ap.add_argument("--gemv", type=int, nargs="*", metavar="T",
                    help="only time the grouped path against the GEMV path, at T tokens (default 1)")
    ap.add_argument("--gemv-sweep", action="store_true", help="only time the one-token path's candidate tiles")
    ap.add_argument("--sweep-json", help="with --sweep: write each token count's fastest config here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.kernel_bench.moe needs CUDA")
    if args.gemv_sweep:
        dev = torch.device("cuda")
        gemv_sweep(torch.bfloat16, dev, torch.Generator(device=dev).manual_seed(0))
        return
    if args.gemv is not None:
        dev = torch.device("cuda")
        gemv_vs_grouped(args.gemv or [1], torch.bfloat16, dev, torch.Generator(device=dev).manual_seed(0))
        return

    from kiln.kernels import moe as KM
    from kiln.ops import moe as R

    dtype, dev = torch.bfloat16, torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    layers = _weights(COPIES, dtype, dev, gen)
    L0 = layers[0]
    router = torch.randn(E + S, H, generator=gen, device=dev).div_(H ** 0.5).to(dtype)
    bias = torch.randn(E, generator=gen, device=dev) * 0.01
    gscale = torch.ones((), device=dev)
    elt = torch.finfo(dtype).bits // 8
    print(f"MoE E={E} k={K} H={H} I={I} shared={S} {dtype} on {torch.cuda.get_device_name()}; median us")
    head = (f"{'T':>5} {'op':<14} {'ref eager':>10} {'kern eager':>10} {'kern graph':>10} "
            f"{'speedup':>8} {'GB/s':>7}")
    print(head)
    print("-" * len(head))
    for t in args.tokens:
        x, ids, w, sw = _inputs(t, dtype, dev, gen)
        decode = t <= 256

        def fused(shared):
            def fn():
                for L in layers:
                    KM.fused_experts(x, L["w13"], L["w2"], ids, w,
                                     shared=(L["sw13"], L["sw2"], sw) if shared else None)
            return fn

        rows = [
            ("experts", lambda: R.experts_ref(x, L0["w13"], L0["w2"], ids, w),
             lambda: KM.fused_experts(x, L0["w13"], L0["w2"], ids, w), fused(False),
             _weight_bytes(ids, elt) - 3 * S * I * H * elt),
            ("+shared", lambda: (R.experts_ref(x, L0["w13"], L0["w2"], ids, w, torch.float32)
                                 + R.shared_experts_ref(x, L0["sw13"], L0["sw2"], sw)).to(dtype),
             lambda: KM.fused_experts(x, L0["w13"], L0["w2"], ids, w, shared=(L0["sw13"], L0["sw2"], sw)),
             fused(True), _weight_bytes(ids, elt)),
            ("sink gate", lambda: R.sink_gate_ref(x, router, bias, gscale, K, 2.5),
             lambda: KM.sink_gate(x, router, bias, gscale, K, 2.5), None, 0),
            ("minimax gate", lambda: R.minimax_gate_ref(x, router[:E], bias, K, 2.5),
             lambda: KM.minimax_gate(x, router[:E], bias, K, 2.5), None, 0),
        ]
        for name, ref_fn, kern_fn, graph_fn, nbytes in rows:
            ref_us = _eager_time(ref_fn)
            kern_us = _eager_time(kern_fn)
            if graph_fn is not None:
                graph_us = _graph_time(graph_fn) / COPIES
            else:
                graph_us = _graph_time(kern_fn)
            gbs = f"{nbytes / graph_us / 1e3:7.0f}" if decode and nbytes else f"{'':>7}"
            print(f"{t:>5} {name:<14} {ref_us:>10.1f} {kern_us:>10.1f} {graph_us:>10.1f} "
                  f"{ref_us / kern_us:>7.1f}x {gbs}")
    if args.sweep:
        best = {}
        sweep(args.tokens, dtype, dev, gen, best)
        if args.sweep_json:
            with open(args.sweep_json, "w") as f:
                json.dump(best, f, indent=1)


if __name__ == "__main__":
    main()
