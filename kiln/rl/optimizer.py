"""`MixedPrecisionAdamW`: the trainer's AdamW, stepping low-precision parameters through fp32
master copies.

A bf16 trainer computes in bf16 (as the rollout engine does, so the two see the same weights),
but an AdamW update is far below a bf16 weight's resolution: AdamW moves each weight by about
the learning rate, and at lr 1e-6 a weight near 0.02 (bf16 ulp 2^-13 ~ 1.2e-4 there) needs a
move of half an ulp, 60x more, to change at all: the update rounds away and the policy never
moves. As Megatron's mixed-precision optimizer (and Miles / slime on top of it) does, the
optimizer keeps an fp32 master copy of every low-precision trainable parameter:

- backward accumulates gradients in the parameters' dtype (micro-batches add up there);
- `grads_to_masters` moves them to the masters in fp32, freeing the low-precision ones;
- AdamW (fp32 moments) updates the masters; the model's weights become the masters rounded.

fp32 parameters (the MoE routers, an fp32 trainer) step directly. Memory per low-precision
parameter: 2 bytes of weight + 4 of master + 8 of moments, plus its gradient (2 bytes during the
backward, 4 at the step), against 8 for bf16 weights with bf16 moments and no master
(`master_weights=False`, whose small updates round away: kept for timing and memory studies).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch


class MixedPrecisionAdamW:
    """AdamW over `params`, through fp32 masters for those not in fp32 (unless `master_weights`
    is False). The optimizer calls a trainer makes: `grads_to_masters()` after the backward (it
    returns the tensors whose gradients to clip), `step()`, `zero_grad()`, `param_groups` (the
    learning rate), `state_dict()` / `load_state_dict()` (moments and masters, for checkpoints).

    Once built, the masters are the weights' source of truth: a weight written into the model
    afterwards is overwritten at the next step, so load weights before building it (the trainer
    builds it on first use)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], master_weights: bool = True, **adamw: Any):
        params = list(params)
        stepped_as_is = [not master_weights or p.dtype == torch.float32 for p in params]
        self.direct = [p for p, as_is in zip(params, stepped_as_is) if as_is]
        self.pairs = [(p, p.detach().to(torch.float32, copy=True)) for p, as_is in zip(params, stepped_as_is)
                      if not as_is]
        self.optimizer = torch.optim.AdamW(self.direct + [m for _, m in self.pairs], **adamw)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def masters(self) -> list[torch.Tensor]:
        return [m for _, m in self.pairs]

    def grads_to_masters(self) -> list[torch.Tensor]:
        """Move every low-precision gradient to its master in fp32 (one at a time, so the peak is
        one parameter's fp32 gradient above the masters'); returns the optimizer's tensors, whose
        `.grad` the caller clips."""
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
            p.grad = None
        return self.direct + self.masters

    @torch.no_grad()
    def step(self) -> None:
        """The AdamW step; then the model's low-precision weights take the updated masters."""
        assert all(p.grad is None for p, _ in self.pairs), "call grads_to_masters() before step()"
        self.optimizer.step()
        self._masters_to_model()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p, _ in self.pairs:
            p.grad = None

    @torch.no_grad()
    def _masters_to_model(self) -> None:
        for p, m in self.pairs:
            p.copy_(m)

    def state_dict(self) -> dict:
        """The AdamW state and the masters, by reference as torch's optimizers give their moments
        (a copy would cost another 4 bytes a parameter on the device while a checkpoint is written)."""
        return {"adamw": self.optimizer.state_dict(), "masters": self.masters}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Moments and masters from `state_dict()`; a plain AdamW state dict (checkpoints written
        before the masters, or by an fp32 trainer) loads the moments and keeps the masters as the
        current weights."""
        if "adamw" not in state:
            self.optimizer.load_state_dict(state)
            return
        masters = state["masters"]
        if len(masters) != len(self.pairs):
            raise ValueError(f"the checkpoint holds {len(masters)} fp32 master weights, this trainer has "
                             f"{len(self.pairs)}: resume with the same trainer dtype and master_weights setting")
        self.optimizer.load_state_dict(state["adamw"])
        for m, saved in zip(self.masters, masters):
            m.copy_(saved)
        self._masters_to_model()
