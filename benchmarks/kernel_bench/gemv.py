"""Decode GEMV (`kiln.kernels.gemv`) against cuBLAS, alone and in a decoder layer's chain; CUDA only.

    python -m benchmarks.kernel_bench.gemv [--layers 32] [--rows 1,4] [--sweep] [--shapes llama-8b] [--no-chain]
                                      [--chain-only] [--fold-sweep]

A decode step at batch 1 is a chain of weight streams separated by small kernels. This replays,
from a CUDA graph, the dense part of `--layers` decoder layers of the Llama-3.1-8B shape (and of
the Inkling `bench` shape), with every layer's weights distinct so nothing stays in L2:

- `cublas`:     add+RMSNorm -> F.linear qkv -> F.linear o -> add+RMSNorm -> F.linear gate_up ->
                SiLU-and-mul -> F.linear down (Kiln's kernel path with --gemv-max-rows 0);
- `gemv`:       the same with Kiln's GEMV for every F.linear (the engine with --gemv-max-rows 1);
- `gemv-nopdl`: `gemv` launched without PDL, so no weight stream starts early;
- `gemv-glu`:   `gemv` with the SiLU-and-mul in the gate_up GEMV (what the engine runs);
- `fold`:       `gemv-glu` with both norms in the prologues of the GEMVs after them (qkv, gate_up:
                `gemv_prenorm`, the engine's --fold-norms-max-hidden); `fold-qkv` folds the first norm only.
                `--fold-sweep` times `fold` with every candidate tile for the folded GEMVs.
- `epilogue`:   `gemv-glu` with each norm in the epilogue of the GEMV before it (o_proj, down_proj:
                `gemv_add_norm`, the engine's norm epilogue above --fold-norms-max-hidden).

(No attention: the chain isolates the projections and what sits between them.) It prints the
median time per layer, the bytes it must read, and the fraction of the measured copy bandwidth.
The isolated table times each projection alone (a graph of up to 20 back-to-back calls over
weight copies of at least 400 MB in all) with the tile `fma_tile` / `dot_tile` picks; `--sweep`
also times every candidate tile (`candidate_tiles`), the data for revisiting that rule.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

from kiln.kernels.activation import silu_and_mul
from kiln.kernels.gemv import gemv, gemv_add_norm, gemv_prenorm
from kiln.kernels.gemv_tiles import FMA_MAX_ROWS, candidate_tiles, dot_tile, fma_tile
from kiln.kernels.launch import set_pdl
from kiln.kernels.norm import fused_add_rms_norm


def tile_name(t: dict) -> str:
    return f"{t['BLOCK_N']}x{t['BLOCK_K']}/w{t['num_warps']}"


def copy_bandwidth() -> float:
    """HBM bandwidth from a 1 GiB device copy (what `benchmarks/roofline.py` measures for the
    engine scripts, which run from benchmarks/ and import it as a top-level module)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), rep=200, return_mode="median")
    return 2 * a.numel() / (ms * 1e-3)


SHAPES = {  # hidden, q+k+v width, attention output width, intermediate
    "llama-8b": (4096, 6144, 4096, 14336),
    "inkling-bench": (2048, 3584, 2048, 6144),
}


def make_layers(n_layers, hidden, qkv, attn, inter, dev, dt):
    def w(n, k):
        return torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5

    return [dict(ln1=1 + 0.1 * torch.randn(hidden, device=dev, dtype=dt), qkv=w(qkv, hidden), o=w(hidden, attn),
                 ln2=1 + 0.1 * torch.randn(hidden, device=dev, dtype=dt), gate_up=w(2 * inter, hidden),
                 down=w(hidden, inter)) for _ in range(n_layers)]


