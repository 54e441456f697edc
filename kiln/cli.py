"""The `kiln` command: `serve`, `generate`, `init-model`, `rl`, `train-draft`, `version`."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import subprocess
import sys
from typing import Optional

from kiln.config import EngineConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Kiln: LLM serving engine and RL framework.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="Serve a model over HTTP (OpenAI-compatible and /generate).")
    EngineConfig.add_cli_args(serve)

    # resolve: our sampling --seed replaces the engine's (it seeds unseeded sampling, a fine default).
    gen = sub.add_parser("generate", help="Generate a completion for one prompt and stream it to stdout.",
                         conflict_handler="resolve")
    EngineConfig.add_cli_args(gen)
    gen.add_argument("prompt", help="The prompt text.")
    gen.add_argument("--max-tokens", type=int, default=64, help="Most tokens to generate.")
    gen.add_argument("--temperature", type=float, default=0.7, help="0 for greedy decoding.")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None, help="Seed for reproducible sampling.")
    gen.add_argument("--stop", action="append", default=[], help="A stop string (repeatable).")
    gen.add_argument("--chat", action="store_true", help="Wrap the prompt in the chat template as a user turn.")

    init = sub.add_parser("init-model", help="Write a randomly initialised Inkling or MiniMax-M3 checkpoint "
                          "(config, weights, tokenizer with chat template) of a preset size.")
    init.add_argument("--arch", required=True, choices=["inkling", "minimax_m3"])
    init.add_argument("--preset", required=True, choices=["tiny", "small", "bench"],
                      help="tiny: CPU tests; small: CPU demos; bench: one H200 (see docs/models.md).")
    init.add_argument("--out", required=True, help="Output directory (created; earlier weights replaced).")
    init.add_argument("--seed", type=int, default=0, help="Seed of the random weights.")
    init.add_argument("--tokenizer-path", default=None,
                      help="Directory with SmolLM2's tokenizer files (default: the embedded model's).")
    init.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                      help="Weight dtype (default: float32 for tiny/small, bfloat16 for bench).")
    init.add_argument("--dspark", action="store_true",
                      help="MiniMax-M3: also write the preset's DSpark drafter (dspark_config and its weights), "
                      "served with --speculative-algorithm dspark.")
    weights = init.add_mutually_exclusive_group()
    weights.add_argument("--no-weights", dest="with_weights", action="store_false", default=None,
                         help="Config and tokenizer only; serve with --load-format dummy (bench's default).")
    weights.add_argument("--with-weights", dest="with_weights", action="store_true",
                         help="Also write the random safetensors (default except for bench).")

    rl = sub.add_parser("rl", help="GRPO post-training: rollouts in the engine, training in process "
                        "(options from --config FILE and --key value overrides; see docs/rl.md).")
    from kiln.rl.config import add_cli_args as add_rl_args

    add_rl_args(rl)

    draft = sub.add_parser("train-draft", help="Train a speculative-decoding drafter (MTP layers or DFlash) "
                           "against a frozen target on its own continuations (see docs/speculative.md).")
    from kiln.spec_train.cli import add_cli_args as add_draft_args

    add_draft_args(draft)

    sub.add_parser("version", help="Print the version.")
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point of the `kiln` console script."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "rl":
        _rl(args, extra)
        return
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "version":
        from kiln import __version__

        print(__version__)
    elif args.command == "serve":
        _serve(args)
    elif args.command == "generate":
        _generate(args)
    elif args.command == "init-model":
        _init_model(args)
    elif args.command == "train-draft":
        from kiln.spec_train.cli import main as train_draft_main

        train_draft_main(args)


def _init_model(args: argparse.Namespace) -> None:
    from kiln.models.init_model import describe, init_model
    from kiln.models.presets import DEFAULT_WITH_WEIGHTS

    with_weights = DEFAULT_WITH_WEIGHTS[args.preset] if args.with_weights is None else args.with_weights
    try:
        config = init_model(args.arch, args.preset, args.out, seed=args.seed, dtype=args.dtype,
                            with_weights=with_weights, tokenizer_path=args.tokenizer_path, dspark=args.dspark)
    except ValueError as e:  # a flag that does not fit the architecture (--dspark on Inkling)
        raise SystemExit(f"kiln init-model: {e}") from None
    what = "weights, config and tokenizer" if with_weights else \
        "config and tokenizer, no weights (serve with --load-format dummy)"
    print(f"kiln init-model: wrote {args.arch} {args.preset} ({describe(config)}) to {args.out}: {what}")


def _rl(args: argparse.Namespace, overrides: list[str]) -> None:
    from kiln.rl.config import RLConfig

    try:
        cfg = RLConfig.from_file(args.config, overrides)
    except (FileNotFoundError, ValueError, ImportError) as e:
        print(f"kiln rl: {e}", file=sys.stderr)
        sys.exit(2)
    if cfg.launcher == "ray":
        from kiln.rl.ray_launcher import launch

        try:
            metrics = launch(cfg)
        except ImportError as e:  # Ray is optional: say how to get it
            print(f"kiln rl: {e}", file=sys.stderr)
            sys.exit(2)
        print(f"kiln rl (ray): {len(metrics)} steps done; metrics in {cfg.out_dir}/metrics.jsonl")
        return
    if cfg.num_gpus > 1 and "WORLD_SIZE" not in os.environ:
        # One FSDP2 trainer rank per GPU (kiln.rl.fsdp): run this same command under torchrun.
        argv = ["rl"] + (["--config", args.config] if args.config else []) + list(overrides)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={cfg.num_gpus}", "-m", "kiln"] + argv
        print(f"kiln rl: launching {cfg.num_gpus} trainer ranks: {' '.join(cmd)}", file=sys.stderr)
        sys.exit(subprocess.call(cmd))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from kiln.rl import run_grpo

    metrics = run_grpo(cfg)
    if metrics and int(os.environ.get("RANK", "0")) == 0:
        last = metrics[-1]
        print(f"kiln rl: {len(metrics)} steps done; last step reward_mean={last['reward_mean']:.3f}; "
              f"metrics in {cfg.out_dir}/metrics.jsonl, curves in {cfg.out_dir}/curves.png")


def _serve(args: argparse.Namespace) -> None:
    from kiln.server.launch import ServerStartupError, launch_server

    try:
        launch_server(EngineConfig.from_cli_args(args))
    except (ServerStartupError, FileNotFoundError, ValueError) as e:  # bad flags, paths, busy port
        print(f"kiln serve: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        pass


def _generate(args: argparse.Namespace) -> None:
    from kiln.engine.request import SamplingParams
    from kiln.offline import Engine

    config = EngineConfig.from_cli_args(args)
    config.seed = args.seed if args.seed is not None else 0
    if config.log_level == "info":  # keep stdout/stderr to the completion unless asked
        config.log_level = "warning"
    logging.basicConfig(level=config.log_level.upper())
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop)
    try:
        with Engine(**dataclasses.asdict(config)) as llm:
            prompt = args.prompt
            if args.chat:
                prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
            for delta in llm.generate_stream(prompt, params):
                sys.stdout.write(delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
    except ValueError as e:
        print(f"kiln generate: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.stdout.write("\n")


if __name__ == "__main__":
    main()
