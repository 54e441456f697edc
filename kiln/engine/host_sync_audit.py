"""`HostSyncAudit`: where the host waits for the GPU, with the Python line that made it wait.

Overlap scheduling only overlaps if nothing between queuing step N's forward and queuing step
N+1's forward waits for the device. The waits that break it are easy to write and invisible on
the CPU: `tensor.item()`, `.tolist()` of a CUDA tensor, indexing a CUDA tensor with a Python list
(its index is copied from pageable memory, which blocks until the stream drains), `torch.tensor(...,
device="cuda")`, `repeat_interleave` without `output_size`. PyTorch reports each of them under
`torch.cuda.set_sync_debug_mode("warn")`; this context manager collects those reports with the
stack of the call that made them, so a test can assert that a steady decode step makes none and
a benchmark can print where the ones it makes come from.

Intended waits go through `torch.cuda.Event.synchronize` (the scheduler's read-back of sampled
tokens, `SampledStep.fetch`), which PyTorch does not report.

    with HostSyncAudit() as audit:
        for _ in range(8):
            core.step()
    assert not audit.sites, audit.report()
"""

from __future__ import annotations

import traceback
import warnings
from collections import Counter

import torch

# The text of PyTorch's warning under set_sync_debug_mode("warn").
SYNC_WARNING = "synchronizing CUDA operation"


class HostSyncAudit:
    """Collects the host <- device synchronisations made inside the `with` block (CUDA only; on
    other devices it records nothing). `sites` counts each distinct call site: the innermost
    `frames` Python frames of the call that synchronised, outside this module and `warnings`."""

    def __init__(self, frames: int = 4):
        self.frames = frames
        self.sites: Counter[tuple[str, ...]] = Counter()
        self._catch = None
        self._mode = 0

    def __enter__(self) -> "HostSyncAudit":
        if not torch.cuda.is_available():
            return self
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        previous = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING not in str(message):
                return previous(message, category, filename, lineno, file, line)
            self.sites[self._site()] += 1

        warnings.showwarning = show
        self._mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self._catch is None:
            return
        torch.cuda.set_sync_debug_mode(self._mode)
        self._catch.__exit__(*exc)
        self._catch = None

    def _site(self) -> tuple[str, ...]:
        stack = [f for f in traceback.extract_stack()
                 if not f.filename.endswith(("host_sync_audit.py", "warnings.py"))]
        return tuple(f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}: {(f.line or '').strip()}"
                     for f in stack[-self.frames:])

    @property
    def count(self) -> int:
        return sum(self.sites.values())

    def report(self) -> str:
        """The sites, most frequent first, innermost frame last."""
        if not self.sites:
            return "no host synchronisation"
        lines = [f"{self.count} host synchronisation(s) at {len(self.sites)} site(s):"]
        for site, n in self.sites.most_common():
            lines.append(f"  x{n}")
            lines.extend(f"    {frame}" for frame in site)
        return "\n".join(lines)
