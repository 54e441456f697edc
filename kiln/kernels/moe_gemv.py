"""The MoE experts of one token as two GEMVs: the one-token path of `kiln.kernels.moe.fused_experts`.

Up to `gemv_max_tokens` tokens (`kiln.kernels.moe.GEMV_MAX_TOKENS`, 1, unless the engine's
`--moe-gemv-max-tokens` says otherwise): batch-1 decode. There every slot (see
`kiln.kernels.moe` for slots and shared chunks) has its own expert, so the grouped GEMMs use 1 of
the 16 rows of each MMA tile, and align and sum_slots are two more latency-bound launches around a
pure weight stream (on an H200, ~45 us per bench MoE layer for ~50 MB of weights, ~12 us at HBM
bandwidth). Two launches instead, both GEMVs on CUDA cores in fp32 like `kiln.kernels.gemv` (no
tl.dot: one row), grids fixed by shapes:
1. `_expert_up_gemv_kernel`, grid (T*KS, I / BLOCK_N): program (slot, n) reads its expert straight
   from topk_ids (or its shared chunk, addressed as `_gate_up_kernel` does), dots BLOCK_N gate and
   up rows with x over all of H, and stores SwiGLU(gate, up) (fp32, as `_gate_up_kernel`) into
   act [T*KS, I].
2. `_expert_down_gemv_kernel`, grid (H / BLOCK_N, T): program n walks the KS slots in
   `_sum_slots_kernel`'s order, dots act with BLOCK_N rows of each slot's down weight, weights it as
   `_down_kernel` does and sums in fp32 registers: one cast, no fp32 slot buffer, no sum kernel.
   With the early trigger its first weight tile loads before the PDL wait (the ids are complete
   by then: its docstring).
   Optionally a decode ShortConv on the sum in its epilogue (Inkling's out_conv: `conv`).
The kernels take any T (one program row per token), but past one token the grouped path stays:
tokens that share an expert read it once there, once per slot here (`benchmarks/kernel_bench/moe.py
--gemv 1 2 4 8` times both; on an H200 the GEMVs lose from 2 tokens on: docs/benchmarks.md,
nineteenth pass). The GEMV tiles are fixed by shape (`gemv_tiles`), so the same inputs give the
same bits in every process, though not the grouped path's bits (the sums run in another order).

Tried and removed (commit 15c4b55, docs/benchmarks.md twenty-second pass): both kernels selecting
the experts from the router logits themselves, with no gate launch. The gate launch costs a
batch-1 Inkling step ~0.09 ms, but the selection in every one of the ~2000 programs (12 serial
reductions over 128 lanes, the exact sigmoid) cost more: 1.61 against 1.27 ms.
Also tried and removed (commit b4f7b09, twenty-third pass): the down kernel loading every slot's id
and weight tile at once ([KS, BLOCK_N, BLOCK_K], before the wait with the trigger) instead of one
slot ahead. Correct (CPU and GPU tests), slower: Inkling 1.266 against 1.214 ms. It took 80
registers per thread against 64 (sm_90 compile), so 6 programs per SM instead of 8 and the 1024
programs of a bench layer no longer fit at once.
Tried and removed in the twenty-fifth pass (commit 983d60a): the down kernel keeping two slots'
tiles in flight (same registers, neutral in the traced chain: -0.14 or +0.13 us a layer), and the
gate/up kernel reducing each K tile into [BLOCK_N] sums instead of one [BLOCK_N, BLOCK_K]
accumulator (64 registers against 88, yet the same 8.7 us spread of its 2048 programs and a
stream 0.5 us longer).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kiln.kernels import interpreting
from kiln.kernels.launch import pdl_launch, wait_for_previous
from kiln.kernels.shortconv import decode_conv_epilogue, decode_conv_history, decode_conv_kernel_args
from kiln.kernels.trace import global_time, store_trace, trace_args

# The one-token path's tiles (BLOCK_N, BLOCK_K, num_warps): a fixed function of the shape, never
# autotuned, so that every process sums in the same order (as `kiln.kernels.gemv`). From
# `python -m benchmarks.kernel_bench.moe --gemv-sweep` on an H200 (docs/benchmarks.md, twelfth pass):
# narrow row blocks with long K steps, as for the dense GEMV. At one token, CUDA-graph medians
# over 8 weight copies: MiniMax-M3 bench 18.5 us with these two (grouped path 20.9); Inkling bench
# 20.0 us with this down tile and a gate/up tile of (8, 256), which timed as (2, 1024) did within
# 0.1 us (grouped 20.8). The first guess, (16, 256) / (8, 512), took 24.0 and 21.8 us.
GEMV_UP_TILE = (2, 1024, 4)
GEMV_DOWN_TILE = (2, 512, 4)
# Under the interpreter: small tiles, so that the tests' tiny shapes span several of them.
GEMV_INTERPRETER_TILE = (4, 16, 1)
# The gate/up kernel's programs per SM on a GPU: each program runs ceil(tiles / (SMs * this)) of
# the (slot, row block) tiles one after another, the next tile's loads in flight while the current
# one finishes, so that every program is resident from the start instead of 2048 one-tile programs
# (Inkling bench) running in waves (docs/benchmarks.md, twenty-fourth pass: spread 8.9 us, up to 18
# per SM). 0: one tile per program. Under the interpreter: 3 tiles per program, so that the tests
# run the loop with a short last share.
UP_PROGRAMS_PER_SM = 4
UP_INTERPRETER_TILES_PER_PROGRAM = 3


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def up_tiles_per_program(tiles: int, device: torch.device) -> int:
    """How many (slot, row block) tiles each gate/up program runs (`UP_PROGRAMS_PER_SM`). Which
    program runs a tile changes no bit of its output."""
    if interpreting() or device.type != "cuda":
        return UP_INTERPRETER_TILES_PER_PROGRAM
    if UP_PROGRAMS_PER_SM <= 0:
        return 1
    return max(1, triton.cdiv(tiles, _sm_count(device) * UP_PROGRAMS_PER_SM))


def gemv_tiles(hidden: int, inter: int) -> tuple[dict, dict]:
    """Launch arguments (BLOCK_N, BLOCK_K, num_warps, num_stages) of the one-token path's gate/up
    kernel (N over `inter`, K over `hidden`) and down kernel (N over `hidden`, K over `inter`).
    No tile is wider than the power-of-2 padded dim it covers."""
    up, down = (GEMV_INTERPRETER_TILE,) * 2 if interpreting() else (GEMV_UP_TILE, GEMV_DOWN_TILE)

    def tile(t, n_dim, k_dim):
        bn, bk, warps = t
        pad = triton.next_power_of_2
        return dict(BLOCK_N=min(bn, pad(n_dim)), BLOCK_K=min(bk, pad(k_dim)), num_warps=warps, num_stages=1)

    return tile(up, inter, hidden), tile(down, hidden, inter)


@triton.jit
def _up_slot_base(w13_ptr, sw13_ptr, e, j, I, stride_we, stride_wn, stride_sn, K: tl.constexpr, KS: tl.constexpr):
    """(gate rows' base, row stride, offset of the up rows) of slot j with expert e, addressed as
    `_gate_up_kernel` does. Routed slot j: expert e = topk_ids[t, j], gate rows n and up rows I + n
    of w13[e]. Shared chunk c = j - K: rows c*I + n and C*I + c*I + n of sw13."""
    is_shared = j >= K
    chunk = tl.maximum(j - K, 0).to(tl.int64)
    base = tl.where(is_shared, sw13_ptr + chunk * I * stride_sn, w13_ptr + e * stride_we)
    row_stride = tl.where(is_shared, stride_sn, stride_wn).to(tl.int64)
    up_off = tl.where(is_shared, (KS - K) * I, I).to(tl.int64) * row_stride
    return base, row_stride, up_off


@triton.jit
def _expert_up_gemv_kernel(x_ptr, w13_ptr, sw13_ptr, ids_ptr, act_ptr, H, I, NB, TILES, PER_PROGRAM,
                           stride_xt, stride_we, stride_wn, stride_sn, TR,
                           K: tl.constexpr, KS: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, PDL: tl.constexpr, TRACE: tl.constexpr):
    """act[s, cols] = silu(gate) * up of slot s = t*KS + j over the n-th BLOCK_N of I, for the
    tiles (s, n) = divmod(q, NB) numbered q = pid * PER_PROGRAM ... (at most PER_PROGRAM of the
    TILES): per tile two weight row blocks over all of K = H, CUDA-core FMAs into [BLOCK_N, BLOCK_K]
    fp32 accumulators reduced once at the end (as `kiln.kernels.gemv._gemv_fma_kernel`).

    Every load is issued one step before its use: the next K tile of the weights and of x while
    the current one is multiplied, the next tile's first K tile before the current tile's last is
    multiplied, and the next tile's expert id one tile ahead of that. A tile's sums are the same,
    in the same order, whichever program runs it, so PER_PROGRAM changes no bit of act.
    TRACE: each program's timestamps go to TR (`kiln.kernels.trace`; the prologue is its first
    expert id's load, the reduction its last tile's)."""
    if TRACE:
        t_start = global_time(0.0)
    wait_for_previous(PDL)
    if TRACE:
        t_waited = global_time(0.0)
    first = tl.program_id(0) * PER_PROGRAM
    count = tl.minimum(PER_PROGRAM, TILES - first)
    rk = tl.arange(0, BLOCK_K)[None, :]
    ar = tl.arange(0, BLOCK_N)

    s = first // NB
    t = s // KS
    j = s % KS
    e = tl.load(ids_ptr + t * K + tl.minimum(j, K - 1)).to(tl.int64)
    x_ptrs = x_ptr + t.to(tl.int64) * stride_xt + rk  # [1, BLOCK_K]
    xk = tl.load(x_ptrs, mask=rk < H, other=0.0)
    if TRACE:
        t_prologue = global_time(e.to(tl.float32))
    base, row_stride, up_off = _up_slot_base(w13_ptr, sw13_ptr, e, j, I, stride_we, stride_wn, stride_sn, K, KS)
    cols = (first % NB) * BLOCK_N + ar
    n_ok = (cols < I)[:, None]
    g_ptrs = base + cols[:, None].to(tl.int64) * row_stride + rk  # [BLOCK_N, BLOCK_K]
    g = tl.load(g_ptrs, mask=n_ok & (rk < H), other=0.0)
    u = tl.load(g_ptrs + up_off, mask=n_ok & (rk < H), other=0.0)
    if TRACE:
        t_reduced = t_prologue
    for i in range(count):
        q = first + i
        # the next tile's slot and expert id, one tile ahead of its weights (clamped to the grid's
        # last tile past this program's share: loaded, never used)
        s_next = tl.minimum(q + 1, TILES - 1) // NB
        t_next = s_next // KS
        j_next = s_next % KS
        e_next = tl.load(ids_ptr + t_next * K + tl.minimum(j_next, K - 1)).to(tl.int64)
        acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(BLOCK_K, H, BLOCK_K):  # all but the last K tile, the next one loading
            g_next = tl.load(g_ptrs + k0, mask=n_ok & (rk < H - k0), other=0.0)
            u_next = tl.load(g_ptrs + up_off + k0, mask=n_ok & (rk < H - k0), other=0.0)
            x_next = tl.load(x_ptrs + k0, mask=rk < H - k0, other=0.0)
            # x rounded to the weights' dtype first, as the grouped GEMM feeds it to tl.dot
            xf = xk.to(g.dtype).to(tl.float32)
            acc_g += g.to(tl.float32) * xf
            acc_u += u.to(tl.float32) * xf
            g, u, xk = g_next, u_next, x_next
        # the next tile's first K tile (all masked off past this program's share)
        more = i + 1 < count
        nb_base, nb_stride, nb_up = _up_slot_base(w13_ptr, sw13_ptr, e_next, j_next, I, stride_we, stride_wn,
                                                  stride_sn, K, KS)
        next_cols = ((q + 1) % NB) * BLOCK_N + ar
        next_ok = (next_cols < I)[:, None] & more
        next_ptrs = nb_base + next_cols[:, None].to(tl.int64) * nb_stride + rk
        next_x = x_ptr + t_next.to(tl.int64) * stride_xt + rk
        g_next = tl.load(next_ptrs, mask=next_ok & (rk < H), other=0.0)
        u_next = tl.load(next_ptrs + nb_up, mask=next_ok & (rk < H), other=0.0)
        x_next = tl.load(next_x, mask=(rk < H) & more, other=0.0)
        xf = xk.to(g.dtype).to(tl.float32)
        acc_g += g.to(tl.float32) * xf
        acc_u += u.to(tl.float32) * xf
        sum_g = tl.sum(acc_g, axis=1)
        sum_u = tl.sum(acc_u, axis=1)
        act = sum_g / (1.0 + tl.exp(-sum_g)) * sum_u  # silu(gate) * up, fp32, as _gate_up_kernel
        cols = (q % NB) * BLOCK_N + ar
        tl.store(act_ptr + (q // NB).to(tl.int64) * I + cols, act.to(act_ptr.dtype.element_ty), mask=cols < I)
        g, u, xk = g_next, u_next, x_next
        g_ptrs, up_off, x_ptrs, n_ok = next_ptrs, nb_up, next_x, (next_cols < I)[:, None]
        if TRACE:
            t_reduced = global_time(tl.sum(act, axis=0))
    if TRACE:
        store_trace(TR, tl.program_id(0), t_start, t_waited, t_prologue, t_reduced, global_time(0.0))


@triton.jit
def _down_slot_id(ids_ptr, t, J: tl.constexpr, K: tl.constexpr):
    """Token t's slot J expert id (int64; 0 for a shared chunk, which needs none). Read from L2
    (".cg": never a stale L1 line), as slot 0's and 1's may be read before the PDL wait."""
    if J < K:
        e = tl.load(ids_ptr + t * K + J, cache_modifier=".cg").to(tl.int64)
    else:
        e = tl.full((), 0, tl.int64)
    return e


@triton.jit
def _down_slot_ptrs(w2_ptr, sw2_ptr, e, rows, rk, I, stride_we, stride_wh, stride_sh,
                    J: tl.constexpr, K: tl.constexpr):
    """Pointers to the first [BLOCK_N, BLOCK_K] tile of slot J's down weight (expert e if routed),
    addressed as `_down_kernel` does: routed w2[e] [H, I]; shared chunk c = J - K: columns c*I..
    of sw2 [H, C*I]."""
    if J < K:
        ptrs = w2_ptr + e * stride_we + rows[:, None].to(tl.int64) * stride_wh + rk
    else:
        ptrs = sw2_ptr + (J - K) * I + rows[:, None].to(tl.int64) * stride_sh + rk
    return ptrs


@triton.jit
def _down_slot_weight(topk_w_ptr, shared_w_ptr, t, J: tl.constexpr, K: tl.constexpr, NUM_SW: tl.constexpr,
                      SW_REP: tl.constexpr, HAS_SW: tl.constexpr):
    """What slot J's output is multiplied by, as in `_down_kernel`: its routing weight, its shared
    expert's weight, or 1."""
    if J < K:
        wt = tl.load(topk_w_ptr + t * K + J)
    elif HAS_SW:
        wt = tl.load(shared_w_ptr + t * NUM_SW + (J - K) // SW_REP)
    else:
        wt = tl.full((), 1.0, tl.float32)
    return wt


@triton.jit
def _expert_down_gemv_kernel(act_ptr, w2_ptr, sw2_ptr, ids_ptr, topk_w_ptr, shared_w_ptr, out_ptr,
                             H, I, stride_we, stride_wh, stride_sh,
                             CW, CBUF, CTAB, CSLOTS, CLENS, CLOCS, stride_cw, stride_cbuf, stride_ctab, TR,
                             K: tl.constexpr, KS: tl.constexpr, NUM_SW: tl.constexpr,
                             SW_REP: tl.constexpr, HAS_SW: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, PDL: tl.constexpr, CONV: tl.constexpr, CK: tl.constexpr,
                             CKP: tl.constexpr, CCHUNK: tl.constexpr, TRACE: tl.constexpr):
    """out[t, rows] = sum over token t's KS slots of w_j * (down_j @ act[t*KS + j]) for the n-th
    BLOCK_N of H (program (n, t)): slots in `_sum_slots_kernel`'s order (routed in selection order,
    then shared chunks), summed in fp32 in registers and cast once.

    Every load is issued one step before its use, so that no step waits for its own L2 round trip:
    the next K tile of the weights and of act while the current one is multiplied, the next slot's
    first tiles (weights and act) before the current slot's last is multiplied, the next slot's
    weight (routing or shared) a slot ahead, and its expert id two slots ahead (the id gives the
    weights' address). The same products in the same order as loading each in its own step.

    With the early trigger (PDL == 2: the engine's batch-1 graphs) slot 0's and 1's ids and slot
    0's first weight tile are loaded before the PDL wait. The routing (ids) is complete once the
    gate/up kernel, this one's predecessor, has passed its own wait, and that kernel lets this one
    launch only after that (`kiln.kernels.launch`: triggers and exits come after the wait), so
    every kernel before it has completed. What does need the wait: act (the gate/up kernel's
    output) and the ShortConv state (CONV); the rest is read after it only because it comes later.
    Without the trigger the kernel waits first: it then launches only as the last gate/up program
    exits, and loading early measured slower there (docs/benchmarks.md, fifteenth pass).

    CONV: the sum goes through token t's decode ShortConv (`kiln.kernels.shortconv`, as in
    `kiln.kernels.gemv`: Inkling's out_conv on the MoE output), its history loaded after the wait.
    TRACE: each program's timestamps go to TR (`kiln.kernels.trace`; the prologue's stamp is taken
    once the conv history's loads are issued)."""
    if TRACE:
        t_start = global_time(0.0)
    t = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = (rows < H)[:, None]
    rk = tl.arange(0, BLOCK_K)[None, :]

    if PDL != 2:  # no early trigger: wait first (docstring)
        wait_for_previous(PDL)
    e = _down_slot_id(ids_ptr, t, 0, K)
    w_ptrs = _down_slot_ptrs(w2_ptr, sw2_ptr, e, rows, rk, I, stride_we, stride_wh, stride_sh, 0, K)
    w = tl.load(w_ptrs, mask=row_ok & (rk < I), other=0.0)
    if KS > 1:
        e_next = _down_slot_id(ids_ptr, t, 1, K)
    else:
        e_next = e
    if PDL == 2:  # the early trigger: the first tile is under way before the wait
        wait_for_previous(PDL)
    if TRACE:
        t_waited = global_time(0.0)
    a_ptrs = act_ptr + t * KS * I + rk
    a = tl.load(a_ptrs, mask=rk < I, other=0.0)
    wt = _down_slot_weight(topk_w_ptr, shared_w_ptr, t, 0, K, NUM_SW, SW_REP, HAS_SW)
    rm = t + tl.arange(0, 1)  # this token as the conv helpers' row vector
    if CONV:
        hist = decode_conv_history(rm, rm >= 0, rows, rows < H, CBUF, stride_cbuf, CTAB, stride_ctab, CSLOTS,
                                   CLENS, CK, CKP, CCHUNK)
    if TRACE:
        t_prologue = global_time(0.0)
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(KS):
        if j + 2 < KS:
            e_after = _down_slot_id(ids_ptr, t, j + 2, K)
        if j + 1 < KS:
            wt_next = _down_slot_weight(topk_w_ptr, shared_w_ptr, t, j + 1, K, NUM_SW, SW_REP, HAS_SW)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(BLOCK_K, I, BLOCK_K):  # all but the last K tile, the next one loading
            w_next = tl.load(w_ptrs + k0, mask=row_ok & (rk < I - k0), other=0.0)
            a_next = tl.load(a_ptrs + k0, mask=rk < I - k0, other=0.0)
            acc += w.to(tl.float32) * a.to(tl.float32)
            w, a = w_next, a_next
        if j + 1 < KS:  # the next slot's stream starts before this slot's last tile is multiplied
            next_ptrs = _down_slot_ptrs(w2_ptr, sw2_ptr, e_next, rows, rk, I, stride_we, stride_wh, stride_sh,
                                        j + 1, K)
            w_next = tl.load(next_ptrs, mask=row_ok & (rk < I), other=0.0)
            a_next = tl.load(a_ptrs + I, mask=rk < I, other=0.0)
        acc += w.to(tl.float32) * a.to(tl.float32)
        out += tl.sum(acc, axis=1) * wt  # the slot's weight multiplies its fp32 output, as in _down_kernel
        if j + 1 < KS:
            w_ptrs, a_ptrs, w, a, wt = next_ptrs, a_ptrs + I, w_next, a_next, wt_next
        if j + 2 < KS:
            e_next = e_after
    if TRACE:
        t_reduced = global_time(tl.sum(out, axis=0))
    if CONV:  # the conv reads the MoE output as the unfused path stores it
        y = decode_conv_epilogue(out.to(CBUF.dtype.element_ty)[None, :], hist, rm, rm >= 0, rows, rows < H, CW,
                                 stride_cw, CBUF, stride_cbuf, CLOCS, CSLOTS, CLENS, CK, CKP, CCHUNK)
        tl.store(out_ptr + t * H + rows[None, :], y.to(out_ptr.dtype.element_ty), mask=(rows < H)[None, :])
    else:
        tl.store(out_ptr + t * H + rows, out.to(out_ptr.dtype.element_ty), mask=rows < H)
    if TRACE:
        store_trace(TR, tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), t_start, t_waited, t_prologue,
                    t_reduced, global_time(0.0))