def chain(mode, layers, h, attn, tile=None):
    """One pass over the layers from the stream h (residual starts at h); returns the last
    (f, residual), (normed, f + residual) in `epilogue` mode. `attn` columns of qkv stand in for the
    attention output. `tile`: the folded GEMVs' tile (`fold` modes), every GEMV's in `gemv` mode."""
    lin = F.linear if mode == "cublas" else (lambda x, w: gemv(x, w, tile)) if mode == "gemv" else gemv

    def project(x, res, ln, w, fold, glu=False):
        """(the projection by w of norm(x + res), silu(gate) * up of it with glu; x + res)."""
        if fold:
            y, res, _ = gemv_prenorm(x, res, ln, 1e-5, w, glu=glu, tile=tile)
            return y, res
        x, res = fused_add_rms_norm(x, res, ln, 1e-5)
        if not glu:
            return lin(x, w), res
        return (gemv(x, w, glu=True) if mode == "gemv-glu" or mode.startswith("fold") else silu_and_mul(lin(x, w))), res

    if mode == "epilogue":  # (normed, stream): the last layer's down norms into its own ln1
        counters = torch.zeros(2, dtype=torch.int32, device=h.device)
        x, res = fused_add_rms_norm(h, torch.zeros_like(h), layers[0]["ln1"], 1e-5)
        for i, L in enumerate(layers):
            o = gemv(x, L["qkv"])[:, :attn]
            x, res = gemv_add_norm(o, L["o"], res, L["ln2"], 1e-5, counters[0:1])
            nxt = layers[i + 1]["ln1"] if i + 1 < len(layers) else L["ln1"]
            x, res = gemv_add_norm(gemv(x, L["gate_up"], glu=True), L["down"], res, nxt, 1e-5, counters[1:2])
        return x, res
    f, res = h, torch.zeros_like(h)
    for L in layers:
        q, res = project(f, res, L["ln1"], L["qkv"], fold=mode.startswith("fold"))
        o = lin(q[:, :attn], L["o"])
        act, res = project(o, res, L["ln2"], L["gate_up"], fold=mode == "fold", glu=True)
        f = lin(act, L["down"])
    return f, res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--sweep", action="store_true", help="time every candidate tile too (* = the rule's)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, from: " + ", ".join(SHAPES))
    ap.add_argument("--no-chain", action="store_true", help="the isolated table only")
    ap.add_argument("--chain-only", action="store_true", help="the chain table only")
    ap.add_argument("--fold-sweep", action="store_true", help="the chain's fold mode with every candidate tile")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s; {torch.cuda.get_device_name()}", flush=True)

    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    if not args.chain_only:
        print(f"\n{'shape':<26}{'rows':>5}{'cuBLAS us':>11}{'GEMV us':>10}{'bound us':>10}{'speedup':>9}")
    for name, (hid, qkv, attn, inter) in ({} if args.chain_only else shapes).items():
        mats = {"qkv": (qkv, hid), "o": (hid, attn), "gate_up": (2 * inter, hid), "down": (hid, inter)}
        for proj, (n, k) in mats.items():
            ws = [torch.randn(n, k, device=dev, dtype=dt) for _ in range(max(2, (400 << 20) // (n * k * 2)))]
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, device=dev, dtype=dt)
                t = {}

                def bench(fn):
                    return triton.testing.do_bench_cudagraph(
                        lambda: [fn(w) for w in ws[:20]], rep=100, return_mode="median") * 1e3 / min(20, len(ws))

                for label, fn in (("cublas", lambda w: F.linear(x, w)), ("gemv", lambda w: gemv(x, w))):
                    fn(ws[0])  # compile outside the graph
                    t[label] = bench(fn)
                bound = n * k * 2 / bw * 1e6
                print(f"{name + ' ' + proj + f' {n}x{k}':<26}{m:>5}{t['cublas']:>11.2f}{t['gemv']:>10.2f}"
                      f"{bound:>10.2f}{t['cublas'] / t['gemv']:>9.2f}", flush=True)
                if args.sweep:
                    rule = tile_name(fma_tile(m, k) if m <= FMA_MAX_ROWS else dot_tile())
                    swept = []
                    set_pdl(False)  # the tiles alone, without the early weight stream
                    for tile in candidate_tiles(m):
                        gemv(x, ws[0], tile)
                        swept.append((bench(lambda w, tile=tile: gemv(x, w, tile)), tile_name(tile)))
                    set_pdl(True)
                    print("    tiles (us, no PDL): " + ", ".join(
                        f"{tn}{'*' if tn == rule else ''} {us:.2f}" for us, tn in sorted(swept)), flush=True)

    if args.no_chain:
        return
    print(f"\n{'chain':<14}{'mode':<22}{'rows':>5}{'us/layer':>10}{'bound':>8}{'of bw':>8}{'max err':>9}")
    for name, (hid, qkv, attn, inter) in shapes.items():
        layers = make_layers(args.layers, hid, qkv, attn, inter, dev, dt)
        layer_bytes = 2 * (qkv * hid + hid * attn + 2 * inter * hid + hid * inter)
        bound = layer_bytes / bw * 1e6
        for m in (int(r) for r in args.rows.split(",")):
            h = torch.randn(m, hid, device=dev, dtype=dt)
            ref = None
            modes = [(mode, None) for mode in ("cublas", "gemv", "gemv-nopdl", "gemv-glu", "fold-qkv", "fold",
                                               "epilogue")]
            if m > FMA_MAX_ROWS:  # the MMA loop: no glu, norm prologue or epilogue; its tiles in the chain
                modes = modes[:3] + [("gemv", tile) for tile in candidate_tiles(m)[1:]]
            elif args.fold_sweep:
                modes += [("fold", tile) for tile in candidate_tiles(m)]
            for mode, tile in modes:
                set_pdl(mode != "gemv-nopdl")
                f, res = chain(mode, layers, h, attn, tile)  # eager: compiles, then checks the stream
                out = (res if mode == "epilogue" else f + res).float()
                ref = out if ref is None else ref
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                us = triton.testing.do_bench_cudagraph(lambda: chain(mode, layers, h, attn, tile), rep=200,
                                                       return_mode="median") * 1e3 / args.layers
                label = mode + (" " + tile_name(tile) if tile else "")  # fold without one: `prenorm_tile`
                # (no tile: gemv's rule tile, `fma_tile` / `dot_tile`)
                print(f"{name:<14}{label:<22}{m:>5}{us:>10.2f}{bound:>8.2f}{bound / us:>8.1%}{err:>9.1e}", flush=True)
            set_pdl(True)


if __name__ == "__main__":
    main()
