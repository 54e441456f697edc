r"""GRPO / DAPO policy loss, advantages and train-rollout mismatch metrics (pure functions).

Notation: per-token tensors are ``[B, T]`` (right-padded) with a ``mask [B, T]`` that is 1 on the
response tokens that count. ``logp`` = log pi_theta (the policy being trained, with grad),
``old_logp`` = log pi_old (the trainer's own pre-update log-probs), ``rollout_logp`` = log-probs
reported by the rollout engine, ``ref_logp`` = log pi_ref.

Advantages (GRPO, per prompt group of G samples; Miles / slime rule)::

    A_i = r_i - mean(r)                       (Dr.GRPO when std_normalize=False)
    A_i = (r_i - mean(r)) / (std(r) + eps)    when std_normalize and std(r) > 0
                                              (std is the unbiased sample std, torch's default)

Dynamic sampling (DAPO): keep a group only if std(r) > eps (1e-8): all-equal groups carry no signal.

Policy gradient term, per token::

    ratio = exp(clamp(logp - old_logp, -20, 20))
    pg    = max(-ratio * A, -clamp(ratio, 1 - eps_clip_low, 1 + eps_clip_high) * A)

``eps_clip_high > eps_clip_low`` is DAPO clip-higher. The clipped branch is "active" (counted in
``clip_frac``) where it is strictly larger; there the token has no gradient.

Truncated importance sampling (TIS) for the rollout-engine / trainer mismatch::

    w   = clamp(exp(old_logp - rollout_logp), tis_cap_low, tis_cap)     (detached: no gradient)
    pg <- w * pg

KL to the reference policy (added with ``kl_coef`` > 0), with d = logp - ref_logp::

    k1 = d
    k2 = d^2 / 2
    k3 = exp(-d) - 1 + d                      (unbiased, non-negative estimate of KL(theta || ref))
    low_var_kl = clamp(k3 with d clamped to [-20, 20], -10, 10)

Total loss::

    loss = agg(pg) + kl_coef * agg(kl) - entropy_coef * agg(entropy)

Aggregation ``agg``:

- ``"token"`` (DAPO): sum of x over all masked tokens of the batch / number of masked tokens.
- ``"sequence"`` (GRPO): per-sample masked mean, then the mean over samples.

Metrics (python floats): ``pg_loss``, ``kl`` and ``entropy`` use the loss's aggregation (so
``loss == pg_loss + kl_coef * kl - entropy_coef * entropy``); the diagnostics ``clip_frac``,
``ppo_kl`` (= mean of old_logp - logp), ``tis_mean`` (mean of the raw, unclipped
exp(old_logp - rollout_logp)) and ``tis_clip_frac`` (fraction of tokens where the TIS clamp
changed the weight) are token means over the mask.

Train-rollout mismatch (Miles' definitions), with lt = trainer log-prob, lr = rollout log-prob and
d = lt - lr on the sampled tokens::

    train_rollout_kl               = mean(clamp(exp(d) - 1 - d, -10, 10))   (k3 of KL(rollout || train))
    train_rollout_logprob_abs_diff = mean(|d|)

(token means over the mask). Both are exactly 0 when the trainer reproduces the engine bit for bit.

Entropy from logits: H = logsumexp(z) - sum(softmax(z) * z), computed in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "LossConfig",
    "dynamic_sampling_mask",
    "entropy_from_logits",
    "group_advantages",
    "kl_estimate",
    "masked_aggregate",
    "mismatch_metrics",
    "policy_loss",
]

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOSS_AGGS = ("token", "sequence")


def group_advantages(rewards: Tensor, std_normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantages for rewards ``[num_groups, G]``: r - mean, divided by (std + eps) when
    ``std_normalize`` and the group's std > 0. A group of one sample gets advantage 0."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {tuple(rewards.shape)}")
    r = rewards.float()
    adv = r - r.mean(dim=-1, keepdim=True)
    if std_normalize and r.shape[-1] > 1:
        std = r.std(dim=-1, keepdim=True)
        adv = torch.where(std > 0, adv / (std + eps), adv)
    return adv


def dynamic_sampling_mask(rewards: Tensor, eps: float = 1e-8) -> Tensor:
    """Bool ``[num_groups]``: True for groups whose reward std > eps (DAPO dynamic sampling)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {tuple(rewards.shape)}")
    if rewards.shape[-1] < 2:
        return torch.zeros(rewards.shape[0], dtype=torch.bool, device=rewards.device)
    return rewards.float().std(dim=-1) > eps


@dataclass
class LossConfig:
    """GRPO/DAPO loss settings. Defaults: DAPO clip-higher (0.2 / 0.28), no KL, token-level
    aggregation, TIS with cap 2 (Miles' defaults). ``std_normalize`` is not used by
    ``policy_loss``: pass it to ``group_advantages`` (it lives here so one config holds the
    whole objective)."""

    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.28
    kl_coef: float = 0.0
    kl_type: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
    loss_agg: Literal["token", "sequence"] = "token"
    use_tis: bool = True
    tis_cap: float = 2.0
    tis_cap_low: float = 0.0
    entropy_coef: float = 0.0
    std_normalize: bool = True  # group_advantages' switch; False = Dr.GRPO (no division by the std)

    def __post_init__(self) -> None:
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"kl_type must be one of {KL_TYPES}, got {self.kl_type!r}")
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {self.loss_agg!r}")
        if self.eps_clip_low < 0 or self.eps_clip_high < 0 or self.eps_clip_low >= 1:
            raise ValueError(
                f"need 0 <= eps_clip_low < 1 and eps_clip_high >= 0, got {self.eps_clip_low}, {self.eps_clip_high}"
            )
        if self.tis_cap_low > self.tis_cap:
            raise ValueError(f"tis_cap_low ({self.tis_cap_low}) > tis_cap ({self.tis_cap})")


