"""Exact verification of sampled drafts (`--speculative-use-rejection-sampling`,
`--speculative-use-block-verification`), on the CPU in fp32.

1. Chi-square on the engine's own verification stage (`sampled_verify.verify_rounds`, which
   `SpecDecoder` calls, with the real sampler processing): mock target and draft logit tables over
   every prefix (V = 8, g = 4), drafts drawn by the engine's `draw_drafts` (q processed like p:
   temperature, top-k, a presence penalty counting the drafts before each row as output),
   N = 200k independent rounds in one call. The first emitted token (df = V - 1) and the first
   two jointly (pad with a target draw when one token was emitted) are compared with an
   independent reference of the processed target; cells with E < 5 are merged; the p-value must
   be > 1e-4. Negative controls (unnormalised residual, residual of p instead of max(0, p - q),
   q processed without the temperature the drafts were drawn with) must fail the same test.
2. End to end on the tiny Inkling with 4 MTP layers: sampled requests verify with either flag,
   finish, are reproducible with a seed whatever else is batched, record acceptance; every
   emitted token's logit row equals the packed reference; the drafter's q rows are exactly the
   processed distributions of its draft logits; greedy requests with the flags equal plain greedy.
3. Flag errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kiln.config import EngineConfig
from kiln.engine.request import SamplingParams, SamplingRow
from kiln.engine.sampler import Sampler, SamplingBatch, processed_probs
from kiln.engine.spec import sampled_verify as SV
from kiln.engine.spec import verify as V_
from kiln.engine.spec.sampled_verify import RowView, draw_drafts, row_view, verify_rounds, verify_views
from tests.engine.test_hybrid_engine import assert_reference, make_core, prompts
from tests.engine.test_speculative import SPEC_INKLING, plain_core, run_plain, run_spec, spec_core

# ----------------------------------------------------------------------------- 1 chi-square
V, G, N = 8, 4, 200_000
TEMP, TOP_K, PRESENCE = 0.7, 6, 0.4
BASE_OUT = [2]  # the request's output so far: the presence penalty sees it in every row
PARAMS = SamplingParams(temperature=TEMP, top_k=TOP_K, presence_penalty=PRESENCE)


def _prefix_index(tokens: torch.Tensor) -> torch.Tensor:
    """tokens [N, L] -> row of that prefix in a table of every prefix of length <= G."""
    L = tokens.shape[1]
    idx = torch.zeros(tokens.shape[0], dtype=torch.long)
    for j in range(L):
        idx = idx * V + tokens[:, j]
    return idx + sum(V ** i for i in range(L))


def _ref_probs(logits: np.ndarray, output: list[int]) -> np.ndarray:
    """Independent reference of the processed target: presence penalty on the output, then
    temperature, softmax, top-k, renormalise (float64)."""
    x = logits.astype(np.float64).copy()
    for t in set(output):
        x[t] -= PRESENCE
    p = np.exp((x - x.max()) / TEMP)
    p /= p.sum()
    keep = np.argsort(-p, kind="stable")[:TOP_K]
    out = np.zeros_like(p)
    out[keep] = p[keep]
    return out / out.sum()


def _req(params=PARAMS) -> SimpleNamespace:
    """What the engine's views read of a request (unseeded: the sampler's shared generator)."""
    return SimpleNamespace(params=params, prompt_ids=[], output_ids=BASE_OUT, eos_token_ids=(), generator=None,
                           sampling_row=SamplingRow.of(params, ()))


def _views(drafts: torch.Tensor, params=PARAMS) -> list[RowView]:
    """The drafter's view of each round's next draft row: drafts [N, i] counted as output."""
    req = _req(params)
    return [row_view(req, d, "cpu") for d in drafts.tolist()]


@pytest.fixture(scope="module")
def rounds():
    """Mock tables, N rounds drafted by the engine's `draw_drafts`, and the target rows."""
    gen = torch.Generator().manual_seed(1234)
    n_pre = sum(V ** i for i in range(G + 1))
    P = torch.randn(n_pre, V, generator=gen) * 1.5  # target logits per prefix of drafts
    Q = P + torch.randn(n_pre, V, generator=gen)  # draft logits: close, not equal
    # negative control: the q a drafter would hand over if it processed its rows without the
    # temperature its drafts were drawn with (one row per prefix of drafts)
    hot = SamplingParams(temperature=1.0, top_k=TOP_K, presence_penalty=PRESENCE)
    every = [torch.tensor(list(itertools.product(range(V), repeat=i))).reshape(V ** i, i) for i in range(G)]
    Q_hot = torch.cat([SV.draft_probs(Q[_prefix_index(t)], _views(t, hot)) for t in every])
    sampler = Sampler(seed=7)
    drafts = torch.zeros(N, 0, dtype=torch.long)
    q, q_hot = [], []
    for i in range(G):
        idx = _prefix_index(drafts)
        tokens, qi = draw_drafts(sampler, Q[idx], _views(drafts))
        q.append(qi)
        q_hot.append(Q_hot[idx])
        drafts = torch.cat([drafts, torch.tensor(tokens).unsqueeze(1)], 1)
    target = torch.stack([P[_prefix_index(drafts[:, :i])] for i in range(G + 1)], 1).reshape(-1, V)
    req = _req()  # the SpecDecoder's views of the verify rows
    batch = SamplingBatch.from_reqs([v for d in drafts.tolist() for v in verify_views(req, d, "cpu")], "cpu")
    # expected: first token, and second given the first, from the reference
    p1 = _ref_probs(P[0].numpy(), BASE_OUT)
    cond = np.stack([_ref_probs(P[1 + t].numpy(), BASE_OUT + [t]) for t in range(V)])
    return dict(target=target, batch=batch, drafts=drafts.tolist(), q=torch.stack(q, 1).reshape(-1, V),
                q_hot=torch.stack(q_hot, 1).reshape(-1, V), p1=p1, cond=cond)


