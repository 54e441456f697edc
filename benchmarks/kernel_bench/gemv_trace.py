"""Where a decode GEMV's time goes in a dependent chain: per-program timestamps; CUDA only.

    python -m benchmarks.kernel_bench.gemv_trace [--layers 24] [--chains dense,o] [--tiles 2x1024,4x512/w8]
                                                [--router-tile 1x2048] [--xpipe on|off|both]
                                                [--trigger on|off|both] [--out trace.json]
                                                [--gate-warps 1,4] [--up-tiles rule,1x1024]

At batch 1 the engine's dense GEMVs take ~4 us each beyond their bytes (docs/benchmarks.md,
twenty-second pass), against ~1.4 us back to back with nothing depending on them. A profile
cannot say where: with PDL a kernel's interval starts at its launch, while it still waits. This
replays, from a CUDA graph with PDL and the early trigger (as the engine's batch-1 graphs run),
chains of GEMVs whose launches record `kiln.kernels.trace` timestamps, and prints per GEMV
(medians over the chain, us; "prev" is the launch before it):

- `span`:      its last program's end minus prev's last end: what it adds to the chain;
- `bytes`:     its weight bytes at the copy bandwidth;
- `launch`:    its first program's start minus prev's last wait (the early trigger lets it launch
               once every program of prev has passed its wait);
- `released`:  its first wait's return minus prev's last end (completion -> release);
- `spread`:    its last wait's return minus its first (late waves start their loads after it);
- `stream`:    its last reduction minus its first wait's return;
- `tail`:      its last end minus its last reduction (epilogue, store);
- `early`:     the share of its programs that started before prev's last end (resident early
               enough to load weights while prev ran);
- `prologue`:  per program (median), its prologue after its wait (a norm's statistics);
- `post`:      per program (median), its reduction after its own wait;
- `per_sm`:    the most of its programs that ran on one SM (resident together or one after another).

Chains: `dense` is Inkling `bench`'s dense path per MoE layer without attention and experts
(qkvr 3584x2048 with the pre-norm in its prologue -> o_proj 2048x2048 -> the router 64x2048,
fp32, pre-norm in its prologue), `o` is o_proj-shaped GEMVs feeding each other, `moe` the MoE at
one token (the router, the sink gate, the two expert GEMVs: `MoEChain`; `--tiles` does not apply). Every layer's
weights are distinct (nothing stays in L2). `--tiles` times the chains with other FMA tiles for
the two large GEMVs (the rule's by default; a tile whose BLOCK_K covers K takes the kernel's
loop-free path, ONE_TILE), `--xpipe` with the activation tiles loaded one tile
ahead (the kernel's default) or in the tile's own iteration. For the `moe` chain, `--gate-warps`
times each listed value of `kiln.kernels.moe_gate.DECODE_GATE_WARPS` (the decode gate's warps),
and `--up-tiles` each gate/up tile (`kiln.kernels.moe_gemv.GEMV_UP_TILE`, as --tiles), in every
combination.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton

from benchmarks.kernel_bench.gemv import copy_bandwidth
from kiln.kernels import moe_gate, moe_gemv
from kiln.kernels.gemv import gemv, gemv_prenorm
from kiln.kernels.gemv_tiles import fma_tile, prenorm_tile
from kiln.kernels.launch import set_pdl
from kiln.kernels.trace import FIELDS, PROLOGUE, REDUCED, SM, START, STORED, WAITED


def tile_of(name: str, rule: dict, xpipe: bool = True) -> dict:
    """'rule' (the engine's tile, given) or 'BNxBK' (4 warps) or 'BNxBK/wW' -> an FMA tile, with
    the activation tiles pipelined or not (the kernel's XPIPE)."""
    if name == "rule":
        return dict(rule, XPIPE=xpipe)
    shape, _, warps = name.partition("/w")
    bn, bk = (int(v) for v in shape.split("x"))
    return dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=int(warps or 4), num_stages=1, XPIPE=xpipe)


class Chain:
    """The launches of one chain, each with its own trace buffer (a slice of one tensor)."""

    def __init__(self, kind: str, layers: int, tile: str, dev, dt=torch.bfloat16, router_tile: str = "rule",
                 xpipe: bool = True):
        self.kind = kind
        qkvr_tile, _, o_tile = tile.partition("+")  # 'QKVR+O', or one tile for both
        self.tile = tile_of(qkvr_tile, prenorm_tile(1, 3584, 2048), xpipe)
        self.o_tile = tile_of(o_tile or qkvr_tile, fma_tile(1, 2048), xpipe)
        self.router_tile = tile_of(router_tile, prenorm_tile(1, 64, 2048), xpipe)
        hid = 2048
        w = lambda n, k, d=dt: (torch.randn(n, k, device=dev) / k ** 0.5).to(d)  # noqa: E731
        self.h = torch.randn(1, hid, device=dev, dtype=dt)
        if kind == "dense":
            self.layers = [dict(ln1=1 + 0.1 * torch.randn(hid, device=dev, dtype=dt), qkvr=w(3584, hid),
                                o=w(hid, hid), ln2=1 + 0.1 * torch.randn(hid, device=dev, dtype=dt),
                                router=w(64, hid, torch.float32)) for _ in range(layers)]
            self.names = ["qkvr", "o", "router"] * layers
        else:
            self.layers = [dict(o=w(hid, hid)) for _ in range(layers)]
            self.names = ["o"] * layers
        self.bytes = {"qkvr": 3584 * hid * 2, "o": hid * hid * 2, "router": 64 * hid * 4}
        self.trace = torch.zeros(len(self.names), 4096 * FIELDS, dtype=torch.int64, device=dev)

    def run(self, traced: bool = True):
        i, f, res = 0, self.h, torch.zeros_like(self.h)
        tr = (lambda j: self.trace[j]) if traced else (lambda j: None)  # noqa: E731
        for L in self.layers:
            if self.kind == "dense":
                q, res, _ = gemv_prenorm(f, res, L["ln1"], 1e-5, L["qkvr"], tile=self.tile, trace=tr(i))
                o = gemv(q[:, :2048], L["o"], tile=self.o_tile, trace=tr(i + 1))
                _, res, _ = gemv_prenorm(o, res, L["ln2"], 1e-5, L["router"], tile=self.router_tile, trace=tr(i + 2))
                f, i = o, i + 3
            else:
                f, i = gemv(f, L["o"], tile=self.o_tile, trace=tr(i)), i + 1
        return f

    def records(self):
        """Per launch: a [programs, FIELDS] int64 array of the last replay (zeros past the grid)."""
        out = []
        for row in self.trace.view(len(self.names), -1, FIELDS).cpu():
            used = row[:, START] != 0
            out.append(row[used])
        return out


class MoEChain:
    """Inkling `bench`'s MoE per layer at one token: the router GEMV with the pre-norm in its
    prologue (traced), the sink gate (not traced), the two expert GEMVs of
    `kiln.kernels.moe_gemv` (traced), whose output feeds the next layer. So the `up` rows'
    `released`, `launch` and `span` include the gate launched between. Every layer's weights are
    distinct (64 experts of 2x512x2048 and 512x2048: ~200 MB a layer)."""

    def __init__(self, layers: int, dev, hidden: int = 2048, experts: int = 64, top_k: int = 6, inter: int = 512,
                 shared: int = 2, dt=torch.bfloat16, router_tile: str = "rule"):
        from kiln.kernels.moe_gate import sink_gate
        from kiln.kernels.moe import fused_experts

        self.sink_gate, self.fused_experts, self.top_k = sink_gate, fused_experts, top_k
        self.router_tile = tile_of(router_tile, prenorm_tile(1, experts + shared, hidden))
        w = lambda *shape: (torch.randn(*shape, device=dev) / shape[-1] ** 0.5).to(dt)  # noqa: E731
        self.h = torch.randn(1, hidden, device=dev, dtype=dt)
        self.layers = [dict(ln=1 + 0.1 * torch.randn(hidden, device=dev, dtype=dt),
                            router=torch.randn(experts + shared, hidden, device=dev) / hidden ** 0.5,
                            bias=0.01 * torch.randn(experts, device=dev), scale=torch.tensor(1.0, device=dev),
                            w13=w(experts, 2 * inter, hidden), w2=w(experts, hidden, inter),
                            sw13=w(2 * shared * inter, hidden), sw2=w(hidden, shared * inter))
                       for _ in range(layers)]
        self.names = ["router", "up", "down"] * layers
        slots = top_k + shared
        self.bytes = {"router": (experts + shared) * hidden * 4, "up": slots * 2 * inter * hidden * 2,
                      "down": slots * hidden * inter * 2}
        self.trace = torch.zeros(len(self.names), 4096 * FIELDS, dtype=torch.int64, device=dev)

    def run(self, traced: bool = True):
        i, f, res = 0, self.h, torch.zeros_like(self.h)
        tr = (lambda j: self.trace[j]) if traced else (lambda j: None)  # noqa: E731
        for L in self.layers:
            z, res, x = gemv_prenorm(f, res, L["ln"], 1e-5, L["router"], keep_normed=True, tile=self.router_tile,
                                     trace=tr(i))
            ids, rw, sw = self.sink_gate(x, L["router"], L["bias"], L["scale"], self.top_k, 1.0, use_gemv=True,
                                         logits=z)
            f = self.fused_experts(x, L["w13"], L["w2"], ids, rw, shared=(L["sw13"], L["sw2"], sw),
                                   trace=(tr(i + 1), tr(i + 2)) if traced else None)
            i += 3
        return f

    records = Chain.records


def analyse(recs: list, names: list, nbytes: dict, bw: float) -> dict:
    """Medians per GEMV name of the quantities in the module docstring, from one replay's records
    (`Chain.records`), the launches' names in order, their weight bytes, and the bandwidth (B/s)."""
    rows = {}
    for i in range(3, len(recs)):  # skip the first launches: their predecessors are outside the chain
        r, p = recs[i], recs[i - 1]
        us = lambda t: t / 1e3  # noqa: E731
        first_wait, last_wait = r[:, WAITED].min(), r[:, WAITED].max()
        per_sm = torch.bincount(r[:, SM]).max().item()
        median = lambda v: us(v.double().quantile(0.5).item())  # noqa: E731
        rows.setdefault(names[i], []).append(dict(
            early=(r[:, START] < p[:, STORED].max()).double().mean().item(),
            prologue=median(r[:, PROLOGUE] - r[:, WAITED]), post=median(r[:, REDUCED] - r[:, WAITED]),
            span=us(r[:, STORED].max() - p[:, STORED].max()), launch=us(r[:, START].min() - p[:, WAITED].max()),
            released=us(first_wait - p[:, STORED].max()), spread=us(last_wait - first_wait),
            stream=us(r[:, REDUCED].max() - first_wait), tail=us(r[:, STORED].max() - r[:, REDUCED].max()),
            per_sm=per_sm, programs=len(r)))
    table = {}
    for name, rs in rows.items():
        table[name] = {k: statistics.median(float(x[k]) for x in rs) for k in rs[0]}
        table[name]["bytes"] = nbytes[name] / bw * 1e6
    return table


def timer_step(recs) -> float:
    """The smallest nonzero difference between timestamps (the timer's resolution), ns."""
    t = torch.cat([r[:, :SM].flatten() for r in recs]).unique()  # every time field
    d = (t[1:] - t[:-1])
    d = d[d > 0]
    return float(d.min()) if len(d) else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--chains", default="dense,o")
    ap.add_argument("--tiles", default="rule", help="comma-separated FMA tiles BNxBK[/wWARPS] (4 warps unless "
                    "given) or 'rule', for qkvr and o; 'QKVR+O' gives each its own (the o chain takes O)")
    ap.add_argument("--router-tile", default="rule", help="the dense chain's router tile, as --tiles")
    ap.add_argument("--xpipe", choices=("on", "off", "both"), default="on",
                    help="the GEMV's activation tiles loaded one tile ahead (XPIPE, the default) or not")
    ap.add_argument("--trigger", choices=("on", "off", "both"), default="both", help="PDL's early trigger")
    ap.add_argument("--gate-warps", default="1", help="moe chain: DECODE_GATE_WARPS values, comma-separated")
    ap.add_argument("--up-tiles", default="rule", help="moe chain: gate/up tiles BNxBK[/wWARPS] or 'rule'")
    ap.add_argument("--out", default=None, help="write the tables as JSON here")
    args = ap.parse_args()
    dev = "cuda"
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s; {torch.cuda.get_device_name()}; rule tile at qkvr "
          f"{prenorm_tile(1, 3584, 2048)}", flush=True)
    results = []
    for trigger in {"on": (True,), "off": (False,), "both": (True, False)}[args.trigger]:
        set_pdl(True, early_trigger=trigger)
        for kind in args.chains.split(","):
            variants = [(t, x) for t in args.tiles.split(",")
                        for x in {"on": (True,), "off": (False,), "both": (True, False)}[args.xpipe]]
            if kind == "moe":  # --tiles and --xpipe do not apply; the MoE knobs do
                variants = [(f"gate-warps {g}, up tile {u}", (int(g), u))
                            for g in args.gate_warps.split(",") for u in args.up_tiles.split(",")]
            rule_up = moe_gemv.GEMV_UP_TILE
            for tname, xpipe in variants:
                if kind == "moe":
                    moe_gate.DECODE_GATE_WARPS, up_tile = xpipe
                    if up_tile == "rule":
                        moe_gemv.GEMV_UP_TILE = rule_up
                    else:
                        t = tile_of(up_tile, {})
                        moe_gemv.GEMV_UP_TILE = (t["BLOCK_N"], t["BLOCK_K"], t["num_warps"])
                    chain = MoEChain(args.layers, dev, router_tile=args.router_tile)
                else:
                    chain = Chain(kind, args.layers, tname, dev, router_tile=args.router_tile, xpipe=xpipe)
                steps = {}
                for traced in (False, True):
                    chain.run(traced)  # compile
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        chain.run(traced)
                    steps[traced] = triton.testing.do_bench(graph.replay, rep=200, return_mode="median") * 1e3
                graph.replay()  # the traced graph: its records are read below
                torch.cuda.synchronize()
                per_layer, traced_layer = steps[False] / args.layers, steps[True] / args.layers
                bound = sum(chain.bytes[n] for n in chain.names) / bw * 1e6 / args.layers
                recs = chain.records()
                table = analyse(recs, chain.names, chain.bytes, bw)
                onoff = lambda b: "on" if b else "off"  # noqa: E731
                label = tname if kind == "moe" else f"tile {tname}, xpipe {onoff(xpipe)}"
                print(f"\n{kind} chain, {label}, early trigger {onoff(trigger)}: "
                      f"{per_layer:.2f} us per layer (traced {traced_layer:.2f}; bytes {bound:.2f}, "
                      f"{bound / per_layer:.1%}); timer step {timer_step(recs):.0f} ns", flush=True)
                cols = ("span", "bytes", "launch", "released", "spread", "stream", "tail", "early", "prologue",
                        "post", "per_sm", "programs")
                print(f"{'gemv':<8}" + "".join(f"{c:>9}" for c in cols))
                for name, t in table.items():
                    print(f"{name:<8}" + "".join(f"{t[c]:>9.2f}" for c in cols), flush=True)
                results.append(dict(chain=kind, tile=tname, xpipe=xpipe, trigger=trigger, us_per_layer=per_layer,
                                    traced_us_per_layer=traced_layer, bound=bound, table=table))
    set_pdl(True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