def masked_aggregate(x: Tensor, mask: Tensor, how: str) -> Tensor:
    """``"token"``: sum(x * mask) / sum(mask); ``"sequence"``: per-row masked mean, then mean over
    rows. Masked-out positions never contribute (even if they hold nan/inf). Empty -> 0."""
    m = mask.to(torch.bool)
    xm = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    mf = m.to(x.dtype)
    if how == "token":
        return xm.sum() / mf.sum().clamp_min(1.0)
    if how == "sequence":
        per_seq = xm.sum(dim=-1) / mf.sum(dim=-1).clamp_min(1.0)
        return per_seq.mean() if per_seq.numel() else per_seq.sum()
    raise ValueError(f"aggregation must be one of {LOSS_AGGS}, got {how!r}")


def kl_estimate(logp: Tensor, ref_logp: Tensor, kl_type: str) -> Tensor:
    """Per-token KL(theta || ref) estimate with d = logp - ref_logp (see the module docstring)."""
    d = logp - ref_logp
    if kl_type == "k1":
        return d
    if kl_type == "k2":
        return 0.5 * d * d
    if kl_type == "k3":
        return torch.exp(-d) - 1 + d
    if kl_type == "low_var_kl":
        d = d.clamp(-20.0, 20.0)
        return (torch.exp(-d) - 1 + d).clamp(-10.0, 10.0)
    raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")


def _token_mean(x: Tensor, mask: Tensor) -> float:
    return float(masked_aggregate(x.detach().float(), mask, "token"))


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    rollout_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO/DAPO clipped policy loss with optional TIS, KL and entropy terms.

    ``logp``, ``old_logp``, ``rollout_logp``, ``ref_logp``, ``entropy`` and ``mask`` are ``[B, T]``;
    ``advantages`` is ``[B]`` (broadcast per token) or ``[B, T]``. Only ``logp`` (and ``entropy``)
    should carry gradient; old/rollout/ref log-probs are detached here. Computes in float32.
    ``rollout_logp`` may be None when ``cfg.use_tis`` is False. Returns (scalar loss, metrics).
    """
    if logp.shape != mask.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and mask {tuple(mask.shape)} must have the same [B, T] shape")
    lp = logp.float()
    old = old_logp.detach().float()
    adv = advantages.detach().float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    m = mask.to(torch.bool)
    agg = cfg.loss_agg

    log_ratio = (lp - old).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -ratio * adv
    pg_clipped = -ratio.clamp(1.0 - cfg.eps_clip_low, 1.0 + cfg.eps_clip_high) * adv
    pg = torch.maximum(pg_unclipped, pg_clipped)
    metrics: dict[str, float] = {
        "clip_frac": _token_mean((pg_clipped > pg_unclipped).float(), m),
        "ppo_kl": _token_mean(old - lp, m),
    }

    if rollout_logp is not None:
        tis_log = (old - rollout_logp.detach().float()).clamp(-20.0, 20.0)
        tis_raw = torch.exp(tis_log)
        w = tis_raw.clamp(cfg.tis_cap_low, cfg.tis_cap).detach()
        metrics["tis_mean"] = _token_mean(tis_raw, m)
        metrics["tis_clip_frac"] = _token_mean((w != tis_raw).float(), m)
        if cfg.use_tis:
            pg = pg * w
    elif cfg.use_tis:
        raise ValueError("cfg.use_tis is set but rollout_logp is None: pass the engine's log-probs or set use_tis=False")

    pg_loss = masked_aggregate(pg, m, agg)
    loss = pg_loss
    metrics["pg_loss"] = float(pg_loss.detach())

    if cfg.kl_coef > 0 and ref_logp is None:
        raise ValueError("cfg.kl_coef > 0 needs ref_logp (the reference policy's log-probs)")
    if ref_logp is not None:
        kl = masked_aggregate(kl_estimate(lp, ref_logp.detach().float(), cfg.kl_type), m, agg)
        metrics["kl"] = float(kl.detach())
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl

    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError("cfg.entropy_coef != 0 needs the per-token entropy")
    if entropy is not None:
        ent = masked_aggregate(entropy.float(), m, agg)
        metrics["entropy"] = float(ent.detach())
        if cfg.entropy_coef != 0:
            loss = loss - cfg.entropy_coef * ent

    return loss, metrics


@torch.no_grad()
def mismatch_metrics(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """Train-rollout mismatch on the sampled tokens (Miles' definitions, token means over mask):
    ``train_rollout_kl`` = mean clamp(exp(d) - 1 - d, -10, 10) and
    ``train_rollout_logprob_abs_diff`` = mean |d|, with d = train_logp - rollout_logp."""
    d = train_logp.float() - rollout_logp.float()
    k3 = (torch.exp(d.clamp(max=20.0)) - 1 - d).clamp(-10.0, 10.0)
    return {
        "train_rollout_kl": _token_mean(k3, mask),
        "train_rollout_logprob_abs_diff": _token_mean(d.abs(), mask),
    }


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) per row: logits ``[N, V]`` -> ``[N]`` (float32)."""
    z = logits.float()
    logz = torch.logsumexp(z, dim=-1)
    p = torch.softmax(z, dim=-1)
    return logz - (p * z).sum(dim=-1)
