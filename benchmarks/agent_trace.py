"""Agent-trace benchmark: a seeded synthetic coding-agent trace replayed against `kiln serve`.

Trace (`make_trace`, seeded). Every session starts with a system prompt shared by all sessions
(tool definitions, `--system-len` tokens) and a task with repository context of its own (lognormal,
mean `--context-len`). It then runs `--turns MIN,MAX` turns (uniform). In each turn the model
answers (`--output-len MIN,MAX` tokens, uniform), the tool runs for a think time (exponential,
mean `--think-s`) and its output (lognormal, mean `--tool-len`) is appended; the next turn resends
the whole context: every earlier prompt, answer and tool output. Token ids are random (dummy
weights); answers are the ids the server returned, so each turn's prompt extends the previous
prompt + answer exactly, as in an agent loop, and the prefix cache sees the true reuse.

Replay (`replay`). For each concurrency level c, c workers play sessions (the first
c x `--sessions-per-user` of the trace, so the working set grows with c) turn by turn over HTTP:
`POST /generate` with `input_ids`, streaming, greedy, `ignore_eos`. The server's cache is flushed
before each level. Per level: throughput = (prompt + output tokens, cached ones included) / wall
time / GPUs; per-user speed = 1 / P90 inter-token latency; TTFT percentiles; the share of prompt
tokens served by each cache tier (device, host, disk; from `meta_info.cached_tokens_details`).

Servers: `--url` drives a running server; otherwise each `--variant NAME=FLAGS` starts
`kiln serve --serve-args FLAGS` (one after the other), e.g. device-only caching against HiCache
with 2x and 4x host pools:

    python benchmarks/agent_trace.py --serve-args "--model-path preset:inkling/bench --load-format dummy
        --skip-tokenizer-init --max-total-tokens 200000" --variant device= \\
        --variant hicache-2x="--enable-hierarchical-cache --hicache-ratio 2" \\
        --variant hicache-4x="--enable-hierarchical-cache --hicache-ratio 4" \\
        --concurrency 1,4,16,32 --out agent.json --plot agent.png

Output: a table on stdout, the rows as JSON (`--out`), throughput and per-user speed against
concurrency as a PNG (`--plot`, needs matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import httpx

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

from common import log, print_table, resolve_model_path, save_json  # noqa: E402


# ---- the trace -------------------------------------------------------------------------------

@dataclass
class Turn:
    new_tokens: list[int]  # user message or tool output appended before this turn's request
    output_len: int
    think_s: float  # tool runtime after the answer, before the next turn


@dataclass
class Session:
    sid: int
    turns: list[Turn]


@dataclass
class TraceSpec:
    sessions: int = 8
    system_len: int = 2000
    context_len: int = 4000  # lognormal mean of each session's task + repository context
    tool_len: int = 800  # lognormal mean of a tool output
    turns: tuple[int, int] = (4, 12)
    output_len: tuple[int, int] = (50, 300)
    think_s: float = 2.0
    sigma: float = 0.6  # lognormal shape of context and tool sizes
    vocab: tuple[int, int] = (100, 32000)  # token ids drawn uniformly from [lo, hi)
    seed: int = 0


def _lognormal(rng: random.Random, mean: float, sigma: float) -> int:
    """A lognormal draw with the given mean (not median)."""
    return max(1, int(rng.lognormvariate(math.log(max(mean, 1)) - sigma ** 2 / 2, sigma)))


def make_trace(spec: TraceSpec) -> list[Session]:
    rng = random.Random(spec.seed)
    ids = lambda n: [rng.randrange(*spec.vocab) for _ in range(n)]  # noqa: E731
    system = ids(spec.system_len)
    sessions = []
    for sid in range(spec.sessions):
        turns = []
        for k in range(rng.randint(*spec.turns)):
            new = system + ids(_lognormal(rng, spec.context_len, spec.sigma)) if k == 0 else \
                ids(_lognormal(rng, spec.tool_len, spec.sigma))
            turns.append(Turn(new, rng.randint(*spec.output_len), rng.expovariate(1 / spec.think_s) if spec.think_s > 0 else 0.0))
        sessions.append(Session(sid, turns))
    return sessions


# ---- replay ----------------------------------------------------------------------------------

@dataclass
class RequestRecord:
    sid: int
    turn: int
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = float("nan")
    itls: list[float] = field(default_factory=list)
    cached: int = 0
    tiers: dict = field(default_factory=dict)
    error: Optional[str] = None


async def _generate(client: httpx.AsyncClient, url: str, ids: list[int], max_tokens: int,
                    rec: RequestRecord) -> list[int]:
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}
    start = last = time.perf_counter()
    out: list[int] = []
    async with client.stream("POST", url + "/generate", json=body) as resp:
        if resp.status_code != 200:
            rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            return out
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            item = json.loads(line[5:])
            if "error" in item:
                rec.error = str(item["error"])
                return out
            ids_now = item.get("output_ids", [])
            now = time.perf_counter()
            new = len(ids_now) - len(out)
            if new > 0:
                if not out:
                    rec.ttft = now - start
                else:  # a chunk of several tokens: its gap shared evenly
                    rec.itls.extend([(now - last) / new] * new)
                last = now
                out = list(ids_now)
            meta = item.get("meta_info") or {}
            rec.cached = meta.get("cached_tokens", rec.cached)
            rec.tiers = meta.get("cached_tokens_details") or rec.tiers
    rec.output_tokens = len(out)
    return out


async def _play(client, url: str, session: Session, records: list, time_scale: float, deadline: float) -> None:
    ctx: list[int] = []
    for k, turn in enumerate(session.turns):
        if time.perf_counter() > deadline:
            return
        ctx = ctx + turn.new_tokens
        rec = RequestRecord(session.sid, k, len(ctx))
        out = await _generate(client, url, ctx, turn.output_len, rec)
        records.append(rec)
        if rec.error:
            return
        ctx = ctx + out
        if turn.think_s * time_scale > 0:
            await asyncio.sleep(turn.think_s * time_scale)


async def replay(url: str, sessions: list[Session], concurrency: int, time_scale: float = 1.0,
                 time_limit: Optional[float] = None) -> tuple[list[RequestRecord], float]:
    """Play `sessions` with `concurrency` workers; returns the records and the wall time. With a
    time limit, no new turn starts after it (turns in flight finish)."""
    queue = list(sessions)
    records: list[RequestRecord] = []
    start = time.perf_counter()
    deadline = start + (time_limit if time_limit else float("inf"))
    limits = httpx.Limits(max_connections=concurrency + 4)

    async def worker(client):
        while queue and time.perf_counter() < deadline:
            await _play(client, url, queue.pop(0), records, time_scale, deadline)

    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return records, time.perf_counter() - start


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if not math.isnan(x))
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(records: list[RequestRecord], wall: float, concurrency: int, gpus: int) -> dict:
    ok = [r for r in records if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    itls = [x for r in ok for x in r.itls]
    p90_itl = percentile(itls, 90)
    tier = lambda t: sum(r.tiers.get(t, 0) for r in ok) / max(prompt, 1)  # noqa: E731
    return {
        "concurrency": concurrency, "requests": len(ok), "errors": len(records) - len(ok),
        "prompt_tokens": prompt, "output_tokens": output, "wall_s": wall,
        "throughput_tok_s_gpu": (prompt + output) / wall / gpus if wall > 0 else float("nan"),
        "per_user_tok_s": 1.0 / p90_itl if p90_itl > 0 else float("nan"),
        "ttft_p50_s": percentile([r.ttft for r in ok], 50), "ttft_p90_s": percentile([r.ttft for r in ok], 90),
        "ttft_p99_s": percentile([r.ttft for r in ok], 99),
        "hit_rate": sum(r.cached for r in ok) / max(prompt, 1),
        "hit_device": tier("device"), "hit_host": tier("host"), "hit_disk": tier("disk"),
    }


# ---- servers ---------------------------------------------------------------------------------

def start_server(args: list[str], log_path: str, timeout: float) -> tuple[str, subprocess.Popen]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "kiln", "serve", *args, "--port", str(port)], cwd=REPO_ROOT,
                            stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kiln serve exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"kiln serve did not become healthy in {timeout:.0f} s; see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_args(base: str, extra: str) -> list[str]:
    """Split the flags; a `preset:ARCH/PRESET` model path becomes a config dir (dummy weights)."""
    args = shlex.split(base) + shlex.split(extra)
    for i, a in enumerate(args[:-1]):
        if a == "--model-path" and args[i + 1].startswith("preset:"):
            args[i + 1] = resolve_model_path(args[i + 1])
    return args


def run_variant(name: str, url: str, trace: list[Session], levels: list[int], opts) -> list[dict]:
    rows = []
    if opts.warmup_s > 0:  # compile the kernels' prefill shapes before measuring (not reported)
        asyncio.run(replay(url, trace[-2:], 2, 0.0, opts.warmup_s))
    for c in levels:
        httpx.post(url + "/flush_cache", timeout=60)
        sessions = trace[:c * opts.sessions_per_user]
        records, wall = asyncio.run(replay(url, sessions, c, opts.time_scale, opts.level_time_limit))
        row = {"variant": name, **summarize(records, wall, c, opts.num_gpus)}
        rows.append(row)
        log(f"{name} c={c}: {row['throughput_tok_s_gpu']:.1f} tok/s/GPU, hit {row['hit_rate']:.2f}")
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        xs = [r["concurrency"] for r in mine]
        axes[0].plot(xs, [r["throughput_tok_s_gpu"] for r in mine], marker="o", label=name)
        axes[1].plot(xs, [r["per_user_tok_s"] for r in mine], marker="o", label=name)
    axes[0].set(xlabel="concurrent sessions", ylabel="tokens / s / GPU (input + output)", title="Throughput")
    axes[1].set(xlabel="concurrent sessions", ylabel="1 / P90 inter-token latency (tok/s)", title="Per-user speed")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    pair = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    p.add_argument("--url", help="A running server (otherwise --serve-args / --variant start them).")
    p.add_argument("--serve-args", default="--load-format dummy --skip-tokenizer-init",
                   help="Flags of every started `kiln serve`.")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=FLAGS added to --serve-args for one server (repeatable; default: one server).")
    p.add_argument("--concurrency", default="1,2,4,8", help="Comma-separated concurrency levels.")
    p.add_argument("--sessions-per-user", type=int, default=2, help="Sessions per worker at each level.")
    p.add_argument("--system-len", type=int, default=TraceSpec.system_len)
    p.add_argument("--context-len", type=int, default=TraceSpec.context_len)
    p.add_argument("--tool-len", type=int, default=TraceSpec.tool_len)
    p.add_argument("--turns", type=pair, default=TraceSpec.turns, help="MIN,MAX turns per session.")
    p.add_argument("--output-len", type=pair, default=TraceSpec.output_len, help="MIN,MAX answer tokens.")
    p.add_argument("--sigma", type=float, default=TraceSpec.sigma, help="Lognormal shape of context and tool sizes.")
    p.add_argument("--think-s", type=float, default=TraceSpec.think_s, help="Mean tool time between turns.")
    p.add_argument("--time-scale", type=float, default=1.0, help="Multiply every think time (0: none).")
    p.add_argument("--vocab", type=pair, default=TraceSpec.vocab, help="LO,HI range of random token ids.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-gpus", type=int, default=1, help="Divide throughput by this.")
    p.add_argument("--level-time-limit", type=float, default=None, help="Seconds per level before no new turn starts.")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--warmup-s", type=float, default=0.0,
                   help="Seconds of unreported turns (two sessions from the end of the trace) per server first.")
    p.add_argument("--log-dir", default=None, help="Server logs (default: next to --out, else /tmp).")
    p.add_argument("--out", default=None, help="JSON rows + metadata.")
    p.add_argument("--plot", default=None, help="PNG of throughput and per-user speed against concurrency.")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> list[dict]:
    opts = parse_args(argv)
    levels = [int(x) for x in opts.concurrency.split(",")]
    spec = TraceSpec(sessions=max(levels) * opts.sessions_per_user, system_len=opts.system_len,
                     context_len=opts.context_len, tool_len=opts.tool_len, turns=opts.turns,
                     output_len=opts.output_len, think_s=opts.think_s, sigma=opts.sigma, vocab=opts.vocab,
                     seed=opts.seed)
    trace = make_trace(spec)
    log(f"trace: {len(trace)} sessions, {sum(len(s.turns) for s in trace)} turns")
    rows: list[dict] = []
    meta = {"trace": asdict(spec), "argv": sys.argv if argv is None else argv, "variants": opts.variant,
            "serve_args": opts.serve_args}
    if opts.url:
        rows += run_variant("server", opts.url, trace, levels, opts)
    else:
        log_dir = opts.log_dir or (os.path.dirname(os.path.abspath(opts.out)) if opts.out else "/tmp")
        for v in opts.variant or ["default="]:
            name, _, extra = v.partition("=")
            url, proc = start_server(serve_args(opts.serve_args, extra), os.path.join(log_dir, f"agent_trace_{name}.log"),
                                     opts.startup_timeout)
            try:
                rows += run_variant(name, url, trace, levels, opts)
            finally:
                stop_server(proc)
            save_json(opts.out, rows, meta)  # after every server: a time limit keeps what was measured
    cols = ["variant", "concurrency", "requests", "throughput_tok_s_gpu", "per_user_tok_s", "ttft_p50_s",
            "ttft_p90_s", "ttft_p99_s", "hit_rate", "hit_device", "hit_host", "hit_disk", "errors"]
    print_table(rows, cols, title="agent trace")
    save_json(opts.out, rows, meta)
    if opts.plot:
        plot(rows, opts.plot)
    return rows


if __name__ == "__main__":
    main()
