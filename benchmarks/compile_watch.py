"""Which Triton kernels compile while the engine serves, and what each first use costs.

Runs `decode_batch.py` with its arguments and records every in-process first use of a Triton
kernel variant (`JITFunction._do_compile`: a compile, or a load from Triton's disk cache) with the
phase it fell in: the engine's build (graph capture included), each batch size's warm-up, each
batch size's measured run. A variant first used in a measured run is a stall inside serving: its
step pays the compile (~0.1-1 s on a cold cache), and `--speculative-adaptive` times it as a step.
Every variant is printed with what sets it apart from the kernel's earlier variants (the
constexprs, and Triton's specialisation of int arguments equal to 1 or divisible by 16, and of
pointers to 16-byte alignment): a variant that differs only there costs a compile for nothing.

    python benchmarks/compile_watch.py --dummy-init auto --model-path preset:inkling/bench \\
        --input-len 1024 --output-len 256 --batch-sizes 1,8 --warmup on \\
        --speculative-algorithm mtp --speculative-num-steps 3 --speculative-adaptive

Set TRITON_CACHE_DIR to an empty folder to time cold compiles.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import decode_batch  # noqa: E402


class CompileWatch:
    """Wraps Triton's per-variant compile entry; `phase` names where the next ones land."""

    def __init__(self):
        import triton.runtime.jit as jit

        self.phase = "start"
        self.events: list[tuple[str, str, float, tuple]] = []  # (phase, kernel, seconds, key)
        original = jit.JITFunction._do_compile
        watch = self

        def recorded(fn, key, signature, device, constexprs, options, attrs, warmup):
            t = time.perf_counter()
            out = original(fn, key, signature, device, constexprs, options, attrs, warmup)
            name = getattr(fn, "__name__", None) or fn.fn.__name__
            args = list(signature)  # argument names, in order
            spec = tuple(sorted((args[i[0]] if i and i[0] < len(args) else str(i), str(v))
                                for i, v in dict(attrs).items()))
            consts = tuple(sorted((args[i[0]] if i and i[0] < len(args) else str(i), repr(v))
                                  for i, v in dict(constexprs).items()))
            watch.events.append((watch.phase, name, time.perf_counter() - t, (consts, spec)))
            return out

        jit.JITFunction._do_compile = recorded

    def report(self) -> str:
        lines, seen = [], collections.defaultdict(list)
        phases = list(dict.fromkeys(p for p, *_ in self.events))
        for phase in phases:
            ev = [e for e in self.events if e[0] == phase]
            lines.append(f"== {phase}: {len(ev)} first uses, {sum(e[2] for e in ev):.2f} s")
            counts = collections.Counter(e[1] for e in ev)
            lines.append("  " + ", ".join(f"{n} x{c}" for n, c in counts.most_common()))
            for _, name, dt, key in ev:
                lines.append(f"    {name} {dt:.3f} s: {_difference(seen[name], key)}")
                seen[name].append(key)
        return "\n".join(lines)


def _difference(earlier: list[tuple], key: tuple) -> str:
    """What sets `key` apart from the nearest earlier variant of the same kernel."""
    if not earlier:
        return "the kernel's first variant"

    def diff(a, b):
        da, db = dict(a[0] + a[1]), dict(b[0] + b[1])
        return {k: (da.get(k), db.get(k)) for k in set(da) | set(db) if da.get(k) != db.get(k)}
    best = min((diff(e, key) for e in earlier), key=len)
    return ", ".join(f"{k}: {old} -> {new}" for k, (old, new) in sorted(best.items())) or "same key (another device?)"


def main(argv: Optional[list[str]] = None) -> None:
    watch = CompileWatch()
    build, guarded = common.build_core, common.run_guarded

    def build_core(*a, **kw):
        watch.phase = "build"
        core = build(*a, **kw)
        watch.phase = "after build"
        return core

    def run_guarded(label, fn):  # decode_batch labels each run: "batch 8 warm-up", "batch 8"
        watch.phase = label
        return guarded(label, fn)

    common.build_core, common.run_guarded = build_core, run_guarded
    decode_batch.main(argv)
    print(watch.report())


if __name__ == "__main__":
    main()
