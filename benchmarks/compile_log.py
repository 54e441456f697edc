"""Which Triton kernels compile (or load from Triton's disk cache) while a benchmark runs, and from where.

    python benchmarks/compile_log.py -- <decode_batch.py arguments>

A kernel variant met for the first time while serving stalls that step for a compile (~0.3 s) or a
cache load (~10 ms): the forty-first and forty-fourth passes saw one round of sampled MTP at batch
8 take 263-346 ms. This runs `decode_batch.py` in this process with Triton's compile hook wrapped:
each compile prints the time since start, the kernel, what it took, and the kiln frames that
launched it, so that a late one names the code path to warm up at startup.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kiln_frames(limit: int = 4) -> str:
    """The innermost kiln frames of the current stack, as file:function:line."""
    out = []
    for f in inspect.stack()[2:]:
        if f"{os.sep}kiln{os.sep}" in f.filename and f"{os.sep}kernels{os.sep}" not in f.filename:
            out.append(f"{os.path.basename(f.filename)}:{f.function}:{f.lineno}")
            if len(out) == limit:
                break
    return " < ".join(out) or "?"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    # no options of its own: this gives --help and refuses anything before `--`
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv[:split])
    import triton.runtime.jit as jit

    import decode_batch

    start = time.perf_counter()
    original = jit.JITFunction._do_compile

    def logged(fn, *a, **kw):
        t0 = time.perf_counter()
        out = original(fn, *a, **kw)
        name = getattr(fn, "__name__", None) or fn.fn.__name__
        took = 1e3 * (time.perf_counter() - t0)
        print(f"[compile {time.strftime('%H:%M:%S')} +{t0 - start:7.2f}s] {name} {took:.1f} ms  {kiln_frames()}",
              file=sys.stderr, flush=True)
        return out

    jit.JITFunction._do_compile = logged
    try:
        decode_batch.main(argv[split + 1:])
    finally:
        jit.JITFunction._do_compile = original


if __name__ == "__main__":
    main()
