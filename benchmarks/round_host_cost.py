"""The host's cost of steady speculative rounds, on the CPU: no GPU needed.

    python benchmarks/round_host_cost.py [--bs 1] [--steps 300] [--ops] [--cprofile] [--verify-ahead]
                                         [--drafter mtp|dflash] [--host-path] [--temperature T]

Builds the tiny Inkling test preset with K = 3 MTP drafts (tests/engine/test_speculative.py's
`spec_core`, fewer layers), or with `--drafter dflash` the tiny Llama with a 2-layer DFlash
drafter (tests/engine/test_block_drafter.py; its context store inside each forward, device
work, is skipped once timing starts), captures the verify and drafter "graphs" (the MTP
chain, the paged block pass) with a capturer whose
replay runs the forward during a warm-up and then does nothing, and times steady rounds on the
device path (`SpecDecoder._device_round`) with `HostPhases` (the same table as `decode_batch.py
--host-phases` on a GPU). What is left is the host's Python and small torch ops: the work that
sits between reading a verify's samples back and queuing the next verify. On a GPU host each
small CUDA call costs 10-20 us against 2-3 us for a CPU op here, so `--ops` counts the aten ops
per round (views apart) by the Kiln line that issued them: those are what a GPU host pays for.
docs/benchmarks.md, eighteenth pass, has what it found. `--verify-ahead` turns on the next verify
queued before the samples are read back (`kiln/engine/spec/verify_ahead.py`, the default on CUDA):
the host's work per round is then off the GPU's critical path as long as it is shorter than a
round's GPU time. `--host-path` times the host path instead (`_verify_and_commit`, then the
drafter's pass from host lists), what block drafters took before the thirty-first session.
`--temperature T` (> 0) samples every request (seeded) under exact verification (rejection
sampling). On the CPU the sampler and the verification take their PyTorch references, so `--ops`
counts their torch ops where a GPU launches Triton kernels instead."""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
import traceback
from collections import Counter

os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel path's eager parts (prefill) on the CPU
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.host_phases import HostPhases  # noqa: E402
from kiln.engine.io import GenerateReq  # noqa: E402
from kiln.engine.request import SamplingParams  # noqa: E402

VIEWS = ("slice", "view", "select", "alias", "unsqueeze", "expand", ".t.", "detach", "lift_fresh", "reshape",
         "split", "unbind", "resolve_", "flatten", "squeeze", "_unsafe_view", "as_strided", "permute")


def switch_capturer():
    """tests/engine/test_graph_buffers.py's `RecomputeCapturer` (replay = re-run the captured
    forward) whose replays do nothing once `compute` is turned off."""
    from tests.engine.test_graph_buffers import RecomputeCapturer

    class SwitchCapturer(RecomputeCapturer):
        compute = True

        def capture(self, fn):
            replay, out = super().capture(fn)
            return (lambda: replay() if self.compute else None), out

    return SwitchCapturer()