def chi2_sf(x: float, df: int) -> float:
    """P(chi2_df > x) = Q(df / 2, x / 2), the regularised upper incomplete gamma (no scipy)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value, with every cell of expected count < 5 merged into one."""
    E = probs * counts.sum()
    O = counts.astype(np.float64)
    small = E < 5
    if small.any():
        E = np.concatenate([E[~small], [E[small].sum()]])
        O = np.concatenate([O[~small], [O[small].sum()]])
    if np.any((E == 0) & (O > 0)):
        return 0.0  # a token with zero target probability was emitted
    keep = E > 0
    return chi2_sf(float(((O[keep] - E[keep]) ** 2 / E[keep]).sum()), int(keep.sum()) - 1)


def _batch_to(batch: SamplingBatch, dev) -> SamplingBatch:
    """The same sampling batch with its tensors on `dev`."""
    move = lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x  # noqa: E731
    pairs = None if batch.id_pairs is None else {
        k: None if v is None else tuple(move(t) for t in v) for k, v in batch.id_pairs.items()}
    return dataclasses.replace(batch, **{f.name: move(getattr(batch, f.name)) for f in dataclasses.fields(batch)
                                         if f.name != "id_pairs"}, id_pairs=pairs)


def engine_pvalues(rounds, method: str, q_key: str = "q", device: str = "cpu") -> tuple[float, float, float]:
    """Run the verification stage on every round (on `device`: on CUDA the sampler's processing
    and draws are the Triton kernels); p-values of the first token and of the first two jointly,
    and the mean number of accepted drafts."""
    batch = rounds["batch"] if device == "cpu" else _batch_to(rounds["batch"], device)
    out, accepted = verify_rounds(Sampler(seed=11, device=device), rounds["target"].to(device), batch,
                                  rounds["drafts"], rounds[q_key].to(device), [None] * N, method)
    tok = out.token_ids.view(N, G + 1).cpu()
    n = torch.tensor(accepted)
    first, second = tok[:, 0], tok[:, 1]
    # one token emitted: pad with a draw from the target given it
    gen = torch.Generator().manual_seed(3)
    pad = torch.multinomial(torch.from_numpy(rounds["cond"])[first], 1, generator=gen).squeeze(1)
    second = torch.where(n == 0, pad, second)
    pv1 = chi2_pvalue(np.bincount(first.numpy(), minlength=V), rounds["p1"])
    joint = (rounds["p1"][:, None] * rounds["cond"]).reshape(-1)
    pv2 = chi2_pvalue(np.bincount((first * V + second).numpy(), minlength=V * V), joint)
    return pv1, pv2, float(n.double().mean())


