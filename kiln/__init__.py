"""Kiln: an LLM serving engine and RL framework sharing one model definition.

    from kiln import Engine, SamplingParams

`Engine` is imported lazily: `import kiln` stays cheap for the CLI and for tools that only need
the config or sampling types.
"""

from __future__ import annotations

from typing import Any

from kiln.config import EngineConfig
from kiln.engine.request import SamplingParams

__version__ = "0.1.0"
__all__ = ["Engine", "EngineConfig", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from kiln.offline import Engine

        return Engine
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