class OpCounter(TorchDispatchMode):
    """Count aten ops by (the innermost kiln/ line that issued them, op)."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        site = next((f"{f.filename.split('/kiln/')[-1]}:{f.lineno} {f.name}"
                     for f in reversed(traceback.extract_stack(limit=12)) if "/kiln/" in f.filename), "?")
        self.counts[(site, str(func))] += 1
        return func(*args, **(kwargs or {}))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bs", type=int, default=1, help="requests decoding together")
    ap.add_argument("--steps", type=int, default=300, help="steady rounds timed")
    ap.add_argument("--ops", action="store_true", help="count aten ops per round by issuing line")
    ap.add_argument("--cprofile", action="store_true", help="print cProfile's top functions")
    ap.add_argument("--verify-ahead", action="store_true", help="queue each next verify before the read-back")
    ap.add_argument("--drafter", choices=("mtp", "dflash"), default="mtp",
                    help="MTP on tiny Inkling, or DFlash on tiny Llama")
    ap.add_argument("--host-path", action="store_true", help="rounds on the host path instead of the device round")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: sampled requests (seeded) under rejection sampling")
    a = ap.parse_args(argv)
    from tests.engine.test_hybrid_engine import prompts

    torch.set_num_threads(1)
    bs = max(4, a.bs)
    sampled = dict(speculative_use_rejection_sampling=True) if a.temperature > 0 else {}
    core = tiny_core(a.drafter, page_size=16, kernel_backend="triton", cuda_graph_max_bs=bs, context_length=8192,
                     max_total_tokens=400000, **sampled)
    core.scheduler.check_after_step = False
    runner, spec = core.runner, core.scheduler.spec
    forward, chain = switch_capturer(), switch_capturer()
    runner.graphs = runner._new_graphs()
    runner.graphs.capture(forward)
    spec.drafter.use_graphs(bs, chain)
    spec.ahead.enabled = spec.ahead.after_device_rounds = a.verify_ahead
    for i, p in enumerate(prompts(a.bs, seed=4, lo=10, hi=30)):
        core.add_request(GenerateReq(rid=f"r{i}", input_ids=p,
                                     params=SamplingParams(max_tokens=6000, temperature=a.temperature, seed=i,
                                                           ignore_eos=True)))
    for _ in range(6):  # prefill and the first rounds, computed
        core.step()
    forward.compute = chain.compute = False
    if a.drafter == "dflash":  # device work like the replays: in an eager forward it would run in the interpreter
        runner.store_draft_context = lambda *x: None
    # the verify-ahead's input moves are one kernel launch (kiln.kernels.verify_moves), device work
    # like the replays: not run here (a real host pays its launch, ~10-20 us, which this omits)
    runner.graphs.move_inputs = lambda *x: None
    rounds = []
    if a.host_path:
        spec._round_on_device = lambda *x: False
    path = "_host_round" if a.host_path else "_device_round"
    timed = getattr(spec, path)
    setattr(spec, path, lambda plan, *x: (rounds.append(1), timed(plan, *x))[1])
    for _ in range(20):
        core.step()
    assert len(rounds) == 20, f"only {len(rounds)} of 20 steps were steady rounds on the {path} path"
    from common import GcTimer  # beside this script, as decode_batch.py imports it
    from kiln.engine.gc_tuning import tune_gc

    tune_gc()  # the startup heap out of the collector's walks, as a serving process has it
    with HostPhases(core) as hp, GcTimer() as gc_runs:
        t = time.perf_counter()
        for _ in range(a.steps):
            core.step()
        dt = time.perf_counter() - t
    ahead = f", {core.stats().spec.verifies_queued_ahead} verifies queued ahead" if a.verify_ahead else ""
    print(f"batch {a.bs}: {a.steps} steady {a.drafter} K = 3 rounds on the {path[1:]} path, "
          f"{dt / a.steps * 1e3:.3f} ms of host per round{ahead}")
    print(hp.report(a.steps))
    print(f"cyclic collections in the timed rounds: {gc_runs.note() or 'none'}")
    if a.ops:
        n = 20
        with OpCounter() as oc:
            for _ in range(n):
                core.step()
        real = {k: v for k, v in oc.counts.items() if not any(x in k[1] for x in VIEWS)}
        print(f"aten ops per round: {sum(oc.counts.values()) / n:.1f}, of which not views: {sum(real.values()) / n:.1f}")
        for (site, op), v in sorted(real.items(), key=lambda kv: -kv[1])[:40]:
            print(f"{v / n:6.1f}  {op:40s} {site}")
    if a.cprofile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.steps):
            core.step()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40)
        print(s.getvalue())


def tiny_core(drafter: str, **kw):
    """A K = 3 engine on the tests' tiny models: MTP on Inkling (fewer layers), or a 2-layer
    DFlash drafter (block size 6) on Llama."""
    from pathlib import Path

    if drafter == "mtp":
        from tests.engine.test_kernel_path import FEWER_LAYERS
        from tests.engine.test_speculative import SPEC_ARCHS, spec_core

        d = tempfile.mkdtemp()
        with open(f"{d}/config.json", "w") as f:
            json.dump({**SPEC_ARCHS["inkling"], **FEWER_LAYERS["inkling"]}, f)
        return spec_core(d, 3, alpha=0.01, **kw)
    from tests.engine.test_block_drafter import make_target, spec_core

    class Dirs:  # what make_target asks of pytest's tmp_path_factory
        mktemp = staticmethod(lambda name: Path(tempfile.mkdtemp(prefix=name)))

    return spec_core(make_target("llama", Dirs), 3, **kw)


if __name__ == "__main__":
    main()
