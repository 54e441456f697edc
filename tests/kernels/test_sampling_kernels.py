"""Triton sampling kernels vs the torch reference `kiln.engine.sampler.filtered_probs` and the
sampler's exponential race, and the CUDA path of `Sampler`.

"cpu" cases run the kernels under Triton's interpreter (a handful of rows, V not a power of two);
"cuda" cases use real vocabularies, capture the kernels in a CUDA graph and run the `Sampler`
under `torch.cuda.set_sync_debug_mode("error")` (any device -> host sync raises).

The kept set must be the reference's exactly, ties by token id included. On the CPU the inputs
keep every top-p boundary away from float rounding (e.g. top_p * V is never an integer for a
uniform row). At real vocabulary sizes a random row can put a token's mass-before within rounding
of the top-p threshold, where the reference's float32 cumsum and the kernel's float32 sums may
disagree: there the GPU tests accept a difference only for tokens within 1e-5 of the threshold.
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")

from kiln.engine import sampler as sampler_mod  # noqa: E402
from kiln.engine.sampler import Sampler, SamplingBatch, make_generator  # noqa: E402
from kiln.kernels import sampling  # noqa: E402
from kiln.kernels.softmax import temperature_softmax  # noqa: E402
from tests.kernels.devices import DEVICES, count_compiles, record_launches  # noqa: E402

TINY = torch.finfo(torch.float32).tiny


def _rows(device, top_ks, top_ps, min_ps, temps):
    f = lambda v: torch.tensor(v, dtype=torch.float32, device=device)  # noqa: E731
    return f(temps), torch.tensor(top_ks, dtype=torch.int64, device=device), f(top_ps), f(min_ps)


def _logits(kind, n, v, gen):
    if kind == "random":
        return torch.randn(n, v, generator=gen) * 3
    if kind == "ties":  # four logit levels: hundreds of exactly equal probabilities per row
        return torch.randint(0, 4, (n, v), generator=gen).float()
    if kind == "dominant":  # one token holds ~all the mass, the rest are tiny but not zero
        x = torch.randn(n, v, generator=gen)
        x[torch.arange(n), torch.randint(0, v, (n,), generator=gen)] = 25.0
        return x
    if kind == "uniform":
        return torch.zeros(n, v)
    raise ValueError(kind)


def _boundary_tokens(logits, temps, top_ks, top_ps, tol):
    """[N, V] bool: tokens whose reference top-p mass-before is within `tol` of the threshold."""
    n, v = logits.shape
    t = torch.where(temps == 0, torch.ones_like(temps), temps)
    probs = torch.softmax(logits.float() / t[:, None], dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    k = torch.where((top_ks <= 0) | (top_ks > v), torch.full_like(top_ks, v), top_ks)
    in_k = sorted_p.double() * (torch.arange(v, device=logits.device)[None] < k[:, None])
    before = in_k.cumsum(-1) - in_k
    thr = top_ps.double()[:, None] * in_k.sum(-1, keepdim=True)
    near = (before - thr).abs() <= tol
    return torch.zeros_like(near).scatter_(1, order, near)


def _check_filtered(logits, temps, top_ks, top_ps, min_ps, cap=sampling.CAP, boundary_tol=0.0):
    got = sampling.filtered_probs(logits, temps, top_ks, top_ps, min_ps, cap=cap)
    want = sampler_mod.filtered_probs(logits, temps, top_ks, top_ps, min_ps)
    assert got.shape == want.shape and got.dtype == torch.float32
    differ = (got > 0) != (want > 0)
    if boundary_tol:
        ok = _boundary_tokens(logits, temps, top_ks, top_ps, boundary_tol)
        assert not (differ & ~ok).any(), "kept sets differ away from the top-p boundary"
        same_rows = ~differ.any(dim=1)
    else:
        assert not differ.any(), f"kept sets differ in rows {differ.any(dim=1).nonzero().flatten().tolist()}"
        same_rows = torch.ones(got.shape[0], dtype=torch.bool, device=got.device)
    torch.testing.assert_close(got[same_rows], want[same_rows], rtol=1e-5, atol=1e-9)
    if not same_rows.all():  # a boundary token more or less: compare on the common support
        both = (got > 0) & (want > 0)
        g, w = got * both, want * both
        torch.testing.assert_close(g / g.sum(-1, keepdim=True), w / w.sum(-1, keepdim=True),
                                   rtol=1e-4, atol=1e-9)
    return got


# ---------------------------------------------------------------------------------- filters

GRID = list(itertools.product([0.1, 0.9, 1.0], [0.0, 0.2]))  # (top_p, min_p) per row
TEMPS = [1.0, 0.7, 0.0, 1.5, 1.0, 0.8]  # 0 means 1 here (greedy rows never reach the filter)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["random", "ties", "dominant"])
@pytest.mark.parametrize("top_k", [0, 1, 5])
def test_filtered_probs_grid(device, kind, top_k):
    """Every (top_p, min_p) of the grid for one top_k, on one kind of row. The CPU runs half the
    cases with a scratch of 8 tokens, so the search also takes its whole-row passes."""
    cuda = device == "cuda"
    gen = torch.Generator().manual_seed(hash((kind, top_k)) % 1000)
    v = 128256 if cuda else 37
    reps = 8 if cuda else 1
    top_ps, min_ps = zip(*(GRID * reps))
    n = len(top_ps)
    logits = _logits(kind, n, v, gen).to(device)
    temps, ks, ps, ms = _rows(device, [top_k] * n, list(top_ps), list(min_ps), (TEMPS * reps)[:n])
    cap = sampling.CAP if cuda or top_k != 5 else 8
    _check_filtered(logits, temps, ks, ps, ms, cap=cap, boundary_tol=1e-5 if cuda else 0.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_rows", [8, 0])  # with the threshold table over chunks, and without
def test_ties_across_blocks_keep_the_lowest_ids(device, max_rows, monkeypatch):
    """Uniform and four-level rows spanning several blocks and chunks (launch shapes shrunk): the
    kept ties are counted across blocks in id order. top_p * V is not an integer, top_k cuts
    inside the ties, min_p = 1 keeps exactly the tokens equal to the maximum, top_p = 0 keeps
    only the first of them."""
    monkeypatch.setattr(sampling, "SELECT", {**sampling.SELECT, "BLOCK": 512, "BLOCK_P": 256})
    monkeypatch.setattr(sampling, "APPLY", {**sampling.APPLY, "CHUNK": 512, "BLOCK": 256})
    monkeypatch.setattr(sampling, "TABLE", {**sampling.TABLE, "CHUNK": 256, "BLOCK": 64,  # 10 chunks, 16 padded
                                            "MAX_ROWS": max_rows})
    v = 2501
    gen = torch.Generator().manual_seed(7)
    logits = torch.cat([torch.zeros(3, v), _logits("ties", 3, v, gen)]).to(device)
    temps, ks, ps, ms = _rows(device, [0, 2100, 0, 0, 0, 900], [0.9, 1.0, 1.0, 0.0, 0.35, 1.0],
                              [0.0, 0.0, 1.0, 0.0, 0.0, 0.0], [1.0] * 6)
    got = _check_filtered(logits, temps, ks, ps, ms)
    kept = (got > 0).sum(dim=1).tolist()
    assert kept[0] == 2251 and kept[1] == 2100 and kept[2] == v and kept[3] == 1 and kept[5] == 900


@pytest.mark.parametrize("device", DEVICES)
def test_disabled_and_extreme_parameters(device):
    """top_k < 0 or > V is off, temperature 0 is 1, top_p 0 keeps the argmax (lowest id on
    ties), min_p 1 keeps every token equal to the maximum, and rows with no filter at all."""
    gen = torch.Generator().manual_seed(3)
    v = 53
    logits = _logits("ties", 6, v, gen).to(device)
    temps, ks, ps, ms = _rows(device, [-3, v + 10, 0, 0, 3, 0], [1.0, 0.9, 0.0, 1.0, 0.0, 1.0],
                              [0.0, 0.0, 0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0, 0.3, 2.0])
    got = _check_filtered(logits, temps, ks, ps, ms)
    assert (got[0] > 0).all() and (got[5] > 0).all()
    assert (got[2] > 0).sum() == 1 and (got[2] > 0).nonzero()[0].item() == logits[2].argmax().item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_rows", [8, 0])
def test_search_passes_over_the_whole_row(device, max_rows, monkeypatch):
    """A scratch of 4 tokens forces every search through its whole-row passes (first octaves,
    then evenly spaced bit patterns) instead of the copy, from the table's bracket and without
    the table."""
    monkeypatch.setattr(sampling, "TABLE", {**sampling.TABLE, "MAX_ROWS": max_rows})
    gen = torch.Generator().manual_seed(11)
    v = 301
    logits = torch.cat([_logits("random", 2, v, gen), _logits("ties", 2, v, gen)]).to(device)
    temps, ks, ps, ms = _rows(device, [0, 40, 7, 150], [0.9, 0.75, 1.0, 0.9], [0.0, 0.01, 0.0, 0.0], [1.0] * 4)
    _check_filtered(logits, temps, ks, ps, ms, cap=4)


@pytest.mark.parametrize("device", DEVICES)
def test_first_search_copied_in_chunks(device, monkeypatch):
    """The copy kernel's three modes, each against the reference and against the selection
    without it (`TABLE["PRE"]` off: `_search` brackets and copies in one program): every token
    >= the table's bracket copied (mode 2; a top-k + top-p row then searches twice in it), the
    bracket's tokens alone (1: a small scratch), neither (0: a smaller one, or min-p on). Eleven
    chunks of 256 tokens, so offsets add up across chunks."""
    monkeypatch.setattr(sampling, "TABLE", {**sampling.TABLE, "CHUNK": 256, "BLOCK": 64})
    gen = torch.Generator().manual_seed(5)
    v = 2600
    logits = (_logits("random", 8, v, gen) * 3).to(device)
    temps, ks, ps, ms = _rows(device, [0, 30, 0, 0, 200, 0, 0, 0], [0.9, 0.8, 0.5, 1.0, 1.0, 0.99, 0.9, 0.9],
                              [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.0], [1.0] * 8)
    probs = sampling._softmax(logits, temps)
    seen = set()
    for cap in (4096, 64, 16):
        got = _check_filtered(logits, temps, ks, ps, ms, cap=cap)
        _, _, pre = sampling._select(probs, ks, ps, ms, cap)
        row_modes = pre[:, 0].tolist()
        assert row_modes[3] == 0 and row_modes[6] == 0, row_modes  # no filter; min-p
        seen.update(row_modes)
        monkeypatch.setattr(sampling, "TABLE", {**sampling.TABLE, "PRE": False})
        without = sampling.filtered_probs(logits, temps, ks, ps, ms, cap=cap)
        monkeypatch.setattr(sampling, "TABLE", {**sampling.TABLE, "PRE": True})
        assert torch.equal(got > 0, without > 0)
        torch.testing.assert_close(got, without, rtol=1e-5, atol=1e-9)
        monkeypatch.setattr(sampling, "TABLE", {**sampling.TABLE, "MAX_ROWS": 0})  # no table: a large batch's path
        assert sampling._select(probs, ks, ps, ms, cap)[2] is None
        no_table = sampling.filtered_probs(logits, temps, ks, ps, ms, cap=cap)
        monkeypatch.setattr(sampling, "TABLE", {**sampling.TABLE, "MAX_ROWS": 8})
        assert torch.equal(got > 0, no_table > 0)
        torch.testing.assert_close(got, no_table, rtol=1e-5, atol=1e-9)
    assert seen == {0, 1, 2}, seen


@pytest.mark.parametrize("device", DEVICES)
def test_rows_without_a_search_skip_the_chunked_launches(device, monkeypatch):
    """`searches=False` (no row has top-k or top-p): the same draws without `_table_kernel` and
    `_copy_kernel`."""
    gen = torch.Generator().manual_seed(9)
    v = 700
    logits = (_logits("random", 4, v, gen) * 2).to(device)
    temps, ks, ps, ms = _rows(device, [0, 0, 0, 0], [1.0] * 4, [0.0, 0.05, 0.3, 0.0], [1.0, 0.7, 1.3, 1.0])
    e = torch.empty(4, v).exponential_(generator=gen).to(device)
    launched = record_launches(monkeypatch, sampling, "_table_kernel", "_copy_kernel")
    with_table = sampling.sample(logits, temps, ks, ps, ms, e)
    assert launched == ["_table_kernel", "_copy_kernel"]
    launched.clear()
    without = sampling.sample(logits, temps, ks, ps, ms, e, searches=False)
    assert launched == []
    assert torch.equal(with_table, without)


# ---------------------------------------------------------------------------------- draws


def _small_chunks(monkeypatch):
    """Several chunks per row on the CPU too, so the per-chunk maxima are merged across chunks."""
    monkeypatch.setattr(sampling, "APPLY", {**sampling.APPLY, "CHUNK": 512, "BLOCK": 256})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("v", [37, 1024, 5000, 49216])
def test_softmax_is_torch_softmax_over_temperature(device, v):
    """The two-launch softmax of logits / T (T = 0 read as 1) against torch's, to float rounding:
    several chunks per row, a chunk of -inf logits alone (off a token map), equal logits giving
    equal probabilities, bf16 logits read as fp32."""
    gen = torch.Generator().manual_seed(v)
    logits = torch.randn(5, v, generator=gen) * 4
    logits[1, : min(v, 2048)] = float("-inf")  # (a whole first chunk at v > 1024)
    logits[1, -1] = 0.0
    logits[2] = 1.5
    temps = torch.tensor([1.0, 0.7, 0.0, 1.3, 0.05])
    want = torch.softmax(logits / torch.where(temps == 0, 1.0, temps)[:, None], -1)
    got = temperature_softmax(logits.to(device), temps.to(device)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-12)
    assert (got[2] == got[2, 0]).all() and (got[1, : min(v, 2048) - (v <= 2048)] == 0).all()
    half = logits.to(torch.bfloat16)
    want = torch.softmax(half.float() / torch.where(temps == 0, 1.0, temps)[:, None], -1)
    torch.testing.assert_close(temperature_softmax(half.to(device), temps.to(device)).cpu(), want, rtol=1e-5,
                               atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_sample_matches_the_reference_race(device, monkeypatch):
    """`sample` (filter + race fused) and `sample_from_probs` draw argmax(probs / e) like the
    sampler does, zeros in e included (clamped to the smallest normal, first index wins)."""
    cuda = device == "cuda"
    if not cuda:
        _small_chunks(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    n, v = (64, 49216) if cuda else (4, 2100)
    logits = _logits("random", n, v, gen)
    logits[1] = 0.0
    logits = logits.to(device)
    temps, ks, ps, ms = _rows(device, ([5, 0, 50, 0] * n)[:n], ([0.9, 1.0, 0.8, 1.0] * n)[:n],
                              ([0.0, 0.0, 0.05, 0.0] * n)[:n], ([1.0, 0.7, 1.2, 0.9] * n)[:n])
    e = torch.empty(n, v).exponential_(generator=gen).to(device)
    e[1, :] = 0.0  # row 1: uniform and unfiltered, every ratio ties across chunks: id 0 wins
    ref_probs = sampler_mod.filtered_probs(logits, temps, ks, ps, ms)
    want = (ref_probs / e.clamp_min(TINY)).argmax(dim=-1)
    got_fused = sampling.sample(logits, temps, ks, ps, ms, e)
    assert got_fused.dtype == torch.int64 and want[1] == 0
    assert torch.equal(got_fused, want)
    assert torch.equal(sampling.sample_from_probs(ref_probs, e), want)


@pytest.mark.parametrize("device", DEVICES)
def test_sample_from_probs_equals_torch(device, monkeypatch):
    if device == "cpu":
        _small_chunks(monkeypatch)
    gen = torch.Generator().manual_seed(2)
    n, v = (256, 128256) if device == "cuda" else (3, 2600)
    probs = torch.softmax(torch.randn(n, v, generator=gen) * 2, dim=-1).to(device)
    probs[0, 5:9] = 0.0
    e = torch.empty(n, v).exponential_(generator=gen).to(device)
    e[0, 6] = 0.0  # p = 0 and e = 0: 0 / tiny = 0, must not win
    probs[1], e[1] = 1.0 / v, 1.0  # every ratio equal, over several chunks: the first index wins
    want = (probs / e.clamp_min(TINY)).argmax(dim=-1)
    assert want[1] == 0
    assert torch.equal(sampling.sample_from_probs(probs, e), want)


# ---------------------------------------------------------------------------------- CUDA only


@pytest.mark.gpu
@pytest.mark.parametrize("v", [49216, 128256])
def test_real_vocab_llm_like_rows(v):
    """Peaked, flat and tie-heavy rows at a real vocabulary, mixed parameters, B = 96."""
    gen = torch.Generator().manual_seed(v)
    n = 96
    logits = torch.randn(n, v, generator=gen) * torch.linspace(0.5, 8, n)[:, None]
    logits[::7] = torch.randint(0, 3, (len(range(0, n, 7)), v), generator=gen).float()
    logits = logits.cuda()
    ks = [[0, 1, 5, 40, 1000, 5000][i % 6] for i in range(n)]
    ps = [[1.0, 0.95, 0.9, 0.5, 0.1][i % 5] for i in range(n)]
    ms = [[0.0, 0.0, 0.05, 0.2][i % 4] for i in range(n)]
    temps, ks, ps, ms = _rows("cuda", ks, ps, ms, [[1.0, 0.6, 1.3][i % 3] for i in range(n)])
    _check_filtered(logits, temps, ks, ps, ms, boundary_tol=1e-5)


@pytest.mark.gpu
def test_sample_captures_in_a_cuda_graph():
    """No host sync and a value-independent grid: capture once, replay on new logits."""
    gen = torch.Generator().manual_seed(0)
    n, v = 32, 49216
    logits = (torch.randn(n, v, generator=gen) * 3).cuda()
    temps, ks, ps, ms = _rows("cuda", [0, 20] * (n // 2), [0.9] * n, [0.0, 0.1] * (n // 2), [1.0] * n)
    e = torch.empty(n, v, device="cuda").exponential_()
    sampling.sample(logits, temps, ks, ps, ms, e)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids = sampling.sample(logits, temps, ks, ps, ms, e)
    for _ in range(3):
        logits.copy_(torch.randn(n, v, generator=gen).cuda() * 3)
        e.exponential_()
        graph.replay()
        assert torch.equal(ids, sampling.sample(logits, temps, ks, ps, ms, e))


def _batch(n, device, temps, top_ks, top_ps, min_ps, gens, greedy):
    """Like `SamplingBatch.from_reqs`: every host -> device copy happens here, before the call
    (the drawing rows and the (row, id) pairs of the id lists too, when `greedy` is given)."""
    f = lambda v: torch.tensor(v, dtype=torch.float32, device=device)  # noqa: E731
    prompts, outputs, suppress = [[1, 2, 3]] + [[] for _ in range(n - 1)], [[4, 4]] + [[] for _ in range(n - 1)], [[7]] * n

    def pairs(lists):
        rows = [i for i, x in enumerate(lists) for _ in x]
        ids = [t for x in lists for t in x]
        return (torch.tensor(rows, device=device), torch.tensor(ids, device=device)) if ids else None

    pre = {}
    if greedy is not None:
        pre = dict(draw_rows=torch.tensor([i for i, g in enumerate(greedy) if not g], device=device),
                   id_pairs={"output": pairs(outputs), "prompt": pairs(prompts), "suppress": pairs(suppress)})
    return SamplingBatch(
        temperatures=f(temps), top_ps=f(top_ps), top_ks=torch.tensor(top_ks, device=device), min_ps=f(min_ps),
        repetition_penalties=f([1.2] + [1.0] * (n - 1)), frequency_penalties=f([0.0] * n),
        presence_penalties=f([0.0] * n), generators=gens, prompt_token_ids=prompts,
        output_token_ids=outputs, suppress_ids=suppress, num_top_logprobs=[-1] * n, greedy=greedy, **pre)


@pytest.mark.gpu
@pytest.mark.parametrize("host_greedy", [True, False])
def test_sampler_cuda_path_has_no_host_sync_and_matches_reference(host_greedy):
    """Sampler on CUDA: same tokens as the reference filter + race with the same noise, and no
    device -> host sync (with the host greedy list, and without it)."""
    n, v = 48, 49216
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(n, v, generator=gen) * 3).cuda()
    temps = [0.0 if i % 5 == 0 else 0.9 for i in range(n)]
    top_ks = [1 if i % 7 == 3 else [0, 20][i % 2] for i in range(n)]
    top_ps, min_ps = [0.9] * n, [0.05 if i % 3 else 0.0 for i in range(n)]
    greedy = [t == 0 or k == 1 for t, k in zip(temps, top_ks)]
    seeds = [100 + i if i % 4 == 1 else None for i in range(n)]

    def make():  # batch tensors are built (copied to the device) before the checked call
        gens = [make_generator(s, "cuda") if s is not None else None for s in seeds]
        return Sampler(seed=9, device="cuda"), _batch(n, "cuda", temps, top_ks, top_ps, min_ps, gens,
                                                      greedy if host_greedy else None)

    warm_sampler, warm_batch = make()
    warm_sampler(logits, warm_batch)  # compile
    sampler, batch = make()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = sampler(logits, batch).token_ids
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # Reference: the same noise streams, the torch filter, argmax(probs / e).
    x = sampler_mod.processed_logits(logits, batch)
    rows = [i for i in range(n) if not greedy[i]] if host_greedy else list(range(n))
    twin = Sampler(seed=9, device="cuda")
    e = twin._exponentials([make_generator(seeds[i], "cuda") if seeds[i] is not None else None for i in rows],
                           v, "cuda")
    idx = torch.tensor(rows, device="cuda")
    probs = sampler_mod.filtered_probs(x[idx], batch.temperatures[idx], batch.top_ks[idx], batch.top_ps[idx],
                                       batch.min_ps[idx])
    want = x.argmax(dim=-1)
    drawn = (probs / e.clamp_min(TINY)).argmax(dim=-1)
    want[idx] = torch.where(torch.tensor(greedy, device="cuda")[idx], want[idx], drawn)
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_select_kernel_compiles_once_whatever_the_parameters_alignment(monkeypatch):
    # The sampler's per-row parameters are views into one [6, B] buffer, so their pointers' 16-byte
    # alignment changes with B; the selection kernel must not compile a variant per alignment
    # (thirty-eighth pass: three variants, ~2.3 s each, at the first sampled batch of 64).
    compiled = count_compiles(monkeypatch, "_select_kernel")
    logits = torch.randn(8, 3000, device="cuda")
    # views at offsets of 0..7 elements into one buffer each: every 16-byte alignment
    ps, mins = torch.rand(16, device="cuda") * 0.5 + 0.5, torch.rand(16, device="cuda") * 0.1
    ks = torch.full((16,), 20, device="cuda", dtype=torch.int64)
    for b in range(8):
        sampling.filtered_probs(logits, torch.ones(8, device="cuda"), ks[b:b + 8], ps[b:b + 8], mins[b:b + 8])
    assert len(compiled) <= 1, f"{len(compiled)} variants of the selection kernel"


@pytest.mark.parametrize("device", DEVICES)
def test_per_row_constants_may_be_strided_views(device):
    # One request's constants expanded over its K draft rows (`expand(...).reshape(-1)` stays a
    # stride-0 view at one request): every row reads its own, not the memory after row 0.
    gen = torch.Generator().manual_seed(12)
    logits = (_logits("random", 3, 300, gen) * 3).to(device)
    temps, ks, ps, ms = _rows(device, [20], [0.8], [0.01], [0.7])
    spread = [t.expand(3) for t in (temps, ks, ps, ms)]
    assert all(t.stride(0) == 0 for t in spread)
    got = sampling.filtered_probs(logits, *spread)
    want = sampler_mod.filtered_probs(logits, *(t.contiguous() for t in spread))
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
