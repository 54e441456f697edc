"""Inkling's MTP chain on packed sequences: masks, alignment (row i sees tokens up to t_{i+k})."""

from __future__ import annotations

import torch

from kiln.models.reference import packed_batch
from tests.models.test_inkling import tiny_inkling


def _mtp(model, ids, lens):
    with torch.no_grad():
        hidden = model(packed_batch(ids, lens))
        return model.forward_mtp_reference(ids, lens, hidden)


def test_mtp_chain_shapes_packing_and_causality():
    model = tiny_inkling(seed=11, num_mtp_layers=3)
    assert [m.block.self_attn.attn.key_gap for m in model.mtp] == [0, 1, 2]
    assert all(m.block.self_attn.attn.sliding_window == 16 for m in model.mtp)
    lens = [30, 3, 19]
    ids = torch.randint(0, 512, (sum(lens),), generator=torch.Generator().manual_seed(12))
    out = _mtp(model, ids, lens)
    assert [o.shape[0] for o in out] == [sum(max(n - k, 0) for n in lens) for k in (1, 2, 3)]
    assert out[0].std() > 0.1
    # Packed == each sequence alone.
    start, rows = 0, [0, 0, 0]
    for n in lens:
        alone = _mtp(model, ids[start:start + n], [n])
        for k in range(3):
            m = max(n - k - 1, 0)
            torch.testing.assert_close(out[k][rows[k]:rows[k] + m], alone[k], atol=2e-5, rtol=2e-5)
            rows[k] += m
        start += n
    # Row i of layer k depends on t_0 .. t_{i+k} only: change every token after t_{i+k}.
    seq = ids[:30]
    base = _mtp(model, seq, [30])
    for k in (1, 2, 3):
        for i in (4, 17):
            changed = seq.clone()
            changed[i + k + 1:] = (changed[i + k + 1:] + 1) % 512
            got = _mtp(model, changed, [30])[k - 1]
            torch.testing.assert_close(got[:i + 1], base[k - 1][:i + 1], atol=2e-5, rtol=2e-5)
            # ... and does depend on t_{i+k} itself.
            changed = seq.clone()
            changed[i + k] = (changed[i + k] + 1) % 512
            assert not torch.allclose(_mtp(model, changed, [30])[k - 1][i], base[k - 1][i])