@pytest.fixture(scope="module")
def honest(rounds):
    """engine_pvalues of both methods on the unbroken path."""
    return {m: engine_pvalues(rounds, m) for m in ("tokenwise", "block")}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["tokenwise", "block"])
def test_engine_verification_matches_the_processed_target(honest, method):
    pv1, pv2, mean_acc = honest[method]
    assert pv1 > 1e-4 and pv2 > 1e-4, (pv1, pv2)
    assert 0.5 < mean_acc < G, mean_acc  # drafts are accepted and rejected


@pytest.mark.slow
def test_block_accepts_more_than_tokenwise(honest):
    assert honest["block"][2] > honest["tokenwise"][2], honest


def _unnormalised_inverse_cdf(weights, u):
    cdf = torch.cumsum(weights, -1)  # not scaled by the total mass
    idx = torch.searchsorted(cdf, u.to(weights.dtype).unsqueeze(-1).contiguous(), right=True).squeeze(-1)
    return idx.clamp(max=weights.shape[-1] - 1)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["tokenwise", "block"])
@pytest.mark.parametrize("control", ["unnormalised_residual", "residual_of_p", "q_without_temperature"])
def test_broken_variants_fail_the_same_test(rounds, method, control, monkeypatch):
    if control == "unnormalised_residual":
        monkeypatch.setattr(V_, "_inverse_cdf", _unnormalised_inverse_cdf)
    elif control == "residual_of_p":
        monkeypatch.setattr(V_, "_residual_weights", lambda p, q, w: p)
    pv1, pv2, _ = engine_pvalues(rounds, method, "q_hot" if control == "q_without_temperature" else "q")
    assert min(pv1, pv2) < 1e-6, (pv1, pv2)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["tokenwise", "block"])
def test_verification_on_cuda_matches_the_processed_target(rounds, method, monkeypatch):
    # The same rounds verified on the GPU (the Triton sampling kernels process p, the uniforms come
    # from the CUDA generator, the verification kernel `kiln.kernels.spec_verify` decides); a
    # broken residual must fail there too. The break is the reference's (the torch verification
    # on CUDA): the kernel has no seam to break, and equals the reference on random rounds
    # (tests/kernels/test_spec_verify.py).
    pv1, pv2, mean_acc = engine_pvalues(rounds, method, device="cuda")
    assert pv1 > 1e-4 and pv2 > 1e-4, (pv1, pv2)
    assert 0.5 < mean_acc < G, mean_acc
    monkeypatch.setattr(SV, "kernels_supported", lambda device: False)
    monkeypatch.setattr(V_, "_residual_weights", lambda p, q, w: p)
    assert min(engine_pvalues(rounds, method, device="cuda")[:2]) < 1e-6


# ----------------------------------------------------------------------------- 2 end to end
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("inkling_mtp")
    (d / "config.json").write_text(json.dumps(SPEC_INKLING))
    return str(d)


FLAGS = {"tokenwise": dict(speculative_use_rejection_sampling=True),
         "block": dict(speculative_use_block_verification=True)}


