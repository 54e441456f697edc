"""DSpark: MiniMax-M3's block drafter (MODELS.md 3.3), the DFlash design of MODELS.md 4.

It is `kiln.models.block_drafter.BlockDrafter` read from the target's checkpoint: weights under
`dspark.` (`dspark.fc.weight`, `dspark.layers.{i}.self_attn.q_proj.weight`, ...), shape from the
config's `dspark_config`. Served with `--speculative-algorithm dspark` by the same engine drafter
as DFlash (`kiln.engine.spec.block_drafter`).
"""

from __future__ import annotations

from kiln.models.block_drafter import BlockDrafter


class DSpark(BlockDrafter):
    """The block drafter inside a MiniMax-M3 checkpoint (no weights or math of its own)."""
