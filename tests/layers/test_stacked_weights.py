"""`kiln.layers.stacked_weights`: separate parameters laid back to back, read as one matrix."""

from __future__ import annotations

import torch
from torch import nn

from kiln.layers.stacked_weights import stack_weights, stacked_weight


def _linears():
    torch.manual_seed(0)
    return nn.Linear(8, 5, bias=False), nn.Linear(8, 3, bias=False)


def test_stacked_weight_is_a_view_of_both_parameters():
    a, b = _linears()
    want = torch.cat([a.weight.detach(), b.weight.detach()])
    assert stacked_weight(a, b) is None  # separate allocations
    assert stack_weights(a, b)
    w = stacked_weight(a, b)
    assert torch.equal(w, want) and w.shape == (8, 8)
    assert isinstance(a.weight, nn.Parameter) and a.weight.shape == (5, 8) and b.weight.shape == (3, 8)
    with torch.no_grad():  # in-place updates (loading, RL weight sync) are seen through the view
        b.weight.add_(1.0)
        a.weight[0].zero_()
    assert torch.equal(stacked_weight(a, b), torch.cat([a.weight.detach(), b.weight.detach()]))
    assert stacked_weight(b, a) is None  # the other order does not lie back to back
    # the layers compute what they computed before, and still train apart
    x = torch.randn(2, 8)
    a(x).sum().backward()
    assert a.weight.grad is not None and b.weight.grad is None


def test_new_data_breaks_the_stack_and_stacking_again_mends_it():
    a, b = _linears()
    stack_weights(a, b)
    b.weight.data = b.weight.data.clone()  # what moving weights to the host and back does
    assert stacked_weight(a, b) is None
    assert stack_weights(a, b)
    assert torch.equal(stacked_weight(a, b), torch.cat([a.weight.detach(), b.weight.detach()]))


def test_mismatched_weights_are_left_alone():
    a, c = nn.Linear(8, 5, bias=False), nn.Linear(6, 5, bias=False)
    before = a.weight.data_ptr(), c.weight.data_ptr()
    assert not stack_weights(a, c)
    assert (a.weight.data_ptr(), c.weight.data_ptr()) == before