def mixed_params() -> list[SamplingParams]:
    """Sampled requests with every kind of processing, and a greedy one in the same batch, with
    different max_tokens (each request's last round is cut by the commit at its own point)."""
    return [
        SamplingParams(max_tokens=24, temperature=0.8, top_k=20, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=19, temperature=1.0, top_p=0.9, min_p=0.02, repetition_penalty=1.2,
                       frequency_penalty=0.3, presence_penalty=0.5, seed=6, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=22, temperature=0.7, min_tokens=12, stop_token_ids=[3], seed=7),
    ]


def watch(core):
    """Record every draft pass's q rows with what they must equal, and every accepted token's
    logprob entry."""
    spec, sched = core.scheduler.spec, core.scheduler
    passes, tokens = [], []
    run, accept = spec.drafter.run, sched._accept_token

    def run_and_record(reqs, num_drafts):
        spec.drafter.keep_logits = True
        run(reqs, num_drafts)
        for r in reqs:
            if r.spec.drafts:
                passes.append((r, list(r.output_ids), list(r.spec.drafts), list(r.spec.draft_logits), r.spec.q))

    def accept_and_record(r, t, logprob):
        tokens.append((r, t, logprob))
        return accept(r, t, logprob)

    spec.drafter.run, sched._accept_token = run_and_record, accept_and_record
    return passes, tokens


def assert_q_rows_are_processed_draft_logits(passes, min_rows: int = 20) -> None:
    """Every pass `watch` recorded: a sampled request's q rows are the sampler's processing of its
    draft logits (the drafts before each row counted as output) and give its draft a nonzero
    probability; a greedy request keeps argmax drafts and no q."""
    n_q = 0
    for r, out, drafts, logits, q in passes:
        if r.params.greedy:
            assert q is None and drafts == [int(x.argmax()) for x in logits]
            continue
        assert q is not None and q.shape == (len(drafts), len(logits[0]))
        for i, d in enumerate(drafts):
            view = RowView(r.params, r.prompt_ids, out + drafts[:i], r.eos_token_ids, None)
            expect = processed_probs(logits[i][None], SamplingBatch.from_reqs([view], "cpu"))[0]
            assert torch.allclose(q[i], expect, atol=1e-7) and q[i, d] > 0
            n_q += 1
    assert n_q > min_rows


@pytest.mark.parametrize("method", ["tokenwise", "block"])
def test_sampled_requests_verify_exactly_and_reproducibly(model_dir, method):
    ps, params = prompts(4, seed=21, lo=20, hi=50), mixed_params()
    core = spec_core(model_dir, 3, alpha=0.01, page_size=4, **FLAGS[method])
    passes, accepted = watch(core)
    res, _, last = run_spec(core, ps, params=params)
    assert_reference(core, res)  # every emitted token's logit row; integrity ran after every step
    counts = core.stats().spec
    assert counts.verify_steps > 0 and 1.5 < counts.accept_length, counts.accept_rate_per_position
    for rid in ("r0", "r1", "r3"):
        assert last[rid].finished and last[rid].spec.verify_steps > 0
    assert len(res["r0"][1]) == 24 and len(res["r1"][1]) == 19
    # the greedy request in the batch: greedy drafts, greedy verification, plain greedy output
    assert res["r2"][1] == run_plain(plain_core(model_dir, alpha=0.01, page_size=4), [ps[2]], max_tokens=21)["r0"]

    assert_q_rows_are_processed_draft_logits(passes)
    # logprobs of the raw distribution at the emitted tokens (r1 asks for them)
    lp_rows = torch.log_softmax(torch.stack(res["r1"][2]) / params[1].temperature, -1)
    entries = [(t, lp) for r, t, lp in accepted if r.rid == "r1"]
    assert [t for t, _ in entries] == res["r1"][1]
    for i, (t, (lp, top)) in enumerate(entries):
        assert abs(lp - lp_rows[i, t].item()) < 1e-4 and len(top) == 2

    # same seeds, another batch: the seeded requests' tokens do not change
    again = spec_core(model_dir, 3, alpha=0.01, page_size=4, **FLAGS[method])
    res2, _, _ = run_spec(again, [ps[1], ps[0]], params=[params[1], params[0]])
    assert res2["r0"][1] == res["r1"][1] and res2["r1"][1] == res["r0"][1]
    assert_reference(again, res2)


