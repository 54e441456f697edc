"""Compare the GPU timelines of decode rounds in Chrome traces written by `decode_batch.py --profile
--trace PATH`: where two codes' rounds differ when their kernels take the same time.

A round is the span between two starts of a kernel that runs once per round (`--mark`; the
default, `_partials_kernel`, is exact verification's first launch). Per trace it prints the median
round, the GPU's idle time inside it, and the kernels per round; then, beside the first trace's
numbers, the idle time each pair of consecutive GPU activities leaves per round (largest
differences first), how many of each kernel start before their predecessor has ended (with
programmatic dependent launch a kernel can; without it none does), and the kernels whose counts
per round differ. The first and last rounds of the window are left out (the profiler's start and
stop). `--segments` also lists, for one round of each trace, its runs of back-to-back activities
(a CUDA graph's replay, mostly: split where the GPU idles longer than `--split-us` or at a copy)
with their median hand-off, which is how a graph whose every hand-off slowed shows. `--replays`
lists every graph replay's median hand-off, graph by graph, with how far ahead the host launched it
(forty-third pass: a graph's replays flip between +0.1 and +0.42 us).

    python benchmarks/trace_rounds.py now=df8_now_bs8.json.gz base=df8_b44_bs8.json.gz

Written in the forty-first session, when e37c5de's verify graph overlapped every MoE kernel with
its predecessor and the current code's overlapped none (docs/benchmarks.md, forty-first pass).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics
from typing import Optional

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def read_trace(path: str) -> list[dict]:
    """The trace's complete events (host calls and GPU activities)."""
    with gzip.open(path) if path.endswith(".gz") else open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def gpu_events(path: str, events: Optional[list[dict]] = None) -> list[dict]:
    """The trace's GPU activities, by start time (from `events`, `read_trace`'s, when given)."""
    events = read_trace(path) if events is None else events
    return sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])


def rounds(gpu: list[dict], mark: str) -> list[dict]:
    """Per round: its period, the idle time per pair of consecutive activities, the kernel counts
    and how many kernels started before their predecessor ended (us, per name)."""
    starts = [i for i, e in enumerate(gpu) if e["name"] == mark]
    out = []
    for a, b in zip(starts[1:], starts[2:]):
        inside = gpu[a:b]
        gaps, early, end, prev = collections.Counter(), collections.Counter(), None, None
        for e in gpu[a:b + 1]:  # up to the next round's mark: the idle before it is this round's
            if end is not None:
                if e["ts"] > end:
                    gaps[(prev["name"][:40], e["name"][:40])] += e["ts"] - end
                elif e["cat"] == "kernel" and e["ts"] < prev["ts"] + prev["dur"] - 0.05:
                    early[e["name"][:40]] += 1
            if end is None or e["ts"] + e["dur"] > end:
                end, prev = e["ts"] + e["dur"], e
        out.append(dict(period=gpu[b]["ts"] - gpu[a]["ts"], gaps=gaps, early=early,
                        count=collections.Counter(e["name"][:40] for e in inside)))
    return out


def segments(gpu: list[dict], mark: str, split_us: float, min_len: int = 8) -> list[dict]:
    """The runs of at least `min_len` back-to-back activities in the window's middle round (split
    where the GPU idles more than `split_us` or at a copy): first activity, count, span (us),
    median hand-off (start minus the predecessor's end, negative when it started early) and how
    many started early."""
    starts = [i for i, e in enumerate(gpu) if e["name"] == mark]
    assert len(starts) >= 3, f"fewer than three {mark} launches in the window"
    mid = len(starts) // 2
    inside = gpu[starts[mid - 1]:starts[mid]]
    runs, cur = [], [inside[0]]
    for prev, e in zip(inside, inside[1:]):
        gap = e["ts"] - (prev["ts"] + prev["dur"])
        if gap > split_us or e["cat"] != "kernel":
            runs.append(cur)
            cur = [e]
        else:
            cur.append(e)
    runs.append(cur)
    out = []
    for r in runs:
        if len(r) < max(min_len, 2):  # a hand-off needs two activities
            continue
        hand = [e["ts"] - (p["ts"] + p["dur"]) for p, e in zip(r, r[1:])]
        out.append(dict(first=r[0]["name"][:40], n=len(r), span=r[-1]["ts"] + r[-1]["dur"] - r[0]["ts"],
                        handoff=statistics.median(hand), early=sum(h < -0.05 for h in hand)))
    return out


