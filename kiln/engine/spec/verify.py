"""Pure verification functions for speculative decoding (notes/algorithms.md, section 1).

Conventions (batch B, draft length g, vocabulary V):
  p[b, i] = target distribution after the committed prefix and drafts d_1..d_i  (i = 0..g)
  q[b, i] = draft distribution that d_{i+1} was sampled from                      (i = 0..g-1)
Both must be the *final* sampling distributions (penalties, temperature, top-k/p, min-p
applied identically, e.g. `sampler.processed_probs`). All randomness comes in as explicit
uniforms in [0, 1), so every function is deterministic. Any float dtype works (fp64 is fine).
"""

from __future__ import annotations

import torch

__all__ = ["verify_greedy", "verify_tokenwise", "verify_block"]


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample from normalize(weights) [B, V] with uniforms u [B] by inverse CDF.

    Returns the first index whose cumulative mass exceeds u * total; only indices with
    positive weight can be chosen. Rows must have positive total mass."""
    cdf = torch.cumsum(weights, dim=-1)
    total = cdf[:, -1:]
    target = u.to(weights.dtype).unsqueeze(-1) * total
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # Rounding guard (u * total >= cdf[-1]): fall back to the last index with positive weight.
    V = weights.shape[-1]
    last_pos = V - 1 - torch.argmax((weights.flip(-1) > 0).to(torch.int8), dim=-1)
    return torch.where(idx >= V, last_pos, idx)


def _residual_weights(p: torch.Tensor, q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Unnormalised residual max(0, w * p - q) for rows p, q [B, V] and weights w [B]."""
    return torch.clamp(w.unsqueeze(-1) * p - q, min=0.0)


