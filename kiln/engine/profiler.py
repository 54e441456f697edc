"""`EngineProfiler`: a torch.profiler trace of a running engine's steps, started and stopped
between two scheduler steps (SGLang's `/start_profile` and `/stop_profile`).

A trace covers whole steps: it starts before the next step and ends after the last one (at
`/stop_profile`, or by itself after `num_steps` steps), then goes to
`output_dir/<prefix>-TP-<rank>.trace.json.gz`, one file per tensor-parallel rank, readable in
Perfetto or chrome://tracing. "GPU" records CUDA kernels (CUPTI) where the engine runs on CUDA;
"MEM" adds allocations. The profiler slows the host several times over (docs/benchmarks.md):
read kernel times from a trace, not step times.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

ACTIVITIES = ("CPU", "GPU", "MEM")


@dataclass
class ProfileOptions:
    """What one trace records and where it goes."""

    output_dir: str
    num_steps: Optional[int] = None  # None: until stop()
    activities: tuple = ("CPU", "GPU")
    with_stack: bool = False
    record_shapes: bool = False
    prefix: str = ""  # default: the start time

    def __post_init__(self) -> None:
        bad = [a for a in self.activities if a not in ACTIVITIES]
        if bad or not self.activities:
            raise ValueError(f"activities must be a non-empty subset of {list(ACTIVITIES)}, got {list(self.activities)}")
        if self.num_steps is not None and self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1 (or null: until /stop_profile), got {self.num_steps}")


class EngineProfiler:
    """One engine rank's profiler: at most one trace at a time."""

    def __init__(self, rank: int, device_type: str):
        self.rank, self.device_type = rank, device_type
        self._prof = None
        self._path = ""
        self._steps_left: Optional[int] = None
        self.last_trace = ""  # the file of the last finished trace

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(self, opts: ProfileOptions) -> str:
        """Start recording; returns the file the trace will be written to."""
        from torch.profiler import ProfilerActivity, profile

        if self.active:
            raise RuntimeError(f"a profile is already running (to {self._path}); POST /stop_profile first")
        try:
            os.makedirs(opts.output_dir, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot write traces to output_dir {opts.output_dir!r}: {e.strerror}") from e
        activities = [ProfilerActivity.CPU] if "CPU" in opts.activities else []
        if "GPU" in opts.activities and self.device_type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        if not activities:  # "GPU" alone on a CPU engine: the ops are all there is
            activities = [ProfilerActivity.CPU]
        prefix = opts.prefix or f"{time.time():.3f}"
        self._path = os.path.join(os.path.abspath(opts.output_dir), f"{prefix}-TP-{self.rank}.trace.json.gz")
        self._prof = profile(activities=activities, record_shapes=opts.record_shapes,
                             profile_memory="MEM" in opts.activities, with_stack=opts.with_stack)
        self._prof.start()
        self._steps_left = opts.num_steps
        return self._path

    def after_step(self) -> None:
        """Count one scheduler step that ran; ends the trace after `num_steps` of them."""
        if self._steps_left is None:
            return
        self._steps_left -= 1
        if self._steps_left <= 0:
            self.stop()

    def stop(self) -> str:
        """End the trace and write it; returns its file."""
        if not self.active:
            raise RuntimeError("no profile is running; POST /start_profile first"
                               + (f" (the last one went to {self.last_trace})" if self.last_trace else ""))
        prof, self._prof, self._steps_left = self._prof, None, None
        prof.stop()
        prof.export_chrome_trace(self._path)
        self.last_trace = self._path
        return self._path
