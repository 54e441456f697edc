"""A reward for timing `kiln rl` on random weights, where a real task's reward is 0 for every
sample and the step would skip its update: a deterministic pseudo-random value in [0, 1) per
completion text, so every group has a spread and the loop trains, syncs and releases as it would.

    kiln rl --model-path DIR --reward benchmarks/timing_reward.py:reward ...
"""

from __future__ import annotations

import zlib


def reward(prompt: str, completion: str, record: dict) -> float:
    """crc32 of the completion, scaled to [0, 1): stable across processes (unlike `hash`)."""
    return zlib.crc32(completion.encode("utf-8", "surrogatepass")) / 2 ** 32
