"""Dummy weights for benchmarks: skip Kiln's CPU-drawn init when real tensors follow, or draw the
same distribution on the GPU (seconds instead of minutes for billions of parameters)."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def no_dummy_init():
    """Skip Kiln's dummy-weight fill while building a core whose weights are loaded right after.

    The fill draws every parameter on the CPU from a per-name generator (single-threaded; about
    2-3 minutes for an 8B model), which is wasted when the transformers twin's weights replace
    it. `load_weights` raises if any parameter is left unloaded, so nothing stays uninitialised.
    """
    import kiln.engine.runner as runner_mod

    original = getattr(runner_mod, "init_dummy_weights", None)
    if original is None:  # the runner changed: fall back to the normal (slower) path
        yield
        return
    runner_mod.init_dummy_weights = lambda model, seed: None
    try:
        yield
    finally:
        runner_mod.init_dummy_weights = original


def _param_seed(seed: int, name: str) -> int:
    import zlib

    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def device_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Kiln's dummy-weight recipe (norm gains and scalars 1, everything else N(0, 0.02), one
    generator per parameter seeded by `seed` and its name) drawn on the parameters' own device:
    seconds instead of minutes for a multi-billion-parameter model on a GPU. Same distribution
    as `kiln.loader.init_dummy_weights`, not the same values (that one draws on the CPU)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 0 or (param.dim() == 1 and "norm" in name.lower() and name.endswith("weight")):
                param.fill_(1.0)
                continue
            gen = torch.Generator(device=param.device)
            gen.manual_seed(_param_seed(seed, name))
            param.normal_(0.0, 0.02, generator=gen)


@contextlib.contextmanager
def dummy_init_on_device():
    import kiln.engine.runner as runner_mod

    original = getattr(runner_mod, "init_dummy_weights", None)
    if original is None:
        yield
        return
    runner_mod.init_dummy_weights = device_dummy_weights
    try:
        yield
    finally:
        runner_mod.init_dummy_weights = original


def resolve_dummy_init(choice: str, device: str) -> str:
    """`--dummy-init auto`: on the device for CUDA, Kiln's own CPU-drawn init elsewhere."""
    if choice == "auto":
        return "device" if str(device).startswith("cuda") else "kiln"
    return choice
