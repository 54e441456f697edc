"""What structured output costs the host (`kiln.engine.grammar`): the tokenizer's table (once per
engine), a schema's compile (once per distinct text) and the per-step mask at several batch sizes,
timed on the `GrammarBackend` of an engine on the given model (default: the embedded SmolLM2).

    python benchmarks/grammar_cost.py [--model-path DIR] [--batch-sizes 1,8,64] [--steps 50] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items":
                                           {"type": "string"}}}, "required": ["name"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None, help="model directory (default: the embedded SmolLM2)")
    ap.add_argument("--batch-sizes", default="1,8,64", help="rows masked per step")
    ap.add_argument("--steps", type=int, default=50, help="timed masks per batch size (median reported)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kiln import Engine
    from kiln.engine.grammar import RequestGrammar

    with Engine(args.model_path, device="cpu", max_total_tokens=1024) as llm:
        g = llm.core.scheduler.grammar
        t0 = time.perf_counter()
        g._get_compiler()
        t1 = time.perf_counter()
        g.matcher(("json_schema", json.dumps(SCHEMA)))
        t2 = time.perf_counter()
        g.matcher(("json_schema", json.dumps(SCHEMA)))
        t3 = time.perf_counter()
        out = {"tokenizer_table_s": t1 - t0, "first_compile_ms": 1e3 * (t2 - t1), "cached_compile_ms": 1e3 * (t3 - t2),
               "mask_ms": {}}
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            logits = torch.randn(bs, g.vocab_size)
            grammars = [RequestGrammar(g.matcher(("regex", "[a-z ]{1,200}"))) for _ in range(bs)]
            times = []
            for _ in range(args.steps):
                t = time.perf_counter()
                g.mask_logits(logits, grammars)
                times.append(1e3 * (time.perf_counter() - t))
            out["mask_ms"][bs] = statistics.median(times)
    print(f"tokenizer table {out['tokenizer_table_s']:.2f} s; schema compile {out['first_compile_ms']:.1f} ms "
          f"(cached {out['cached_compile_ms']:.2f} ms); mask per step (median): "
          + ", ".join(f"{bs} rows {ms:.2f} ms" for bs, ms in out["mask_ms"].items()))
    return out


if __name__ == "__main__":
    main()
