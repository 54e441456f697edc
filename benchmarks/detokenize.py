"""The API side's work per generated token: `RequestState.update` (incremental detokenization,
stop strings, token and logprob bookkeeping) for a batch of sequences, one token per step.

    python benchmarks/detokenize.py [--batch 512] [--tokens 100] [--stop] [--no-stream] [--tokenizer-path DIR]
                                    [--profile]

The server's TokenizerManager runs this for every running sequence every step, and the offline
`Engine` runs it on the thread that steps the scheduler, so at batch 512 a few us a token is a
step's worth of host time. The token streams are spans of real text (this repository's docs)
encoded with the tokenizer (default: the embedded SmolLM2's), so characters split across tokens
occur as in generated text; `--stop` adds two stop strings that never match, which turns on the
hold-back of possible stop prefixes. Prints us per token (least of `--repeats` runs) and checks
that each sequence's text equals the tokenizer's decode of its ids.
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402,F401  (puts the repository root on sys.path)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=512, help="Sequences updated per step.")
    ap.add_argument("--tokens", type=int, default=100, help="Tokens per sequence (steps).")
    ap.add_argument("--stop", action="store_true", help="Two stop strings that never match.")
    ap.add_argument("--no-stream", action="store_true",
                    help="Sequences nobody streams (offline generate, non-streamed HTTP): without stop strings "
                         "their text is decoded once, at the end.")
    ap.add_argument("--tokenizer-path", default=None, help="Default: the embedded SmolLM2's tokenizer.")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="Print a cProfile of one more run.")
    args = ap.parse_args(argv)

    from kiln.engine.frontend import RequestState
    from kiln.engine.io import ReqOutput
    from kiln.engine.request import SamplingParams
    from kiln.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(args.tokenizer_path or resolve_model(None).model_dir)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = "".join(open(f, encoding="utf-8").read() for f in sorted(glob.glob(os.path.join(root, "docs", "*.md"))))
    ids = tok.encode(text, add_special_tokens=False)
    rng = random.Random(0)
    starts = [rng.randrange(0, len(ids) - args.tokens) for _ in range(args.batch)]
    streams = [ids[s:s + args.tokens] for s in starts]
    params = SamplingParams(max_tokens=args.tokens, stop=["<never>", "zzzq"] if args.stop else [])

    def run() -> tuple[float, list]:
        states = [RequestState(f"r{b}", None, ids[:20], params, tok, stream=not args.no_stream)
                  for b in range(args.batch)]
        t0 = time.perf_counter()
        for i in range(args.tokens):
            last = i == args.tokens - 1
            for b, st in enumerate(states):
                st.update(0, ReqOutput(f"r{b}-0", [streams[b][i]], finished=last,
                                       finish_reason="length" if last else None))
        return (time.perf_counter() - t0) / (args.batch * args.tokens) * 1e6, states

    us, states = min((run() for _ in range(args.repeats)), key=lambda r: r[0])
    same = all(st.seqs[0].text == tok.decode(s, skip_special_tokens=True) for st, s in zip(states, streams))
    print(f"batch {args.batch} x {args.tokens} tokens, stop strings {args.stop}, streamed {not args.no_stream}: "
          f"{us:.2f} us per token "
          f"(least of {args.repeats}); text equals the decode of the ids: {same}")
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(run)
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    if not same:
        raise SystemExit("a sequence's text differs from the decode of its ids")
    return {"us_per_token": us, "batch": args.batch, "tokens": args.tokens, "stop": args.stop,
            "stream": not args.no_stream}


if __name__ == "__main__":
    main()
