"""benchmarks/trace_rounds.py on synthetic Chrome traces: rounds split at the mark kernel, the idle
time between activities, and kernels that start before their predecessor ends."""

from __future__ import annotations

import gzip
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import trace_rounds  # noqa: E402


def _trace(path, rounds: int, overlap: bool) -> str:
    """`rounds` + 2 rounds of mark (2 us), a (5 us) and b (5 us): b starts 0.5 us before a ends
    with `overlap`, else 1 us after it; 3 us idle before the next mark."""
    events, t = [], 0.0
    for _ in range(rounds + 2):
        for name, dur, gap in (("_partials_kernel", 2.0, 0.0), ("a", 5.0, 0.0), ("b", 5.0, -0.5 if overlap else 1.0)):
            t += gap
            events.append({"ph": "X", "cat": "kernel", "name": name, "ts": t, "dur": dur})
            t += dur
        t += 3.0
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0.0, "dur": 1.0})  # not a GPU activity
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(path)


def test_rounds_count_idle_and_early_starts(tmp_path):
    rs = trace_rounds.rounds(trace_rounds.gpu_events(_trace(tmp_path / "x.json.gz", 4, overlap=False)),
                             "_partials_kernel")
    assert len(rs) == 4  # the first and last marks' rounds are left out
    for r in rs:
        assert abs(r["period"] - 16.0) < 1e-9
        assert dict(r["gaps"]) == {("a", "b"): 1.0, ("b", "_partials_kernel"): 3.0}
        assert not r["early"] and r["count"] == {"_partials_kernel": 1, "a": 1, "b": 1}
    over = trace_rounds.rounds(trace_rounds.gpu_events(_trace(tmp_path / "y.json.gz", 4, overlap=True)),
                               "_partials_kernel")
    assert all(r["early"] == {"b": 1} and ("a", "b") not in r["gaps"] for r in over)


def test_main_prints_both_traces(tmp_path, capsys, monkeypatch):
    a, b = _trace(tmp_path / "a.json.gz", 3, False), _trace(tmp_path / "b.json.gz", 3, True)
    monkeypatch.setattr(sys, "argv", ["trace_rounds.py", f"now={a}", f"base={b}"])
    trace_rounds.main()
    out = capsys.readouterr().out
    assert "now: 3 rounds, median 16.0 us, GPU idle 4.0 us a round" in out
    assert "base: 3 rounds, median 14.5 us, GPU idle 3.0 us a round" in out
    assert "1.0      0.0  a -> b" in out and "0.0     1.0  b" in out


def test_segments_split_at_idle_and_report_hand_offs(tmp_path):
    # a round: mark, a, b back to back (b 0.5 us early or 1 us late), 3 us idle before the next mark
    early = trace_rounds.segments(trace_rounds.gpu_events(_trace(tmp_path / "e.json.gz", 3, overlap=True)),
                                  "_partials_kernel", split_us=2.0, min_len=1)
    assert early == [dict(first="_partials_kernel", n=3, span=11.5, handoff=-0.25, early=1)]
    late = trace_rounds.segments(trace_rounds.gpu_events(_trace(tmp_path / "l.json.gz", 3, overlap=False)),
                                 "_partials_kernel", split_us=0.5, min_len=1)
    assert [(s["first"], s["n"]) for s in late] == [("_partials_kernel", 2)]  # b alone has no hand-off
    assert late[0]["handoff"] == 0.0 and late[0]["early"] == 0
    assert trace_rounds.segments(trace_rounds.gpu_events(_trace(tmp_path / "m.json.gz", 3, overlap=False)),
                                 "_partials_kernel", split_us=0.5) == []  # runs shorter than min_len=8


def _graph_trace(path) -> str:
    """Two replays of a 12-kernel graph (hand-offs 0.1 us, then 0.4 us), one 3-kernel graph and an
    eager kernel; each replay's kernels carry its cudaGraphLaunch's correlation id."""
    events, t = [], 100.0
    for corr, n, gap, call_ts in ((1, 12, 0.1, 50.0), (2, 3, 0.1, 60.0), (3, 12, 0.4, 70.0)):
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": call_ts, "dur": 5.0,
                       "args": {"correlation": corr}})
        for _ in range(n):
            events.append({"ph": "X", "cat": "kernel", "name": f"k{corr}", "ts": t, "dur": 2.0,
                           "args": {"correlation": corr}})
            t += 2.0 + gap
    events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 80.0, "dur": 3.0,
                   "args": {"correlation": 4}})
    events.append({"ph": "X", "cat": "kernel", "name": "eager", "ts": t, "dur": 1.0, "args": {"correlation": 4}})
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(path)


def test_graph_replays_report_each_replay_of_each_graph(tmp_path):
    reps = trace_rounds.graph_replays(_graph_trace(tmp_path / "g.json.gz"), min_kernels=10)
    assert list(reps) == [12]  # the 3-kernel graph and the eager kernel are left out
    (fast, slow) = reps[12]
    assert abs(fast["handoff"] - 0.1) < 1e-9 and abs(slow["handoff"] - 0.4) < 1e-9
    assert fast["early"] == slow["early"] == 0
    assert fast["lead"] == 100.0 - 55.0  # first kernel at 100, the launch call returned at 55
    assert reps == trace_rounds.graph_replays(str(tmp_path / "g.json.gz"))


def test_main_lists_replays_of_a_trace_without_the_mark(tmp_path, capsys, monkeypatch):
    g = _graph_trace(tmp_path / "g.json.gz")
    monkeypatch.setattr(sys, "argv", ["trace_rounds.py", f"g={g}", "--replays"])
    trace_rounds.main()
    out = capsys.readouterr().out
    assert "g: graph replays" in out and "12 activities: +0.10/45  +0.40/" in out
