"""Tests for kiln.engine.spec.verify (notes/algorithms.md section 1.3).

1. Exact enumeration oracle: (a) numpy closed form of both algorithms; (b) the real torch
   functions evaluated at one point of every decision region of the uniforms, weighted by the
   region's measure (regions and residuals computed independently in numpy). Both must give a
   joint over (g+1)-token strings equal to prod p(t_i | t_<i) to 1e-12.
2. Monte-Carlo chi-square of the real functions, with negative controls that must fail.
3. Boundary cases.
"""

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from kiln.engine.spec import verify as V_
from kiln.engine.spec.verify import verify_block, verify_greedy, verify_tokenwise

TOL = 1e-12


# ----------------------------------------------------------------------------- tables
def make_tables(V, g, seed, zero_frac=0.2):
    """p(.|prefix) for prefixes of length 0..g, q(.|prefix) for length 0..g-1 (dict by tuple).
    Some p and q entries are zeroed (as top-k/top-p would), and a few q rows equal p."""
    rng = np.random.default_rng(seed)

    def dist():
        x = rng.dirichlet(np.full(V, 0.7))
        mask = rng.random(V) < zero_frac
        mask[rng.integers(V)] = False
        x = np.where(mask, 0.0, x)
        return x / x.sum()

    P, Q = {}, {}
    for L in range(g + 1):
        for pre in itertools.product(range(V), repeat=L):
            P[pre] = dist()
            if L < g:
                Q[pre] = P[pre].copy() if rng.random() < 0.1 else dist()
    return P, Q


def target_joint(P, V, g):
    out = {}
    for t in itertools.product(range(V), repeat=g + 1):
        out[t] = np.prod([P[t[:i]][t[i]] for i in range(g + 1)])
    return out


def extend(P, prefix, prob, g, acc):
    """Add prob * (target extension of prefix to length g+1) into acc."""
    if prob == 0.0:
        return
    if len(prefix) == g + 1:
        acc[prefix] = acc.get(prefix, 0.0) + prob
        return
    for x, px in enumerate(P[prefix]):
        if px > 0:
            extend(P, prefix + (x,), prob * px, g, acc)


def np_residual(p, q, w=1.0):
    r = np.maximum(0.0, w * p - q)
    s = r.sum()
    return p.copy() if s <= 0 else r / s


def np_block_pieces(P, Q, X, g):
    """w_0..w_g and h_1..h_g (h[0] unused) for draft X, in numpy."""
    w = [1.0]
    h = [0.0]
    for i in range(1, g + 1):
        pre = X[: i - 1]
        pp, qq = P[pre][X[i - 1]], Q[pre][X[i - 1]]
        num = w[-1] * pp
        wi = min(1.0, num / qq) if qq > 0 else (1.0 if num > 0 else 0.0)
        w.append(wi)
        if i < g:
            r = np.maximum(0.0, wi * P[X[:i]] - Q[X[:i]]).sum()
            den = r + 1.0 - wi
            h.append(r / den if den > 0 else 0.0)
        else:
            h.append(wi)
    return w, h


def draft_prob(Q, X):
    return np.prod([Q[X[:i]][X[i]] for i in range(len(X))])


