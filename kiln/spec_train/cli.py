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


def cpu_lacks_bf16_matmul(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this Linux CPU has neither AVX512-BF16 nor AMX-BF16, so that bf16 matmuls run
    emulated: on the 2-core AMD EPYC (AVX2 only) of the fifty-third session a [896 x 576] x
    [576 x 49152] product took 3.77 s in bf16 against 0.57 s in fp32, and `--autocast-bf16` made a
    DFlash training step ~50x slower than the 1.4 s measured on a CPU with bf16 matmuls. False
    where the flags cannot be read (not Linux): no claim either way."""
    try:
        with open(cpuinfo) as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return bool(flags) and not ({"avx512_bf16", "amx_bf16"} & set(flags.split()))


def warn_on_slow_bf16(cfg: TrainDraftConfig, lacks_bf16=cpu_lacks_bf16_matmul) -> bool:
    """Log a warning when `--autocast-bf16` would run on a CPU without bf16 matmuls; returns
    whether it warned."""
    if cfg.autocast_bf16 and cfg.device == "cpu" and lacks_bf16():
        logging.getLogger("kiln.spec_train").warning(
            "--autocast-bf16 on a CPU without AVX512-BF16 or AMX-BF16: bf16 matmuls are emulated here "
            "and several times slower than fp32; drop --autocast-bf16 on this machine")
        return True
    return False


def train_draft(cfg: TrainDraftConfig) -> dict:
    """Run `kiln train-draft` with `cfg`; returns the trainer's final metrics. Warns first when
    `--autocast-bf16` would be slow on this CPU (`warn_on_slow_bf16`)."""
    train = trainer_for(cfg.method)
    warn_on_slow_bf16(cfg)
    return train(cfg)


def main(args: argparse.Namespace) -> None:
    """The `kiln train-draft` command: errors in the options exit with status 2 and one line."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kiln.spec_train").setLevel(logging.INFO)
    try:
        cfg = TrainDraftConfig.from_cli_args(args)
        metrics = train_draft(cfg)
    except (FileNotFoundError, ValueError) as e:
        print(f"kiln train-draft: {e}", file=sys.stderr)
        sys.exit(2)
    shown = " ".join(f"{k}={v}" for k, v in metrics.items())
    print(f"kiln train-draft: wrote {cfg.method} drafter to {cfg.out} ({shown}); curve in {cfg.out}/loss.png")
