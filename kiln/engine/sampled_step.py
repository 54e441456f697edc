"""`SampledStep`: one scheduler step's sampled tokens, still on the device (overlap scheduling
reads them back one step later)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kiln.engine.request import Req
from kiln.engine.sampler import SampleOutput


@dataclass
class SampledStep:
    """One step's sampling, queued on the device: `out` holds the tokens of `reqs` (row i is
    reqs[i], `rows` maps a request id to its row).

    On CUDA the results are copied to pinned host memory right after sampling, with an event
    behind the copy (`start_copy`). Reading them (`fetch`) waits for that event only: a plain
    `.tolist()` would wait for everything queued on the stream, including the *next* step's
    forward that overlap scheduling has already launched, and the GPU would then idle while the
    host prepares the step after it."""

    reqs: list[Req]
    out: SampleOutput
    rows: dict[str, int]
    host: Optional[dict] = None
    ready: Optional[torch.cuda.Event] = None

    FIELDS = ("token_ids", "logprobs", "top_ids", "top_logprobs")

    def start_copy(self) -> None:
        if self.out.token_ids.device.type != "cuda":
            return
        self.host = {f: getattr(self.out, f).to("cpu", non_blocking=True) for f in self.FIELDS
                     if getattr(self.out, f) is not None}
        self.ready = torch.cuda.Event()
        self.ready.record()

    def fetch(self) -> tuple:
        """(tokens, logprobs, top ids, top logprobs) as lists (None where not asked for)."""
        if self.ready is not None:
            self.ready.synchronize()
            src = self.host
        else:
            src = {f: getattr(self.out, f) for f in self.FIELDS if getattr(self.out, f) is not None}
        return tuple(src[f].tolist() if f in src else None for f in self.FIELDS)
