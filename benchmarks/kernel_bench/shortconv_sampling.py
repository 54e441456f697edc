"""ShortConv and sampling kernels vs their torch references on one GPU.

    python -m benchmarks.kernel_bench.shortconv_sampling [--quick]

Medians of `triton.testing.do_bench` (ms, shown in us), printed as one table:
- ShortConv decode (one token per sequence) and extend (16-token chunks after a 100-token prefix)
  at B = 1, 64, 256 and C = 2048, 4096, 6144 (K = 4, bf16, fragmented paged buffer): the reference
  is what `PagedBackend.short_conv` runs without kernels (history gather through the table, buffer
  write, `kiln.ops.shortconv.short_conv`);
- sampling at V = 49216 and 128256, B = 1, 64, 256 for four parameter mixes: the reference
  `kiln.engine.sampler.filtered_probs` (one stable sort) against `kiln.kernels.sampling.
  filtered_probs`, and the reference filter + exponential race against the fused
  `kiln.kernels.sampling.sample`.
"""

from __future__ import annotations

import argparse

import torch
import triton

from kiln.engine import sampler as ref_sampler
from kiln.kernels import sampling
from kiln.kernels.shortconv import short_conv_decode, short_conv_extend
from kiln.ops.shortconv import short_conv

TINY = torch.finfo(torch.float32).tiny


def _bench(fn) -> float:
    """Median time in microseconds."""
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


# ------------------------------------------------------------------------------ ShortConv


def _paged(prefix_lens, extend_lens, c, dev, gen):
    """Buffer, table, rows, starts and out_locs of a fragmented conv space."""
    b = len(prefix_lens)
    total = [p + n for p, n in zip(prefix_lens, extend_lens)]
    n_slots = sum(total) + 64
    perm = torch.randperm(n_slots, generator=gen)
    table = torch.zeros(b + 1, max(total) + 1, dtype=torch.int64)
    used, out = 0, []
    for row, (p, n) in enumerate(zip(prefix_lens, extend_lens)):
        slots = perm[used:used + p + n]
        used += p + n
        table[row + 1, :p + n] = slots
        out.append(slots[p:])
    buf = torch.randn(n_slots, c, generator=gen).to(torch.bfloat16)
    rows = torch.arange(1, b + 1)
    starts = torch.tensor([0] + list(extend_lens[:-1])).cumsum(0)
    return buf.to(dev), table.to(dev), rows.to(dev), starts.to(dev), torch.cat(out).to(dev)


def _conv_reference(x, w, buf, table, rows, prefix_lens, prefix_t, extend_lens, out_locs):
    """PagedBackend.short_conv without kernels (prefix_lens also as a device tensor, as the
    backend caches its index tensors)."""
    k = w.shape[1]
    pos = prefix_t[:, None] - (k - 1) + torch.arange(k - 1, device=x.device)
    valid = pos >= 0
    slots = table[rows[:, None], pos.clamp(min=0)]
    prev = buf[slots] * valid[..., None].to(buf.dtype)
    buf[out_locs] = x.to(buf.dtype)
    return short_conv(x, w, extend_lens, prev)


def bench_shortconv(batches, channels, table_rows):
    dev, k = "cuda", 4
    gen = torch.Generator().manual_seed(0)
    for mode in ("decode", "extend"):
        for bsz in batches:
            for c in channels:
                prefix = torch.randint(0, 300, (bsz,), generator=gen).tolist() if mode == "decode" else [100] * bsz
                ext = [1] * bsz if mode == "decode" else [16] * bsz
                buf, table, rows, starts, out_locs = _paged(prefix, ext, c, dev, gen)
                x = torch.randn(sum(ext), c, generator=gen).to(torch.bfloat16).to(dev)
                w = (torch.randn(c, k, generator=gen) * 0.5).to(torch.bfloat16).to(dev)
                prefix_t = torch.tensor(prefix, device=dev)
                ext_t = torch.tensor(ext, device=dev)
                ref = lambda: _conv_reference(x, w, buf, table, rows, prefix, prefix_t, ext, out_locs)  # noqa: E731
                if mode == "decode":
                    seq_lens = prefix_t + 1
                    ker = lambda: short_conv_decode(x, w, buf, table, rows, seq_lens, out_locs)  # noqa: E731
                else:
                    ker = lambda: short_conv_extend(x, w, buf, table, rows, prefix_t, ext_t, starts, out_locs)  # noqa: E731
                assert torch.equal(ref(), ker()), "kernel != reference"
                t_ref, t_ker = _bench(ref), _bench(ker)
                shape = f"B={bsz} T={sum(ext)} C={c} K={k}"
                table_rows.append((f"short_conv_{mode}", shape, "bf16", t_ref, t_ker))