def experts_gemv(x, w13, w2, sw13, sw2, ids, topk_w, shared_w, out, k, ks_slots, n_shared_w, sw_rep,
                 has_sw, conv=None, trace=None) -> torch.Tensor:
    """`kiln.kernels.moe.fused_experts` on this path, its arguments prepared there (contiguous last
    dims, fp32 weights, the slot counts); writes and returns `out`. act [T*KS, I] holds the
    activations in the weights' dtype between the two kernels; there is no slot buffer.
    conv: the arguments of `kiln.kernels.shortconv.short_conv_decode` after x (token t is decode
    sequence t), run on out in the down kernel's epilogue (`out`'s dtype must be the state's).
    trace: (the up kernel's, the down kernel's) `kiln.kernels.trace` buffers (CUDA only)."""
    T, H = x.shape
    inter = w2.shape[2]
    up, down = gemv_tiles(H, inter)
    act = torch.empty(T * ks_slots, inter, dtype=w2.dtype, device=x.device)
    blocks = triton.cdiv(inter, up["BLOCK_N"])
    tiles = T * ks_slots * blocks
    per_program = up_tiles_per_program(tiles, x.device)
    up_grid = (triton.cdiv(tiles, per_program),)
    down_grid = (triton.cdiv(H, down["BLOCK_N"]), T)
    up_trace, down_trace = trace if trace is not None else (None, None)
    _expert_up_gemv_kernel[up_grid](
        x, w13, sw13, ids, act, H, inter, blocks, tiles, per_program, x.stride(0), w13.stride(0), w13.stride(1),
        sw13.stride(0), **trace_args(up_trace, x, up_grid[0]), K=k, KS=ks_slots, **up, **pdl_launch(x.device))
    # Launched right after the gate/up kernel: the down kernel reads ids before its wait (its docstring).
    _expert_down_gemv_kernel[down_grid](
        act, w2, sw2, ids, topk_w, shared_w, out, H, inter, w2.stride(0), w2.stride(1), sw2.stride(0),
        **decode_conv_kernel_args(conv, out), **trace_args(down_trace, x, down_grid[0] * down_grid[1]), K=k,
        KS=ks_slots,
        NUM_SW=n_shared_w, SW_REP=sw_rep, HAS_SW=has_sw, **down, **pdl_launch(x.device))
    return out
