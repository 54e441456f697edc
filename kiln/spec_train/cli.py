"""`kiln train-draft`: flags -> `TrainDraftConfig` -> the trainer of `--method`."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kiln.spec_train.config import TrainDraftConfig

# --method -> (module, function called with the config)
TRAINERS = {"mtp": ("kiln.spec_train.mtp", "train_mtp"), "dflash": ("kiln.spec_train.dflash_run", "train_dflash_run"),
            "dspark": ("kiln.spec_train.dflash_run", "train_dflash_run")}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    TrainDraftConfig.add_cli_args(parser)


def trainer_for(method: str):
    """The training function of `method`; a clear error when its module is not part of Kiln yet."""
    module, fn = TRAINERS[method]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:  # a missing dependency inside the trainer: not ours to hide
            raise
        raise ValueError(f"--method {method} is not available yet ({module} is not in this build of Kiln)") from None
    return getattr(mod, fn)


def train_draft(cfg: TrainDraftConfig) -> dict:
    """Run `kiln train-draft` with `cfg`; returns the trainer's final metrics."""
    return trainer_for(cfg.method)(cfg)


def main(args: argparse.Namespace) -> None:
    """The `kiln train-draft` command: errors in the options exit with status 2 and one line."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kiln.spec_train").setLevel(logging.INFO)
    try:
        cfg = TrainDraftConfig.from_cli_args(args)
        train = trainer_for(cfg.method)
    except ValueError as e:
        print(f"kiln train-draft: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        metrics = train(cfg)
    except (FileNotFoundError, ValueError) as e:
        print(f"kiln train-draft: {e}", file=sys.stderr)
        sys.exit(2)
    shown = " ".join(f"{k}={v}" for k, v in metrics.items())
    print(f"kiln train-draft: wrote {cfg.method} drafter to {cfg.out} ({shown}); curve in {cfg.out}/loss.png")
