"""`PinnedWeights`: the engine's weights parked in pinned host memory while they are released.

`release_memory_occupation(["weights"])` (the colocated RL loop, around every training step) once
moved the model with `model.to("cpu")`: fresh pageable host tensors each time, copied at a few GB/s
(6.9 s out and 4.2 s back for Inkling `bench`'s 11.5 GB on an H200, more than the rest of a GRPO
step). Here every parameter and buffer gets one pinned host tensor, allocated at the first release
and reused, so both copies run at the link's speed; the pinned memory stays allocated for the next
release (as SGLang's memory saver keeps its CPU backup). torch's pinned allocator rounds each
allocation up to a power of two: 11.95 GB pinned for Inkling `bench`'s 11.52 GB of weights, 10.76
for MiniMax-M3 `bench`'s 10.50, 18.26 for Llama-3.1-8B's 16.06 (computed from the shapes).
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

Setter = Callable[[torch.Tensor], None]


def _tensors(modules: list[torch.nn.Module]) -> Iterator[tuple[tuple, torch.Tensor, Setter]]:
    """(stable key, tensor, setter) for each parameter and buffer, each once (a tied parameter is
    one `Parameter` held by two modules). Parameters keep their object and swap `.data`."""
    seen: set = set()
    for root in modules:
        for mod in root.modules():
            for name, p in mod._parameters.items():
                if p is not None and ("p", id(p)) not in seen:
                    seen.add(("p", id(p)))
                    yield ("p", id(p)), p.data, lambda t, p=p: setattr(p, "data", t)
            for name, b in mod._buffers.items():
                if b is not None and ("b", id(mod), name) not in seen:
                    seen.add(("b", id(mod), name))
                    yield ("b", id(mod), name), b, lambda t, mod=mod, name=name: mod._buffers.__setitem__(name, t)


class PinnedWeights:
    """Moves modules' weights to reused pinned host tensors (`offload`) and back (`restore`)."""

    def __init__(self):
        self._host: dict[tuple, torch.Tensor] = {}

    def offload(self, modules: list[torch.nn.Module]) -> int:
        """Copy every weight to its pinned host tensor and point the module there; returns bytes."""
        moved: list[tuple[Setter, torch.Tensor]] = []
        for key, t, set_t in _tensors(modules):
            h = self._host.get(key)
            if h is None or h.shape != t.shape or h.dtype != t.dtype:
                h = self._host[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            moved.append((set_t, h))
        torch.cuda.synchronize()  # every copy landed before the device tensors are let go
        for set_t, h in moved:
            set_t(h)
        return sum(h.numel() * h.element_size() for _, h in moved)

    def restore(self, modules: list[torch.nn.Module], device: torch.device) -> None:
        """Copy every weight back to `device` (new device tensors; the pinned ones are kept)."""
        for _, t, set_t in _tensors(modules):
            set_t(t.to(device, non_blocking=True))
        torch.cuda.synchronize()
