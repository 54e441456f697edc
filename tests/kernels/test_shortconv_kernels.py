"""Triton ShortConv kernels vs the reference `kiln.ops.shortconv.short_conv` with the history read
from the paged buffer exactly like `PagedBackend._conv_history`, plus the buffer writes.

"cpu" cases run the kernels under Triton's interpreter (tiny shapes, fp32); "cuda" cases compile
them at real shapes in bf16 and also capture and replay the decode kernel in a CUDA graph. The
kernels accumulate in the reference's order without FMA contraction, so results must be equal.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels.shortconv import short_conv_decode, short_conv_extend  # noqa: E402
from kiln.ops.shortconv import short_conv  # noqa: E402
from tests.kernels.devices import DEVICES, count_compiles  # noqa: E402



class Paged:
    """A conv buffer with spare slots, a table whose rows are not 0..B-1 and whose positions map to
    slots in random order (fragmented), and fresh slots for the new tokens."""

    def __init__(self, prefix_lens, extend_lens, c, dtype, device, gen, n_slots=None, width=None):
        b = len(prefix_lens)
        total = [p + n for p, n in zip(prefix_lens, extend_lens)]
        n_slots = n_slots or sum(total) + 7
        width = width or max(total) + 4
        perm = torch.randperm(n_slots, generator=gen)
        self.buf = torch.randn(n_slots, c, generator=gen).to(dtype)
        self.rows = torch.randperm(b + 3, generator=gen)[:b]
        # Garbage everywhere the kernel must not look: other rows, positions past the history.
        self.table = torch.randint(0, n_slots, (b + 3, width), generator=gen)
        used, out = 0, []
        for row, p, n in zip(self.rows.tolist(), prefix_lens, extend_lens):
            slots = perm[used:used + p + n]
            used += p + n
            self.table[row, :p + n] = slots
            out.append(slots[p:])  # the new tokens' slots, never part of anyone's history
        self.out_locs = torch.cat(out)
        self.prefix_lens, self.extend_lens = list(prefix_lens), list(extend_lens)
        self.device = device

    def to_device(self):
        d = self.device
        return self.buf.to(d), self.table.to(d), self.rows.to(d), self.out_locs.to(d)

    def chunk_tensors(self):
        """On the device: (prefix_lens, extend_lens, extend_starts) per sequence, as
        `short_conv_extend` takes them, and (request row, position) per token, as a chunk
        epilogue takes them (`PagedBackend.chunk_conv_args`)."""
        d, ext = self.device, self.extend_lens
        starts = [sum(ext[:i]) for i in range(len(ext))]
        positions = torch.cat([torch.arange(p, p + e) for p, e in zip(self.prefix_lens, ext)])
        token_rows = torch.repeat_interleave(self.rows, torch.tensor(ext))
        return (torch.tensor(self.prefix_lens, device=d), torch.tensor(ext, device=d), torch.tensor(starts, device=d),
                token_rows.to(d), positions.to(d))

    def reference(self, x, w):
        """(y, buffer after the step) computed the way PagedBackend does without kernels."""
        k = w.shape[1]
        buf = self.buf.to(x.device)
        prefix = torch.tensor(self.prefix_lens, device=x.device)
        pos = prefix[:, None] - (k - 1) + torch.arange(k - 1, device=x.device)
        valid = pos >= 0
        slots = self.table.to(x.device)[self.rows.to(x.device)[:, None], pos.clamp(min=0)]
        prev = buf[slots] * valid[..., None].to(buf.dtype)
        y = short_conv(x, w, self.extend_lens, prev)
        new_buf = buf.clone()
        new_buf[self.out_locs.to(x.device)] = x.to(buf.dtype)
        return y, new_buf


def _inputs(prefix_lens, extend_lens, c, k, dtype, device, seed, w_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    paged = Paged(prefix_lens, extend_lens, c, dtype, device, gen)
    x = torch.randn(sum(extend_lens), c, generator=gen).to(dtype).to(device)
    w = (torch.randn(c, k, generator=gen) * 0.5).to(w_dtype or dtype).to(device)
    return paged, x, w


def _check_extend(device, prefix_lens, extend_lens, c, k, dtype=torch.float32, seed=0, w_dtype=None):
    paged, x, w = _inputs(prefix_lens, extend_lens, c, k, dtype, device, seed, w_dtype)
    buf, table, rows, out_locs = paged.to_device()
    starts = torch.tensor([0] + extend_lens[:-1]).cumsum(0)
    as_t = lambda v: torch.as_tensor(v, dtype=torch.int64).to(device)  # noqa: E731
    y = short_conv_extend(x, w, buf, table, rows, as_t(prefix_lens), as_t(extend_lens), as_t(starts),
                          out_locs)
    want_y, want_buf = paged.reference(x, w)
    assert y.dtype == x.dtype and y.shape == x.shape
    torch.testing.assert_close(y, want_y, rtol=0, atol=0)
    torch.testing.assert_close(buf, want_buf, rtol=0, atol=0)


def _check_decode(device, seq_lens, c, k, dtype=torch.float32, seed=0, w_dtype=None):
    prefix_lens = [n - 1 for n in seq_lens]
    paged, x, w = _inputs(prefix_lens, [1] * len(seq_lens), c, k, dtype, device, seed, w_dtype)
    buf, table, rows, out_locs = paged.to_device()
    y = short_conv_decode(x, w, buf, table, rows, torch.tensor(seq_lens, device=device), out_locs)
    want_y, want_buf = paged.reference(x, w)
    torch.testing.assert_close(y, want_y, rtol=0, atol=0)
    torch.testing.assert_close(buf, want_buf, rtol=0, atol=0)


# ---------------------------------------------------------------------------------- decode


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [2, 3, 4])
def test_decode_matches_reference(device, k):
    # seq_len 1 (no history at all), shorter than K - 1, exactly K - 1, long.
    big = device == "cuda"
    seq_lens = [1, 2, k - 1 if k > 2 else 3, 9, 40] * (13 if big else 1)
    c = 2112 if big else 12  # not powers of two
    dtype = torch.bfloat16 if big else torch.float32
    _check_decode(device, seq_lens, c, k, dtype, seed=k)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_kernel_size_one_and_odd_channels(device):
    _check_decode(device, [1, 5, 3], 7, 1)  # K = 1: no history, y = x + w * x


@pytest.mark.gpu
def test_decode_bf16_with_fp32_weights_and_large_batch():
    _check_decode("cuda", [int(n) for n in torch.randint(1, 300, (256,), generator=torch.Generator().manual_seed(3))],
                  6144, 4, torch.bfloat16, w_dtype=torch.float32)


# ---------------------------------------------------------------------------------- extend


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [2, 3, 4])
def test_extend_matches_reference(device, k):
    # prefix 0 and > 0, chunks shorter than K - 1, a prefix shorter than K - 1, a decode-like row.
    prefix_lens = [0, 1, 7, 0, 2, 5]
    extend_lens = [5, 1, 3, 1, 9, 2]
    big = device == "cuda"
    if big:
        prefix_lens, extend_lens = prefix_lens * 4 + [300], extend_lens * 4 + [517]
    c = 3000 if big else 5
    dtype = torch.bfloat16 if big else torch.float32
    _check_extend(device, prefix_lens, extend_lens, c, k, dtype, seed=10 + k)


@pytest.mark.parametrize("device", DEVICES)
def test_extend_one_long_prefill(device):
    n = 2000 if device == "cuda" else 23
    _check_extend(device, [0], [n], 2048 if device == "cuda" else 9, 4,
                  torch.bfloat16 if device == "cuda" else torch.float32, seed=5)


@pytest.mark.parametrize("device", DEVICES)
def test_extend_history_comes_from_the_buffer_not_from_x(device):
    """Zeroing the history slots must change the first K-1 outputs of a chunk and nothing else."""
    paged, x, w = _inputs([6], [5], 4, 4, torch.float32, device, seed=1)
    buf, table, rows, out_locs = paged.to_device()
    args = (torch.tensor([6], device=device), torch.tensor([5], device=device), torch.tensor([0], device=device))
    y1 = short_conv_extend(x, w, buf.clone(), table, rows, *args, out_locs)
    hist = paged.table[paged.rows[0], 3:6].to(device)
    buf[hist] = 0
    y2 = short_conv_extend(x, w, buf, table, rows, *args, out_locs)
    assert not torch.equal(y1[:3], y2[:3])
    assert torch.equal(y1[3:], y2[3:])


@pytest.mark.gpu
def test_extend_bf16_with_fp32_weights():
    _check_extend("cuda", [0, 100, 3, 4096], [64, 1, 700, 33], 6144, 4, torch.bfloat16, w_dtype=torch.float32)


# ---------------------------------------------------------------------------------- CUDA graph


@pytest.mark.gpu
def test_decode_captures_in_a_cuda_graph():
    """Capture once, then replay with new values in the same input tensors: the graph must read
    them (no host sync, no value-dependent grid) and match the reference every time."""
    dev, c, k, bsz, max_len = "cuda", 2048, 4, 64, 50
    gen = torch.Generator().manual_seed(0)
    layout = dict(n_slots=bsz * max_len + 7, width=max_len + 4)

    def step_inputs(seed):
        lens = torch.randint(1, max_len, (bsz,), generator=gen).tolist()
        paged = Paged([n - 1 for n in lens], [1] * bsz, c, torch.bfloat16, dev,
                      torch.Generator().manual_seed(seed), **layout)
        x = torch.randn(bsz, c, generator=gen).to(torch.bfloat16).to(dev)
        return paged, x, torch.tensor(lens, device=dev)

    w = (torch.randn(c, k, generator=gen) * 0.5).to(torch.bfloat16).to(dev)
    paged, x, seq_lens = step_inputs(0)
    buf, table, rows, out_locs = paged.to_device()
    short_conv_decode(x, w, buf.clone(), table, rows, seq_lens, out_locs)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = short_conv_decode(x, w, buf, table, rows, seq_lens, out_locs)
    for seed in range(1, 4):
        paged, new_x, new_lens = step_inputs(seed)
        for dst, src in zip((buf, table, rows, out_locs), paged.to_device()):
            dst.copy_(src)
        x.copy_(new_x)
        seq_lens.copy_(new_lens)
        graph.replay()
        want_y, want_buf = paged.reference(x, w)
        torch.testing.assert_close(y, want_y, rtol=0, atol=0)
        torch.testing.assert_close(buf, want_buf, rtol=0, atol=0)


@pytest.mark.gpu
def test_one_variant_per_mode_whatever_the_batch_and_the_metadata_alignment(monkeypatch):
    # The metadata tensors are views into the step's buffers (their 16-byte alignment changes with
    # the batch) and the row / sequence counts follow the graph ladder (1, 16, 24, 64, ...): one
    # compiled variant per mode (decode, extend) for all of them, not one per alignment and per
    # divisibility by 16 (thirty-eighth pass: five variants at the first prefill batch of 64).
    compiled = count_compiles(monkeypatch, "_short_conv_kernel")
    dev, c, k = "cuda", 256, 4
    for offset, bsz in ((0, 1), (1, 16), (2, 24), (3, 64)):
        for mode in ("decode", "extend"):
            ext = [1] * bsz if mode == "decode" else [3] * bsz
            paged, x, w = _inputs([5] * bsz, ext, c, k, torch.bfloat16, dev, seed=bsz)
            buf, table, rows, out_locs = paged.to_device()
            pad = lambda t: torch.cat([torch.zeros(offset, dtype=t.dtype, device=dev), t])[offset:]  # noqa: E731
            meta = [pad(t) for t in (rows, torch.tensor([6] * bsz, device=dev), out_locs)]
            if mode == "decode":
                short_conv_decode(x, w, buf, table, meta[0], meta[1], meta[2])
            else:
                prefix, lens, starts, _, _ = paged.chunk_tensors()
                short_conv_extend(x, w, buf, table, meta[0], pad(prefix), pad(lens), pad(starts), meta[2])
    assert len(compiled) <= 2, f"{len(compiled)} variants of the ShortConv kernel"
