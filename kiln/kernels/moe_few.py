"""The MoE experts of a few tokens, each selected expert read once: the few-token path of
`kiln.kernels.moe.fused_experts`.

Between the one-token expert GEMVs (`kiln.kernels.moe_gemv`) and the grouped GEMMs
(`kiln.kernels.moe`): a speculative verify's few rows at batch 1, decode at batch 2-8. The GEMVs
read an expert once per token routed to it; the grouped path reads it once but spends two of its
four launches on sorting tokens by expert (align) and summing the slots (on an H200, a batch-1 K = 3
verify of 4 rows spent ~39 us per Inkling MoE layer there, the weights it reads being ~21 us at
HBM bandwidth: docs/benchmarks.md, nineteenth and twenty-first passes). Two launches here, nothing
sorted, grids fixed by shapes:

Distinct experts. The T*k routed assignments in order (token by token, each in selection order)
are numbered by first occurrence: assignment s is the first of its expert when no earlier one has
its id, and the u-th first names distinct expert u. Every program recomputes that from the ids
(at most MAX_ASSIGNMENTS of them: an [S, S] comparison in registers), so nothing has to be
sorted and no launch spent on it. The shared chunks follow as slots U..U+C-1, U = min(T*k, E)
being the grid's worst case.

1. `_few_up_kernel`, grid (U + C, I / BLOCK_N): program (u, n) finds distinct expert u (and exits
   if there are fewer), reads BLOCK_N of its gate and up rows once over all of H (a software
   pipelined K loop of tensor-core dots, every token padded to ROWS = 16 rows), and stores SwiGLU
   into act[u, t] (zero for tokens that did not select it); program (u, 0) also stores each
   token's routing weight for it (0 if not selected).
2. `_few_down_kernel`, grid (H / BLOCK_N, SPLITS): program (n, s) walks its share of the distinct
   experts (rank order, then the shared chunks), reading BLOCK_N of each one's down rows once
   for every token, into an fp32 partial; the last of a column tile's SPLITS programs to finish
   sums the partials in split order (no slot buffer, no sum launch) and, optionally, runs each
   token's ShortConv on the result (Inkling's out_conv; decode sequences or a verify's chunks),
   as `_sum_slots_conv_kernel` does. One program per column tile walking every expert measured
   1.4-1.9 TB/s: too few bytes in flight (docs/benchmarks.md, twenty-first pass).

A token's sum runs over its experts in distinct-rank order, then the shared chunks, its splits
summed in order: fixed by the ids and the tiles, so the same inputs give the same bits in every
process, though not the other paths' bits. A first form with CUDA-core products (an [ROWS,
BLOCK_N, BLOCK_K] product reduced over K) measured 2-4x slower than tensor-core dots at 4-8
tokens and is gone (`python -m benchmarks.kernels.moe --few 2 4 8` times this path against the
grouped one).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels import interpreting
from kiln.kernels.launch import pdl_launch, wait_for_previous
from kiln.kernels.shortconv import decode_conv_epilogue, decode_conv_history, decode_conv_kernel_args

# The path takes up to MAX_TOKENS tokens (its dots pad them to ROWS = 16, one MMA tile) with
# T*k <= MAX_ASSIGNMENTS (every program holds the [S, S] comparison of the ids: 4096 predicates
# at 64).
MAX_TOKENS = 8
MAX_ASSIGNMENTS = 64
ROWS = 16
# Tiles, fixed by the shape, never autotuned (every process sums in the same order):
# gate/up (BLOCK_N, BLOCK_K, num_warps, num_stages), N over I and K over H, the K loop software
# pipelined (the grouped path's decode tile); down (BLOCK_N, BLOCK_K, num_warps), N over H and K
# over I, and SPLITS programs per column tile walking the experts in contiguous shares.
# Swept on an H200 (`python -m benchmarks.kernels.moe --few 2 4 8 --few-sweep`, twenty-first pass):
# the best at 8 tokens, within 3 us of the best at 4. Even so the path ran at 0.75-0.98x the
# grouped path's speed (docs/benchmarks.md).
FEW_UP_TILE = (64, 128, 4, 4)
FEW_DOWN_TILE = (32, 256, 4)
FEW_SPLITS = 4
# Under the interpreter: small tiles, so that the tests' tiny shapes span several programs, and
# three splits, so that some walk nothing when few experts are selected.
FEW_INTERPRETER_TILES = ((16, 16, 1, 1), (16, 16, 1))
FEW_INTERPRETER_SPLITS = 3


def few_tiles(hidden: int, inter: int) -> tuple[dict, dict, int]:
    """Launch arguments of the gate/up kernel and the down kernel, and the down kernel's splits.
    No tile is wider than the power-of-2 padded dim it covers nor narrower than 16 (tl.dot's least)."""
    up, down = FEW_INTERPRETER_TILES if interpreting() else (FEW_UP_TILE, FEW_DOWN_TILE)
    splits = FEW_INTERPRETER_SPLITS if interpreting() else FEW_SPLITS
    fit = lambda b, d: max(16, min(b, triton.next_power_of_2(d)))  # noqa: E731
    bn, bk, warps, stages = up
    up_args = dict(BLOCK_N=fit(bn, inter), BLOCK_K=fit(bk, hidden), num_warps=warps, num_stages=stages)
    bn, bk, warps = down
    return up_args, dict(BLOCK_N=fit(bn, hidden), BLOCK_K=fit(bk, inter), num_warps=warps, num_stages=1), splits


@triton.jit
def _distinct_experts(ids_ptr, T, K: tl.constexpr, S_PAD: tl.constexpr):
    """The T*K routed ids in order [S_PAD] (-1 past them), whether each is the first of its expert,
    and each first's rank among the firsts (module docstring)."""
    s = tl.arange(0, S_PAD)
    ok = s < T * K
    ids = tl.load(ids_ptr + s, mask=ok, other=-1).to(tl.int32)
    same_before = (ids[:, None] == ids[None, :]) & (s[None, :] < s[:, None])
    first = ok & (tl.sum(same_before.to(tl.int32), axis=1) == 0)
    rank = tl.cumsum(first.to(tl.int32), axis=0) - 1
    return ids, first, rank


@triton.jit
def _few_up_kernel(x_ptr, w13_ptr, sw13_ptr, ids_ptr, topk_w_ptr, act_ptr, wts_ptr, counts_ptr, T, U, H, I,
                   n_counts, stride_xt, stride_we, stride_wn, stride_sn,
                   K: tl.constexpr, KP: tl.constexpr, C: tl.constexpr, S_PAD: tl.constexpr, ROWS: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """act[u, t, cols] = silu(gate) * up of distinct expert u (u >= U: shared chunk u - U) for
    token t, 0 where t did not select it; wts[u, t] its routing weight (module docstring).
    Program (0, 0) also zeroes the down kernel's arrival counts."""
    wait_for_previous(PDL)
    u = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    tok = tl.arange(0, ROWS)
    tok_ok = tok < T
    ks = tl.arange(0, BLOCK_K)
    if (u == 0) & (tl.program_id(1) == 0):
        for c0 in range(0, n_counts, 128):
            c = c0 + tl.arange(0, 128)
            tl.store(counts_ptr + c, tl.zeros([128], dtype=tl.int32), mask=c < n_counts)

    ids, first, rank = _distinct_experts(ids_ptr, T, K, S_PAD)
    routed = u < U
    is_shared = u >= U
    if routed & (u >= tl.sum(first.to(tl.int32), axis=0)):
        return  # fewer distinct experts than the grid's worst case
    e = tl.sum(tl.where(first & (rank == u), ids, 0), axis=0).to(tl.int64)  # (0 for a shared chunk)
    kk = tl.arange(0, KP)
    sel_ok = tok_ok[:, None] & (kk < K)[None, :]
    hit = (tl.load(ids_ptr + tok[:, None] * K + kk[None, :], mask=sel_ok, other=-1) == e) & sel_ok & routed
    selected = tl.where(is_shared, tok_ok, tl.sum(hit.to(tl.int32), axis=1) > 0)
    if (tl.program_id(1) == 0) & routed:
        tw = tl.load(topk_w_ptr + tok[:, None] * K + kk[None, :], mask=sel_ok, other=0.0)
        tl.store(wts_ptr + u * ROWS + tok, tl.sum(tl.where(hit, tw, 0.0), axis=1))

    # Addressed as `_gate_up_kernel` does: routed e, gate rows n and up rows I + n of w13[e]; shared
    # chunk c, rows c*I + n and C*I + c*I + n of sw13.
    chunk = tl.maximum(u - U, 0).to(tl.int64)
    w_base = tl.where(is_shared, sw13_ptr + chunk * I * stride_sn, w13_ptr + e * stride_we)
    row_stride = tl.where(is_shared, stride_sn, stride_wn).to(tl.int64)
    up_off = tl.where(is_shared, C * I, I).to(tl.int64) * row_stride
    g_ptrs = w_base + cols[None, :].to(tl.int64) * row_stride + ks[:, None]  # [BLOCK_K, BLOCK_N]
    x_ptrs = x_ptr + tok[:, None].to(tl.int64) * stride_xt + ks[None, :]  # [ROWS, BLOCK_K]
    acc_g = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K):  # software pipelined (num_stages)
        k_ok = ks < H - k0
        a = tl.load(x_ptrs + k0, mask=tok_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs + k0, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        up = tl.load(g_ptrs + up_off + k0, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        a = a.to(g.dtype)  # x rounded to the weights' dtype, as the grouped GEMM
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, up, acc_u, input_precision=PRECISION)
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up, fp32, as _gate_up_kernel
    act = tl.where(selected[:, None], act, 0.0)
    tl.store(act_ptr + (u * ROWS + tok[:, None]).to(tl.int64) * I + cols[None, :],
             act.to(act_ptr.dtype.element_ty), mask=col_ok[None, :])


@triton.jit
def _down_tile_ptrs(w2_ptr, sw2_ptr, ids, first, rank, v, n_routed, rows, ks, k0, I, stride_we, stride_wh,
                    stride_sh):
    """Pointers to the [BLOCK_K, BLOCK_N] (transposed) down tile at column k0 of expert v in the
    walk: distinct expert v (w2[e], [H, I]) while v < n_routed, then shared chunk v - n_routed
    (columns c*I.. of sw2, [H, C*I])."""
    is_shared = v >= n_routed
    e = tl.sum(tl.where(first & (rank == v), ids, 0), axis=0).to(tl.int64)
    chunk = tl.maximum(v - n_routed, 0).to(tl.int64)
    base = tl.where(is_shared, sw2_ptr + chunk * I, w2_ptr + e * stride_we)
    stride = tl.where(is_shared, stride_sh, stride_wh).to(tl.int64)
    return base + rows[None, :].to(tl.int64) * stride + k0 + ks[:, None]


@triton.jit
def _few_down_kernel(act_ptr, w2_ptr, sw2_ptr, ids_ptr, wts_ptr, shared_w_ptr, part_ptr, counts_ptr, out_ptr,
                     T, U, H, I, stride_we, stride_wh, stride_sh,
                     CW, CBUF, CTAB, CSLOTS, CLENS, CLOCS, stride_cw, stride_cbuf, stride_ctab,
                     K: tl.constexpr, C: tl.constexpr, S_PAD: tl.constexpr, ROWS: tl.constexpr,
                     NUM_SW: tl.constexpr, SW_REP: tl.constexpr, HAS_SW: tl.constexpr, SPLITS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
                     CONV: tl.constexpr, CK: tl.constexpr, CKP: tl.constexpr, CCHUNK: tl.constexpr):
    """Program (n, s): over its contiguous share of the walk (the distinct experts in rank order,
    then the shared chunks), sum_u w[u, t] * (down_u @ act[u, t]) for the n-th BLOCK_N of H and
    every token, into partial s (fp32). Each program then counts itself done on column tile n
    (acq_rel, as decode attention's splits), and the last to arrive sums the SPLITS partials in
    order and stores the result, through each token's ShortConv with CONV (decode sequence t, or
    with CCHUNK a chunk's token).

    The walk is flattened over (expert, K tile) steps, each step's load of the next tile issued
    before the current one is multiplied. With the early trigger (PDL == 2) split 0 loads its
    first tile before the PDL wait: distinct expert 0 is always the first assignment's, and the
    ids are complete once this kernel's predecessor (the gate/up kernel) has passed its own wait,
    as in `kiln.kernels.moe_gemv._expert_down_gemv_kernel`."""
    n = tl.program_id(0)
    split = tl.program_id(1)
    rows = n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < H
    tok = tl.arange(0, ROWS)
    tok_ok = tok < T
    ks = tl.arange(0, BLOCK_K)
    KT = tl.cdiv(I, BLOCK_K)

    if PDL != 2:
        wait_for_previous(PDL)
    e0 = tl.load(ids_ptr, cache_modifier=".cg").to(tl.int64)
    w = tl.load(w2_ptr + e0 * stride_we + rows[None, :].to(tl.int64) * stride_wh + ks[:, None],
                mask=row_ok[None, :] & (ks < I)[:, None] & (split == 0), other=0.0)
    if PDL == 2:
        wait_for_previous(PDL)
    ids, first, rank = _distinct_experts(ids_ptr, T, K, S_PAD)
    n_routed = tl.sum(first.to(tl.int32), axis=0)
    n_total = n_routed + C
    share = tl.cdiv(n_total, SPLITS)
    v_lo = tl.minimum(split * share, n_total)
    v_hi = tl.minimum(v_lo + share, n_total)
    if split != 0:  # the first tile of this share
        w = tl.load(_down_tile_ptrs(w2_ptr, sw2_ptr, ids, first, rank, v_lo, n_routed, rows, ks, 0, I, stride_we,
                                    stride_wh, stride_sh),
                    mask=row_ok[None, :] & (ks < I)[:, None] & (v_lo < v_hi), other=0.0)
    out = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    n_steps = (v_hi - v_lo) * KT
    for i in range(0, n_steps):
        v = v_lo + i // KT
        k0 = (i % KT) * BLOCK_K
        vn = v_lo + (i + 1) // KT
        kn = ((i + 1) % KT) * BLOCK_K
        n_ptrs = _down_tile_ptrs(w2_ptr, sw2_ptr, ids, first, rank, vn, n_routed, rows, ks, kn, I, stride_we,
                                 stride_wh, stride_sh)
        w_next = tl.load(n_ptrs, mask=row_ok[None, :] & (ks < I - kn)[:, None] & (i + 1 < n_steps), other=0.0)
        slot = tl.where(v < n_routed, v, U + v - n_routed)
        a = tl.load(act_ptr + (slot * ROWS + tok[:, None]).to(tl.int64) * I + k0 + ks[None, :],
                    mask=(ks < I - k0)[None, :], other=0.0)
        acc = tl.dot(a.to(w.dtype), w, acc, input_precision=PRECISION)
        if k0 + BLOCK_K >= I:  # the expert's last tile: weight its fp32 output, as _down_kernel
            if v < n_routed:
                wt = tl.load(wts_ptr + v * ROWS + tok)
            elif HAS_SW:
                wt = tl.load(shared_w_ptr + tok * NUM_SW + (v - n_routed) // SW_REP, mask=tok_ok, other=0.0)
            else:
                wt = tl.where(tok_ok, 1.0, 0.0)
            out += acc * wt[:, None]
            acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        w = w_next

    mask = tok_ok[:, None] & row_ok[None, :]
    part = part_ptr + (split * ROWS + tok[:, None]) * H + rows[None, :]
    tl.store(part, out, mask=mask)
    # Every warp's partial is written before the release (one thread issues the atomic); the last
    # arrival acquires them all and reads them from L2.
    tl.debug_barrier()
    if tl.atomic_add(counts_ptr + n, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
        total = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLITS):  # in split order: the same bits in every process
            total += tl.load(part_ptr + (s * ROWS + tok[:, None]) * H + rows[None, :], mask=mask, other=0.0,
                             cache_modifier=".cg")
        if CONV:  # the conv reads the MoE output as the unfused path stores it
            hist = decode_conv_history(tok, tok_ok, rows, row_ok, CBUF, stride_cbuf, CTAB, stride_ctab, CSLOTS,
                                       CLENS, CK, CKP, CCHUNK)
            y = decode_conv_epilogue(total.to(CBUF.dtype.element_ty), hist, tok, tok_ok, rows, row_ok, CW, stride_cw,
                                     CBUF, stride_cbuf, CLOCS, CSLOTS, CLENS, CK, CKP, CCHUNK)
            tl.store(out_ptr + tok[:, None] * H + rows[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptr + tok[:, None] * H + rows[None, :], total.to(out_ptr.dtype.element_ty), mask=mask)


def takes_few(num_tokens: int, top_k: int) -> bool:
    """Whether this path can take `num_tokens` tokens of `top_k` routed experts each."""
    return 0 < num_tokens <= MAX_TOKENS and num_tokens * top_k <= MAX_ASSIGNMENTS


def experts_few(x, w13, w2, sw13, sw2, ids, topk_w, shared_w, out, k, chunks, n_shared_w, sw_rep, has_sw,
                conv=None, conv_chunk=False) -> torch.Tensor:
    """`kiln.kernels.moe.fused_experts` on this path, its arguments prepared there (contiguous last
    dims, fp32 weights, the chunk counts); writes and returns `out`. act [(U + C) * ROWS, I] holds
    the activations in the weights' dtype between the two kernels, part [SPLITS * ROWS, H] the
    down kernel's fp32 partial sums. conv: as `kiln.kernels.moe_gemv.experts_gemv`'s, with
    `conv_chunk` for a verify's short chunks."""
    T, H = x.shape
    E = w13.shape[0]
    inter = w2.shape[2]
    assert takes_few(T, k), f"the few-token path takes 1..{MAX_TOKENS} tokens and {MAX_ASSIGNMENTS} assignments"
    up, down, splits = few_tiles(H, inter)
    U = min(T * k, E)
    dev = x.device
    n_tiles = triton.cdiv(H, down["BLOCK_N"])
    act = torch.empty((U + chunks) * ROWS, inter, dtype=w2.dtype, device=dev)
    wts = torch.empty(U * ROWS, dtype=torch.float32, device=dev)
    part = torch.empty(splits * ROWS, H, dtype=torch.float32, device=dev)
    counts = torch.empty(n_tiles, dtype=torch.int32, device=dev)  # zeroed by the gate/up kernel
    consts = dict(K=k, C=chunks, S_PAD=triton.next_power_of_2(T * k), ROWS=ROWS,
                  PRECISION="ieee" if w2.dtype == torch.float32 else "tf32")
    _few_up_kernel[(U + chunks, triton.cdiv(inter, up["BLOCK_N"]))](
        x, w13, sw13, ids, topk_w, act, wts, counts, T, U, H, inter, n_tiles, x.stride(0), w13.stride(0),
        w13.stride(1), sw13.stride(0), KP=triton.next_power_of_2(k), **consts, **up, **pdl_launch(dev))
    # Launched right after the gate/up kernel: the down kernel reads ids before its wait (its docstring).
    _few_down_kernel[(n_tiles, splits)](
        act, w2, sw2, ids, wts, shared_w, part, counts, out, T, U, H, inter, w2.stride(0), w2.stride(1),
        sw2.stride(0), **decode_conv_kernel_args(conv, out, conv_chunk), NUM_SW=n_shared_w, SW_REP=sw_rep,
        HAS_SW=has_sw, SPLITS=splits, **consts, **down, **pdl_launch(dev))
    return out
