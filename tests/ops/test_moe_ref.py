"""`experts_ref` under autograd (the RL trainer's MoE): its output and every gradient equal a
per-token oracle's, with experts that get no token, one token, and many."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.moe import experts_ref


def _oracle(x, w13, w2, ids, w):
    inter = w13.shape[1] // 2
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=x.dtype)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = F.silu(w13[e, :inter] @ x[t]) * (w13[e, inter:] @ x[t])
            acc = acc + w[t, j] * (w2[e] @ h)
        rows.append(acc)
    return torch.stack(rows)


def test_experts_ref_output_and_gradients_equal_the_per_token_oracle():
    g = torch.Generator().manual_seed(0)
    T, E, K, H, I = 23, 7, 2, 8, 4
    x, w13, w2 = torch.randn(T, H, generator=g), torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])  # expert E-1 gets no token
    ids[0, 0] = 5 if 5 not in ids[0] else ids[0, 0]
    w = torch.rand(T, K, generator=g)
    grads = []
    for fn in (experts_ref, _oracle):
        leaves = [t.clone().requires_grad_(True) for t in (x, w13, w2, w)]
        y = fn(leaves[0], leaves[1], leaves[2], ids, leaves[3]).float() if fn is _oracle else \
            fn(leaves[0], leaves[1], leaves[2], ids, leaves[3], torch.float32)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        grads.append([y.detach()] + [t.grad for t in leaves])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (grads[0][2][E - 1] == 0).all() and (grads[0][3][E - 1] == 0).all()  # the idle expert's gradients
