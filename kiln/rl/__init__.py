"""Kiln RL: GRPO post-training with the Kiln engine doing the rollouts.

    from kiln.rl import run_grpo, RLConfig
    metrics = run_grpo(RLConfig(num_steps=30, lr=1e-5, out_dir="runs/arith"))

Heavy modules (torch, the engine, the trainer) load lazily on first use.
"""

from __future__ import annotations

from typing import Any

from kiln.rl.config import RLConfig

__all__ = ["RLConfig", "run_grpo", "export_hf"]


def __getattr__(name: str) -> Any:
    if name == "run_grpo":
        from kiln.rl.loop import run_grpo

        return run_grpo
    if name == "export_hf":
        from kiln.rl.checkpoint import export_hf

        return export_hf
    raise AttributeError(f"module 'kiln.rl' has no attribute {name!r}")