@pytest.mark.parametrize("method", ["tokenwise", "block"])
def test_greedy_requests_with_the_flags_equal_plain_greedy(model_dir, method):
    ps = prompts(3, seed=22, lo=10, hi=60)
    kw = dict(page_size=4, chunked_prefill_size=16, max_prefill_tokens=24)
    core = spec_core(model_dir, 4, alpha=0.01, **kw, **FLAGS[method])
    res, drafts, _ = run_spec(core, ps, max_tokens=20)
    assert {rid: r[1] for rid, r in res.items()} == run_plain(plain_core(model_dir, alpha=0.01, **kw), ps,
                                                              max_tokens=20)
    counts = core.stats().spec
    assert 0 < counts.accepted_tokens < sum(counts.proposed)
    assert_reference(core, res)


def test_verify_rounds_mixed_draft_lengths_and_seeded_streams():
    # Rounds of k = 2, 0, 3 in one call: row layout d_1..d_n, y, 0..; a seeded round's outcome
    # does not depend on the other rounds.
    gen = torch.Generator().manual_seed(0)
    ks = [2, 0, 3]
    logits = torch.randn(sum(k + 1 for k in ks), V, generator=gen)
    q = torch.softmax(torch.randn(sum(ks), V, generator=gen), -1)
    drafts = [[1, 2], [], [3, 4, 5]]
    params = SamplingParams(temperature=0.9, seed=1)
    views = [RowView(params, [], d[:i], (), None) for d in drafts for i in range(len(d) + 1)]
    seeded = lambda: [torch.Generator().manual_seed(s) for s in (1, 2, 3)]  # noqa: E731
    for method in ("tokenwise", "block"):
        out, n = verify_rounds(Sampler(), logits, SamplingBatch.from_reqs(views, "cpu"), drafts, q, seeded(),
                               method)
        tok, row = out.token_ids.tolist(), 0
        for d, k, nb in zip(drafts, ks, n):
            assert 0 <= nb <= k and tok[row:row + nb] == d[:nb] and tok[row + nb + 1:row + k + 1] == [0] * (k - nb)
            row += k + 1
        out3, n3 = verify_rounds(Sampler(seed=99), logits[4:], SamplingBatch.from_reqs(views[4:], "cpu"),
                                 drafts[2:], q[2:], seeded()[2:], method)
        assert n3 == n[2:] and out3.token_ids.tolist() == tok[4:]


# ----------------------------------------------------------------------------- 3 flags
def test_flag_errors_and_cli(model_dir):
    with pytest.raises(ValueError, match="pick one"):
        EngineConfig(speculative_algorithm="mtp", speculative_use_rejection_sampling=True,
                     speculative_use_block_verification=True)
    for flag in FLAGS.values():
        with pytest.raises(ValueError, match="needs --speculative-algorithm"):
            make_core(model_dir, **flag)
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    cfg = EngineConfig.from_cli_args(parser.parse_args(
        ["--speculative-algorithm", "mtp", "--speculative-use-block-verification"]))
    assert cfg.speculative_use_block_verification and not cfg.speculative_use_rejection_sampling
    with pytest.raises(ValueError, match="needs --speculative-algorithm"):
        EngineConfig.from_cli_args(parser.parse_args(["--speculative-use-rejection-sampling"]))


def test_row_view_counts_the_drafts_before_it_as_output():
    # the view's output (penalties) and its count (min_tokens) include the drafts before the row;
    # the request's own list is not changed
    req = _req()
    views = verify_views(req, [11, 12], "cpu")
    assert [v.output_ids for v in views] == [BASE_OUT, BASE_OUT + [11], BASE_OUT + [11, 12]]
    assert [v.num_output for v in views] == [len(BASE_OUT) + i for i in range(3)]
    assert req.output_ids == BASE_OUT
