"""ShortConv: the packed reference op against F.conv1d, chunking and decode with carried state."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.engine.batch import ForwardBatch, ForwardMode
from kiln.layers.attention import PackedAttentionBackend
from kiln.layers.shortconv import ShortConv
from kiln.ops.shortconv import short_conv, short_conv_final_state

C, K = 6, 4


def _oracle(x, w):
    """One sequence: residual + depthwise conv1d after left-padding K-1 zeros (fp64)."""
    xt = x.double().T[None]  # [1, C, n]
    y = F.conv1d(F.pad(xt, (w.shape[1] - 1, 0)), w.double()[:, None, :], groups=x.shape[1])
    return (y[0].T + x.double())


def _data(seq_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(seq_lens), C, generator=g), torch.randn(C, K, generator=g)


def test_current_token_tap_is_the_last_column():
    x = torch.randn(5, C)
    w = torch.zeros(C, K)
    w[:, K - 1] = 2.0
    torch.testing.assert_close(short_conv(x, w, [5]), x + 2 * x)
    w = torch.zeros(C, K)
    w[:, 0] = 1.0  # the oldest tap: K-1 tokens back, zeros before the start
    want = x.clone()
    want[K - 1:] += x[:5 - (K - 1)]
    torch.testing.assert_close(short_conv(x, w, [5]), want)


def test_packed_equals_each_sequence_alone_and_conv1d():
    seq_lens = [1, 3, 9, 4]
    x, w = _data(seq_lens)
    y = short_conv(x, w, seq_lens)
    start = 0
    for n in seq_lens:
        sl = slice(start, start + n)
        torch.testing.assert_close(y[sl], short_conv(x[sl], w, [n]), atol=0, rtol=0)
        torch.testing.assert_close(y[sl].double(), _oracle(x[sl], w), atol=1e-5, rtol=1e-5)
        start += n


def test_chunks_with_state_equal_the_whole_sequence():
    x, w = _data([20], seed=1)
    full = short_conv(x, w, [20])
    state, outs, start = None, [], 0
    for n in [5, 1, 2, 7, 5]:  # chunks shorter than K-1 too
        chunk = x[start:start + n]
        outs.append(short_conv(chunk, w, [n], state))
        state = short_conv_final_state(chunk, [n], state, kernel_size=K)
        start += n
    torch.testing.assert_close(torch.cat(outs), full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, x[-(K - 1):][None])


def test_decode_one_token_at_a_time_for_a_batch():
    """Several sequences decode together (seq_lens all 1, prev [B, K-1, C]) after a prefill."""
    lens, prompt = [11, 6, 2], [3, 1, 2]
    xs = [torch.randn(n, C) for n in lens]
    w = torch.randn(C, K)
    first = torch.cat([x[:p] for x, p in zip(xs, prompt)])
    state = short_conv_final_state(first, prompt, None, kernel_size=K)
    assert state.shape == (3, K - 1, C)
    outs = [[y] for y in short_conv(first, w, prompt).split(prompt)]
    for step in range(max(n - p for n, p in zip(lens, prompt))):
        live = [b for b in range(3) if prompt[b] + step < lens[b]]
        x_t = torch.stack([xs[b][prompt[b] + step] for b in live])
        prev = state[live]
        y_t = short_conv(x_t, w, [1] * len(live), prev)
        state[live] = short_conv_final_state(x_t, [1] * len(live), prev)
        for i, b in enumerate(live):
            outs[b].append(y_t[i:i + 1])
    for b in range(3):
        torch.testing.assert_close(torch.cat(outs[b]).double(), _oracle(xs[b], w), atol=1e-5, rtol=1e-5)


def test_final_state_left_pads_with_prev_or_zeros():
    x = torch.randn(3, C)
    w = torch.randn(C, K)
    prev = torch.randn(2, K - 1, C)
    st = short_conv_final_state(x, [1, 2], prev)
    torch.testing.assert_close(st[0], torch.cat([prev[0, 1:], x[:1]]))
    torch.testing.assert_close(st[1], torch.cat([prev[1, 2:], x[1:3]]))
    st0 = short_conv_final_state(x[:1], [1], None, kernel_size=K)
    torch.testing.assert_close(st0[0], torch.cat([torch.zeros(K - 2, C), x[:1]]))
    assert w.shape[1] == K


def test_low_precision_accumulates_in_fp32_and_casts_once():
    x, w = _data([12], seed=3)
    xb, wb = x.bfloat16(), w.bfloat16()
    got = short_conv(xb, wb, [12])
    assert got.dtype == torch.bfloat16
    want = _oracle(xb.float(), wb.float()).to(torch.bfloat16)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("seq_lens", [[7], [2, 5, 3]])
def test_layer_through_the_packed_backend(seq_lens):
    x, w = _data(seq_lens, seed=4)
    conv = ShortConv(conv_id=5, channels=C, kernel_size=K)
    conv.weight_loader(conv.weight, w[:, None, :])  # the conv1d [C, 1, K] layout loads too
    t = sum(seq_lens)
    batch = ForwardBatch(ForwardMode.TRAIN, input_ids=torch.zeros(t, dtype=torch.long),
                         positions=torch.cat([torch.arange(n) for n in seq_lens]),
                         prefix_lens=[0] * len(seq_lens), extend_lens=seq_lens,
                         logits_indices=torch.arange(t), backend=PackedAttentionBackend())
    torch.testing.assert_close(conv(x, batch), short_conv(x, w, seq_lens), atol=0, rtol=0)
