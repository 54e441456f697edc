"""`HostPhases`: where the host's time goes in a scheduler step, without a profiler.

torch.profiler makes every host op several times slower (and a CUDA-graph launch under CUPTI far
slower still), so a profiled timeline shows host gaps that an unprofiled run does not have. This
wraps a fixed list of engine methods with `time.perf_counter` (inclusive times, nothing
synchronised) for a window of steps, so the host phases of a real step can be compared with its
GPU time. Used by `decode_batch.py --host-phases`."""

from __future__ import annotations

import time
from collections import defaultdict

from kiln.engine.sampled_step import HostReadback
from kiln.engine.sampler import Sampler


class HostPhases:
    """Time the phases of `core`'s steps while active (a context manager)."""

    def __init__(self, core):
        sched = core.scheduler
        spec = sched.spec
        runner = core.runner
        # (owner, attribute, label); owners that are classes patch every instance
        self.targets = [
            (core, "step", "core.step (whole step)"),
            (sched, "_schedule", "scheduler._schedule"),
            (sched, "_forward", "scheduler._forward (inputs + forward launch)"),
            (runner, "forward", "runner.forward"),
            (getattr(runner, "graphs", None), "replay", "graphs.replay (input copies + launch)"),
            (sched, "_commit", "scheduler._commit (plain decode)"),
            (spec, "after_forward", "spec.after_forward"),
            (spec, "_device_round", "spec._device_round"),
            (spec, "run_queued", "spec.run_queued (a step on a verify queued ahead, or none)"),
            (getattr(spec, "ahead", None), "queue", "ahead.queue (the next verify: moved inputs + launch)"),
            (spec, "_verify_and_commit", "spec._verify_and_commit"),
            (spec, "_commit", "spec._commit"),
            (getattr(spec, "drafter", None), "run", "drafter.run"),
            (getattr(spec, "drafter", None), "run_after_verify", "drafter.run_after_verify"),
            (Sampler, "__call__", "Sampler.__call__"),
            (HostReadback, "lists", "HostReadback.lists (waits for the device)"),
        ]
        # graph launches: the replay callables stored per captured shape
        drafter = getattr(spec, "drafter", None)
        self.graph_tables = [(getattr(runner, "graphs", None), "forward graph launch (cudaGraphLaunch)"),
                             (getattr(drafter, "graph", None), "MTP chain graph launch (cudaGraphLaunch)"),
                             (getattr(drafter, "paged", None), "block pass graph launch (cudaGraphLaunch)")]
        self.total = defaultdict(float)
        self.calls = defaultdict(int)
        self._saved = []
        self._tables = []

    def _wrap(self, fn, label):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[label] += time.perf_counter() - t
                self.calls[label] += 1
        return timed

    def __enter__(self) -> "HostPhases":
        for owner, name, label in self.targets:
            if owner is None or not hasattr(owner, name):
                continue
            had_own = name in vars(owner)
            self._saved.append((owner, name, vars(owner).get(name), had_own))
            setattr(owner, name, self._wrap(getattr(owner, name), label))
        for holder, label in self.graph_tables:
            if holder is not None and getattr(holder, "graphs", None):
                saved = dict(holder.graphs)
                self._tables.append((holder, saved))
                holder.graphs = {key: (self._wrap(v[0], label), *v[1:]) for key, v in saved.items()}
        return self

    def __exit__(self, *exc) -> None:
        for holder, saved in self._tables:
            holder.graphs = saved
        self._tables = []
        for owner, name, old, had_own in reversed(self._saved):
            if had_own:
                setattr(owner, name, old)
            else:
                delattr(owner, name)
        self._saved = []

    def report(self, steps: int) -> str:
        """One line per phase that ran: ms per step (inclusive) and calls per step."""
        lines = [f"{'phase':48s} {'ms/step':>8s} {'calls/step':>10s}"]
        for label in [t[2] for t in self.targets] + [t[1] for t in self.graph_tables]:
            if self.calls[label]:
                lines.append(f"{label:48s} {self.total[label] / steps * 1e3:8.3f} {self.calls[label] / steps:10.1f}")
        return "\n".join(lines)
