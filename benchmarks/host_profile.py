"""Where the scheduler's host time goes per request and step: cProfile of one offline batch on a
model too small for its compute to matter (`benchmarks/configs/tiny-llama`: 2 layers, 64 wide,
dummy weights; `--model-path` for another).

    python benchmarks/host_profile.py [--prompts 1024] [--new-tokens 32] [--max-running-requests 256]
                                      [--device cpu] [--sort tottime] [--rows 25] [--repeats 3]

A small model at a large batch (SmolLM2 at 512 requests in `spec_train_gpu.py`, RL rollouts)
steps the GPU in a few ms, so the host's Python work per running request and step (scheduling,
page growth, sampling parameters, commit, output routing) can bound it. This prints the batch's
wall time, the host time per request-step outside the model's forward, and the profile's top rows.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=os.path.join(common.CONFIGS_DIR, "tiny-llama"),
                    help="A config-only model directory or preset:ARCH/PRESET (dummy weights).")
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sort", default="tottime", help="pstats sort key (tottime, cumulative)")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs; the one with the least host time counts")
    args = ap.parse_args(argv)

    from kiln.engine.request import SamplingParams
    from kiln.offline import Engine

    model = common.resolve_model_path(args.model_path)
    vocab = common.model_config_of(model).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)]
               for _ in range(args.prompts)]
    opts = dict(device=args.device, load_format="dummy", skip_tokenizer_init=True, log_level="warning",
                max_running_requests=args.max_running_requests)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    with Engine(model_path=model, **opts) as llm:
        llm.generate(prompts[:8], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm up
        # Unprofiled first, the model's forward timed around the runner's call (cProfile roughly
        # doubles the cost of Python code, so the profile's shares matter, not its times).
        runner = llm.core.scheduler.runner
        real, spent = runner.forward, [0.0]

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t0

        runner.forward = timed
        runs = []  # (host s, wall s, forward s): the least host time of the runs (this CPU is shared)
        for _ in range(args.repeats):
            spent[0] = 0.0
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t
            runs.append((wall - spent[0], wall, spent[0]))
        runner.forward = real
        _, wall, forward = min(runs)
        prof = cProfile.Profile()
        prof.enable()
        llm.generate(prompts, params, use_tqdm=False)
        prof.disable()
    stats = pstats.Stats(prof)
    request_steps = args.prompts * args.new_tokens
    print(f"{args.prompts} prompts x {args.new_tokens} tokens, at most {args.max_running_requests} running: "
          f"{wall:.2f} s, the model's forward {forward:.2f} s; the rest {(wall - forward) / request_steps * 1e6:.1f} "
          f"us per request and step (unprofiled, least of {args.repeats} runs). The profile of another run:")
    stats.sort_stats(args.sort).print_stats(args.rows)
    return dict(wall_s=wall, forward_s=forward, host_us_per_request_step=(wall - forward) / request_steps * 1e6)


if __name__ == "__main__":
    main()
