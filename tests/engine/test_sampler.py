"""Sampler tests: greedy, seeded reproducibility, the exact sampled distribution (chi-square
against an independent numpy reference), filters, penalties, suppression and logprobs."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from kiln.engine.request import Req, SamplingParams, SamplingRow
from kiln.engine.seeded_noise import SeededStream
from kiln.engine.sampler import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    compute_logprobs,
    make_generator,
    processed_probs,
)


def make_batch(n, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, rep=1.0, freq=0.0, pres=0.0,
               generators=None, prompt=None, output=None, suppress=None, logprobs=None):
    """A SamplingBatch of `n` rows; scalars apply to every row, lists give one value per row."""

    def col(v, dtype):
        return torch.tensor(v if isinstance(v, list) else [v] * n, dtype=dtype)

    return SamplingBatch(
        temperatures=col(temperature, torch.float32),
        top_ps=col(top_p, torch.float32),
        top_ks=col(top_k, torch.int64),
        min_ps=col(min_p, torch.float32),
        repetition_penalties=col(rep, torch.float32),
        frequency_penalties=col(freq, torch.float32),
        presence_penalties=col(pres, torch.float32),
        generators=generators if generators is not None else [None] * n,
        prompt_token_ids=prompt if prompt is not None else [[] for _ in range(n)],
        output_token_ids=output if output is not None else [[] for _ in range(n)],
        suppress_ids=suppress if suppress is not None else [[] for _ in range(n)],
        num_top_logprobs=logprobs if logprobs is not None else [-1] * n,
    )


# ---------------------------------------------------------------- independent numpy reference


def ref_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Plain numpy/python reference of the documented filter chain (float64)."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))  # ties: lower id first
    keep = set(order[:top_k] if top_k > 0 else order)
    # top-p on the distribution renormalised after top-k
    mass = sum(p[i] for i in keep)
    acc, kept_p = 0.0, set()
    for i in order:
        if i not in keep:
            continue
        if acc < top_p * mass or not kept_p:
            kept_p.add(i)
        acc += p[i]
    keep &= kept_p
    pmax = p[order[0]]
    keep = {i for i in keep if p[i] >= min_p * pmax}
    out = np.array([p[i] if i in keep else 0.0 for i in range(len(p))])
    return out / out.sum()


def chi2_pvalue(counts, probs):
    """Chi-square p-value of observed counts vs probs, merging cells with expected < 5."""
    counts = np.asarray(counts, dtype=np.float64)
    expected = np.asarray(probs, dtype=np.float64) * counts.sum()
    order = np.argsort(expected)
    obs_cells, exp_cells, pool_o, pool_e = [], [], 0.0, 0.0
    for i in order:
        if pool_e < 5:  # keep pooling the smallest cells until the pool is large enough
            pool_o, pool_e = pool_o + counts[i], pool_e + expected[i]
        else:
            obs_cells.append(counts[i])
            exp_cells.append(expected[i])
    if pool_e < 5 and exp_cells:  # the last pool is too small on its own: fold into a neighbour
        exp_cells[0] += pool_e
        obs_cells[0] += pool_o
    else:
        obs_cells.append(pool_o)
        exp_cells.append(pool_e)
    if len(exp_cells) < 2:
        return 1.0
    if any(e == 0 and o > 0 for o, e in zip(obs_cells, exp_cells)):
        return 0.0
    return chisquare(obs_cells, exp_cells).pvalue


T, TOP_K, TOP_P, MIN_P = 0.7, 5, 0.9, 0.05
PERM = [3, 0, 6, 1, 7, 4, 2, 5]  # token id of each rank, so sorted order != id order


def logits_for(sorted_q):
    """float32 logits whose softmax at temperature T is `sorted_q`, ranks placed at PERM ids."""
    q = np.zeros(8)
    q[PERM] = sorted_q
    return torch.tensor(T * np.log(q) + 1.3, dtype=torch.float32)


# One case per binding filter (the three filters all cut a suffix of the sorted order, so only one
# can bind per row): top-k alone; top-p, cutting only because top-k renormalised first; min-p,
# removing a token that top-k and top-p keep.
CASES = {
    "top_k": [0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.03, 0.02],
    "top_p": [0.40, 0.25, 0.13, 0.09, 0.06, 0.04, 0.02, 0.01],
    "min_p": [0.66, 0.1555, 0.032, 0.0305, 0.0305, 0.0305, 0.0305, 0.0305],
}
FULL = dict(temperature=T, top_k=TOP_K, top_p=TOP_P, min_p=MIN_P)


def test_each_filter_matters_in_the_statistical_cases():
    for name, off in (("top_k", {"top_k": 0}), ("top_p", {"top_p": 1.0}),
                      ("min_p", {"min_p": 0.0})):
        logits = logits_for(CASES[name]).numpy()
        with_all = ref_probs(logits, **FULL)
        without = ref_probs(logits, **{**FULL, **off})
        assert not np.allclose(with_all, without), name
    # the top-p case really depends on top-p seeing the top-k renormalised mass
    logits = logits_for(CASES["top_p"]).numpy()
    assert (ref_probs(logits, **FULL) > 0).sum() == 4
    assert (ref_probs(logits, temperature=T, top_p=TOP_P, min_p=MIN_P) > 0).sum() == 5


N_DRAWS = 20000


def draw_counts(logits_row, seeded=True, seed0=1000, kind="stream"):
    """Counts of N_DRAWS samples: one batch of N_DRAWS identical rows with distinct seeds, each a
    `SeededStream` (what the engine gives a seeded request) or a torch generator (`kind`)."""
    make = SeededStream if kind == "stream" else (lambda seed: make_generator(seed, "cpu"))
    gens = [make(seed0 + i) for i in range(N_DRAWS)] if seeded else None
    batch = make_batch(N_DRAWS, generators=gens, **FULL)
    out = Sampler(seed=7)(logits_row.expand(N_DRAWS, -1).contiguous(), batch)
    return np.bincount(out.token_ids.numpy(), minlength=8)


@pytest.mark.parametrize("kind", ["stream", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_sampled_distribution_matches_reference(case, kind):
    logits = logits_for(CASES[case])
    ref = ref_probs(logits.numpy(), **FULL)
    counts = draw_counts(logits, kind=kind)
    assert counts[ref == 0].sum() == 0  # filtered tokens are never drawn
    assert chi2_pvalue(counts, ref) > 1e-4
    # negative control: the same test must reject a reference that forgets the temperature
    wrong = ref_probs(logits.numpy(), temperature=1.0, top_k=TOP_K, top_p=TOP_P, min_p=MIN_P)
    assert chi2_pvalue(counts, wrong) < 1e-4


def test_shared_generator_distribution_matches_reference():
    logits = logits_for(CASES["top_p"])
    counts = draw_counts(logits, seeded=False)
    assert chi2_pvalue(counts, ref_probs(logits.numpy(), **FULL)) > 1e-4


def test_chi2_negative_control_for_a_wrong_filter_order():
    # top-p on the un-renormalised distribution keeps one more token: must be rejected
    logits = logits_for(CASES["top_p"])
    counts = draw_counts(logits, seed0=5)
    wrong = ref_probs(logits.numpy(), temperature=T, top_p=TOP_P, min_p=MIN_P)
    assert chi2_pvalue(counts, wrong) < 1e-4


# ---------------------------------------------------------------- filters, one at a time


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.5),
        dict(temperature=2.0),
        dict(top_k=3),
        dict(top_k=1000),  # larger than the vocab: no-op
        dict(top_p=0.5),
        dict(top_p=1e-6),  # always keeps at least one token
        dict(min_p=0.1),
        dict(temperature=0.8, top_k=10, top_p=0.7, min_p=0.02),
    ],
)
def test_processed_probs_match_reference(params):
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    batch = make_batch(4, **params)
    probs = processed_probs(logits, batch)
    for r in range(4):
        ref = ref_probs(logits[r].numpy(), **params)
        np.testing.assert_allclose(probs[r].numpy(), ref, rtol=1e-5, atol=1e-6)


def test_processed_probs_greedy_rows_are_one_hot():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [0.0, 2.0, 2.0, 1.0]])
    probs = processed_probs(logits, make_batch(2, temperature=[0.0, 1.0], top_k=[0, 1]))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]] * 2))


def test_top_p_ties_keep_lower_ids():
    logits = torch.zeros(1, 4)  # uniform: top_p 0.5 keeps exactly two tokens, the lowest ids
    probs = processed_probs(logits, make_batch(1, top_p=0.5))
    np.testing.assert_allclose(probs[0].numpy(), [0.5, 0.5, 0.0, 0.0])


# ---------------------------------------------------------------- greedy and reproducibility


def test_greedy_is_argmax_with_lowest_id_on_ties():
    torch.manual_seed(1)
    logits = torch.randn(6, 100)
    logits[5] = 0.0
    logits[5, [7, 3, 40]] = 5.0  # tie: 3 wins
    out = Sampler()(logits, make_batch(6, temperature=[0.0, 0.0, 0.0, 1.0, 0.5, 0.0],
                                       top_k=[0, 0, 0, 1, 1, 0]))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.token_ids[5].item() == 3
    assert out.logprobs is None and out.top_ids is None


def test_greedy_rows_consume_no_randomness():
    g, stream = make_generator(3, "cpu"), SeededStream(3)
    before = g.get_state().clone()
    Sampler()(torch.randn(2, 30), make_batch(2, temperature=0.0, generators=[g, stream]))
    assert torch.equal(g.get_state(), before) and stream.draws == 0


def test_a_sampled_row_consumes_exactly_one_draw_of_v():
    V = 30
    g, twin, stream = make_generator(3, "cpu"), make_generator(3, "cpu"), SeededStream(3)
    Sampler()(torch.randn(3, V), make_batch(3, generators=[None, g, stream]))
    torch.empty(V).exponential_(generator=twin)
    assert torch.equal(g.get_state(), twin.get_state()) and stream.draws == 1


def run_stream(steps, seed, pos, others, V=64):
    """Tokens of one seeded row over `steps`, placed at `pos` among `others` (other params)."""
    g = SeededStream(seed)
    sampler = Sampler(seed=123)
    logits_gen = torch.Generator().manual_seed(99)
    tokens = []
    for _ in range(steps):
        row = torch.randn(1, V, generator=logits_gen) * 2
        n = len(others) + 1
        filler = torch.randn(n, V)
        filler[pos] = row[0]
        temps = [o["temperature"] for o in others]
        gens = [SeededStream(o["seed"]) if o["seed"] is not None else None for o in others]
        temps.insert(pos, 0.9)
        gens.insert(pos, g)
        out = sampler(filler, make_batch(n, temperature=temps, top_p=0.95, generators=gens))
        tokens.append(out.token_ids[pos].item())
    return tokens


def test_seeded_row_is_independent_of_batch():
    alone = run_stream(8, seed=42, pos=0, others=[])
    others = [dict(temperature=1.0, seed=None), dict(temperature=0.0, seed=None),
              dict(temperature=1.3, seed=5), dict(temperature=0.7, seed=None)]
    assert run_stream(8, seed=42, pos=0, others=[]) == alone  # same seed, same tokens
    assert run_stream(8, seed=42, pos=2, others=others) == alone
    assert run_stream(8, seed=42, pos=4, others=others[::-1]) == alone
    assert run_stream(8, seed=43, pos=0, others=[]) != alone


# ---------------------------------------------------------------- penalties and suppression


def test_repetition_penalty_hf_rule_on_prompt_and_output():
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 0.5, 4.0]])
    batch = make_batch(1, rep=2.0, prompt=[[0, 1]], output=[[3, 3]])
    raw = logits.clone()
    got = apply_penalties(logits, batch)
    assert torch.equal(got, torch.tensor([[1.0, -4.0, 3.0, -2.0, 0.5, 4.0]]))
    assert torch.equal(logits, raw)  # out of place: logprobs still see the raw logits


def test_frequency_and_presence_penalties_use_output_counts_only():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    batch = make_batch(1, freq=0.5, pres=0.25, prompt=[[4, 4, 4]], output=[[0, 2, 2, 2, 1, 2]])
    got = apply_penalties(logits, batch)
    # token 0: once, token 1: once, token 2: four times, 3 and 4 never in the output
    want = torch.tensor([[1 - 0.5 - 0.25, 1 - 0.5 - 0.25, 1 - 2.0 - 0.25, 1.0, 1.0]])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_penalties_are_per_row():
    logits = torch.tensor([[2.0, 1.0, -1.0]] * 3)
    batch = make_batch(3, rep=[1.0, 4.0, 1.0], freq=[0.0, 0.0, 1.0],
                       prompt=[[], [0, 2], []], output=[[0], [], [1, 1]])
    got = apply_penalties(logits, batch)
    want = torch.tensor([[2.0, 1.0, -1.0], [0.5, 1.0, -4.0], [2.0, -1.0, -1.0]])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    out = Sampler()(logits, make_batch(1, temperature=0.0, rep=1.5, output=[[0]]))
    assert out.token_ids.item() == 1  # 3 / 1.5 = 2 < 2.5


def test_suppressed_ids_are_never_sampled():
    n = 2000
    logits = torch.zeros(n, 6)
    logits[:, 2] = 20.0
    logits[:, 5] = 19.0
    suppress = [[2, 5]] * n
    temps = [0.0 if i % 4 == 0 else 1.0 for i in range(n)]
    out = Sampler(seed=1)(logits, make_batch(n, temperature=temps, suppress=suppress))
    assert not torch.isin(out.token_ids, torch.tensor([2, 5])).any()


def test_logit_bias_from_reqs_shifts_the_processed_distribution():
    """logit_bias (OpenAI) is added after the penalties, per row: the processed distribution is
    softmax(logits + bias), greedy follows it, -100 all but bans a token, rows without one are
    untouched, and the raw logprobs ignore it (as the penalties do)."""
    torch.manual_seed(5)
    logits = torch.randn(3, 32)
    top = logits.argmax(dim=-1).tolist()
    reqs = [Req("a", [1], SamplingParams(temperature=0.0, logit_bias={7: 100.0}, logprobs=0)),
            Req("b", [1], SamplingParams(temperature=1.0, logit_bias={top[1]: -100.0, 3: 2.5})),
            Req("c", [1], SamplingParams(temperature=0.0, repetition_penalty=1.5), output_ids=[top[2]])]
    batch = SamplingBatch.from_reqs(reqs, "cpu")
    bias = torch.zeros(3, 32)
    bias[0, 7], bias[1, top[1]], bias[1, 3] = 100.0, -100.0, 2.5
    want = apply_penalties(logits, batch) + bias
    probs = processed_probs(logits, batch)
    torch.testing.assert_close(probs[1], torch.softmax(want[1], dim=-1))
    assert probs[0].argmax().item() == 7 and probs[1, top[1]] < 1e-30
    out = Sampler(seed=1)(logits, batch)
    assert out.token_ids[0].item() == 7
    assert out.token_ids[2].item() == want[2].argmax().item()  # penalised, not biased
    torch.testing.assert_close(out.logprobs[0], torch.log_softmax(logits[0], -1)[7])
    n = 4000
    draws = Sampler(seed=2)(logits[1:2].expand(n, -1).contiguous(), SamplingBatch.from_reqs([reqs[1]] * n, "cpu"))
    assert top[1] not in draws.token_ids.tolist()
    assert SamplingBatch.from_reqs(reqs[2:], "cpu").logit_bias is None


@pytest.mark.parametrize("bias, match", [({-1: 1.0}, "keys must be token ids in"), ({40: 1.0}, "keys must be"),
                                         ({3: 101.0}, "values must be in"), ({3: float("nan")}, "values must be"),
                                         ([3], "must map token ids")])
def test_logit_bias_errors(bias, match):
    from kiln.engine.request import SamplingParamsError

    with pytest.raises(SamplingParamsError, match=match):
        SamplingParams(logit_bias=bias).validate(vocab_size=32)


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_over_temperature():
    torch.manual_seed(2)
    logits = torch.randn(4, 40) * 2
    temps = [0.0, 0.7, 1.0, 1.5]
    batch = make_batch(4, temperature=temps, top_k=8, rep=1.3, output=[[0, 1]] * 4,
                       logprobs=[0, 3, -1, 5])
    out = Sampler(seed=4)(logits, batch)
    t = torch.tensor([1.0, 0.7, 1.0, 1.5])
    ref = torch.log_softmax(logits / t[:, None], dim=-1)
    torch.testing.assert_close(compute_logprobs(logits, torch.tensor(temps)), ref)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_ids.shape == (4, 5) and out.top_logprobs.shape == (4, 5)
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])
    torch.testing.assert_close(out.top_logprobs, ref.gather(1, out.top_ids))
    torch.testing.assert_close(out.top_logprobs, ref.topk(5, dim=-1).values)


def test_logprobs_zero_k_gives_chosen_only():
    out = Sampler()(torch.randn(2, 10), make_batch(2, logprobs=[0, -1]))
    assert out.logprobs.shape == (2,) and out.top_ids.shape == (2, 0)


# ---------------------------------------------------------------- from_reqs


def test_from_reqs_maps_params():
    a = Req("a", [1, 2, 3], SamplingParams(temperature=0.0, top_k=-1, min_tokens=2,
                                           stop_token_ids=[9], ignore_eos=True, logprobs=2,
                                           repetition_penalty=1.2),
            eos_token_ids=(7,), output_ids=[4])
    b = Req("b", [5], SamplingParams(top_k=4, top_p=0.5, min_p=0.1, seed=11,
                                     frequency_penalty=0.5), output_ids=[6, 6])
    c = Req("c", [8, 8], SamplingParams(min_tokens=1), eos_token_ids=(7,), output_ids=[3])
    batch = SamplingBatch.from_reqs([a, b, c], "cpu")
    assert batch.temperatures.tolist() == [0.0, 1.0, 1.0]
    assert batch.top_ks.tolist() == [0, 4, 0]
    assert batch.top_ps.tolist() == [1.0, 0.5, 1.0]
    assert batch.min_ps.tolist() == pytest.approx([0.0, 0.1, 0.0])
    assert batch.repetition_penalties.tolist() == pytest.approx([1.2, 1.0, 1.0])
    assert batch.frequency_penalties.tolist() == [0.0, 0.5, 0.0]
    assert batch.suppress_ids == [[7, 9], [], []]  # ignore_eos still suppresses under min_tokens
    assert batch.num_top_logprobs == [2, -1, -1]
    assert batch.greedy == [True, False, False]
    # ids are only carried where a penalty needs them
    assert batch.prompt_token_ids == [[1, 2, 3], [], []]
    assert batch.output_token_ids == [[4], [6, 6], []]
    # a seeded request gets a generator that lives on the Req (and survives retraction)
    assert batch.generators[0] is None and batch.generators[2] is None
    assert batch.generators[1] is b.generator is not None
    assert SamplingBatch.from_reqs([b], "cpu").generators[0] is b.generator
    # whether a drawing row searches its kept set (top-k > 1 or top-p < 1): b does
    assert batch.searches is True


def test_from_reqs_knows_whether_a_drawing_row_searches():
    """`searches` (the filter kernels' hint, `kiln.kernels.sampling.sample`): a drawing row with
    top-k > 1 or top-p < 1. Greedy rows (temperature 0, or top-k 1) and min-p alone do not."""
    def batch(*params):
        return SamplingBatch.from_reqs([Req(str(i), [1], p) for i, p in enumerate(params)], "cpu")

    assert not batch(SamplingParams(min_p=0.1), SamplingParams()).searches
    assert not batch(SamplingParams(temperature=0.0, top_p=0.5), SamplingParams(top_k=1, top_p=0.5)).searches
    assert batch(SamplingParams(), SamplingParams(top_p=0.9)).searches
    assert batch(SamplingParams(top_k=2)).searches


def test_from_reqs_precopied_ids_match_the_in_call_path():
    """`from_reqs` copies the drawing rows and the (row, id) pairs of the penalty / suppression
    lists with its other ints, so the sampler's call copies nothing: same processed logits and
    the same draws as building them in the call."""
    import dataclasses
    from types import SimpleNamespace

    from kiln.engine import sampler as sampler_mod

    def req(i, **kw):
        out = [4, 5, 5][:i]
        params = SamplingParams(max_tokens=8, seed=10 + i, **kw)
        return SimpleNamespace(params=params, generator=None, sampling_row=SamplingRow.of(params, (7,)),
                               prompt_ids=[1, 2, 3 + i], output_ids=out, num_output=len(out))

    reqs = [req(0, temperature=0.0), req(1, repetition_penalty=1.3, temperature=0.8),
            req(2, frequency_penalty=0.5, presence_penalty=0.2, temperature=0.7, min_tokens=5), req(3, top_k=1)]
    batch = SamplingBatch.from_reqs(reqs, "cpu")
    assert batch.draw_rows.tolist() == [1, 2] and batch.id_pairs["suppress"] is not None
    plain = dataclasses.replace(batch, draw_rows=None, id_pairs=None)
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampler_mod.processed_logits(logits, batch), sampler_mod.processed_logits(logits, plain))
    for r in reqs:
        r.generator = None
    again = SamplingBatch.from_reqs(reqs, "cpu")
    a = Sampler(seed=3, device="cpu")(logits, batch).token_ids
    b = Sampler(seed=3, device="cpu")(logits, dataclasses.replace(again, draw_rows=None, id_pairs=None)).token_ids
    assert torch.equal(a, b)


def test_select_rows_equals_list_indexing():
    from kiln.engine.sampler import select_rows

    x = torch.randn(5, 7)
    assert select_rows(x, [0, 1, 2, 3, 4]) is x  # a decode step: no copy at all
    for rows in ([4, 0, 2], [1], [], [0, 1, 2], [2, 2]):
        assert torch.equal(select_rows(x, rows), x[rows])
