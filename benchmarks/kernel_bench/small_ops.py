"""Per-layer small ops of a decode step: one-launch Triton kernels vs the references, CUDA only.

    python -m benchmarks.kernel_bench.small_ops [--quick]

- `store_kv` (`kiln.kernels.kv_store`) vs `kiln.ops.attention.store_kv` (an index_put per
  tensor): Llama-3.1-8B's K/V rows (8 KV heads x 128, bf16), v a view of the fused QKV output,
  into a 64K-slot pool at random slots;
- `silu_and_mul` (`kiln.kernels.activation`) vs `kiln.layers.activation.silu_and_mul_ref`:
  Llama-3.1-8B's gate_up output [T, 2 x 14336], bf16;
- `conv_qk_norm` (`kiln.kernels.conv_qk_norm`, at decode) vs what it replaces on the
  kernel path: two `short_conv_decode`, two per-head `rms_norm` kernels and q's lam scale, at
  Inkling's bench preset (Hq=16, Hkv=4, D=128, K=4, bf16; fragmented conv buffers);
- `argmax` (`kiln.kernels.argmax`, the engine's greedy tokens) vs torch.argmax over fp32 logit rows
  of 49,216 (Inkling / MiniMax-M3 bench) and 128,256 (Llama 3) tokens.

At T = 1..256 (decode batches) and 2048 (a prefill chunk; not for the decode prologue). Medians
in us of the op replayed from a CUDA graph (`triton.testing.do_bench_cudagraph`, how the engine's
decode runs: no launch cost on the host) and called eagerly (`do_bench`, where the launch count
shows).
"""

from __future__ import annotations

import argparse

import torch


def _timers():
    import triton

    def eager(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3

    def graphed(fn):
        torch.cuda.synchronize()  # do_bench_cudagraph runs fn on a stream of its own
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3

    return eager, graphed


def cases(tokens):
    """(op, shape, reference fn, kernel fn) per configuration; each pair checked once first."""
    from kiln.kernels.activation import silu_and_mul
    from kiln.kernels.argmax import argmax
    from kiln.kernels.kv_store import store_kv
    from kiln.layers.activation import silu_and_mul_ref
    from kiln.ops.attention import store_kv as store_kv_ref

    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    hq, hkv, d, inter, slots = 32, 8, 128, 14336, 1 << 16
    k_cache = torch.zeros(slots, hkv, d, device=dev, dtype=dt)
    v_cache = torch.zeros_like(k_cache)
    out = []
    for t in tokens:
        qkv = torch.randn(t, (hq + 2 * hkv) * d, device=dev, dtype=dt, generator=gen)
        k = torch.randn(t, hkv, d, device=dev, dtype=dt, generator=gen)  # RoPE's output
        v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        loc = torch.randperm(slots, device=dev, generator=gen)[:t]
        ref = lambda k=k, v=v, loc=loc: store_kv_ref(k, v, k_cache, v_cache, loc)  # noqa: E731
        ker = lambda k=k, v=v, loc=loc: store_kv(k, v, k_cache, v_cache, loc)  # noqa: E731
        ker()
        assert torch.equal(k_cache[loc], k) and torch.equal(v_cache[loc], v), "store_kv"
        out.append(("store_kv", f"T={t} Hkv={hkv} D={d}", ref, ker))
        gate_up = torch.randn(t, 2 * inter, device=dev, dtype=dt, generator=gen)
        torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_ref(gate_up), rtol=1.6e-2, atol=1e-2)
        out.append(("silu_and_mul", f"T={t} I={inter}", lambda g=gate_up: silu_and_mul_ref(g),
                    lambda g=gate_up: silu_and_mul(g)))
        if t <= 256:
            out.append(_prologue_case(t, gen))
            for vocab in (49216, 128256):  # the Inkling bench preset's and Llama 3's vocabularies
                x = torch.randn(t, vocab, device=dev, generator=gen)  # fp32 logits
                assert torch.equal(argmax(x), x.argmax(dim=-1)), "argmax"
                out.append(("argmax", f"B={t} V={vocab} fp32", lambda x=x: x.argmax(dim=-1), lambda x=x: argmax(x)))
    return out


def _prologue_case(bsz, gen):
    """Inkling's decode prologue: fused vs the unfused kernels, on a full layer (with lam)."""
    from kiln.kernels.conv_qk_norm import conv_qk_norm
    from kiln.kernels.norm import rms_norm
    from kiln.kernels.shortconv import short_conv_decode

    dev, dt, eps = "cuda", torch.bfloat16, 1e-6
    hq, hkv, d, kk, r_dim, ctx = 16, 4, 128, 4, 32, 2048
    c = hkv * d
    n_slots = bsz * ctx + 64
    perm = torch.randperm(n_slots, device=dev, generator=gen)
    table = perm[:bsz * ctx].view(bsz, ctx).contiguous()
    rows = torch.arange(bsz, device=dev)
    seq_lens = torch.randint(1, ctx, (bsz,), device=dev, generator=gen)
    out_locs = table[rows, seq_lens - 1].contiguous()
    k_buf, v_buf = (torch.randn(n_slots, c, device=dev, dtype=dt, generator=gen) for _ in range(2))
    qkvr = torch.randn(bsz, (hq + 2 * hkv) * d + hq * r_dim, device=dev, dtype=dt, generator=gen)
    q, k, v, _ = qkvr.split([hq * d, c, c, hq * r_dim], dim=-1)
    qw, kw = (1 + 0.1 * torch.randn(d, device=dev, generator=gen)).to(dt), torch.ones(d, device=dev, dtype=dt)
    kcw, vcw = ((0.5 * torch.randn(c, kk, device=dev, generator=gen)).to(dt) for _ in range(2))
    lam = 1 + torch.rand(bsz, device=dev, generator=gen)
    positions = seq_lens - 1

    def unfused():
        kc = short_conv_decode(k, kcw, k_buf, table, rows, seq_lens, out_locs)
        vc = short_conv_decode(v, vcw, v_buf, table, rows, seq_lens, out_locs)
        qn = (rms_norm(q.reshape(bsz, hq, d), qw, eps).float() * lam[:, None, None]).to(dt)
        return qn, rms_norm(kc.reshape(bsz, hkv, d), kw, eps), vc

    def fused():
        return conv_qk_norm(q, k, v, qw, kw, eps, eps, kcw, vcw, k_buf, v_buf, table, rows, positions,
                            out_locs, d, q_scale=lam)

    for g, w in zip(fused(), unfused()):
        torch.testing.assert_close(g, w, rtol=1.6e-2, atol=1e-2)
    return "conv_qk_norm", f"B={bsz} Hq={hq} Hkv={hkv} D={d}", unfused, fused


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T = 1 and 64 only")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.kernel_bench.small_ops needs CUDA")
    import triton

    eager, graphed = _timers()
    rows = []
    for op, shape, ref, ker in cases([1, 64] if args.quick else [1, 8, 64, 256, 2048]):
        rows.append((op, shape, graphed(ref), graphed(ker), eager(ref), eager(ker)))
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"| {'op':<14} | {'shape':<26} | {'graph ref us':>12} | {'graph kernel us':>15} | "
          f"{'eager ref us':>12} | {'eager kernel us':>15} |")
    print(f"|{'-' * 16}|{'-' * 28}|{'-' * 14}|{'-' * 17}|{'-' * 14}|{'-' * 17}|")
    for op, shape, gr, gk, er, ek in rows:
        print(f"| {op:<14} | {shape:<26} | {gr:12.1f} | {gk:15.1f} | {er:12.1f} | {ek:15.1f} |")


if __name__ == "__main__":
    main()
