"""`SampledStep`: one scheduler step's sampled tokens, still on the device (overlap scheduling
reads them back one step later), and `HostReadback`, the pinned read-back it and the speculative
drafts in flight share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kiln.engine.request import Req
from kiln.engine.sampler import SampleOutput


class HostReadback:
    """Device tensors to read on the host without waiting for work queued after them.

    On CUDA each tensor is copied to pinned host memory as soon as this is built, with an event
    recorded right behind the copies; `lists` waits for that event only. A plain `.tolist()` would
    wait for everything queued on the stream, e.g. the next step's forward that overlap scheduling
    has already launched, and the GPU would then idle while the host prepares the step after it.
    Elsewhere the tensors are read directly."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.host: Optional[dict[str, torch.Tensor]] = None
        self.ready: Optional[torch.cuda.Event] = None
        self._lists: Optional[dict[str, list]] = None
        if any(t.device.type == "cuda" for t in tensors.values()):
            self.host = {k: t.to("cpu", non_blocking=True) for k, t in tensors.items()}
            self.ready = torch.cuda.Event()
            self.ready.record()

    def lists(self) -> dict[str, list]:
        """Every tensor as a (nested) list; read once, then cached."""
        if self._lists is None:
            if self.ready is not None:
                self.ready.synchronize()
            src = self.host if self.host is not None else self.tensors
            self._lists = {k: t.tolist() for k, t in src.items()}
        return self._lists


SAMPLE_FIELDS = ("token_ids", "logprobs", "top_ids", "top_logprobs")


def sample_readback(out: SampleOutput, **extra: torch.Tensor) -> HostReadback:
    """The read-back of a sampler output's fields that are set (plus `extra` tensors), queued now."""
    fields = {f: getattr(out, f) for f in SAMPLE_FIELDS if getattr(out, f) is not None}
    return HostReadback({**fields, **extra})


@dataclass
class SampledStep:
    """One step's sampling, queued on the device: `out` holds the tokens of `reqs` (row i is
    reqs[i], `rows` maps a request id to its row). `start_copy` queues the read-back right after
    sampling (`HostReadback`); `fetch` reads it."""

    reqs: list[Req]
    out: SampleOutput
    rows: dict[str, int]
    readback: Optional[HostReadback] = None

    def start_copy(self) -> None:
        self.readback = sample_readback(self.out)

    def fetch(self) -> tuple:
        """(tokens, logprobs, top ids, top logprobs) as lists (None where not asked for)."""
        if self.readback is None:
            self.start_copy()
        got = self.readback.lists()
        return tuple(got.get(f) for f in SAMPLE_FIELDS)
