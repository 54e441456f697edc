"""`LayerGate`: lets an eager forward start before HiCache's copies are done, layer by layer.

HiCache copies pages between the device pools and the host pool on a side stream (load-backs
host -> device, backups device -> host). The forward must not touch a pool buffer (one layer's K,
V, index keys or ShortConv inputs) before the copies queued on it have finished. Waiting for the
whole side stream before the forward serialises a long load-back with the forward; instead the
host pool records, per device buffer, an event after the last copy that touches it, and the paged
backend makes the compute stream wait for a buffer's event right before the layer that uses the
buffer. Layer l's attention then overlaps the load-back of layers l+1.. (SGLang's HiCache does
the same with per-layer load events).

CUDA-graph replays and everything that runs after the forward (the drafter, memory release) wait
for all remaining events (`wait_all`): a graph cannot wait mid-replay, and code outside the
backend does not ask for its buffers.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


class LayerGate:
    """Per device buffer (keyed by its data pointer), the side-stream event its copies end with."""

    def __init__(self, wait_event: Callable[[Any], None] | None = None):
        self.events: dict[int, Any] = {}
        # How the compute stream waits for an event; replaced in tests (CPU has no streams).
        self._wait_event = wait_event or (lambda ev: torch.cuda.current_stream().wait_event(ev))

    def record(self, buffer: torch.Tensor, event: Any) -> None:
        """`buffer` may be used once `event` has completed (a later event replaces an earlier one:
        both were recorded on the same side stream)."""
        self.events[buffer.data_ptr()] = event

    def wait(self, *buffers: torch.Tensor) -> None:
        """The compute stream waits for the copies on these buffers (no-op when none is pending)."""
        if not self.events:
            return
        for b in buffers:
            ev = self.events.pop(b.data_ptr(), None)
            if ev is not None:
                self._wait_event(ev)

    def wait_all(self) -> None:
        """The compute stream waits for every pending copy."""
        events, self.events = self.events, {}
        for ev in events.values():
            self._wait_event(ev)

    def __len__(self) -> int:
        return len(self.events)
