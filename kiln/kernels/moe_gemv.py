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
Tried and removed in the twenty-sixth pass (commit 1fdd2e8): every load one step ahead (the down
kernel's act, slot weight and expert id; the gate/up kernel's x and its next tile's id) and the
gate/up tiles several per program, 2-6 programs per SM, so that none ran in waves. The down
kernel's programs took as long after their wait as before (5.5 us against 5.7: not one L2 round
trip per slot, then); the gate/up kernel grew from 88 to 128 registers, and its resident
programs streamed at ~10 GB/s each, one 8 KB tile pair in flight: at 4 per SM 23.88 us a layer
against 23.82 (untraced chain), Inkling 1.170 against 1.168 ms; with one tile per program 1.193.
Nor do deeper pipelines help: asynchronous copies (cp.async, TMA) streamed no faster than register
loads (`benchmarks/kernel_bench/stream_gemv.py`); each launch pays ~1.6-2.5 us beyond its bytes.
"""

from __future__ import annotations

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
def _expert_up_gemv_kernel(x_ptr, w13_ptr, sw13_ptr, ids_ptr, act_ptr, H, I,
                           stride_xt, stride_we, stride_wn, stride_sn, TR,
                           K: tl.constexpr, KS: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, PDL: tl.constexpr, TRACE: tl.constexpr):
    """act[s, cols] = silu(gate) * up of slot s = t*KS + j (program (s, n)), cols the n-th BLOCK_N
    of I: two weight row blocks over all of K = H, CUDA-core FMAs into [BLOCK_N, BLOCK_K] fp32
    accumulators reduced once at the end, the next tiles loaded while the current ones are
    multiplied (as `kiln.kernels.gemv._gemv_fma_kernel`). TRACE: each program's timestamps go to
    TR (`kiln.kernels.trace`; the prologue is the expert id's load)."""
    if TRACE:
        t_start = global_time(0.0)
    wait_for_previous(PDL)
    if TRACE:
        t_waited = global_time(0.0)
    s = tl.program_id(0)
    t = s // KS
    j = s % KS
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    n_ok = col_ok[:, None]
    rk = tl.arange(0, BLOCK_K)[None, :]

    # Addressed as `_gate_up_kernel` does. Routed slot j: expert topk_ids[t, j], gate rows n and
    # up rows I + n of w13[e]. Shared chunk c = j - K: rows c*I + n and C*I + c*I + n of sw13.
    # (Starting a shared chunk's stream before the wait measured no gain: docs/benchmarks.md.)
    is_shared = j >= K
    e = tl.load(ids_ptr + t * K + tl.minimum(j, K - 1)).to(tl.int64)
    chunk = tl.maximum(j - K, 0).to(tl.int64)
    w_base = tl.where(is_shared, sw13_ptr + chunk * I * stride_sn, w13_ptr + e * stride_we)
    row_stride = tl.where(is_shared, stride_sn, stride_wn).to(tl.int64)
    up_off = tl.where(is_shared, (KS - K) * I, I).to(tl.int64) * row_stride
    g_ptrs = w_base + cols[:, None].to(tl.int64) * row_stride + rk  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + t.to(tl.int64) * stride_xt + rk  # [1, BLOCK_K]

    if TRACE:
        t_prologue = global_time(e.to(tl.float32))
    g = tl.load(g_ptrs, mask=n_ok & (rk < H), other=0.0)
    u = tl.load(g_ptrs + up_off, mask=n_ok & (rk < H), other=0.0)
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(BLOCK_K, H + BLOCK_K, BLOCK_K):
        # load tile k0 (masked off past H) while tile k0 - BLOCK_K is multiplied
        g_next = tl.load(g_ptrs + k0, mask=n_ok & (rk < H - k0), other=0.0)
        u_next = tl.load(g_ptrs + up_off + k0, mask=n_ok & (rk < H - k0), other=0.0)
        # x rounded to the weights' dtype first, as the grouped GEMM feeds it to tl.dot
        xk = tl.load(x_ptrs + (k0 - BLOCK_K), mask=rk < H - k0 + BLOCK_K, other=0.0)
        xk = xk.to(g.dtype).to(tl.float32)
        acc_g += g.to(tl.float32) * xk
        acc_u += u.to(tl.float32) * xk
        g = g_next
        u = u_next
    acc_g = tl.sum(acc_g, axis=1)
    acc_u = tl.sum(acc_u, axis=1)
    if TRACE:
        t_reduced = global_time(tl.sum(acc_g + acc_u, axis=0))
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up, fp32, as _gate_up_kernel
    tl.store(act_ptr + s.to(tl.int64) * I + cols, act.to(act_ptr.dtype.element_ty), mask=col_ok)
    if TRACE:
        store_trace(TR, s * tl.num_programs(1) + tl.program_id(1), t_start, t_waited, t_prologue, t_reduced,
                    global_time(0.0))


@triton.jit
def _down_slot_ptrs(w2_ptr, sw2_ptr, ids_ptr, t, rows, rk, I, stride_we, stride_wh, stride_sh,
                    J: tl.constexpr, K: tl.constexpr):
    """Pointers to the first [BLOCK_N, BLOCK_K] tile of token t's slot J down weight, addressed as
    `_down_kernel` does: routed w2[e] [H, I]; shared chunk c = J - K: columns c*I.. of sw2 [H, C*I].
    Slot 0's id may be read before the PDL wait, so from L2 (".cg": never a stale L1 line)."""
    if J < K:
        if J == 0:
            e = tl.load(ids_ptr + t * K, cache_modifier=".cg").to(tl.int64)
        else:
            e = tl.load(ids_ptr + t * K + J).to(tl.int64)
        ptrs = w2_ptr + e * stride_we + rows[:, None].to(tl.int64) * stride_wh + rk
    else:
        ptrs = sw2_ptr + (J - K) * I + rows[:, None].to(tl.int64) * stride_sh + rk
    return ptrs


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

    With the early trigger (PDL == 2: the engine's batch-1 graphs) the first slot's id and first
    weight tile are loaded before the PDL wait. The routing (ids) is complete once the gate/up
    kernel, this one's predecessor, has passed its own wait, and that kernel lets this one launch
    only after that (`kiln.kernels.launch`: triggers and exits come after the wait), so every
    kernel before it has completed. What does need the wait: act (the gate/up kernel's output) and
    the ShortConv state (CONV); the rest is read after it only because it comes later. Without the
    trigger the kernel waits first: it then launches only as the last gate/up program exits, and
    loading early measured slower there (docs/benchmarks.md, fifteenth pass).

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
    last = (tl.cdiv(I, BLOCK_K) - 1) * BLOCK_K  # where each slot's last K tile starts

    if PDL != 2:  # no early trigger: wait first (docstring)
        wait_for_previous(PDL)
    w_ptrs = _down_slot_ptrs(w2_ptr, sw2_ptr, ids_ptr, t, rows, rk, I, stride_we, stride_wh, stride_sh, 0, K)
    w = tl.load(w_ptrs, mask=row_ok & (rk < I), other=0.0)
    if PDL == 2:  # the early trigger: the first tile is under way before the wait
        wait_for_previous(PDL)
    if TRACE:
        t_waited = global_time(0.0)
    rm = t + tl.arange(0, 1)  # this token as the conv helpers' row vector
    if CONV:
        hist = decode_conv_history(rm, rm >= 0, rows, rows < H, CBUF, stride_cbuf, CTAB, stride_ctab, CSLOTS,
                                   CLENS, CK, CKP, CCHUNK)
    if TRACE:
        t_prologue = global_time(0.0)
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(KS):
        a_ptrs = act_ptr + (t * KS + j) * I + rk
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(BLOCK_K, I, BLOCK_K):  # all but the last tile, the next one loading
            w_next = tl.load(w_ptrs + k0, mask=row_ok & (rk < I - k0), other=0.0)
            acc += w.to(tl.float32) * tl.load(a_ptrs + (k0 - BLOCK_K)).to(tl.float32)
            w = w_next
        if j + 1 < KS:
            # The next slot's stream starts before this slot's last tile is multiplied, so the
            # loads stay in flight across slots too.
            next_ptrs = _down_slot_ptrs(w2_ptr, sw2_ptr, ids_ptr, t, rows, rk, I, stride_we, stride_wh,
                                        stride_sh, j + 1, K)
            w_next = tl.load(next_ptrs, mask=row_ok & (rk < I), other=0.0)
        a = tl.load(a_ptrs + last, mask=rk < I - last, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * a
        # The slot's weight multiplies its fp32 output, as in _down_kernel.
        if j < K:
            out += tl.sum(acc, axis=1) * tl.load(topk_w_ptr + t * K + j)
        elif HAS_SW:
            out += tl.sum(acc, axis=1) * tl.load(shared_w_ptr + t * NUM_SW + (j - K) // SW_REP)
        else:
            out += tl.sum(acc, axis=1)
        if j + 1 < KS:
            w_ptrs = next_ptrs
            w = w_next
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
    up_grid = (T * ks_slots, triton.cdiv(inter, up["BLOCK_N"]))
    down_grid = (triton.cdiv(H, down["BLOCK_N"]), T)
    up_trace, down_trace = trace if trace is not None else (None, None)
    _expert_up_gemv_kernel[up_grid](
        x, w13, sw13, ids, act, H, inter, x.stride(0), w13.stride(0), w13.stride(1), sw13.stride(0),
        **trace_args(up_trace, x, up_grid[0] * up_grid[1]), K=k, KS=ks_slots, **up, **pdl_launch(x.device))
    # Launched right after the gate/up kernel: the down kernel reads ids before its wait (its docstring).
    _expert_down_gemv_kernel[down_grid](
        act, w2, sw2, ids, topk_w, shared_w, out, H, inter, w2.stride(0), w2.stride(1), sw2.stride(0),
        **decode_conv_kernel_args(conv, out), **trace_args(down_trace, x, down_grid[0] * down_grid[1]), K=k,
        KS=ks_slots,
        NUM_SW=n_shared_w, SW_REP=sw_rep, HAS_SW=has_sw, **down, **pdl_launch(x.device))
    return out
