"""`MixedPrecisionAdamW` (kiln.rl.optimizer): a bf16 trainer steps through fp32 master weights.

The masters must follow exactly the fp32 AdamW run on the same gradients, the model's weights must
be those masters rounded, updates that a bf16 weight cannot hold must still accumulate (they are
lost without masters: the reason for them), and a checkpoint's state must resume bit for bit."""

from __future__ import annotations

import pytest
import torch

from kiln.rl.optimizer import MixedPrecisionAdamW

LR = 1e-6  # a GRPO learning rate: below half a bf16 ulp of these weights


def _params(dtype):
    g = torch.Generator().manual_seed(0)
    # weights in [2^-5, 2^-4): a bf16 ulp of 2^-12 there, so a change needs a move of 1.2e-4
    w = torch.nn.Parameter((0.035 + 0.025 * torch.rand(64, 32, generator=g)).to(dtype))
    router = torch.nn.Parameter(torch.randn(8, 32, generator=g))  # fp32, as Kiln keeps the routers
    return [w, router]


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(64, 32, generator=g), torch.randn(8, 32, generator=g)]


def _run(opt, params, steps, first=0, grads=_grads):
    for s in range(first, first + steps):
        for p, g in zip(params, grads(s)):
            p.grad = g.to(p.dtype)
        opt.grads_to_masters()
        opt.step()
        opt.zero_grad()


def test_masters_follow_fp32_adamw_and_the_weights_are_them_rounded():
    ref = [torch.nn.Parameter(p.detach().float()) for p in _params(torch.bfloat16)]
    ref_opt = torch.optim.AdamW(ref, lr=LR)
    for s in range(5):
        w_grad, router_grad = _grads(s)
        ref[0].grad = w_grad.to(torch.bfloat16).float()  # the gradient a bf16 backward gives
        ref[1].grad = router_grad
        ref_opt.step()
        ref_opt.zero_grad()

    params = _params(torch.bfloat16)
    start = params[0].detach().clone()
    opt = MixedPrecisionAdamW(params, lr=LR)
    assert [p.dtype for p in opt.grads_to_masters()] == [torch.float32, torch.float32]
    _run(opt, params, 5)
    (master,) = opt.masters
    assert torch.equal(master, ref[0].detach())
    assert torch.equal(params[1].detach(), ref[1].detach())  # fp32 parameters step directly
    assert torch.equal(params[0].detach(), master.to(torch.bfloat16))
    assert (master - start.float()).abs().max() > 4 * LR  # the masters moved


def test_without_masters_the_small_updates_round_away():
    params = _params(torch.bfloat16)
    start = params[0].detach().clone()
    opt = MixedPrecisionAdamW(params, master_weights=False, lr=LR)
    assert not opt.masters
    _run(opt, params, 5)
    assert torch.equal(params[0].detach(), start)  # five steps, not one bf16 weight changed

    # With masters they add up: a constant gradient moves every weight by LR a step, so after
    # 200 steps (2e-4, more than half an ulp) every bf16 weight has changed.
    params = _params(torch.bfloat16)
    opt = MixedPrecisionAdamW(params, lr=LR)
    _run(opt, params, 200, grads=lambda s: [torch.ones(64, 32), torch.ones(8, 32)])
    assert (params[0].detach() != start).all()


def test_gradients_move_to_the_masters_before_the_step():
    params = _params(torch.bfloat16)
    opt = MixedPrecisionAdamW(params, lr=LR)
    params[0].grad = torch.ones(64, 32, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="grads_to_masters"):
        opt.step()
    clipped = opt.grads_to_masters()
    assert params[0].grad is None  # the bf16 gradient is freed
    assert clipped[1].grad.dtype == torch.float32 and torch.equal(clipped[1].grad, torch.ones(64, 32))


def test_state_dict_resumes_bit_for_bit():
    params = _params(torch.bfloat16)
    opt = MixedPrecisionAdamW(params, lr=LR)
    _run(opt, params, 6)
    whole = [p.detach().clone() for p in params] + [m.clone() for m in opt.masters]

    params = _params(torch.bfloat16)
    opt = MixedPrecisionAdamW(params, lr=LR)
    _run(opt, params, 3)
    state = opt.state_dict()
    saved = [p.detach().clone() for p in params]
    params = _params(torch.bfloat16)  # a fresh trainer: weights from the bf16 checkpoint ...
    with torch.no_grad():
        for p, w in zip(params, saved):
            p.copy_(w)
    opt = MixedPrecisionAdamW(params, lr=LR)
    opt.load_state_dict(state)  # ... masters and moments from the optimizer file
    _run(opt, params, 3, first=3)
    resumed = [p.detach() for p in params] + opt.masters
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed, strict=True))

    with pytest.raises(ValueError, match="master"):
        MixedPrecisionAdamW(_params(torch.bfloat16), master_weights=False, lr=LR).load_state_dict(state)


def test_a_plain_adamw_state_loads():
    """Checkpoints written before the masters hold torch.optim.AdamW's state dict."""
    params = _params(torch.float32)
    plain = torch.optim.AdamW(params, lr=LR)
    for p, g in zip(params, _grads(0)):
        p.grad = g
    plain.step()
    opt = MixedPrecisionAdamW(params, lr=LR)
    opt.load_state_dict(plain.state_dict())
    assert torch.equal(opt.optimizer.state_dict()["state"][0]["exp_avg"], plain.state_dict()["state"][0]["exp_avg"])


@pytest.mark.gpu
def test_fused_on_cuda_matches_fp32_fused_adamw():
    """The trainer builds it fused on CUDA (one kernel, no full-size temporaries)."""
    ref = [torch.nn.Parameter(p.detach().float().cuda()) for p in _params(torch.bfloat16)]
    ref_opt = torch.optim.AdamW(ref, lr=1e-4, fused=True)
    params = [torch.nn.Parameter(p.detach().cuda()) for p in _params(torch.bfloat16)]
    opt = MixedPrecisionAdamW(params, lr=1e-4, fused=True)
    for s in range(3):
        w_grad, router_grad = (g.cuda() for g in _grads(s))
        ref[0].grad, ref[1].grad = w_grad.to(torch.bfloat16).float(), router_grad
        ref_opt.step()
        params[0].grad, params[1].grad = w_grad.to(torch.bfloat16), router_grad
        opt.grads_to_masters()
        opt.step()
        opt.zero_grad()
    assert torch.equal(opt.masters[0], ref[0].detach()) and torch.equal(params[1].detach(), ref[1].detach())
    assert torch.equal(params[0].detach(), ref[0].detach().to(torch.bfloat16))
