"""Reading checkpoint tensors, and deterministic dummy weights for benchmarks and tests."""

from __future__ import annotations

import zlib
from typing import Iterator

import torch

from kiln.loader.source import ModelSource


def iter_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint, one at a time, on CPU.

    Tensors are read lazily so peak host memory stays near one tensor, not the whole model.
    A dummy source yields nothing.
    """
    from safetensors import safe_open

    for path in source.weight_files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def copy_into_param(p: torch.nn.Parameter, tensor: torch.Tensor, shard=None) -> None:
    """Copy one checkpoint tensor into parameter `p` in its dtype: through the parameter's
    `weight_loader` when it has one (tensor-parallel slicing, `shard` of a stacked parameter such
    as gate_up), else whole."""
    loader = getattr(p, "weight_loader", None)
    if loader is None:
        p.data.copy_(tensor.to(p.dtype))
    elif shard is None:
        loader(p, tensor.to(p.dtype))
    else:
        loader(p, tensor.to(p.dtype), shard)


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give every parameter `dtype`, except those marked `keep_fp32` (MoE router weights: routing
    is computed in fp32, so a bf16 router would be upcast, one copy kernel per MoE layer, in every
    forward). Buffers (RoPE tables, router biases) keep their dtype."""
    for p in model.parameters():
        p.data = p.data.to(torch.float32 if getattr(p, "keep_fp32", False) else dtype)


def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter of `model` deterministically; buffers are left alone.

    Norm gains (1-D parameters with "norm" in the name) and scalar parameters (gains such as a
    router's global scale) get ones; everything else N(0, 0.02). Values are drawn on the CPU from
    a generator seeded by `seed` and the parameter's name, then copied, so they are identical on
    every device, independent of parameter order, and unchanged when other parameters are added.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if _is_gain(name, param):
                param.fill_(1.0)
                continue
            gen = torch.Generator(device="cpu")
            gen.manual_seed(_param_seed(seed, name))
            values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen)
            param.copy_(values)


def _is_gain(name: str, param: torch.Tensor) -> bool:
    if param.dim() == 0:
        return True
    return param.dim() == 1 and "norm" in name.lower() and name.endswith("weight")


def _param_seed(seed: int, name: str) -> int:
    # crc32 is stable across processes (unlike hash()), so every rank and run agrees.
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63)
