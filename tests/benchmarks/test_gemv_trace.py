"""The GEMV trace's analysis (`benchmarks/kernel_bench/gemv_trace.py`) on records with known gaps."""

import pytest
import torch

from kiln.kernels.trace import FIELDS, PROLOGUE, REDUCED, SM, START, STORED, WAITED

from benchmarks.kernel_bench import gemv_trace
from tests.kernels.devices import DEVICES


def launch(t0, waits, reduced, stored, sms):
    """One launch's records: program p starts at t0 and waits until waits[p], etc. (ns)."""
    rec = torch.zeros(len(waits), FIELDS, dtype=torch.int64)
    rec[:, START], rec[:, WAITED], rec[:, REDUCED], rec[:, STORED] = t0, torch.tensor(waits), \
        torch.tensor(reduced), torch.tensor(stored)
    rec[:, PROLOGUE] = rec[:, WAITED] + 400
    rec[:, SM] = torch.tensor(sms)
    return rec


def test_analysis_reads_the_gaps_between_launches():
    # Each launch starts 500 ns after the previous one's last wait, is released 300 ns after the
    # previous one's last store, its second program waits 200 ns longer (a later wave on SM 0),
    # reduces 1000 ns after its first wait, and stores 100 ns after its last reduction; each
    # program's prologue takes 400 ns. Every program starts before the previous launch ends.
    recs, end, last_wait = [], 0, 0
    for _ in range(6):
        start = last_wait + 500
        w0 = end + 300
        recs.append(launch(start, [w0, w0 + 200], [w0 + 1000, w0 + 1000], [w0 + 1100, w0 + 1100], [0, 0]))
        end, last_wait = w0 + 1100, w0 + 200
    table = gemv_trace.analyse(recs, ["o"] * 6, {"o": 4_200_000}, 4.2e12)
    o = table["o"]
    assert o["span"] == pytest.approx(1.4) and o["released"] == pytest.approx(0.3)
    assert o["launch"] == pytest.approx(0.5) and o["spread"] == pytest.approx(0.2)
    assert o["stream"] == pytest.approx(1.0) and o["tail"] == pytest.approx(0.1)
    assert o["per_sm"] == 2 and o["programs"] == 2 and o["bytes"] == pytest.approx(1.0)
    # per program: the prologue 0.4 us, the reduction 1.0 and 0.8 us after its own wait
    assert o["prologue"] == pytest.approx(0.4) and o["post"] == pytest.approx(0.9) and o["early"] == 1.0
    assert gemv_trace.timer_step(recs) == 100


@pytest.mark.parametrize("device", DEVICES)
def test_moe_chain_runs_the_engine_kernels(device):
    """The MoE chain's plumbing (router GEMV with the norm prologue, sink gate from its logits, the
    one-token expert GEMVs) at tiny sizes: a finite, repeatable output per layer. Under the
    interpreter a traced run is refused with the trace module's message; on CUDA it gives the
    same output and one record per program of every traced launch."""
    chain = gemv_trace.MoEChain(2, device, hidden=64, experts=8, top_k=2, inter=16, shared=2, dt=torch.float32)
    assert chain.names == ["router", "up", "down"] * 2
    assert chain.bytes == {"router": 10 * 64 * 4, "up": 4 * 32 * 64 * 2, "down": 4 * 64 * 16 * 2}
    a, b = chain.run(traced=False), chain.run(traced=False)
    assert a.shape == (1, 64) and torch.isfinite(a).all() and torch.equal(a, b)
    if device == "cpu":
        with pytest.raises(AssertionError, match="needs a GPU"):
            chain.run(traced=True)
        return
    assert torch.equal(chain.run(traced=True), a)
    assert all(len(r) > 0 for r in chain.records())
