"""The sampling noise of a batch of seeded rows: one torch generator per row against the
counter-based streams drawn in one op (`kiln.engine.seeded_noise`).

    python benchmarks/sampling_noise.py [--device cpu|cuda] [--batch-sizes 8,64,256,512] [--vocab 49152]

Every GRPO rollout sample has a seed, so at rollout batch sizes each decode step draws V Exp(1)
values for hundreds of seeded rows. Prints, per batch size, the wall time of one step's noise
(median of `--repeats`, CUDA synchronised) both ways, through `Sampler._exponentials`, the call
the sampler makes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-sizes", default="8,64,256,512")
    ap.add_argument("--vocab", type=int, default=49152, help="V (default: SmolLM2's vocabulary).")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    import torch

    from kiln.engine.sampler import Sampler, make_generator
    from kiln.engine.seeded_noise import SeededStream

    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    sampler = Sampler(seed=0, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def timed(gens) -> float:
        times = []
        for _ in range(args.repeats + 1):  # the first run warms up
            sync()
            t0 = time.perf_counter()
            sampler._exponentials(gens, args.vocab, dev)
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:]) * 1e3

    rows = {}
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        per_row = timed([make_generator(i, dev) for i in range(bs)])
        batched = timed([SeededStream(i) for i in range(bs)])
        rows[bs] = {"generators_ms": per_row, "streams_ms": batched}
        print(f"batch {bs:4d} x V {args.vocab}: a generator per row {per_row:8.2f} ms, "
              f"streams in one op {batched:8.2f} ms ({per_row / batched:.1f}x)")
    return rows


if __name__ == "__main__":
    main()
