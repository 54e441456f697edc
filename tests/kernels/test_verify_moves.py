"""`kiln.kernels.verify_moves`: the verify's inputs moved on in one launch equal the PyTorch
reference, for the device round's tokens (last[b, shift[b] - 1]) and prompt lookup's (last[b, 0]),
one to four slot maps and strided token sources."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels.verify_moves import move_verify_inputs  # noqa: E402
from kiln.ops.verify_moves import move_verify_inputs as move_verify_inputs_reference  # noqa: E402
from tests.kernels.devices import DEVICES  # noqa: E402


def random_case(n: int, q: int, maps: int, seed: int, device: str, rows: int = 9, context: int = 64):
    """Inputs as the graph runner leaves them after a verify: positions L_b - 1 .. L_b - 2 + q,
    room for any shift 1 .. q in every table; tokens from strided sources."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, context - 2 * q, (n,), generator=g)
    state = dict(positions=(lens[:, None] - 1 + torch.arange(q)).contiguous(), prefix_lens=lens - 1,
                 seq_lens=lens + q - 1, req_slots=torch.randperm(rows, generator=g)[:n],
                 input_ids=torch.randint(0, 100, (n, q), generator=g))
    tables = [torch.randint(0, 10_000, (rows, context), generator=g) for _ in range(maps)]
    outs = [torch.zeros(n, q, dtype=torch.int64) for _ in range(maps)]
    shift = torch.randint(1, q + 1, (n,), generator=g)
    to = lambda t: t.to(device)  # noqa: E731
    # row-strided views, sliced on the device (a copy across devices would make them contiguous)
    samples = to(torch.randint(0, 1000, (n, q + 3), generator=g))[:, 1:q + 1]
    drafts = to(torch.randint(0, 1000, (n, 2 * q), generator=g))[:, :q - 1]
    assert samples.stride(0) == q + 3 and (q == 1 or drafts.stride(0) == 2 * q)
    return (to(shift), samples, drafts, {k: to(v) for k, v in state.items()},
            [(to(t), to(o)) for t, o in zip(tables, outs)])


def run(fn, shift, last, last_at_shift, drafts, state, maps):
    state = {k: v.clone() for k, v in state.items()}
    maps = [(t, o.clone()) for t, o in maps]
    fn(shift, last, last_at_shift, drafts, state["positions"], state["prefix_lens"], state["seq_lens"],
       state["req_slots"], state["input_ids"], maps)
    return state, [o for _, o in maps]


@pytest.mark.parametrize("device", DEVICES)
def test_a_transposed_column_of_drafts_is_taken(device):
    # MTP's drafts at K = 1 are a [n, 1] transpose of [1, n] (strides (1, n)), which torch calls
    # contiguous: the kernel reads only column 0, so it must take them
    shift, samples, drafts, state, slot_maps = random_case(3, 2, 2, seed=5, device=device)
    drafts = drafts.t().contiguous().t()
    assert drafts.shape == (3, 1) and drafts.stride() == (1, 3)
    want = run(move_verify_inputs_reference, shift, samples, True, drafts, state, slot_maps)
    got = run(move_verify_inputs, shift, samples, True, drafts, state, slot_maps)
    for w, g in zip([*want[0].values(), *want[1]], [*got[0].values(), *got[1]]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,q,maps", [(1, 4, 1), (3, 4, 3), (5, 9, 4), (2, 2, 2), (6, 1, 1)])
@pytest.mark.parametrize("last_at_shift", [True, False])
def test_moves_equal_the_reference(device, n, q, maps, last_at_shift):
    shift, samples, drafts, state, slot_maps = random_case(n, q, maps, seed=n * 31 + q * 7 + maps, device=device)
    if not last_at_shift:  # prompt lookup: the host's [last, drafts] rows
        ids = torch.cat([samples[:, :1], drafts], dim=1)
        last, drafts = ids, ids[:, 1:]
    else:
        last = samples
    want_state, want_outs = run(move_verify_inputs_reference, shift, last, last_at_shift, drafts, state, slot_maps)
    got_state, got_outs = run(move_verify_inputs, shift, last, last_at_shift, drafts, state, slot_maps)
    for k in want_state:
        torch.testing.assert_close(got_state[k], want_state[k], rtol=0, atol=0, msg=k)
    for got, want in zip(got_outs, want_outs):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # the reference itself: row b moved by shift[b], its first token the one the mode names
    b = n - 1
    assert (want_state["positions"][b] == state["positions"][b] + shift[b]).all()
    first = samples[b, shift[b] - 1] if last_at_shift else last[b, 0]
    assert want_state["input_ids"][b, 0] == first
    assert (want_outs[-1][b] == slot_maps[-1][0][state["req_slots"][b], want_state["positions"][b]]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_bad_buffers_are_refused(device):
    shift, samples, drafts, state, slot_maps = random_case(2, 4, 5, seed=3, device=device)
    with pytest.raises(AssertionError):  # more window spaces than the kernel takes
        run(move_verify_inputs, shift, samples, True, drafts, state, slot_maps)
    with pytest.raises(AssertionError):  # int32 positions
        run(move_verify_inputs, shift, samples, True, drafts, {**state, "positions": state["positions"].int()},
            slot_maps[:1])