# ------------------------------------------------------------------------------ sampling

MIXES = {  # name: (logit scale, filter parameters or None for a different mix on every row)
    "top_p=0.9": (4.0, dict(top_k=0, top_p=0.9, min_p=0.0)),
    "k=50,p=0.95,minp=0.05": (4.0, dict(top_k=50, top_p=0.95, min_p=0.05)),
    "mixed rows": (4.0, None),  # off / top-k / top-p / min-p / all three, row by row
    "top_p=0.9, flat rows": (1.0, dict(top_k=0, top_p=0.9, min_p=0.0)),  # worst case: ~60% kept
}


def _params(mix, n, dev):
    m = MIXES[mix][1]
    if m is not None:
        ks, ps, ms = [m["top_k"]] * n, [m["top_p"]] * n, [m["min_p"]] * n
    else:
        ks = [[0, 40, 0, 0, 20][i % 5] for i in range(n)]
        ps = [[1.0, 1.0, 0.9, 1.0, 0.95][i % 5] for i in range(n)]
        ms = [[0.0, 0.0, 0.0, 0.1, 0.05][i % 5] for i in range(n)]
    temps = [[0.7, 1.0, 0.9][i % 3] for i in range(n)]
    f = lambda v: torch.tensor(v, dtype=torch.float32, device=dev)  # noqa: E731
    return f(temps), torch.tensor(ks, device=dev), f(ps), f(ms)


def bench_sampling(batches, vocabs, table_rows):
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    for v in vocabs:
        for bsz in batches:
            noise = torch.randn(bsz, v, device=dev, generator=gen)
            e = torch.empty(bsz, v, device=dev).exponential_(generator=gen)
            for mix in MIXES:
                # randn * 4: peaked rows, top-p 0.9 keeps a few hundred tokens of 128K; randn * 1:
                # flat rows, where it keeps most of the vocabulary (the search's worst case).
                logits = noise * MIXES[mix][0]
                params = _params(mix, bsz, dev)
                ref_f = lambda: ref_sampler.filtered_probs(logits, *params)  # noqa: E731
                ker_f = lambda: sampling.filtered_probs(logits, *params)  # noqa: E731
                ref_s = lambda: (ref_sampler.filtered_probs(logits, *params) / e.clamp_min(TINY)).argmax(-1)  # noqa: E731
                ker_s = lambda: sampling.sample(logits, *params, e)  # noqa: E731
                a, b = ref_f(), ker_f()
                diff = ((a > 0) != (b > 0)).sum().item()
                note = f"{mix}" + (f" ({diff} boundary tokens differ)" if diff else "")
                shape = f"B={bsz} V={v}"
                table_rows.append(("filtered_probs", shape, note, _bench(ref_f), _bench(ker_f)))
                table_rows.append(("filter+draw", shape, mix, _bench(ref_s), _bench(ker_s)))
            del logits, noise, e
            torch.cuda.empty_cache()
        # the race alone
        for bsz in batches:
            probs = torch.softmax(torch.randn(bsz, v, device=dev, generator=gen) * 3, -1)
            e = torch.empty(bsz, v, device=dev).exponential_(generator=gen)
            ref = lambda: (probs / e.clamp_min(TINY)).argmax(-1)  # noqa: E731
            ker = lambda: sampling.sample_from_probs(probs, e)  # noqa: E731
            assert torch.equal(ref(), ker())
            table_rows.append(("sample_from_probs", f"B={bsz} V={v}", "", _bench(ref), _bench(ker)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="B = 1 and 64 only, one C and one V")
    ap.add_argument("--only", choices=["shortconv", "sampling"], default=None)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "CUDA only"
    batches = [1, 64] if args.quick else [1, 64, 256]
    rows: list = []
    if args.only != "sampling":
        bench_shortconv(batches, [2048] if args.quick else [2048, 4096, 6144], rows)
    if args.only != "shortconv":
        bench_sampling(batches, [128256] if args.quick else [49216, 128256], rows)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"| {'op':<18} | {'shape':<24} | {'params':<40} | {'ref us':>9} | {'kernel us':>9} | {'speedup':>7} |")
    print(f"|{'-' * 20}|{'-' * 26}|{'-' * 42}|{'-' * 11}|{'-' * 11}|{'-' * 9}|")
    for op, shape, note, t_ref, t_ker in rows:
        print(f"| {op:<18} | {shape:<24} | {note:<40} | {t_ref:9.1f} | {t_ker:9.1f} | {t_ref / t_ker:6.1f}x |")


if __name__ == "__main__":
    main()