def graph_replays(path: str, min_kernels: int = 10, events: Optional[list[dict]] = None) -> dict[int, list[dict]]:
    """Every CUDA graph replay of at least `min_kernels` activities (those that share a
    `cudaGraphLaunch`'s correlation id), keyed by its activity count (which tells the graphs apart
    in a round), in launch order: its median hand-off, how many started early, and its lead (us
    from the launch call's return to its first activity: how far the host was ahead)."""
    events = read_trace(path) if events is None else events
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("name") == "cudaGraphLaunch" and "correlation" in e.get("args", {})}
    by_launch = collections.defaultdict(list)
    for e in events:
        c = e.get("args", {}).get("correlation")
        if e.get("cat") in GPU_CATS and c in launches:
            by_launch[c].append(e)
    out = collections.defaultdict(list)
    for c, acts in sorted(by_launch.items(), key=lambda kv: min(e["ts"] for e in kv[1])):
        if len(acts) < min_kernels:
            continue
        acts.sort(key=lambda e: e["ts"])
        hand = [e["ts"] - (p["ts"] + p["dur"]) for p, e in zip(acts, acts[1:])]
        call = launches[c]
        out[len(acts)].append(dict(handoff=statistics.median(hand), early=sum(h < -0.05 for h in hand),
                                   lead=acts[0]["ts"] - (call["ts"] + call["dur"])))
    return dict(out)


def per_round(rs: list[dict], key: str) -> collections.Counter:
    total = collections.Counter()
    for r in rs:
        total.update(r[key])
    return collections.Counter({k: v / len(rs) for k, v in total.items()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="name=path of a --trace file; the first is the reference")
    p.add_argument("--mark", default="_partials_kernel", help="A kernel that runs once per round.")
    p.add_argument("--rows", type=int, default=14)
    p.add_argument("--segments", action="store_true", help="List one round's runs of back-to-back activities.")
    p.add_argument("--split-us", type=float, default=1.2, help="--segments: idle that ends a run (us).")
    p.add_argument("--replays", action="store_true",
                   help="List every graph replay's median hand-off (and lead), graph by graph; a trace "
                        "without the mark kernel then prints only these.")
    args = p.parse_args()
    named = [t.split("=", 1) for t in args.traces]
    data = {}
    for name, path in named:
        events = read_trace(path)
        gpu = gpu_events(path, events)
        rs = rounds(gpu, args.mark)
        if args.replays:
            print(f"{name}: graph replays, median hand-off us / lead us, in launch order")
            for n, reps in graph_replays(path, events=events).items():
                print(f"    {n:4d} activities: " + "  ".join(f"{r['handoff']:+.2f}/{r['lead']:.0f}" for r in reps))
            if not rs:
                continue
        assert rs, f"{path}: fewer than three {args.mark} launches in the window"
        data[name] = {k: per_round(rs, k) for k in ("gaps", "early", "count")}
        idle = statistics.median(sum(r["gaps"].values()) for r in rs)
        print(f"{name}: {len(rs)} rounds, median {statistics.median(r['period'] for r in rs):.1f} us, "
              f"GPU idle {idle:.1f} us a round, {statistics.median(sum(r['count'].values()) for r in rs):.0f} "
              "activities a round")
        if args.segments:
            for seg in segments(gpu, args.mark, args.split_us):
                print(f"    {seg['n']:4d} activities over {seg['span']:7.1f} us, median hand-off "
                      f"{seg['handoff']:5.2f} us, {seg['early']:3d} early, from {seg['first']}")
    names = [n for n, _ in named if n in data]
    if not names:
        return
    first = names[0]

    def table(title: str, key: str, fmt: str) -> None:
        keys = set().union(*(data[n][key] for n in names))
        ranked = sorted(keys, key=lambda k: -max(abs(data[n][key][k] - data[first][key][k]) for n in names))
        print(f"\n{title} ({' / '.join(names)}):")
        for k in ranked[:args.rows]:
            if max(abs(data[n][key][k] - data[first][key][k]) for n in names) < 0.05:
                break
            label = f"{k[0]} -> {k[1]}" if isinstance(k, tuple) else k
            print("  " + "  ".join(format(data[n][key][k], fmt) for n in names) + f"  {label}")

    table("idle us a round after -> before", "gaps", "7.1f")
    table("kernels a round that start before their predecessor ends", "early", "6.1f")
    table("activities a round", "count", "6.1f")


if __name__ == "__main__":
    main()
