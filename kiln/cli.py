"""The `kiln` command: `serve`, `generate`, `version`."""

from __future__ import annotations

import argparse
import dataclasses
import logging
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

    sub.add_parser("version", help="Print the version.")
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point of the `kiln` console script."""
    args = build_parser().parse_args(argv)
    if args.command == "version":
        from kiln import __version__

        print(__version__)
    elif args.command == "serve":
        _serve(args)
    elif args.command == "generate":
        _generate(args)


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