# ----------------------------------------------------------------------------- 1a closed form
@pytest.mark.parametrize("g", [2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_closed_form_oracle(g, seed):
    Vn = 4
    P, Q = make_tables(Vn, g, seed)
    ref = target_joint(P, Vn, g)
    tok, blk = {}, {}
    exp_tok = exp_blk = 0.0
    for X in itertools.product(range(Vn), repeat=g):
        px = draft_prob(Q, X)
        if px == 0:
            continue
        # token-wise: P(n = k) = prod_{j<=k} a_j (1 - a_{k+1})
        a = [min(1.0, P[X[:j]][X[j]] / Q[X[:j]][X[j]]) for j in range(g)]
        for k in range(g + 1):
            pk = np.prod(a[:k]) * (1.0 - a[k] if k < g else 1.0)
            out = P[X[:g]] if k == g else np_residual(P[X[:k]], Q[X[:k]])
            exp_tok += px * pk * k
            for y in range(Vn):
                extend(P, X[:k] + (y,), px * pk * out[y], g, tok)
        # block: P(tau = i) = h_i prod_{j>i} (1 - h_j), P(tau = 0) = prod_j (1 - h_j)
        w, h = np_block_pieces(P, Q, X, g)
        for i in range(g + 1):
            pt = (h[i] if i > 0 else 1.0) * np.prod([1.0 - h[j] for j in range(i + 1, g + 1)])
            out = P[X[:g]] if i == g else np_residual(P[X[:i]], Q[X[:i]], w[i])
            exp_blk += px * pt * i
            for y in range(Vn):
                extend(P, X[:i] + (y,), px * pt * out[y], g, blk)
    for got in (tok, blk):
        err = max(abs(got.get(t, 0.0) - ref[t]) for t in ref)
        assert err < TOL, err
        assert abs(sum(got.values()) - 1.0) < TOL
    # block verification is optimal for a single block: never fewer expected accepts
    assert exp_blk >= exp_tok - 1e-12


# ----------------------------------------------------------------------------- 1b real functions
def _region_midpoints(dist):
    """(midpoint, length, token) of each positive-length inverse-CDF interval of dist."""
    c = np.concatenate([[0.0], np.cumsum(dist)])
    c = c / c[-1]
    return [((c[y] + c[y + 1]) / 2, c[y + 1] - c[y], y) for y in range(len(dist)) if c[y + 1] > c[y]]


def _run_regions(algo, P, Q, Vn, g):
    """Evaluate the real function at one point of every decision region; returns the joint."""
    rows = []  # (X, uniforms, residual_u, weight, expected n, expected y)
    for X in itertools.product(range(Vn), repeat=g):
        px = draft_prob(Q, X)
        if px == 0:
            continue
        if algo == "tokenwise":
            thr = [min(1.0, P[X[:j]][X[j]] / Q[X[:j]][X[j]]) for j in range(g)]
        else:
            w, h = np_block_pieces(P, Q, X, g)
            thr = h[1:]
        for pattern in itertools.product([True, False], repeat=g):
            lens = [t if acc else 1.0 - t for t, acc in zip(thr, pattern)]
            if min(lens) <= 0:
                continue
            us = [t / 2 if acc else (1.0 + t) / 2 for t, acc in zip(thr, pattern)]
            if algo == "tokenwise":
                n = next((j for j in range(g) if not pattern[j]), g)
                out = P[X[:g]] if n == g else np_residual(P[X[:n]], Q[X[:n]])
            else:
                n = max([i + 1 for i in range(g) if pattern[i]], default=0)
                out = P[X[:g]] if n == g else np_residual(P[X[:n]], Q[X[:n]], w[n])
            for mid, ln, y in _region_midpoints(out):
                rows.append((X, us, mid, px * np.prod(lens) * ln, n, y))

    B = len(rows)
    p = torch.zeros(B, g + 1, Vn, dtype=torch.float64)
    q = torch.zeros(B, g, Vn, dtype=torch.float64)
    for b, (X, *_rest) in enumerate(rows):
        for i in range(g + 1):
            p[b, i] = torch.from_numpy(P[X[:i]])
        for i in range(g):
            q[b, i] = torch.from_numpy(Q[X[:i]])
    drafts = torch.tensor([r[0] for r in rows])
    u = torch.tensor([r[1] for r in rows], dtype=torch.float64)
    ru = torch.tensor([r[2] for r in rows], dtype=torch.float64)
    fn = verify_tokenwise if algo == "tokenwise" else verify_block
    n, y = fn(p, q, drafts, u, ru)
    joint = {}
    for b, (X, _, _, wt, _, _) in enumerate(rows):
        k, t = int(n[b]), int(y[b])
        extend(P, X[:k] + (t,), wt, g, joint)
    return joint


@pytest.mark.parametrize("algo", ["tokenwise", "block"])
@pytest.mark.parametrize("g", [2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_real_functions_exact_by_region_enumeration(algo, g, seed):
    Vn = 4
    P, Q = make_tables(Vn, g, seed)
    ref = target_joint(P, Vn, g)
    got = _run_regions(algo, P, Q, Vn, g)
    err = max(abs(got.get(t, 0.0) - ref[t]) for t in ref)
    assert err < TOL, err
    assert set(got) <= set(ref)


# ----------------------------------------------------------------------------- 2 Monte-Carlo
V_MC, G_MC, N_MC, T_MC = 8, 3, 200_000, 0.7


def _prefix_index(tokens, V):
    """tokens [N, L] -> flat index of the prefix in a table of all prefixes of length <= g."""
    L = tokens.shape[1]
    offset = sum(V ** l for l in range(L))
    idx = torch.zeros(tokens.shape[0], dtype=torch.long)
    for j in range(L):
        idx = idx * V + tokens[:, j]
    return idx + offset


def _mc_tables():
    gen = torch.Generator().manual_seed(1234)
    n_pre = sum(V_MC ** l for l in range(G_MC + 2))
    lp = torch.randn(n_pre, V_MC, generator=gen, dtype=torch.float64) * 1.5
    lq = lp + torch.randn(n_pre, V_MC, generator=gen, dtype=torch.float64) * 1.0
    P = torch.softmax(lp / T_MC, -1)
    Q = torch.softmax(lq / T_MC, -1)
    Q_broken = torch.softmax(lq / 1.0, -1)  # draft probs without temperature
    return P, Q, Q_broken


def _mc_run(fn, q_for_verifier="good", seed=0):
    P, Q, Qb = _mc_tables()
    gen = torch.Generator().manual_seed(seed)
    N, g = N_MC, G_MC
    drafts = torch.zeros(N, g, dtype=torch.long)
    p = torch.zeros(N, g + 1, V_MC, dtype=torch.float64)
    q = torch.zeros(N, g, V_MC, dtype=torch.float64)
    for i in range(g + 1):
        idx = _prefix_index(drafts[:, :i], V_MC)
        p[:, i] = P[idx]
        if i < g:
            q[:, i] = (Q if q_for_verifier == "good" else Qb)[idx]
            drafts[:, i] = torch.multinomial(Q[idx], 1, generator=gen).squeeze(-1)
    u = torch.rand(N, g, generator=gen, dtype=torch.float64)
    ru = torch.rand(N, generator=gen, dtype=torch.float64)
    n, y = fn(p, q, drafts, u, ru)
    first = torch.where(n > 0, drafts[:, 0], y)
    second = torch.where(n > 1, drafts[:, 1], torch.where(n == 1, y, torch.full_like(y, -1)))
    pad_idx = _prefix_index(first.unsqueeze(-1), V_MC)
    pad = torch.multinomial(P[pad_idx], 1, generator=gen).squeeze(-1)
    second = torch.where(n == 0, pad, second)
    return first, second, P


def _chi2_p(obs, expected_probs, N):
    E = N * expected_probs
    O = obs.astype(np.float64)
    small = E < 5
    if small.any():  # merge small cells into one
        E = np.concatenate([E[~small], [E[small].sum()]])
        O = np.concatenate([O[~small], [O[small].sum()]])
    chi2 = ((O - E) ** 2 / E).sum()
    return stats.chi2.sf(chi2, len(E) - 1)


def _pvalues(first, second, P):
    N = first.shape[0]
    p0 = P[0].numpy()
    pv1 = _chi2_p(np.bincount(first.numpy(), minlength=V_MC), p0, N)
    cond = P[_prefix_index(torch.arange(V_MC).unsqueeze(-1), V_MC)].numpy()  # [V, V]
    joint = (p0[:, None] * cond).reshape(-1)
    pv2 = _chi2_p(np.bincount((first * V_MC + second).numpy(), minlength=V_MC ** 2), joint, N)
    return pv1, pv2


ALGOS = {"tokenwise": verify_tokenwise, "block": verify_block}


@pytest.mark.parametrize("algo", list(ALGOS))
def test_monte_carlo_matches_target(algo):
    pv1, pv2 = _pvalues(*_mc_run(ALGOS[algo]))
    assert pv1 > 1e-4 and pv2 > 1e-4, (pv1, pv2)


def _broken_unnormalized(weights, u):
    cdf = torch.cumsum(weights, -1)  # not divided by the total mass
    idx = torch.searchsorted(cdf, u.to(weights.dtype).unsqueeze(-1), right=True).squeeze(-1)
    return idx.clamp(max=weights.shape[-1] - 1)


@pytest.mark.parametrize("algo", list(ALGOS))
@pytest.mark.parametrize("control", ["unnormalized", "residual_of_p", "q_without_temperature"])
def test_negative_controls_fail(algo, control, monkeypatch):
    if control == "unnormalized":
        monkeypatch.setattr(V_, "_inverse_cdf", _broken_unnormalized)
    elif control == "residual_of_p":
        monkeypatch.setattr(V_, "_residual_weights", lambda p, q, w: p)
    qv = "broken" if control == "q_without_temperature" else "good"
    pv1, pv2 = _pvalues(*_mc_run(ALGOS[algo], q_for_verifier=qv))
    assert min(pv1, pv2) < 1e-6, (pv1, pv2)


# ----------------------------------------------------------------------------- 3 boundaries
@pytest.mark.parametrize("algo", list(ALGOS))
def test_acceptance_threshold_boundary(algo):
    # g = 1: ratio p(d)/q(d) = 0.3/0.6 = 0.5 (for block, h_1 = w_1 = 0.5 as well)
    p = torch.tensor([[[0.3, 0.2, 0.5], [0.1, 0.1, 0.8]]], dtype=torch.float64)
    q = torch.tensor([[[0.6, 0.3, 0.1]]], dtype=torch.float64)
    d = torch.tensor([[0]])
    eps = 1e-9
    n, y = ALGOS[algo](p, q, d, torch.tensor([[0.5 - eps]], dtype=torch.float64),
                       torch.tensor([0.99], dtype=torch.float64))
    assert int(n) == 1 and int(y) == 2  # bonus from p_2
    n, y = ALGOS[algo](p, q, d, torch.tensor([[0.5 + eps]], dtype=torch.float64),
                       torch.tensor([0.0], dtype=torch.float64))
    # residual max(0, p - q) = [0, 0, 0.4]: only token 2 is possible
    assert int(n) == 0 and int(y) == 2


def test_tokenwise_boundary_multi_position_and_float32():
    p = torch.tensor([[[0.2, 0.8], [0.9, 0.1], [0.5, 0.5]]])
    q = torch.tensor([[[0.4, 0.6], [0.3, 0.7]]])
    d = torch.tensor([[0, 1]])  # ratios 0.5, 1/7
    r2 = 0.1 / 0.7
    n, _ = verify_tokenwise(p, q, d, torch.tensor([[0.49, r2 - 1e-4]]), torch.tensor([0.5]))
    assert int(n) == 2
    n, y = verify_tokenwise(p, q, d, torch.tensor([[0.49, r2 + 1e-4]]), torch.tensor([0.5]))
    assert int(n) == 1 and int(y) == 0  # residual [0.6, 0] -> token 0


def test_residual_zero_falls_back_to_p():
    p = torch.tensor([[[0.5, 0.5], [0.25, 0.75]]], dtype=torch.float64)
    q = p[:, :1].clone()
    d = torch.tensor([[1]])
    # p == q: always accepted for any u < 1 ...
    n, y = verify_tokenwise(p, q, d, torch.tensor([[0.999]], dtype=torch.float64),
                            torch.tensor([0.1], dtype=torch.float64))
    assert int(n) == 1 and int(y) == 0
    # ... and a forced rejection with an empty residual samples from p (u = 1.0 is outside [0,1)
    # but exercises the fallback).
    n, y = verify_tokenwise(p, q, d, torch.tensor([[1.0]], dtype=torch.float64),
                            torch.tensor([0.6], dtype=torch.float64))
    assert int(n) == 0 and int(y) == 1


def test_greedy_hand_examples():
    d = torch.tensor([[3, 5, 7], [3, 5, 7], [3, 5, 7], [1, 1, 1]])
    a = torch.tensor([[3, 5, 7, 9], [3, 4, 7, 9], [2, 5, 7, 9], [1, 1, 2, 1]])
    n, emitted = verify_greedy(d, a)
    assert n.tolist() == [3, 1, 0, 2]
    assert emitted == [[3, 5, 7, 9], [3, 4], [2], [1, 1, 2]]
    n, emitted = verify_greedy(torch.zeros(2, 0, dtype=torch.long), torch.tensor([[4], [6]]))
    assert n.tolist() == [0, 0] and emitted == [[4], [6]]


def test_block_at_zero_temperature_is_prefix_matching():
    gen = torch.Generator().manual_seed(7)
    B, g, Vn = 512, 4, 5
    n_pre = sum(Vn ** l for l in range(g + 2))
    tp = torch.randint(0, Vn, (n_pre,), generator=gen)
    tq = torch.where(torch.rand(n_pre, generator=gen) < 0.7, tp,
                     torch.randint(0, Vn, (n_pre,), generator=gen))
    onehot = lambda t: torch.nn.functional.one_hot(t, Vn).to(torch.float64)
    first = torch.randint(0, Vn, (B, 1), generator=gen)  # random committed context token
    drafts = torch.zeros(B, g, dtype=torch.long)
    p = torch.zeros(B, g + 1, Vn, dtype=torch.float64)
    q = torch.zeros(B, g, Vn, dtype=torch.float64)
    amax = torch.zeros(B, g + 1, dtype=torch.long)
    for i in range(g + 1):
        idx = _prefix_index(torch.cat([first, drafts[:, :i]], 1), Vn)
        p[:, i], amax[:, i] = onehot(tp[idx]), tp[idx]
        if i < g:
            q[:, i] = onehot(tq[idx])
            drafts[:, i] = tq[idx]
    u = torch.rand(B, g, generator=gen, dtype=torch.float64)
    ru = torch.rand(B, generator=gen, dtype=torch.float64)
    n_g, emitted = verify_greedy(drafts, amax)
    for fn in (verify_block, verify_tokenwise):
        n, y = fn(p, q, drafts, u, ru)
        assert torch.equal(n, n_g)
        assert y.tolist() == [e[-1] for e in emitted]
    assert 0 < int((n_g == g).sum()) < B and int((n_g == 0).sum()) > 0


def test_accepted_prefix_equals_verify_greedy():
    from kiln.engine.spec.verify import accepted_prefix

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        k = int(torch.randint(0, 5, (1,), generator=g))
        drafts = torch.randint(0, 3, (1, k), generator=g)
        samples = torch.randint(0, 3, (1, k + 1), generator=g)
        n, _ = verify_greedy(drafts, samples)
        assert accepted_prefix(drafts[0].tolist(), samples[0].tolist()) == int(n[0])


def test_drafts_in_flight_are_read_back_once_and_only_when_read():
    from kiln.engine.spec.drafter import DraftsInFlight, DraftState

    flight = DraftsInFlight.start(torch.tensor([[5, 6, 7], [8, 9, 10]]))
    a, b = DraftState(), DraftState()
    a.set_in_flight(flight, 0, 3)
    b.set_in_flight(flight, 1, 2)
    assert a.num_drafts == 3 and b.num_drafts == 2 and flight.readback._lists is None  # nothing read yet
    assert b.drafts == [8, 9] and b.in_flight is None and b.num_drafts == 2
    assert a.drafts == [5, 6, 7]
    a.set_in_flight(flight, 0, 3)
    a.drafts = []  # dropped before anyone read them
    assert a.in_flight is None and a.num_drafts == 0 and a.drafts == []
