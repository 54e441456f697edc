"""Where `_select_kernel`'s time goes: a traced copy (global timer at each pass), one row.
python scratch/t/select_trace.py"""
import os, sys; sys.path.insert(0, os.getcwd())
import torch, triton, triton.language as tl
from kiln.kernels import sampling as S
from kiln.kernels.sampling import _bits, _pivots, _narrow, _pivot_stats
from kiln.kernels.trace import global_time
from kiln.kernels.softmax import temperature_softmax


@triton.jit
def _mark(TR, idx, code, dep):
    tl.store(TR + idx * 2, code)
    tl.store(TR + idx * 2 + 1, global_time(dep))
    return idx + 1


@triton.jit
def _search_t(row_ptr, V, scratch_ptr, lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, kk, thr, rm, TR, idx,
              CAP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, NP: tl.constexpr,
              BLOCK_S: tl.constexpr, NP_S: tl.constexpr):
    while (hi - lo > 1) & (cnt_lo - cnt_hi > CAP):
        piv = _pivots(lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, kk, thr, rm, CAP // 4, NP)
        cnt, mass, b_min, b_max = _pivot_stats(row_ptr, V, piv, lo, hi, BLOCK_P, NP)
        lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi = _narrow(piv, cnt, mass, b_min, b_max, lo, cnt_lo, mass_lo,
                                                           hi, cnt_hi, mass_hi, kk, thr, rm)
        idx = _mark(TR, idx, 2, mass_lo)
    if hi - lo > 1:
        n_c = tl.full([], 0, tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < V
            p = tl.load(row_ptr + offs, mask=ok, other=0.0)
            b = _bits(p)
            inside = ok & (b >= lo) & (b < hi)
            dst = n_c + tl.cumsum(inside.to(tl.int32), axis=0) - 1
            tl.store(scratch_ptr + dst, p, mask=inside)
            n_c += tl.sum(inside.to(tl.int32), axis=0)
        idx = _mark(TR, idx, 3, n_c.to(tl.float32))
        base_c = cnt_hi
        base_m = mass_hi
        while hi - lo > 1:
            piv = _pivots(lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, kk, thr, rm, 1, NP_S)
            cnt, mass, b_min, b_max = _pivot_stats(scratch_ptr, n_c, piv, lo, hi, BLOCK_S, NP_S)
            lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi = _narrow(piv, cnt + base_c, mass + base_m, b_min, b_max, lo,
                                                               cnt_lo, mass_lo, hi, cnt_hi, mass_hi, kk, thr, rm)
            idx = _mark(TR, idx, 4, mass_lo)
    return lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, idx


@triton.jit
def _select_t(probs_ptr, scratch_ptr, TR, k, top_p, V, CAP: tl.constexpr, BLOCK: tl.constexpr,
              BLOCK_P: tl.constexpr, NP: tl.constexpr, BLOCK_S: tl.constexpr, NP_S: tl.constexpr):
    row_ptr = probs_ptr
    idx = _mark(TR, 0, 0, top_p)
    mx_acc = tl.zeros([BLOCK], dtype=tl.float32)
    s_acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        p = tl.load(row_ptr + offs, mask=offs < V, other=0.0)
        mx_acc = tl.maximum(mx_acc, p)
        s_acc += p
    p_max = tl.max(mx_acc, axis=0)
    total = tl.sum(s_acc, axis=0)
    idx = _mark(TR, idx, 1, total)
    use_k = k < V
    top = _bits(p_max) + 1
    zero_i = tl.full([], 0, tl.int32)
    zero_f = tl.full([], 0.0, tl.float32)
    lo = zero_i
    cnt_lo = zero_i + V
    mass_lo = total
    s_k = total
    inf = float("inf")
    if use_k:
        lo, cnt_lo, mass_lo, hi_k, cnt_gt_k, mass_gt_k, idx = _search_t(
            row_ptr, V, scratch_ptr, lo, cnt_lo, mass_lo, top, zero_i, zero_f, k, inf, V + 1, TR, idx,
            CAP, BLOCK, BLOCK_P, NP, BLOCK_S, NP_S)
        v_k = lo.to(tl.float32, bitcast=True)
        s_k = mass_gt_k + (k - cnt_gt_k).to(tl.float32) * v_k
        idx = _mark(TR, idx, 5, s_k)
    thr_p = top_p * s_k
    lo, cnt_lo, mass_lo, hi, cnt_gt, mass_gt, idx = _search_t(
        row_ptr, V, scratch_ptr, lo, cnt_lo, mass_lo, top, zero_i, zero_f, k, thr_p, V + 1, TR, idx,
        CAP, BLOCK, BLOCK_P, NP, BLOCK_S, NP_S)
    idx = _mark(TR, idx, 6, mass_gt)
    tl.store(TR + 127 * 2, idx.to(tl.int64))


NAMES = {0: "start", 1: "max+total", 2: "row pass", 3: "copy", 4: "scratch pass", 5: "k found", 6: "end"}


def main():
    dev, V = "cuda", 49216
    g = torch.Generator(device=dev).manual_seed(0)
    cfg = S.SELECT
    print(f"# {torch.cuda.get_device_name()}; SELECT={cfg}")
    cases = [("randn*3", 3.0, 0, 0.9), ("randn*1", 1.0, 0, 0.9), ("randn*3", 3.0, 50, 0.95), ("randn*3", 3.0, 0, 0.95)]
    for name, scale, k, tp in cases:
        logits = torch.randn(1, V, device=dev, generator=g) * scale
        probs = temperature_softmax(logits, torch.ones(1, device=dev))
        scratch = torch.empty(S.CAP, device=dev)
        tr = torch.zeros(256, dtype=torch.int64, device=dev)
        for rep in range(5):  # the last repetition is printed (warm caches, compiled)
            tr.zero_()
            _select_t[(1,)](probs, scratch, tr, k if k > 0 else V, tp, V, CAP=S.CAP, BLOCK=cfg["BLOCK"],
                            BLOCK_P=cfg["BLOCK_P"], NP=cfg["NP"], BLOCK_S=cfg["BLOCK_S"], NP_S=cfg["NP_S"],
                            num_warps=cfg["num_warps"])
            torch.cuda.synchronize()
        t = tr.view(-1, 2).cpu()
        n = int(t[127, 0])
        t0 = int(t[0, 1])
        events = [(NAMES[int(t[i, 0])], (int(t[i, 1]) - int(t[i - 1, 1])) / 1e3) for i in range(1, n)]
        ms = sum(e[1] for e in events)
        print(f"{name} top_k={k} top_p={tp}: total {ms:.1f} us: " + ", ".join(f"{a} {b:.1f}" for a, b in events))
        # the engine's kernel for comparison (graph medians)
        params = (torch.ones(1, device=dev), torch.tensor([k], device=dev), torch.tensor([tp], device=dev),
                  torch.zeros(1, device=dev))
        us = triton.testing.do_bench_cudagraph(lambda: S.filtered_probs(logits, *params), rep=50,
                                               return_mode="median") * 1e3
        print(f"    filtered_probs (graph median) {us:.1f} us")


if __name__ == "__main__":
    main()