def _sample_residual(p: torch.Tensor, q: torch.Tensor, w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample from normalize(max(0, w p - q)); rows whose residual is all zero sample from p."""
    r = _residual_weights(p, q, w)
    empty = r.sum(dim=-1) <= 0
    r = torch.where(empty.unsqueeze(-1), p, r)
    return _inverse_cdf(r, u)


def _gather_draft(probs: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """probs [B, g(+1), V], drafts [B, g] -> probs[b, i, drafts[b, i]] as [B, g]."""
    g = drafts.shape[1]
    return torch.gather(probs[:, :g], 2, drafts.long().unsqueeze(-1)).squeeze(-1)


def _check(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor) -> None:
    B, g = drafts.shape
    if p.shape[:2] != (B, g + 1) or q.shape[:2] != (B, g) or p.shape[2] != q.shape[2]:
        raise ValueError(f"shape mismatch: p {tuple(p.shape)}, q {tuple(q.shape)}, drafts {tuple(drafts.shape)}")


def verify_greedy(draft_tokens: torch.Tensor, target_argmax: torch.Tensor):
    """Greedy verification (section 1.1).

    draft_tokens [B, g], target_argmax [B, g+1]. Accepts the longest prefix with
    d_j == a_j and emits d_1..d_n, a_{n+1}. Returns (num_accepted [B] long, emitted: list of
    per-row token lists, each of length num_accepted + 1)."""
    B, g = draft_tokens.shape
    if target_argmax.shape != (B, g + 1):
        raise ValueError(f"target_argmax must be [B, g+1], got {tuple(target_argmax.shape)}")
    match = (draft_tokens.long() == target_argmax[:, :g].long()).long()
    n = torch.cumprod(match, dim=1).sum(dim=1)
    emitted = []
    for b in range(B):
        k = int(n[b])
        emitted.append(draft_tokens[b, :k].tolist() + [int(target_argmax[b, k])])
    return n, emitted


def accepted_prefix(drafts: list[int], samples: list[int]) -> int:
    """`verify_greedy`'s n for one round on host lists: the longest prefix with samples[i] ==
    drafts[i] (`samples` has len(drafts) + 1 entries). The engine's per-round check, without a
    tensor per request."""
    n = 0
    while n < len(drafts) and samples[n] == drafts[n]:
        n += 1
    return n


def accepted_prefixes(drafts: list[list[int]], samples: list[int]) -> list[int]:
    """`accepted_prefix` of consecutive rounds: round b's len(drafts[b]) + 1 samples follow round
    b - 1's in `samples`."""
    out, row = [], 0
    for d in drafts:
        out.append(accepted_prefix(d, samples[row:row + len(d) + 1]))
        row += len(d) + 1
    return out


def committed_counts(samples: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Greedy rounds on the device: samples [n, K + 1] (the verify's argmax per row), drafts
    [n, K] -> each round's committed count, its accepted prefix + 1 ([n] int64; `verify_greedy`'s
    n + 1). The reference of `kiln.kernels.greedy_accept.committed_counts`."""
    K = drafts.shape[1]
    return (samples[:, :K] == drafts).long().cumprod(dim=1).sum(dim=1) + 1


def verify_tokenwise(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                     uniforms: torch.Tensor, residual_uniform: torch.Tensor):
    """Token-wise speculative sampling for a chain (section 1.2).

    Accept d_i iff u_i * q_i(d_i) < p_i(d_i); stop at the first rejection n+1 and sample the
    replacement from normalize(max(0, p_{n+1} - q_{n+1})) (from p_{n+1} if that is all zero);
    if all g are accepted, sample the bonus from p_{g+1}. Returns (num_accepted [B],
    next_token [B])."""
    _check(p, q, drafts)
    B, g = drafts.shape
    rows = torch.arange(B, device=p.device)
    pd = _gather_draft(p, drafts)
    qd = _gather_draft(q, drafts)
    accept = uniforms.to(p.dtype) * qd < pd
    n = torch.cumprod(accept.long(), dim=1).sum(dim=1)

    p_n = p[rows, n]                                   # [B, V]; n == g selects p_{g+1}
    q_pad = torch.cat([q, q.new_zeros(B, 1, q.shape[2])], dim=1)  # (g = 0 too)
    q_n = q_pad[rows, n]                               # zero row for the bonus: residual == p
    next_token = _sample_residual(p_n, q_n, torch.ones_like(p_n[:, 0]), residual_uniform)
    return n, next_token


def verify_block(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                 uniforms: torch.Tensor, residual_uniform: torch.Tensor):
    """Block verification of Sun et al., arXiv 2403.10444 (section 1.4).

    w_0 = 1, w_i = min(1, w_{i-1} p(X_i|X^{i-1}) / q(X_i|X^{i-1}));
    h_i = r_i / (r_i + 1 - w_i) with r_i = sum_x max(0, w_i p(x|X^i) - q(x|X^i)) for i < g,
    h_g = w_g (0/0 := 0). tau = the largest i with eta_i < h_i (0 if none; eta = uniforms).
    Emit X_1..X_tau then Y ~ p(.|X^g) if tau == g, else Y ~ normalize(max(0, w_tau p - q)) at
    position tau (p itself if that residual is all zero). Returns (num_accepted = tau [B],
    next_token [B]).

    The comparison is strict (eta < h, like u*q < p token-wise); it differs from the paper's
    `eta <= h` only on a null set and never selects a position with h_i == 0."""
    _check(p, q, drafts)
    B, g = drafts.shape
    rows = torch.arange(B, device=p.device)
    dt = p.dtype
    pd = _gather_draft(p, drafts)
    qd = _gather_draft(q, drafts)

    w = torch.ones(B, g + 1, dtype=dt, device=p.device)       # w[:, i] = w_i
    h = torch.zeros(B, g + 1, dtype=dt, device=p.device)      # h[:, i] = h_i (h_0 unused)
    for i in range(1, g + 1):
        num = w[:, i - 1] * pd[:, i - 1]
        den = qd[:, i - 1]
        ratio = torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)),
                            (num > 0).to(dt))                 # q(X_i) == 0: 0/0 := 0, x/0 -> 1
        w[:, i] = torch.clamp(ratio, max=1.0)
        if i < g:
            r = _residual_weights(p[:, i], q[:, i], w[:, i]).sum(dim=-1)
            hden = r + 1.0 - w[:, i]
            h[:, i] = torch.where(hden > 0, r / torch.where(hden > 0, hden, torch.ones_like(hden)),
                                  torch.zeros_like(r))
        else:
            h[:, i] = w[:, i]

    # Backward scan: tau = max{i : eta_i < h_i}, 0 if none.
    tau = torch.zeros(B, dtype=torch.long, device=p.device)
    hit = uniforms.to(dt) < h[:, 1:]                          # [B, g]
    for i in range(g, 0, -1):
        tau = torch.where((tau == 0) & hit[:, i - 1], torch.full_like(tau, i), tau)

    p_t = p[rows, tau]
    q_pad = torch.cat([q, q.new_zeros(B, 1, q.shape[2])], dim=1)  # (g = 0 too)
    q_t = q_pad[rows, tau]                                    # zero row at tau == g -> sample p
    w_t = torch.where(tau == g, torch.ones_like(w[:, 0]), w[rows, tau])
    next_token = _sample_residual(p_t, q_t, w_t, residual_uniform)
    return tau, next_token
