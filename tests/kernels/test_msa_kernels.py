"""MSA Triton kernels (`kiln.kernels.msa`) against the reference ops (`kiln.ops.msa`).

"cpu" cases run the kernels under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
without a GPU) on tiny shapes; "cuda" cases (marked gpu) run the bench preset in bf16 and a CUDA
graph capture. Caches are fragmented (a random slot for every position) and the table's entries
past each sequence point at real slots holding other data, so reading past a sequence, or through
the wrong row, changes the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kiln.kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton")

if triton_available():
    from kiln.kernels import msa as K
from kiln.ops import msa as R
from tests.kernels.devices import DEVICES  # noqa: E402



@dataclass
class Case:
    q: torch.Tensor
    qI: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    ki_cache: torch.Tensor
    req_to_token: torch.Tensor
    req_slots: torch.Tensor  # [S] int64
    prefix_lens: list
    extend_lens: list

    @property
    def seq_lens(self) -> torch.Tensor:
        return torch.tensor([p + n for p, n in zip(self.prefix_lens, self.extend_lens)],
                            dtype=torch.int64, device=self.q.device)


def make_case(device, dtype, prefix_lens, extend_lens, hq, g, d, di, max_len, seed=0, ties=False,
              num_slots=None) -> Case:
    """Random caches holding every sequence's positions 0..prefix+n-1 at random distinct slots."""
    gen = torch.Generator().manual_seed(seed)
    totals = [p + n for p, n in zip(prefix_lens, extend_lens)]
    num_slots = num_slots or sum(totals) + 13
    perm = torch.randperm(num_slots, generator=gen)
    rows = len(totals) + 3
    # Stale entries everywhere: real slots of other data, so unmasked reads show in the result.
    table = torch.randint(0, num_slots, (rows, max_len), generator=gen)
    req_slots = torch.randperm(rows, generator=gen)[:len(totals)]
    used = 0
    for row, total in zip(req_slots.tolist(), totals):
        table[row, :total] = perm[used:used + total]
        used += total
    t = sum(extend_lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    if ties:
        # Small integers: dot products are exact in any summation order and many blocks share
        # their max, so the order among equal scores (lower id first) decides the selection.
        ki = torch.randint(-1, 2, (num_slots, g, di), generator=gen).float()
        qi = torch.randint(0, 2, (t, g, di), generator=gen).float()
    else:
        ki, qi = rnd(num_slots, g, di), rnd(t, g, di)
    to = dict(device=device, dtype=dtype)
    return Case(rnd(t, hq, d).to(**to), qi.to(**to), rnd(num_slots, g, d).to(**to),
                rnd(num_slots, g, d).to(**to), ki.to(**to), table.to(device), req_slots.to(device),
                list(prefix_lens), list(extend_lens))


def reference(c: Case, block, topk, scale):
    return R.paged_msa_attention(c.q, c.qI, c.k_cache, c.v_cache, c.ki_cache, c.req_to_token,
                                 c.req_slots.tolist(), c.prefix_lens, c.extend_lens, block, topk, scale)


def reference_selection(c: Case, block, topk):
    """[T, G, N] reference block ids, queries in row order."""
    out, start = [], 0
    for slot, prefix, n in zip(c.req_slots.tolist(), c.prefix_lens, c.extend_lens):
        total = prefix + n
        slots = c.req_to_token[slot, :total]
        q_pos = torch.arange(prefix, total, device=c.q.device)
        k_pos = torch.arange(total, device=c.q.device)
        out.append(R.select(c.qI[start:start + n], c.ki_cache[slots], q_pos, k_pos, block, topk).transpose(0, 1))
        start += n
    return torch.cat(out)


def check_scores(got, c: Case, block, past_written=True):
    """Kernel scores [T, G, NB] equal the reference's on every causal block, and are -inf on the
    rest where the kernel writes them (`past_written`; the decode kernel leaves them as they were)."""
    start = 0
    for slot, prefix, n in zip(c.req_slots.tolist(), c.prefix_lens, c.extend_lens):
        total = prefix + n
        slots = c.req_to_token[slot, :total]
        pos = torch.arange(total, device=c.q.device)
        ref = R.block_scores(c.qI[start:start + n], c.ki_cache[slots], pos[prefix:], pos, block).transpose(0, 1)
        nb = ref.shape[-1]
        mine = got[start:start + n]
        finite = torch.isfinite(ref)
        assert torch.equal(finite, torch.isfinite(mine[..., :nb]))
        torch.testing.assert_close(mine[..., :nb][finite], ref[finite], rtol=1e-5, atol=1e-5)
        if past_written:
            assert torch.isneginf(mine[..., nb:]).all()
        start += n


# (hq, g, d, di, block, topk, max_len, seq_lens) for decode on the interpreter
TINY = dict(hq=4, g=2, d=16, di=16, block=4, topk=3, max_len=48)
DECODE_LENS = {
    "short": [1, 5, 9],            # fewer causal blocks than N
    "exact_n": [9, 12],            # exactly N blocks (the last one full or not)
    "n_plus_1": [13],              # first row that must choose
    "long": [45, 30, 17, 48, 1],   # many more blocks than N, mixed with short ones
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(DECODE_LENS))
@pytest.mark.parametrize("ties", [False, True])
def test_decode_matches_reference(device, kind, ties):
    p = TINY
    lens = DECODE_LENS[kind]
    c = make_case(device, torch.float32, [n - 1 for n in lens], [1] * len(lens), p["hq"], p["g"],
                  p["d"], p["di"], p["max_len"], seed=len(lens) + ties, ties=ties)
    scale = p["d"] ** -0.5
    q_pos = c.seq_lens - 1
    scores = K.msa_decode_scores(c.qI, c.ki_cache, c.req_to_token, c.req_slots, q_pos, p["block"])
    assert scores.shape == (len(lens), p["g"], p["max_len"] // p["block"])
    check_scores(scores, c, p["block"], past_written=False)
    sel = K.msa_select(scores, q_pos, p["block"], p["topk"])
    assert torch.equal(sel, reference_selection(c, p["block"], p["topk"]))
    out = K.msa_decode(c.q, c.qI, c.k_cache, c.v_cache, c.ki_cache, c.req_to_token, c.req_slots,
                       c.seq_lens, p["block"], p["topk"], scale)
    torch.testing.assert_close(out, reference(c, p["block"], p["topk"], scale), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("programs", [2, 5, 12])
def test_score_programs_stride_over_blocks(device, programs):
    """Each program scores every P-th block up to its row's (or query tile's) last one, whatever
    P is: fewer programs than blocks (each loops), as many, more (some score nothing). Decode
    leaves the blocks past each query unwritten, so only the causal ones are compared there."""
    p = TINY
    lens = DECODE_LENS["long"]
    c = make_case(device, torch.float32, [n - 1 for n in lens], [1] * len(lens), p["hq"], p["g"],
                  p["d"], p["di"], p["max_len"], seed=4)
    q_pos = c.seq_lens - 1
    scores = K.msa_decode_scores(c.qI, c.ki_cache, c.req_to_token, c.req_slots, q_pos, p["block"],
                                 programs=programs)
    check_scores(scores, c, p["block"], past_written=False)
    prefix, ext = [20, 7, 0], [6, 1, 5]
    c = make_case(device, torch.float32, prefix, ext, p["hq"], p["g"], p["d"], p["di"], p["max_len"], seed=5)
    dev = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    starts = dev([sum(ext[:i]) for i in range(len(ext))])
    scores = K.msa_extend_scores(c.qI, c.ki_cache, c.req_to_token, c.req_slots, dev(prefix), dev(ext),
                                 starts, p["block"], programs=programs)
    check_scores(scores, c, p["block"])


def nan_allocated(monkeypatch, fn, *args, **kwargs):
    """fn(*args, **kwargs) with every `torch.empty` it makes filled with NaN, so that what a kernel
    leaves unwritten shows."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    try:
        return fn(*args, **kwargs)
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("programs", [None, 3])
def test_decode_scores_only_what_selection_reads(device, programs, monkeypatch):
    """With select_blocks = N, a row with at most N causal blocks is not scored at all and a
    longer row only before its own block (the selection reads nothing else): those scores stay
    as allocated (NaN here) and the rest equal the full scores; msa_decode's output is unchanged."""
    p = TINY  # block 4, N 3: rows 1, 5, 9 take every causal block (at most 3), 13+ select
    lens = [1, 5, 9, 13, 45, 30, 17, 48]
    c = make_case(device, torch.float32, [n - 1 for n in lens], [1] * len(lens), p["hq"], p["g"],
                  p["d"], p["di"], p["max_len"], seed=8)
    q_pos = c.seq_lens - 1
    full = K.msa_decode_scores(c.qI, c.ki_cache, c.req_to_token, c.req_slots, q_pos, p["block"])
    got = nan_allocated(monkeypatch, K.msa_decode_scores, c.qI, c.ki_cache, c.req_to_token, c.req_slots, q_pos,
                        p["block"], programs=programs, select_blocks=p["topk"])
    for r, n in enumerate(lens):
        local = (n - 1) // p["block"]
        scored = local if local + 1 > p["topk"] else 0
        torch.testing.assert_close(got[r, :, :scored], full[r, :, :scored], rtol=0, atol=0)
        assert got[r, :, scored:local + 1].isnan().all(), (r, got[r])
    out = K.msa_decode(c.q, c.qI, c.k_cache, c.v_cache, c.ki_cache, c.req_to_token, c.req_slots,
                       c.seq_lens, p["block"], p["topk"], p["d"] ** -0.5)
    torch.testing.assert_close(out, reference(c, p["block"], p["topk"], p["d"] ** -0.5), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("programs", [None, 2])
def test_extend_scores_only_what_selection_reads(device, programs, monkeypatch):
    """As the decode test above, for chunks of several queries: with select_blocks = N a query
    with at most N causal blocks is not scored and a longer one only before its own block, within
    one query tile whose queries differ in that (a prefill from 0 crossing N blocks, a verify-like
    chunk after a long prefix, a short sequence)."""
    p = TINY  # block 4, N 3: positions 0..11 take every causal block, 12+ select
    prefix, ext = [0, 37, 2], [15, 4, 3]
    c = make_case(device, torch.float32, prefix, ext, p["hq"], p["g"], p["d"], p["di"], p["max_len"], seed=9)
    dev = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    starts = dev([sum(ext[:i]) for i in range(len(ext))])
    args = (c.qI, c.ki_cache, c.req_to_token, c.req_slots, dev(prefix), dev(ext), starts, p["block"])
    full = K.msa_extend_scores(*args)
    got = nan_allocated(monkeypatch, K.msa_extend_scores, *args, programs=programs, select_blocks=p["topk"])
    positions = [pre + i for pre, n in zip(prefix, ext) for i in range(n)]
    assert any(q // p["block"] + 1 > p["topk"] for q in positions[:15])  # the first tile mixes both
    for r, q in enumerate(positions):
        local = q // p["block"]
        scored = local if local + 1 > p["topk"] else 0
        torch.testing.assert_close(got[r, :, :scored], full[r, :, :scored], rtol=0, atol=0)
        assert got[r, :, scored:].isnan().all(), (r, got[r])


@pytest.mark.parametrize("device", DEVICES)
def test_scores_stop_at_max_len(device):
    """A row longer than max_len (a caller's error) must not make the kernels store past the
    scores' NB blocks into the next (row, head): each row's blocks below NB stay right. The last
    row is the longest, so its stores past NB would leave the allocation (under the interpreter
    the process then crashes, as it did before the kernels bounded their loops by NB)."""
    p = TINY
    lens = [45, 30, 48]
    c = make_case(device, torch.float32, [n - 1 for n in lens], [1] * len(lens), p["hq"], p["g"],
                  p["d"], p["di"], p["max_len"], seed=6)
    nb = 5  # max_len 20: rows span up to 12 blocks
    full = K.msa_decode_scores(c.qI, c.ki_cache, c.req_to_token, c.req_slots, c.seq_lens - 1, p["block"])
    for programs in (1, 3):
        got = K.msa_decode_scores(c.qI, c.ki_cache, c.req_to_token, c.req_slots, c.seq_lens - 1, p["block"],
                                  max_len=nb * p["block"], programs=programs)
        assert got.shape[-1] == nb
        torch.testing.assert_close(got, full[..., :nb], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("blocks_per_split", [1, 2, 3])
@pytest.mark.parametrize("merge_here", [False, True], ids=["combine_kernel", "merge_in_kernel"])
def test_sparse_attention_splits(device, blocks_per_split, merge_here, monkeypatch):
    """Split-softmax merge (`_combine_kernel`, or with split counters the last split of each
    group inside the attention kernel), uneven last split and -1 padding included, and the
    single-split direct write, agree with the reference on the same selection; the counters are
    left at zero, so a second call merges again."""
    p = dict(TINY, block=8, topk=3, max_len=64)
    lens = [3, 17, 64, 40]  # 1 block (two -1 pads), 3 blocks, 8 blocks, a partial local block
    c = make_case(device, torch.float32, [n - 1 for n in lens], [1] * len(lens), p["hq"], p["g"],
                  p["d"], p["di"], p["max_len"], seed=7)
    scale = 0.3
    q_pos = c.seq_lens - 1
    sel = reference_selection(c, p["block"], p["topk"])
    counters = torch.zeros(len(lens) * p["g"] + 2, dtype=torch.int32, device=device) if merge_here else None
    if merge_here:  # a launch of the combine kernel fails the test
        monkeypatch.setattr(K, "_combine_kernel", None)
    for _ in range(2 if merge_here else 1):
        out = K.msa_sparse_attention(c.q, c.k_cache, c.v_cache, c.req_to_token, c.req_slots, q_pos, sel,
                                     p["block"], scale, blocks_per_split=blocks_per_split, split_counters=counters)
        torch.testing.assert_close(out, reference(c, p["block"], p["topk"], scale), rtol=1e-4, atol=1e-5)
        if merge_here:
            assert not counters.any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("blocks_per_split,chunk", [(1, None), (2, 4), (3, None)])
def test_selection_inside_attention_equals_select_kernel(device, blocks_per_split, chunk):
    """With the scores instead of the selection, the attention kernel selects itself: bit for
    bit the output of `msa_select` + attention on the same scores. Rows with fewer causal blocks
    than N, exactly N, and many more; ties (zeros of both signs); several chunks of scores per
    row (chunk=4); uneven splits (3 blocks of N = 5). Scores past each query's history are NaN
    and huge, so reading one changes the result."""
    block, topk = 4, 5
    lens = [3, 20, 21, 64, 45, 30]
    c = make_case(device, torch.float32, [n - 1 for n in lens], [1] * len(lens), 4, 2, 16, 16, 64, seed=5)
    gen = torch.Generator().manual_seed(6)
    nb = 64 // block
    scores = torch.randint(-1, 2, (len(lens), 2, nb), generator=gen).float()
    scores[torch.rand(scores.shape, generator=gen) < 0.3] = -0.0
    scores = scores.to(device)
    q_pos = c.seq_lens - 1
    ids = torch.arange(nb, device=device)
    local = (q_pos // block)[:, None, None]
    poison = torch.where(ids % 2 == 0, torch.full_like(scores, float("nan")), torch.full_like(scores, 1e30))
    poisoned = torch.where(ids >= local, poison, scores)
    sel = K.msa_select(poisoned, q_pos, block, topk)
    args = (c.q, c.k_cache, c.v_cache, c.req_to_token, c.req_slots, q_pos)
    want = K.msa_sparse_attention(*args, sel, block, 0.3, blocks_per_split=blocks_per_split)
    got = K.msa_sparse_attention(*args, None, block, 0.3, blocks_per_split=blocks_per_split, scores=poisoned,
                                 topk_blocks=topk, select_chunk=chunk)
    assert torch.equal(got, want)
    for select_in_attention in (True, False):  # both routes of msa_decode reach the reference
        out = K.msa_decode(c.q, c.qI, c.k_cache, c.v_cache, c.ki_cache, c.req_to_token, c.req_slots,
                           c.seq_lens, block, topk, 0.3, select_in_attention=select_in_attention)
        torch.testing.assert_close(out, reference(c, block, topk, 0.3), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ties,chunk,nb", [(False, None, 40), (True, None, 40), (True, None, 100), (True, 16, 40)])
def test_select_matches_select_blocks(device, ties, chunk, nb):
    """Selection alone on given scores: exact ids and order, ties to the lower id: by rank (rows
    of at most RANK_MAX_BLOCKS blocks), by the chain of max reductions (longer rows, nb=100), also
    across chunks of a row (chunk=16). Scores past each query's history hold huge values, which
    must not be read; zeros of both signs tie."""
    assert 40 <= K.RANK_MAX_BLOCKS < 100
    gen = torch.Generator().manual_seed(3)
    rows, g, block, topk = 12, 3, 4, 5
    if ties:
        scores = torch.randint(-1, 2, (rows, g, nb), generator=gen).float()
        scores[torch.rand(rows, g, nb, generator=gen) < 0.3] = -0.0
    else:
        scores = torch.randn(rows, g, nb, generator=gen)
    q_pos = torch.randint(0, nb * block, (rows,), generator=gen)
    q_pos[:4] = torch.tensor([0, topk * block - 1, topk * block, nb * block - 1])
    scores = scores.to(device)
    q_pos = q_pos.to(device)
    ids = torch.arange(nb, device=device)
    local = (q_pos // block)[:, None, None]
    poisoned = torch.where(ids >= local, torch.full_like(scores, 1e30), scores)
    got = K.msa_select(poisoned, q_pos, block, topk, chunk=chunk)
    for r in range(rows):
        n_causal = int(q_pos[r]) // block + 1
        ref = R.select_blocks(scores[r, :, None, :n_causal], q_pos[r:r + 1], block, topk)[:, 0]
        assert torch.equal(got[r], ref), (r, got[r], ref)


def test_select_ties_pick_lower_ids():
    """All-equal scores: the N-1 lowest history blocks, in order, then the local block."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    scores = torch.zeros(1, 2, 10, device=device)
    got = K.msa_select(scores, torch.tensor([37], device=device), 4, 4)  # local block 9
    assert got.tolist() == [[[0, 1, 2, 9], [0, 1, 2, 9]]]


EXTEND_CASES = {  # (prefix_lens, extend_lens, ties), block 4, N 3
    "prefill": ([0], [15], False),                # later queries of the chunk choose, earlier ones do not
    "chunked": ([20, 7, 0], [6, 1, 5], False),    # a chunk after a prefix, a decode row, a new sequence
    "long_prefix_ties": ([37], [9], True),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(EXTEND_CASES))
def test_extend_matches_reference(device, kind):
    p = dict(TINY, max_len=48)
    prefix, ext, ties = EXTEND_CASES[kind]
    c = make_case(device, torch.float32, prefix, ext, p["hq"], p["g"], p["d"], p["di"], p["max_len"],
                  seed=11, ties=ties)
    scale = p["d"] ** -0.5
    dev = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    starts = dev([sum(ext[:i]) for i in range(len(ext))])
    scores = K.msa_extend_scores(c.qI, c.ki_cache, c.req_to_token, c.req_slots, dev(prefix), dev(ext),
                                 starts, p["block"])
    check_scores(scores, c, p["block"])
    # the engine passes every row's position and request row (its batch has them) instead
    rows = dict(q_pos=dev([pre + i for pre, n in zip(prefix, ext) for i in range(n)]),
                row_slots=c.req_slots.repeat_interleave(dev(ext)))
    for select_in_attention, given in ((True, {}), (False, {}), (True, rows)):
        out = K.msa_extend(c.q, c.qI, c.k_cache, c.v_cache, c.ki_cache, c.req_to_token, c.req_slots,
                           dev(prefix), dev(ext), starts, p["block"], p["topk"], scale,
                           select_in_attention=select_in_attention, **given)
        torch.testing.assert_close(out, reference(c, p["block"], p["topk"], scale), rtol=1e-4, atol=1e-5)


# ---- bench shapes on the GPU -----------------------------------------------------------------

BENCH = dict(hq=16, g=4, d=128, di=128, block=128, topk=16)


def _bench_case(lens, max_len, seed=0, ties=False, num_slots=None):
    b = BENCH
    return make_case("cuda", torch.bfloat16, [n - 1 for n in lens], [1] * len(lens), b["hq"], b["g"],
                     b["d"], b["di"], max_len, seed=seed, ties=ties, num_slots=num_slots)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [
    [1, 100, 2048, 2049],                                # short, exactly N blocks, N + 1
    [8192, 5000, 32768, 129, 20000, 30001, 16 * 128 * 3 + 1, 777],
    [32768] * 32,                                        # many rows: splits > 1 or direct write
    [300 + 337 * i for i in range(96)],                  # 96 lengths up to 32315
])
def test_decode_bench_shapes_cuda(lens):
    b = BENCH
    c = _bench_case(lens, max_len=32768, seed=len(lens))
    scale = b["d"] ** -0.5
    q_pos = c.seq_lens - 1
    scores = K.msa_decode_scores(c.qI, c.ki_cache, c.req_to_token, c.req_slots, q_pos, b["block"])
    sel = K.msa_select(scores, q_pos, b["block"], b["topk"])
    assert torch.equal(sel, reference_selection(c, b["block"], b["topk"]))
    out = K.msa_decode(c.q, c.qI, c.k_cache, c.v_cache, c.ki_cache, c.req_to_token, c.req_slots,
                       c.seq_lens, b["block"], b["topk"], scale)
    ref = reference(c, b["block"], b["topk"], scale)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_decode_ties_cuda():
    b = BENCH
    c = _bench_case([5000, 2049, 30000], max_len=32768, seed=5, ties=True)
    q_pos = c.seq_lens - 1
    scores = K.msa_decode_scores(c.qI, c.ki_cache, c.req_to_token, c.req_slots, q_pos, b["block"])
    sel = K.msa_select(scores, q_pos, b["block"], b["topk"])
    assert torch.equal(sel, reference_selection(c, b["block"], b["topk"]))


@pytest.mark.gpu
def test_extend_bench_shapes_cuda():
    b = BENCH
    prefix, ext = [0, 4000, 9000], [3000, 700, 1]
    c = make_case("cuda", torch.bfloat16, prefix, ext, b["hq"], b["g"], b["d"], b["di"], 16384, seed=2)
    dev = lambda xs: torch.tensor(xs, dtype=torch.int64, device="cuda")  # noqa: E731
    starts = dev([0, ext[0], ext[0] + ext[1]])
    scale = b["d"] ** -0.5
    out = K.msa_extend(c.q, c.qI, c.k_cache, c.v_cache, c.ki_cache, c.req_to_token, c.req_slots,
                       dev(prefix), dev(ext), starts, b["block"], b["topk"], scale)
    torch.testing.assert_close(out.float(), reference(c, b["block"], b["topk"], scale).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_decode_cuda_graph_replay():
    """Capture once, then refill lengths, table, queries and caches in place and replay: the
    graph must follow the new values (nothing value-dependent was baked in at capture)."""
    b = BENCH
    max_len, slots = 24576, 4 * 24576
    lens = [4000, 20000, 129, 9000]
    c = _bench_case(lens, max_len=max_len, seed=1, num_slots=slots)
    scale = b["d"] ** -0.5
    seq_lens = c.seq_lens.clone()
    args = (c.q, c.qI, c.k_cache, c.v_cache, c.ki_cache, c.req_to_token, c.req_slots, seq_lens,
            b["block"], b["topk"], scale)
    K.msa_decode(*args, max_len=max_len)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.msa_decode(*args, max_len=max_len)
    for step, new_lens in enumerate([[4001, 20001, 130, 9001], [24576, 1, 2049, 17000]]):
        d = _bench_case(new_lens, max_len=max_len, seed=10 + step, num_slots=slots)
        for name in ("q", "qI", "k_cache", "v_cache", "ki_cache", "req_to_token", "req_slots"):
            getattr(c, name).copy_(getattr(d, name))
        seq_lens.copy_(d.seq_lens)
        graph.replay()
        ref = reference(d, b["block"], b["topk"], scale)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
