"""kiln.rl.loss: hand-checked advantages, clipping, TIS, KL estimators, aggregation and metrics."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.rl.loss import (
    LossConfig,
    dynamic_sampling_mask,
    entropy_from_logits,
    group_advantages,
    kl_estimate,
    mismatch_metrics,
    policy_loss,
)

PLAIN = dict(use_tis=False, kl_coef=0.0, entropy_coef=0.0)


def _one_token(ratio: float, adv: float, cfg: LossConfig):
    """A single-token batch whose PPO ratio is `ratio`; returns (loss, grad wrt logp, metrics)."""
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    loss, metrics = policy_loss(logp, old, old, torch.tensor([adv]), torch.ones(1, 1), cfg)
    loss.backward()
    return loss.item(), logp.grad.item(), metrics


def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 3.0, 0.0, 0.0]])
    a = group_advantages(r, std_normalize=False)
    torch.testing.assert_close(a, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [-0.75, 2.25, -0.75, -0.75]]))

    a = group_advantages(r)
    std0 = math.sqrt((4 * 0.25) / 3)  # unbiased std of [1, 0, 0, 1]
    std2 = math.sqrt((3 * 0.75**2 + 2.25**2) / 3)
    expect = torch.tensor(
        [
            [0.5 / (std0 + 1e-6), -0.5 / (std0 + 1e-6), -0.5 / (std0 + 1e-6), 0.5 / (std0 + 1e-6)],
            [0.0, 0.0, 0.0, 0.0],  # std == 0: no division, no nan
            [x / (std2 + 1e-6) for x in (-0.75, 2.25, -0.75, -0.75)],
        ]
    )
    torch.testing.assert_close(a, expect)
    assert torch.isfinite(a).all()
    assert torch.equal(group_advantages(torch.tensor([[5.0], [1.0]])), torch.zeros(2, 1))  # G = 1
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, 2.0]))


def test_dynamic_sampling_drops_all_equal_groups():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5 + 1e-3]])
    assert dynamic_sampling_mask(r).tolist() == [False, False, True, True]


def test_clip_above_one_plus_eps_high_has_zero_gradient_for_positive_advantage():
    cfg = LossConfig(**PLAIN)
    loss, grad, metrics = _one_token(1.5, 2.0, cfg)  # 1.5 > 1 + 0.28
    assert grad == 0.0
    assert loss == pytest.approx(-(1 + 0.28) * 2.0)
    assert metrics["clip_frac"] == 1.0


def test_ratio_inside_the_range_gives_gradient_minus_a_times_ratio():
    cfg = LossConfig(**PLAIN)
    for ratio, adv in [(1.1, 2.0), (0.9, -1.5), (1.0, 0.7), (1.25, 3.0)]:
        loss, grad, metrics = _one_token(ratio, adv, cfg)
        assert loss == pytest.approx(-ratio * adv)
        assert grad == pytest.approx(-adv * ratio)  # d(-A * exp(logp - old)) / d logp
        assert metrics["clip_frac"] == 0.0


def test_negative_advantage_clips_below_one_minus_eps_low_only():
    cfg = LossConfig(**PLAIN)
    _, grad, m = _one_token(0.7, -1.0, cfg)  # ratio < 0.8 with A < 0: clipped, no gradient
    assert grad == 0.0 and m["clip_frac"] == 1.0
    _, grad, m = _one_token(1.5, -1.0, cfg)  # ratio > 1 + eps with A < 0: never clipped (pessimistic bound)
    assert grad == pytest.approx(1.5) and m["clip_frac"] == 0.0
    _, grad, m = _one_token(0.5, 1.0, cfg)  # ratio < 1 - eps with A > 0: not clipped
    assert grad == pytest.approx(-0.5) and m["clip_frac"] == 0.0


def test_clip_higher_is_asymmetric():
    cfg = LossConfig(eps_clip_low=0.2, eps_clip_high=0.28, **PLAIN)
    # 1.25 is beyond a symmetric 0.2 but inside clip-higher's 0.28: still gets a gradient.
    _, grad, _ = _one_token(1.25, 1.0, cfg)
    assert grad == pytest.approx(-1.25)
    _, grad_sym, _ = _one_token(1.25, 1.0, LossConfig(eps_clip_low=0.2, eps_clip_high=0.2, **PLAIN))
    assert grad_sym == 0.0
    # The low side still uses 0.2: 0.78 is clipped for a negative advantage.
    _, grad, _ = _one_token(0.78, -1.0, cfg)
    assert grad == 0.0
    _, grad, _ = _one_token(0.82, -1.0, cfg)
    assert grad == pytest.approx(0.82)


def test_token_vs_sequence_aggregation_with_different_lengths():
    # Sample 0 has 1 token (A = 1), sample 1 has 3 tokens (A = -1); ratio 1 everywhere -> pg = -A.
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -1.0])
    tok, _ = policy_loss(logp, logp, logp, adv, mask, LossConfig(loss_agg="token", **PLAIN))
    seq, _ = policy_loss(logp, logp, logp, adv, mask, LossConfig(loss_agg="sequence", **PLAIN))
    assert tok.item() == pytest.approx((-1 + 3 * 1) / 4)  # token-sum / total tokens = 0.5
    assert seq.item() == pytest.approx((-1 + 1) / 2)  # per-sample means -1 and +1, then mean = 0

    # Non-trivial per-token values: pg_t = -A * ratio_t.
    logp = torch.log(torch.tensor([[1.1, 7.0, 7.0], [0.9, 1.0, 1.2]]))
    old = torch.zeros(2, 3)
    adv = torch.tensor([2.0, 1.0])
    cfg_t = LossConfig(loss_agg="token", eps_clip_low=0.5, eps_clip_high=0.5, **PLAIN)
    cfg_s = LossConfig(loss_agg="sequence", eps_clip_low=0.5, eps_clip_high=0.5, **PLAIN)
    tok, _ = policy_loss(logp, old, old, adv, mask, cfg_t)
    seq, _ = policy_loss(logp, old, old, adv, mask, cfg_s)
    assert tok.item() == pytest.approx((-2.2 - 0.9 - 1.0 - 1.2) / 4, rel=1e-6)
    assert seq.item() == pytest.approx((-2.2 + (-0.9 - 1.0 - 1.2) / 3) / 2, rel=1e-6)


def test_padding_is_ignored_even_if_it_holds_garbage():
    logp = torch.tensor([[0.0, float("nan")], [0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, float("inf")], [0.0, 0.0]])
    mask = torch.tensor([[1, 0], [1, 1]])
    loss, metrics = policy_loss(logp, old, old, torch.tensor([1.0, 2.0]), mask, LossConfig())
    loss.backward()
    assert loss.item() == pytest.approx(-(1 + 2 + 2) / 3)
    assert torch.isfinite(logp.grad[mask.bool()]).all()
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_ratio_one_without_kl_or_tis_is_minus_mean_advantage(agg):
    torch.manual_seed(0)
    B, T = 4, 5
    logp = torch.randn(B, T)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]])
    adv = torch.tensor([0.5, -1.0, 2.0, -0.25])
    loss, metrics = policy_loss(logp, logp, None, adv, mask, LossConfig(loss_agg=agg, **PLAIN))
    lengths = mask.sum(-1).float()
    expect = -(adv * lengths).sum() / lengths.sum() if agg == "token" else -adv.mean()
    assert loss.item() == pytest.approx(expect.item(), abs=1e-6)
    assert metrics["pg_loss"] == pytest.approx(loss.item())
    assert metrics["clip_frac"] == 0.0 and metrics["ppo_kl"] == 0.0


def test_tis_weight_is_capped_and_has_no_gradient():
    # old - rollout: log 3 (capped to 2), log 0.5 (kept), 0 (kept), log 0.1 (floored to 0.2 with tis_cap_low).
    old = torch.log(torch.tensor([[3.0, 0.5, 1.0, 0.1]]))
    rollout = torch.zeros(1, 4, requires_grad=True)
    old_req = old.clone().requires_grad_(True)
    logp = old.clone().requires_grad_(True)  # ratio 1 -> pg = -A
    mask = torch.ones(1, 4)
    cfg = LossConfig(use_tis=True, tis_cap=2.0, tis_cap_low=0.2)
    loss, metrics = policy_loss(logp, old_req, rollout, torch.tensor([1.0]), mask, cfg)
    assert loss.item() == pytest.approx(-(2.0 + 0.5 + 1.0 + 0.2) / 4, rel=1e-6)
    assert metrics["tis_clip_frac"] == pytest.approx(0.5)
    assert metrics["tis_mean"] == pytest.approx((3.0 + 0.5 + 1.0 + 0.1) / 4, rel=1e-6)
    loss.backward()
    assert rollout.grad is None and old_req.grad is None  # w and old_logp are detached
    # Gradient wrt logp is -A * ratio * w per token / 4 tokens.
    torch.testing.assert_close(logp.grad, -torch.tensor([[2.0, 0.5, 1.0, 0.2]]) / 4)

    # use_tis=False: same inputs, weights ignored (metrics still reported).
    loss, metrics = policy_loss(logp, old, rollout, torch.tensor([1.0]), mask, LossConfig(use_tis=False))
    assert loss.item() == pytest.approx(-1.0)
    assert "tis_mean" in metrics
    with pytest.raises(ValueError, match="rollout_logp"):
        policy_loss(logp, old, None, torch.tensor([1.0]), mask, LossConfig(use_tis=True))


def test_kl_estimators_by_hand():
    logp = torch.tensor([0.0, 0.5, -1.0, -30.0])
    ref = torch.tensor([0.0, 0.0, 0.0, 0.0])
    d = [0.0, 0.5, -1.0, -30.0]
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor(d))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([x * x / 2 for x in d]))
    k3 = [math.exp(-x) - 1 + x for x in d]
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.tensor(k3))
    assert k3[1] == pytest.approx(0.1065306597, rel=1e-8) and k3[2] == pytest.approx(math.e - 2)
    low = kl_estimate(logp, ref, "low_var_kl")
    torch.testing.assert_close(low[:3], torch.tensor(k3[:3]))
    assert low[3].item() == 10.0  # d clamped to -20, then the value clamped to 10
    assert (kl_estimate(torch.randn(100), torch.randn(100), "k3") >= 0).all()


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_term_in_the_loss(kl_type):
    logp = torch.tensor([[0.5, -1.0]], requires_grad=True)
    ref = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    cfg = LossConfig(kl_coef=0.1, kl_type=kl_type, use_tis=False)
    loss, metrics = policy_loss(logp, logp.detach(), None, torch.tensor([1.0]), mask, cfg, ref_logp=ref)
    expect_kl = kl_estimate(logp.detach(), ref, kl_type).mean().item()
    assert metrics["kl"] == pytest.approx(expect_kl, rel=1e-6)
    assert loss.item() == pytest.approx(-1.0 + 0.1 * expect_kl, rel=1e-6)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, logp.detach(), None, torch.tensor([1.0]), mask, cfg)


def test_entropy_bonus():
    logp = torch.zeros(1, 2)
    ent = torch.tensor([[1.0, 3.0]], requires_grad=True)
    cfg = LossConfig(entropy_coef=0.01, use_tis=False)
    loss, metrics = policy_loss(logp, logp, None, torch.tensor([1.0]), torch.ones(1, 2), cfg, entropy=ent)
    assert metrics["entropy"] == pytest.approx(2.0)
    assert loss.item() == pytest.approx(-1.0 - 0.01 * 2.0)
    loss.backward()
    torch.testing.assert_close(ent.grad, torch.full((1, 2), -0.01 / 2))


def test_ppo_kl_metric():
    logp = torch.tensor([[-1.0, -2.0]])
    old = torch.tensor([[-1.1, -1.9]])
    _, m = policy_loss(logp, old, None, torch.tensor([0.0]), torch.ones(1, 2), LossConfig(use_tis=False))
    assert m["ppo_kl"] == pytest.approx(((-1.1 + 1.0) + (-1.9 + 2.0)) / 2, abs=1e-7)


def test_bad_config():
    with pytest.raises(ValueError, match="kl_type"):
        LossConfig(kl_type="k4")
    with pytest.raises(ValueError, match="loss_agg"):
        LossConfig(loss_agg="batch")


def test_mismatch_metrics():
    torch.manual_seed(0)
    lt = torch.randn(3, 6)
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    m = mismatch_metrics(lt, lt.clone(), mask)
    assert m == {"train_rollout_kl": 0.0, "train_rollout_logprob_abs_diff": 0.0}

    lr = lt + 0.1 * torch.randn(3, 6)
    lr_padded = lr.clone()
    lr_padded[~mask.bool()] = 100.0  # padding must not matter
    m = mismatch_metrics(lt, lr_padded, mask)
    assert m["train_rollout_kl"] > 0 and m["train_rollout_logprob_abs_diff"] > 0
    d = (lt - lr)[mask.bool()]
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx(d.abs().mean().item(), rel=1e-5)
    assert m["train_rollout_kl"] == pytest.approx((torch.exp(d) - 1 - d).mean().item(), rel=1e-5)
    # Per-token clamp at 10.
    big = mismatch_metrics(torch.tensor([[50.0]]), torch.tensor([[0.0]]), torch.ones(1, 1))
    assert big["train_rollout_kl"] == 10.0


def test_entropy_from_logits():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]])
    h = entropy_from_logits(logits)
    p = torch.softmax(logits[2], -1)
    torch.testing.assert_close(h, torch.stack([torch.tensor(math.log(4)), torch.tensor(0.0), -(p * p.log()).sum()]))
    assert entropy_from_logits(logits.to(torch.bfloat16)).dtype == torch.float32
